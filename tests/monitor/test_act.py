"""docs/spec.md section 6, acting before the damage: ``on_spike="skip"`` (decided on the device,
NaN-safe, the update gated and never scaled, a bad batch leaving the run where it would have
been) and the precursors (notices: update-to-weight ratio, gradient RMS under Adam's eps,
output-logit and attention-logit growth)."""

import copy
import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fasthealth as fh
from fasthealth.monitor.skip_rule import SkipConfig, SkipRule

X = torch.randn(4096, 10, generator=torch.Generator().manual_seed(0))
Y = X @ torch.randn(10, 1, generator=torch.Generator().manual_seed(1)) + 0.1 * torch.randn(
    4096, 1, generator=torch.Generator().manual_seed(2))

OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, 1e-2, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, 1e-2, foreach=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, 1e-2, momentum=0.9),
}


def regression(opt_name, steps, bad_at=None, bad=lambda y: y * 50.0, on_spike="skip",
               watch=None, drop_at=None, **opts):
    """A ReLU MLP regression under the Monitor; ``bad(y)`` replaces the targets at ``bad_at``;
    the batch of step ``drop_at`` is left out (no step at all). Returns (losses, monitor,
    (params, optimizer state) before and after the bad step)."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = OPTIMIZERS[opt_name](m.parameters())
    mon = fh.Monitor(m, opt, on_spike=on_spike, **opts)
    losses, around = [], None
    for t in range(steps):
        i = torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(t))
        x, y = X[i], Y[i]
        if t == drop_at:
            losses.append(math.nan)
            continue
        if t == bad_at:
            x, y = (x, bad(y)) if not callable(watch) else watch(x, y)
        loss = F.mse_loss(m(x), y)
        loss.backward()
        if t == bad_at:
            before = copy.deepcopy((m.state_dict(), opt.state_dict()["state"]))
        mon.step(loss, batch=(x, y))
        opt.zero_grad()
        if t == bad_at:
            around = before, copy.deepcopy((m.state_dict(), opt.state_dict()["state"]))
        losses.append(loss.item())
    mon.close()
    return losses, mon, around


def same_state(a, b):
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(eq(a, b) for a, b in zip(x, y))
        return x == y
    return eq(a, b)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bad_batch_is_skipped_without_damage(opt_name):
    """A batch of 50x targets at step 150: skipped at its step, parameters and optimizer state
    untouched, the loss afterwards exactly that of the run without that batch, one alarm
    incident and no aftermath alarms."""
    clean, _, _ = regression(opt_name, 200, drop_at=150)
    losses, mon, (before, after) = regression(opt_name, 200, bad_at=150)
    assert same_state(before, after), "the skipped step changed parameters or optimizer state"
    assert losses[151:] == clean[151:], "the run did not continue as if the batch never came"
    skipped = [e for e in mon.events if e.details.get("skipped")]
    assert {e.step for e in skipped} == {150}
    assert any(e.kind == "loss_spike" and e.severity == "alarm" for e in skipped)
    assert [e for e in mon.events if e.step > 150 and e.severity == "alarm"] == []
    assert len([i for i in mon.incidents if i.severity == "alarm"]) == 1
    # the same bad batch without skipping damages the run (what the skip prevents)
    warned, _, _ = regression(opt_name, 200, bad_at=150, on_spike="warn")
    assert sum(warned[151:171]) > 2 * sum(clean[151:171])


@pytest.mark.parametrize("opt_name", ["adamw_fused", "adamw_foreach"])
def test_nan_batch_leaves_adam_moments_finite(opt_name):
    """A NaN in the batch: the step is gated (never multiplied by 0: 0 x NaN is NaN), so Adam's
    moments stay finite and later steps are not skipped."""
    def nan_batch(x, y):
        x = x.clone()
        x[0, 0] = math.nan
        return x, y
    losses, mon, (before, after) = regression(opt_name, 120, bad_at=100, watch=nan_batch)
    assert same_state(before, after)
    state = after[1]
    for st in state.values():
        assert torch.isfinite(st["exp_avg"]).all() and torch.isfinite(st["exp_avg_sq"]).all()
    assert all(math.isfinite(v) for v in losses[101:])
    assert {e.step for e in mon.events if e.severity == "alarm"} == {100}


def test_healthy_run_is_not_skipped(tmp_path):
    """A healthy run skips nothing; steps.jsonl says so step by step."""
    losses, mon, _ = regression("adamw_fused", 300, log_dir=tmp_path)
    assert not [e for e in mon.events if e.details.get("skipped")]
    rows = [json.loads(line) for line in open(mon.run_dir / "steps.jsonl")]
    assert len(rows) == 300 and all(r["spike_skip"] is False for r in rows)


def test_jsonl_records_the_skipped_step(tmp_path):
    _, mon, _ = regression("adamw_fused", 160, bad_at=150, log_dir=tmp_path)
    rows = {r["step"]: r for r in map(json.loads, open(mon.run_dir / "steps.jsonl"))}
    assert rows[150]["spike_skip"] is True and rows[150]["skipped"] is True
    assert rows[150]["skip_z_loss"] > 6
    assert not any(r["spike_skip"] for s, r in rows.items() if s != 150)


def test_the_host_rule_judges_by_the_score_the_device_skipped_by(tmp_path):
    """Under on_spike="skip" the spike score is the device rule's: the loss_spike event of the
    skipped step carries the score in steps.jsonl (``skip_z_loss``) and the host rule judges
    by it; a value the device scored under the threshold is no loss_spike on the host either,
    however its own window would score it."""
    _, mon, _ = regression("adamw_fused", 160, bad_at=150, log_dir=tmp_path)
    rows = {r["step"]: r for r in map(json.loads, open(mon.run_dir / "steps.jsonl"))}
    (spike,) = [e for e in mon.events if e.kind == "loss_spike"]
    assert spike.step == 150 and spike.details["skipped"]
    assert spike.details["zscore"] == rows[150]["skip_z_loss"]

    from fasthealth.monitor.record import StepHost, StepRecord
    from fasthealth.monitor.rules.spike import Spike

    def step(t, loss, z=math.nan, skip=math.nan):
        values = dict(loss=loss, grads_finite=1.0, grad_norm=1.0, spike_skip=skip,
                      skip_z_loss=z, skip_z_grad_norm=0.0 if skip == skip else math.nan)
        return StepRecord(t, values, [1.0], [0.0], StepHost(t))

    losses = [2.0 + 0.01 * math.sin(t) for t in range(60)]
    host, device = Spike(), Spike()
    for t, v in enumerate(losses):
        assert host.observe(step(t, v)) == device.observe(step(t, v, 0.0, 0.0)) == []
    # far above the window on the host's own score, under the threshold on the device's
    assert [f.kind for f in host.observe(step(60, 2.5))] == ["loss_spike"]
    assert device.observe(step(60, 2.5, 3.0, 0.0)) == []
    (found,) = device.observe(step(61, 2.5, 7.5, 1.0))
    assert (found.kind, found.details["zscore"], found.details["skipped"]) == (
        "loss_spike", 7.5, True)


def test_decision_needs_no_host_sync(monkeypatch):
    """With a fused optimizer nothing in mon.step reads a device value on the host: every
    conversion of a tensor to a Python value fails while steps run (flushes excepted)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(m.parameters(), 1e-2, fused=True)
    mon = fh.Monitor(m, opt, on_spike="skip", flush_every=500)
    batches = [(X[i * 32:(i + 1) * 32], Y[i * 32:(i + 1) * 32]) for i in range(60)]

    def fail(self, *a, **k):
        raise AssertionError("host sync in mon.step")
    for x, y in batches[:3]:  # warm caches (first-call work may inspect values)
        F.mse_loss(m(x), y).backward()
        mon.step(F.mse_loss(m(x), y).detach())
        opt.zero_grad()
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, fail)
    for x, y in batches[3:]:
        loss = F.mse_loss(m(x), y)
        loss.backward()
        mon.step(loss)
        opt.zero_grad()
    monkeypatch.undo()
    mon.close()


