"""The learning-rate schedule as evidence (docs/spec.md section 6; fasthealth/monitor/schedule.py):
a warm restart the scheduler makes is a new start for the rules, not an alarm; a change of rate
no schedule explains is ``lr_jump``; the scheduler is given in plain loops (``scheduler=``) and
by the trainers' callbacks."""

from __future__ import annotations

import math

import pytest
import torch

import fasthealth as fh
from fasthealth.monitor import rules, schedule
from fasthealth.monitor.schedule import ScheduleConfig, ScheduleView
from fasthealth.monitor.skip_rule import SkipRule


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)


def _sgdr_run(seed=0, steps=300, by_hand=False, known=None, garbage_at=None, **monitor):
    """An MLP on scikit-learn's digits, SGD at lr 1 with momentum, warm restarts every 60
    steps (SGDR): at each restart the loss climbs several-fold for tens of steps, then falls
    below where it was. ``by_hand``: the same rates set on the param group directly, with no
    scheduler (or with ``known``, a scheduler that did not set them). ``garbage_at``: a step
    whose inputs are noise of std 5."""
    X, Y = _digits()
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.9)
    rates = [0.5 * (1 + math.cos(math.pi * (t % 60) / 60)) for t in range(steps)]
    sched = None if by_hand else torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, 60)
    known = known(opt) if known is not None else sched  # as a user passes it
    mon = fh.Monitor(m, opt, scheduler=known, **monitor)
    losses = []
    for t in range(steps):
        if by_hand:
            opt.param_groups[0]["lr"] = rates[t]
        i = torch.randint(0, len(X), (64,), generator=g)
        x = 5 * torch.randn(64, 64, generator=g) if t == garbage_at else X[i]
        loss = torch.nn.functional.cross_entropy(m(x), Y[i])
        loss.backward()
        mon.step(loss)
        opt.zero_grad()
        losses.append(loss.item())
        if sched is not None:
            sched.step()
    mon.close()
    return mon, losses


def _alarms(mon):
    return [(e.step, e.kind) for e in mon.events if e.severity == "alarm"]


def test_warm_restarts_are_the_schedules_and_raise_no_alarm():
    mon, losses = _sgdr_run()
    assert mon.schedule.scheduler is not None  # given
    assert _alarms(mon) == []
    # the run does what makes the case: the loss climbs after the restart at step 60
    assert max(losses[61:90]) > 2 * min(losses[40:60])


def test_without_the_restart_the_same_run_alarms(monkeypatch):
    """The test above can fail: with the restart test off, the climb after a restart is read
    against the windows of the old rate (a divergence)."""
    monkeypatch.setattr(ScheduleView, "observe", lambda self, lr, scheduled: (False, False))
    mon, _ = _sgdr_run()
    assert any(k == "divergence" for _, k in _alarms(mon)), _alarms(mon)


def test_a_garbage_batch_at_the_restarts_own_step_is_skipped():
    """The restart's own step is judged against the old windows (its loss and gradients come
    from the weights the old rate made; the windows start again after it): under
    on_spike='skip' the device rule skips a garbage batch there."""
    mon, _ = _sgdr_run(garbage_at=120, on_spike="skip")
    assert _alarms(mon) == [(120, "loss_spike")], _alarms(mon)
    spike = next(e for e in mon.events if e.kind == "loss_spike")
    assert spike.details.get("skipped") is True, spike.details


def test_a_bad_batch_at_the_restarts_own_step_is_a_spike_on_the_host():
    """The same for the host rules, where a loss 1.5x a flat level (far below the 10x of the
    window before a restart that the first steps after it are held to) is a spike only
    against the old window: the rate set by hand, decaying to 0.01 and back to 1 at step 100."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(0)
    with fh.Monitor(m, opt, flush_every=10) as mon:
        for t in range(130):
            opt.param_groups[0]["lr"] = 1.0 - 0.99 * (t % 100) / 99
            m(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            level = 1.0 + 0.01 * torch.randn((), generator=g).item()
            mon.step(torch.tensor(1.5 if t == 100 else level))
            opt.zero_grad()
    assert [s for s, k in _alarms(mon) if k == "loss_spike"] == [100], _alarms(mon)


def test_restarts_set_by_hand_without_a_scheduler_are_taken_as_a_schedule():
    mon, _ = _sgdr_run(by_hand=True)
    assert mon.schedule.scheduler is None
    assert _alarms(mon) == []


def test_a_rise_the_known_scheduler_did_not_make_is_lr_jump():
    """The same rates by hand while a (constant) scheduler is known: each restart is a change
    no schedule explains."""
    mon, _ = _sgdr_run(by_hand=True, steps=130,
                       known=lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5,
                                                                           total_iters=10**6))
    jumps = [e for e in mon.events if e.kind == "lr_jump"]
    # one incident's repeats are counted on its first event (Event.repeats)
    seen = sorted({e.step for e in jumps} | {e.last_step for e in jumps if e.repeats})
    assert seen == [60, 120]
    assert "did not set it" in jumps[0].message and jumps[0].severity == "alarm"


def test_restart_view():
    v = ScheduleView()
    # a linear warm-up from 0, a cosine decay to ~0, a restart: only the restart (and the
    # warm-up's first step, inside every rule's warm-up) counts
    warm = [0.1 * t / 10 for t in range(11)]
    decay = [0.05 * (1 + math.cos(math.pi * t / 40)) for t in range(40)]
    seen = [v.observe(lr, lr)[0] for lr in warm + decay + [0.1, 0.099]]
    assert [i for i, r in enumerate(seen) if r] == [1, 51]
    # without a scheduler: a rise back within the peak is a restart, one above it is not
    v = ScheduleView()
    assert [v.observe(lr, None)[0] for lr in (0.1, 1e-4, 0.1, 1e-4, 1.0)] == [
        False, False, True, False, False]
    # a scheduler that did not set the rate: unexplained, never a restart
    v = ScheduleView(ScheduleConfig())
    assert v.observe(0.1, 0.1) == (False, False)
    assert v.observe(2.0, 0.1) == (False, True)


def test_the_scheduler_given_and_a_bad_argument():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters())
    s = torch.optim.lr_scheduler.StepLR(opt, 5)
    assert schedule.ScheduleSource(opt).rates() == (pytest.approx(1e-3), None)
    with pytest.raises(TypeError, match="scheduler must be a learning-rate scheduler"):
        fh.Monitor(m, opt, scheduler="cosine")
    assert schedule.ScheduleSource(opt, s).rates() == (pytest.approx(1e-3), pytest.approx(1e-3))


def test_the_device_skip_rule_restarts_with_the_schedule():
    """on_spike="skip" decides on the device from its own windows: they start again at a
    restart too (this run skips nothing either way: what is checked is that the windows are
    emptied at the restart's step, and that no healthy step of the run is skipped)."""
    emptied = []
    real = SkipRule.rearm

    def rearm(self):
        real(self)
        emptied.append(bool(self.buf.isnan().all()))

    SkipRule.rearm = rearm
    try:
        mon, _ = _sgdr_run(on_spike="skip", steps=130)
    finally:
        SkipRule.rearm = real
    assert emptied == [True, True]  # the restarts at steps 60 and 120
    assert [e.step for e in mon.events if e.details.get("skipped")] == []
    assert _alarms(mon) == []


class _DigitsSet(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = _digits()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _DigitsNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                     torch.nn.Linear(128, 10))

    def forward(self, x, labels=None):
        logits = self.f(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def _hf_sgdr_alarms(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from fasthealth.integrations.transformers import HealthCallback

    torch.manual_seed(0)
    model = _DigitsNet()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, 60)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=64, max_steps=300,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=50,
                             seed=0, disable_tqdm=True)  # max_grad_norm: the default, 1.0
    cb = HealthCallback(log_dir=False)
    Trainer(model, args, train_dataset=_DigitsSet(), callbacks=[cb],
            optimizers=(opt, sched)).train()
    assert cb.monitor is not None and cb.monitor.schedule.scheduler is sched  # passed, not found
    return _alarms(cb.monitor)


def test_hf_trainer_with_warm_restarts_raises_no_alarm(tmp_path):
    """The user's report: SGD with CosineAnnealingWarmRestarts through the Trainer, the
    callback at its defaults."""
    assert _hf_sgdr_alarms(tmp_path) == []


def test_hf_trainer_with_warm_restarts_alarms_without_the_restart_test(tmp_path, monkeypatch):
    monkeypatch.setattr(ScheduleView, "observe", lambda self, lr, scheduled: (False, False))
    assert any(k == "divergence" for _, k in _hf_sgdr_alarms(tmp_path))


def _lightning_sgdr_alarms(seed=2):
    L = pytest.importorskip("lightning")

    from fasthealth.integrations.lightning import HealthCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _DigitsNet()

        def training_step(self, batch, i):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.9)
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, 60)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    L.seed_everything(seed, verbose=False)
    loader = torch.utils.data.DataLoader(_DigitsSet(), batch_size=64, shuffle=True)
    cb = HealthCallback(log_dir=False)
    trainer = L.Trainer(max_steps=300, callbacks=[cb], logger=False, accelerator="cpu",
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), loader)
    assert cb.monitor is not None and cb.monitor.schedule.scheduler is not None  # passed
    return _alarms(cb.monitor)