def test_a_new_level_is_not_skipped_forever():
    """Targets x10 from step 120 on (a regime change, not a bad batch): at most max_run (5)
    steps are skipped, then the run trains on and the rule takes the new level in."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(m.parameters(), 1e-2, fused=True)
    mon = fh.Monitor(m, opt, on_spike="skip")
    skipped = []
    for t in range(220):
        i = torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(t))
        y = Y[i] * (10.0 if t >= 120 else 1.0)
        loss = F.mse_loss(m(X[i]), y)
        loss.backward()
        skipped.append(mon.step(loss).skip.item())
        opt.zero_grad()
    mon.close()
    assert 1 <= sum(skipped[120:126]) <= 5 and sum(skipped) <= 5
    assert not any(skipped[130:])


def test_skip_rule_ignores_nan_and_skipped_values():
    """The rule's window never takes a non-finite or a skipped value: after a NaN step and a
    skipped outlier, a normal value is normal and the next outlier is still one."""
    r = SkipRule(torch.device("cpu"), SkipConfig(warmup=20))
    ok, bad = torch.tensor(True), torch.tensor(False)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        skip, _ = r.update(1 + 0.01 * torch.randn((), generator=g), torch.tensor(2.0) +
                           0.02 * torch.randn((), generator=g), ok)
        assert not skip
    skip, _ = r.update(torch.tensor(math.nan), torch.tensor(math.nan), bad)
    assert not skip  # non-finite: on_nonfinite's business, not the spike rule's
    skip, z = r.update(torch.tensor(5.0), torch.tensor(2.0), ok)
    assert skip and z[0] > 6
    assert (r.buf[~r.buf.isnan()] < 4).all()  # neither the NaN nor the outlier went in
    skip, _ = r.update(torch.tensor(1.0), torch.tensor(2.0), ok)
    assert not skip
    skip, _ = r.update(torch.tensor(5.0), torch.tensor(2.0), ok)
    assert skip


def test_a_blip_at_a_floor_is_not_skipped_once_the_first_loss_is_known():
    """A classifier converged at 0.52 from 2.3, its batches within 1% of each other: a batch
    15% above the floor scores far past the threshold but rises 3.5% of the first loss; with
    the first loss handed over (at a flush) it is neither skipped nor taken into the window;
    a bad batch (2.6) still is skipped. Before the first loss is known, the score alone
    decides, as before."""
    g = torch.Generator().manual_seed(0)

    def floor(rule):
        for _ in range(60):
            skip, _ = rule.update(0.52 + 0.003 * torch.randn((), generator=g),
                                  torch.tensor(1.0) + 0.01 * torch.randn((), generator=g),
                                  torch.tensor(True))
            assert not skip

    blind, told = (SkipRule(torch.device("cpu"), SkipConfig(warmup=20)) for _ in range(2))
    told.set_start(2.3)
    for r in (blind, told):
        floor(r)
    skip, z = blind.update(torch.tensor(0.60), torch.tensor(1.0), torch.tensor(True))
    assert skip and z[0] > 6
    before = told.buf.clone()
    skip, z = told.update(torch.tensor(0.60), torch.tensor(1.0), torch.tensor(True))
    assert not skip and z[0] > 6 and torch.equal(told.buf.nan_to_num(), before.nan_to_num())
    skip, _ = told.update(torch.tensor(2.6), torch.tensor(1.0), torch.tensor(True))
    assert skip


def test_the_monitor_hands_the_first_loss_to_the_device_at_a_flush():
    m = nn.Linear(10, 1)
    opt = torch.optim.SGD(m.parameters(), 0.01)
    mon = fh.Monitor(m, opt, on_spike="skip", flush_every=10)
    for t in range(12):
        i = torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(t))
        loss = F.mse_loss(m(X[i]), Y[i])
        loss.backward()
        mon.step(loss)
        opt.zero_grad()
    start = mon.analyser.loss_start()
    assert start > 0 and mon.skip_rule.start.item() == start  # the first flush, at step 10
    mon.close()


def test_check_path_skips_the_trainers_step():
    """Monitor.check (the callbacks' path) arms the skip of the step the trainer takes."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(m.parameters(), 1e-2, fused=True)
    mon = fh.Monitor(m, opt, on_spike="skip")
    for t in range(160):
        i = torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(t))
        y = Y[i] * (50.0 if t == 150 else 1.0)
        loss = F.mse_loss(m(X[i]), y)
        loss.backward()
        before = [p.detach().clone() for p in m.parameters()]
        mon.check(loss)
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(a, p) for a, p in zip(before, m.parameters()))
        assert moved == (t != 150), t
    mon.close()
    assert {e.step for e in mon.events if e.details.get("skipped")} == {150}


def test_on_spike_skip_needs_an_optimizer():
    m = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="on_spike='skip' needs the optimizer"):
        fh.Monitor(m, on_spike="skip")
    with pytest.raises(ValueError, match="on_spike"):
        fh.Monitor(m, torch.optim.SGD(m.parameters(), 0.1), on_spike="drop")


def test_one_spike_policy_the_device_skip_reads_the_spike_rule_s_settings():
    m = nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    by_rules = fh.Monitor(m, opt, on_spike="skip",
                          rules={"spike": {"zscore": 9.0, "window": 64, "max_run": 3}})
    c = by_rules.skip_rule.config
    assert (c.zscore, c.window, c.max_run) == (9.0, 64, 3)
    spike = next(r for r in by_rules.detectors if r.name == "spike")
    assert (spike.config.zscore, spike.config.window) == (9.0, 64)
    by_keyword = fh.Monitor(m, opt, on_spike="skip", spike_zscore=7.0, warmup_steps=30)
    assert (by_keyword.skip_rule.config.zscore, by_keyword.skip_rule.config.warmup) == (7.0, 30)
    default = next(r for r in by_keyword.detectors if r.name == "spike").config
    assert SkipConfig().max_run == default.max_run == by_keyword.skip_rule.config.max_run


# ---- precursors -----------------------------------------------------------------------------