def test_lightning_with_warm_restarts_raises_no_alarm():
    assert _lightning_sgdr_alarms() == []


def test_lightning_with_warm_restarts_alarms_without_the_restart_test(monkeypatch):
    # The same run (seed 2) alarms at step 78, just after the first restart, on one intra-op
    # thread and on two; on some seeds (1 on one thread, 4) the restart goes unnoticed either way
    monkeypatch.setattr(ScheduleView, "observe", lambda self, lr, scheduled: (False, False))
    assert any(k == "divergence" for _, k in _lightning_sgdr_alarms())


def test_rules_start_again_after_the_restarts_step_or_before_it_when_they_judge_its_update():
    """At a restart the rules' windows start again after the restart's own step (its loss and
    gradients are the old rate's), and before it for a rule of the step's update
    (``REARM_BEFORE``: the update ratio precursor), whose update the new rate made."""
    from fasthealth.monitor.rules.update_ratio import UpdateRatio

    class Recorder:
        def __init__(self, before):
            self.REARM_BEFORE, self.calls = before, []

        def observe(self, s):
            self.calls.append(("observe", s.step))
            return []

        def rearm(self):
            self.calls.append(("rearm", None))

    early, late = Recorder(True), Recorder(False)
    mon, _ = _sgdr_run(steps=70, detectors=[early, late])
    assert early.calls[60:62] == [("rearm", None), ("observe", 60)], early.calls[58:63]
    assert late.calls[60:62] == [("observe", 60), ("rearm", None)], late.calls[58:63]
    assert UpdateRatio.REARM_BEFORE and not rules.Spike.REARM_BEFORE