class TinyLM(nn.Module):
    """A one-block GPT with a packed q/k/v projection and an ``lm_head``."""

    def __init__(self, vocab=32, d=32, heads=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.block = nn.Module()
        self.block.attn = nn.Module()
        self.block.attn.qkv = nn.Linear(d, 3 * d)
        self.block.attn.heads = heads
        self.lm_head = nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, ids):
        x = self.tok(ids)
        b, t, d = x.shape
        q, k, v = self.block.attn.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.lm_head(x + y.transpose(1, 2).reshape(b, t, d))


def lm_run(steps, grow=None, lr=1e-3, **opts):
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), lr)
    mon = fh.Monitor(m, opt, attention=r"attn$", **opts)
    g = torch.Generator().manual_seed(0)
    for t in range(steps):
        ids = torch.randint(0, 32, (8, 17), generator=g)
        logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
        loss.backward()
        mon.step(loss)
        opt.zero_grad()
        if grow is not None:
            grow(t, m, opt)
    mon.close()
    return mon


def kinds(mon):
    return [(e.step, e.kind, e.severity) for e in mon.events if e.kind.startswith("precursor_")]


def test_precursors_stay_quiet_on_a_healthy_lm():
    assert kinds(lm_run(200)) == []


def test_logit_and_attention_growth_are_notices():
    """The head's and the q/k projection's weights growing 4% a step from step 100: both
    precursors fire, as notices, while the loss alarms nothing yet."""
    def grow(t, m, opt):
        if t >= 100:
            with torch.no_grad():
                m.lm_head.weight.mul_(1.04)
                m.block.attn.qkv.weight[:64].mul_(1.04)
    found = kinds(lm_run(200, grow))
    assert {k for _, k, _ in found} >= {"precursor_logit_growth", "precursor_attention_logits"}
    assert all(sev == "notice" and step > 100 for step, _, sev in found)