def _warmup_per_epoch(scheduler, bad_rate=None, steps=240, epoch=40, seed=0):
    """timm's default shape, stepped per epoch: the first epoch at 1e-5 (``warmup_lr``), then
    cosine from 0.5 (a 50,000x rise at one step); an MLP on digits, SGD with momentum.
    ``scheduler``: "given" (a LambdaLR the Monitor is told of), "hidden" (the same, not told),
    "none" (the same rates set by hand). ``bad_rate``: (step, factor) a bug that multiplies the
    rate from that step on."""
    X, Y = _digits()
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)

    def rate(e):  # per epoch, as a share of 0.5
        return 2e-5 if e == 0 else 0.5 * (1 + math.cos(math.pi * e / (steps // epoch)))
    sched = (_PositionScheduler(opt, lambda e: 0.5 * rate(e)) if scheduler == "timm" else
             torch.optim.lr_scheduler.LambdaLR(opt, rate) if scheduler != "none" else None)
    mon = fh.Monitor(m, opt, scheduler=sched if scheduler in ("given", "timm") else None)
    for t in range(steps):
        if scheduler == "none":
            for grp in opt.param_groups:
                grp["lr"] = 0.5 * rate(t // epoch)
        if bad_rate is not None and t >= bad_rate[0]:
            for grp in opt.param_groups:
                grp["lr"] = grp["lr"] * bad_rate[1] if t == bad_rate[0] else grp["lr"]
        i = torch.randint(0, len(X), (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(m(X[i]), Y[i])
        opt.zero_grad()
        loss.backward()
        mon.step(loss, batch=(X[i], Y[i]))
        if sched is not None and (t + 1) % epoch == 0:
            sched.step((t + 1) // epoch) if scheduler == "timm" else sched.step()
    mon.close()
    return mon


class _PositionScheduler:
    """timm's ``Scheduler`` as it is (timm needs torchvision, which this environment's torch
    cannot load; the zoo runs the real one): the rate a pure function ``_get_lr(t)`` of the
    position the loop passes to ``step(epoch)``, set into the groups; no last rate kept."""

    def __init__(self, optimizer, rate):
        self.optimizer, self.rate, self.t_in_epochs = optimizer, rate, True
        self.update_groups(self._get_lr(0))

    def _get_lr(self, t):
        return [self.rate(t) for _ in self.optimizer.param_groups]

    def step(self, epoch, metric=None):
        self.update_groups(self._get_lr(epoch))

    def update_groups(self, values):
        for grp, v in zip(self.optimizer.param_groups, values):
            grp["lr"] = v

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("scheduler", ["given", "timm", "hidden", "none"])
def test_a_warm_up_stepped_per_epoch_raises_no_alarm_with_or_without_the_scheduler(scheduler):
    mon = _warmup_per_epoch(scheduler)
    assert not _alarms(mon), [(e.step, e.kind, e.message) for e in mon.events]
    jumps = [e for e in mon.events if e.kind == "lr_jump"]
    if scheduler in ("given", "timm"):  # the scheduler set it: no finding at all
        assert not jumps
    else:  # not known: a notice that says why it is no alarm
        assert [e.step for e in jumps] == [40] and jumps[0].severity == "notice"
        assert "no scheduler is known" in jumps[0].message


@pytest.mark.parametrize("scheduler", ["given", "timm", "none"])
def test_a_rate_bug_the_loss_suffers_from_is_an_lr_jump_alarm(scheduler):
    mon = _warmup_per_epoch(scheduler, bad_rate=(150, 40.0))
    jumps = [e for e in mon.events if e.kind == "lr_jump" and e.severity == "alarm"]
    assert jumps and 150 <= jumps[0].step <= 150 + 20, [(e.step, e.kind) for e in mon.events]
    inc = next(i for i in mon.incidents if "lr_jump" in i.kinds and i.severity == "alarm")
    assert inc.cause == "learning_rate", inc


def test_a_scheduler_with_step_and_state_is_accepted():
    """timm's schedulers have no get_last_lr(); step(), state_dict() and load_state_dict()
    are what the Monitor uses of them (the rollback restores them)."""
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    class EpochScheduler:  # the interface of timm.scheduler.Scheduler
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, epoch, metric=None):
            for grp in self.optimizer.param_groups:
                grp["lr"] = 0.1 * 0.5 ** epoch

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass
    mon = fh.Monitor(m, opt, scheduler=EpochScheduler(opt))
    assert schedule.ScheduleSource(opt, mon.schedule.scheduler).rates() == (0.1, None)
    mon.close()
    with pytest.raises(TypeError, match="timm's"):
        fh.Monitor(m, opt, scheduler=object())


def test_a_position_scheduler_s_rate_is_found_and_a_rate_it_did_not_set_is_unexplained():
    """A timm-shaped scheduler keeps no last rate: the rate it set is found among its
    positions (near the last one, or anywhere in its cycle after a resume); a rate that is no
    position's is told apart at once, with no loss needed, and costs no rescan while it holds."""
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = _PositionScheduler(opt, lambda e: 0.1 * 0.5 ** e)
    src = schedule.ScheduleSource(opt, sched)
    assert src.rates() == (0.1, 0.1)
    sched.step(1)
    assert src.rates() == (0.05, 0.05)
    sched.step(7)  # a jump ahead, as a resumed run makes: found by the wider scan
    assert src.rates() == (0.1 * 0.5 ** 7, 0.1 * 0.5 ** 7)
    opt.param_groups[0]["lr"] = 0.3  # by hand
    calls = []
    real = sched._get_lr
    sched._get_lr = lambda t: calls.append(t) or real(t)
    assert src.rates() == (0.3, 0.1 * 0.5 ** 7)
    scanned = len(calls)
    assert scanned > 0 and src.rates() == (0.3, 0.1 * 0.5 ** 7) and len(calls) == scanned
    view = schedule.ScheduleView()
    assert view.observe(0.1 * 0.5 ** 7, 0.1 * 0.5 ** 7) == (False, False)
    assert view.observe(0.3, 0.1 * 0.5 ** 7) == (False, True)