def test_logits_are_read_every_tenth_step_and_a_log_z_drift_fires(tmp_path):
    """The LM head's logits are read on the steps the update ratio is (every 10), the attention
    logits every step; 15 added to every logit from step 100 moves log Z by 15 nats and leaves
    the loss as it was (softmax does not see a shift): the log Z precursor fires at its first
    reading."""
    def shift(t, m, opt):
        if t == 99:
            with torch.no_grad():
                m.lm_head.bias.add_(15.0)
    mon = lm_run(160, shift, log_dir=tmp_path)
    steps = fh.monitor.steps_from_log(mon.run_dir)
    for field in ("log_z", "logit_max", "update_ratio_max"):
        read = [s.step for s in steps if math.isfinite(s.values[field])]
        assert read == list(range(0, 160, 10)), field
    assert all(math.isfinite(s.values["attention_logit_max"]) for s in steps)
    found = [e for e in mon.events if e.kind == "precursor_logit_growth"]
    assert [e.step for e in found] == [100]
    d = found[0].details
    assert "log Z" in found[0].message and 14 < d["value"] - d["early_level"] < 16


def test_update_ratio_precursor_fires_on_an_lr_jump():
    def jump(t, m, opt):
        if t == 120:
            for grp in opt.param_groups:
                grp["lr"] *= 100
    found = kinds(lm_run(160, jump))
    ratio = [s for s, k, _ in found if k == "precursor_update_ratio"]
    assert ratio and 120 < ratio[0] <= 131


def test_adam_eps_precursor():
    """A loss scaled by 1e-9 makes every gradient RMS fall under eps=1e-8."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    mon = fh.Monitor(m, opt)
    for _ in range(60):
        loss = F.mse_loss(m(X[:32]), Y[:32]) * 1e-9
        loss.backward()
        mon.step(loss)
        opt.zero_grad()
    mon.close()
    found = kinds(mon)
    assert [k for _, k, _ in found] == ["precursor_adam_eps"] and found[0][2] == "notice"


def test_precursor_options_name_bad_input():
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="logits='head' names no module"):
        fh.Monitor(m, opt, logits="head")
    with pytest.raises(ValueError, match="attention='mlp' matches no self-attention"):
        fh.Monitor(m, opt, attention="mlp")
    mon = fh.Monitor(m, opt, precursors=False)
    assert mon.precursors is None
    mon.close()


def test_device_scores_are_the_host_rules_scores():
    """The device rule scores as ``robust.spike_scores`` does: the same median, the noise
    unit of the window or its last 32 values, the log-scale floor; on a flat plateau, on a run
    that became noisier than its window, on a series with negative values (linear only), on a
    fitted classifier's losses with zeros in them (gaps on the log scale) and on zeros only."""
    from fasthealth.monitor.robust import spike_score

    g = torch.Generator().manual_seed(3)
    flat = (2.3 * (1 + 0.001 * torch.randn(100, generator=g))).tolist()
    noisy = (2.3 * torch.exp(-0.03 * torch.arange(28) + 0.3 * torch.randn(28, generator=g)))
    fitted = (10 ** (-5 + 2.5 * torch.randn(128, generator=g))).clamp_max(1.0)
    fitted[[7, 60, 125]] = 0.0  # losses that underflowed: gaps on the log scale
    for series in (flat, flat + noisy.tolist(), (torch.randn(128, generator=g) - 0.5).tolist(),
                   fitted.tolist(), [0.0] * 40):
        r = SkipRule(torch.device("cpu"), SkipConfig(warmup=20))
        for v in series:
            r.buf[:, r.pos[0]] = v
            r.pos = (r.pos + 1) % r.window
        for x in (series[-1] * 1.01, series[-1] * 1.5, max(series) + 1.0):
            z = r.scores(torch.tensor([x, x], dtype=torch.float64))
            assert z[0].item() == pytest.approx(spike_score(series, x), rel=1e-9, abs=1e-9)
