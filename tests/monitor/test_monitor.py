"""fh.Monitor (docs/spec.md section 6): each detector fires at the planted step, a clean run raises
no event, bad steps are skipped (without a sync for fused optimizers), capture and replay."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import fasthealth as fh
from fasthealth.monitor import robust, rules
from fasthealth.monitor.rules.base import Context

NAN = float("nan")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5


def loss_fn(model, batch):
    x, y, w = batch
    return (w * (model(x) - y) ** 2).mean()


def train(model, opt, steps, plant=None, **kw):
    """A small training loop; plant(step, batch, model, opt) may return a modified batch."""
    kw.setdefault("flush_every", 10)
    kw.setdefault("warmup_steps", 10)
    mon = fh.Monitor(model, opt, **kw)
    x, y = data()
    w = torch.ones(64, 1)
    for step in range(steps):
        batch = (x, y, w)
        if plant is not None:
            batch = plant(step, batch, model, opt) or batch
        loss = loss_fn(model, batch)
        if opt is not None:
            opt.zero_grad()
        scaler = kw.get("scaler")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        mon.step(loss, batch=batch, sample_ids=torch.arange(64) + 64 * step)
    mon.close()
    return mon


def kinds_at(mon):
    return sorted((e.step, e.kind) for e in mon.events)


@pytest.mark.parametrize("fused", [True, False])
def test_clean_run_has_no_events(fused):
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
    mon = train(m, opt, 120)
    assert mon.events == []
    assert mon.steps_seen == 120


def _backward(m, opt, x, y, nan=False):
    """One batch's loss, its gradients computed (a NaN input planted when ``nan``)."""
    xb = x.clone()
    if nan:
        xb[0, 0] = NAN
    loss = loss_fn(m, (xb, y, torch.ones(64, 1)))
    opt.zero_grad()
    loss.backward()
    return loss


def nan_batch_at(k):
    def plant(step, batch, model, opt):
        if step == k:
            x, y, w = batch
            x = x.clone()
            x[3, 2] = NAN
            return (x, y, w)
    return plant


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
    lambda p: torch.optim.Adam(p, lr=1e-2),  # non-fused: one sync per step
], ids=["adamw_fused", "adam_fused", "sgd_fused", "adam_plain"])
def test_nonfinite_step_is_skipped_leaving_params_and_state(make_opt):
    m = make_model()
    opt = make_opt(m.parameters())
    k = 25
    captured = {}

    def plant(step, batch, model, o):
        if step == k:
            captured["params"] = [p.detach().clone() for p in model.parameters()]
            captured["state"] = [{n: (t.clone() if torch.is_tensor(t) else t)
                                  for n, t in o.state[p].items()} for p in model.parameters()]
        if step == k + 1:
            captured["after_params"] = [p.detach().clone() for p in model.parameters()]
            captured["after_state"] = [{n: (t.clone() if torch.is_tensor(t) else t)
                                        for n, t in o.state[p].items()}
                                       for p in model.parameters()]
        return nan_batch_at(k)(step, batch, model, o)

    mon = train(m, opt, 40, plant=plant)
    assert kinds_at(mon) == [(k, "nonfinite_grad"), (k, "nonfinite_loss")]
    for a, b in zip(captured["params"], captured["after_params"]):
        assert torch.equal(a, b)
    for sa, sb in zip(captured["state"], captured["after_state"]):
        assert sa.keys() == sb.keys()
        for n in sa:
            assert torch.equal(torch.as_tensor(sa[n]), torch.as_tensor(sb[n])), n
    ev = next(e for e in mon.events if e.kind == "nonfinite_grad")
    assert set(ev.details["tensors"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert ev.details["skipped"] is True
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_fused_skip_needs_no_host_sync(monkeypatch):
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    mon = fh.Monitor(m, opt, flush_every=1000)
    x, y = data()
    calls = []

    def boom(self, *a, **k):
        calls.append("sync")
        raise AssertionError("host sync in Monitor.step")

    for step in range(5):
        loss = _backward(m, opt, x, y, nan=step == 3)
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "item", boom)
            mp.setattr(torch.Tensor, "__bool__", boom)
            mp.setattr(torch.Tensor, "tolist", boom)
            mp.setattr(torch.Tensor, "cpu", boom)
            mon.step(loss)
    assert calls == []
    mon.close()
    assert kinds_at(mon) == [(3, "nonfinite_grad"), (3, "nonfinite_loss")]
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_raise_and_warn_modes():
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    with pytest.raises(fh.NonFiniteError) as info:
        train(m, opt, 40, plant=nan_batch_at(13), on_nonfinite="raise")
    assert info.value.events[0].step == 13
    assert "step 13" in str(info.value)
    assert all(torch.isfinite(p).all() for p in m.parameters())  # "raise" also protects

    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    mon = train(m, opt, 20, plant=nan_batch_at(13), on_nonfinite="warn")
    assert (13, "nonfinite_loss") in kinds_at(mon)
    assert not all(torch.isfinite(p).all() for p in m.parameters())  # "warn" lets it through
    with pytest.raises(ValueError, match="on_nonfinite"):
        fh.Monitor(m, opt, on_nonfinite="ignore")


@pytest.mark.parametrize("mode", ["warn", "skip"])
@pytest.mark.parametrize("with_opt", [True, False])
def test_obs_skip_says_whether_the_step_was_taken(mode, with_opt):
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    mon = fh.Monitor(m, opt if with_opt else None, on_nonfinite=mode, flush_every=10)
    x, y = data()
    skips = []
    for step in range(4):
        loss = _backward(m, opt, x, y, nan=step == 2)
        skips.append(bool((mon.step(loss) if with_opt else mon.check(loss)).skip))
        if not with_opt and not skips[-1]:
            opt.step()  # the user's own step, skipped when obs.skip says so
    mon.close()
    assert skips == [False, False, mode == "skip", False]
    assert all(torch.isfinite(p).all() for p in m.parameters()) == (mode == "skip")


def test_loss_and_grad_norm_spike_at_the_right_step():
    def plant(step, batch, model, opt):
        if step == 70:
            x, y, w = batch
            return (x, y * 40.0, w)

    m = make_model()
    mon = train(m, torch.optim.AdamW(m.parameters(), lr=3e-3, fused=True), 90, plant=plant)
    ks = kinds_at(mon)
    assert (70, "loss_spike") in ks and (70, "grad_norm_spike") in ks
    # Adam's momentum from that gradient then keeps the grad norm and the loss up for some
    # steps, which the rules may rightly report; nothing may fire before the spike.
    assert all(step >= 70 for step, _ in ks), ks
    ev = next(e for e in mon.events if e.kind == "loss_spike")
    d = ev.details
    assert d["zscore"] > 6, d
    assert "Check first" in ev.message


def test_divergence_after_lr_jump():
    def plant(step, batch, model, opt):
        if step == 60:
            for g in opt.param_groups:
                g["lr"] = 2.0

    m = make_model()
    mon = train(m, torch.optim.SGD(m.parameters(), lr=1e-2), 110, plant=plant)
    div = [e for e in mon.events if e.kind == "divergence"]
    assert len(div) == 1 and 60 <= div[0].step <= 80, kinds_at(mon)
    assert not [e for e in mon.events if e.step < 60], kinds_at(mon)
    assert (60, "lr_jump") in kinds_at(mon)  # the cause, read off the optimizer at the step


def _host(t, loss=1.0, grad_norm=1.0, lr=None):
    from fasthealth.monitor.record import StepHost, StepRecord

    values = dict(loss=loss, loss_finite=1.0, grads_finite=1.0, skipped=0.0,
                  loss_scale=float("nan"), nan_count=0.0, inf_count=0.0, grad_norm=grad_norm,
                  optimizer_nonfinite=float("nan"))
    return StepRecord(t, values, [grad_norm], [0.0], StepHost(t, lr=lr))


def test_lr_jump_rule_ignores_schedules_and_reports_a_jump_above_the_peak():
    """Warm-up from 1e-3 of the peak, cosine decay and warm restarts back to the old peak are
    schedules at work; the rate set 30x above anything it had been is reported at that step."""
    peak = 3e-3
    warm = [peak * min(1.0, 1e-3 + t / 10) for t in range(10)]
    cos = [peak * 0.5 * (1 + math.cos(math.pi * (t % 100) / 100)) for t in range(300)]
    schedule = warm + cos  # SGDR: back to the peak every 100 steps
    rule = rules.LRJump()
    assert not [f for t, lr in enumerate(schedule) for f in rule.observe(_host(t, lr=lr))]
    (f,) = rule.observe(_host(len(schedule), lr=peak * 30))
    kind, msg, d = f.kind, f.message, f.details
    assert kind == "lr_jump" and d["ratio"] == pytest.approx(30) and "Check first" in msg
    assert rule.observe(_host(len(schedule) + 1, lr=peak * 30)) == []  # now the peak
    assert rule.observe(_host(len(schedule) + 2, lr=None)) == []  # no optimizer: no rule


def test_lr_jump_finds_a_rate_climbing_past_its_peak_from_a_decayed_schedule():
    """A rate growing 10% a step from a schedule decayed to 16% of its peak never jumps at one
    step: the climb is found once it passes ``climb_ratio`` (1.5x) the peak, 24 steps in, not
    at ``ratio`` (3x, 31 steps). A warm-up stepped per epoch (the rate x2, x1.5, ... at each
    epoch's first step, flat in between) passes its old peak by up to 2x in one step after
    flat steps: no climb, no jump."""
    peak = 3e-3
    decay = [peak * (1 - t / 1000) for t in range(840)]  # 16% of the peak at step 840
    ramp = [decay[-1] * 1.1 ** (k + 1) for k in range(40)]
    rule = rules.LRJump()
    found = [t for t, lr in enumerate(decay + ramp) for _ in rule.observe(_host(t, lr=lr))]
    assert len(found) == 1 and found[0] - len(decay) < 25, found
    assert rule.config.climb_ratio * peak < (decay + ramp)[found[0]] < rule.config.ratio * peak
    epochs = [peak * min(1.0, (t // 25 + 1) / 8) for t in range(400)]  # 8 epochs of warm-up
    rule = rules.LRJump()
    assert not [f for t, lr in enumerate(epochs) for f in rule.observe(_host(t, lr=lr))]


def test_grad_norm_climbing_steadily_is_exploding_grad():
    """Weights growing 8% a step: the global gradient norm climbs several-fold over a few dozen
    steps while no single step is a spike. Noise around a level, or the 2-3x climb of early
    training, is not reported."""
    g = torch.Generator().manual_seed(0)
    noise = (0.3 * torch.randn(400, generator=g)).tolist()
    rule = rules.GradNormTrend()
    calm = [math.exp(e) for e in noise[:200]]
    early = [math.exp(e + math.log(2.5) * min(t, 60) / 60) for t, e in enumerate(noise[200:])]
    assert not [f for t, v in enumerate(calm + early) for f in rule.observe(_host(t, grad_norm=v))]
    rule = rules.GradNormTrend()
    climb = [math.exp(e + 0.08 * max(0, t - 100)) for t, e in enumerate(noise[:200])]
    fired = [t for t, v in enumerate(climb) for _ in rule.observe(_host(t, grad_norm=v))]
    assert len(fired) == 1 and 100 < fired[0] <= 125, fired


def test_oscillation_detector():
    def plant(step, batch, model, opt):
        if step >= 60:
            x, y, w = batch
            return (x, y, w * (4.0 if step % 2 else 0.25))

    m = make_model()
    mon = train(m, torch.optim.SGD(m.parameters(), lr=1e-3), 100, plant=plant,
                   spike_zscore=1e9)
    osc = [e for e in mon.events if e.kind == "oscillation"]
    assert len(osc) == 1 and 60 <= osc[0].step <= 85, kinds_at(mon)
    # the rule on synthetic log-losses: calm minibatch noise, then swings 5x as large that
    # alternate: it fires within the window; the same noise alone, or a falling zigzag, never
    g = torch.Generator().manual_seed(0)
    noise = (torch.rand(200, generator=g) - 0.5).tolist()
    calm = [1.0 * math.exp(0.05 * e) for e in noise[:100]]
    swings = [1.0 * math.exp(0.25 * (1 if i % 2 else -1) + 0.05 * e)
              for i, e in enumerate(noise[100:])]
    d = rules.Oscillation(rules.Oscillation.Config(warmup=0))
    fired = [k for k, v in enumerate(calm + swings) if d.update(v)]
    assert len(fired) == 1 and 100 <= fired[0] < 100 + 32, fired
    d = rules.Oscillation(rules.Oscillation.Config(warmup=0))
    assert not any(d.update(1.0 * math.exp(0.05 * e)) for e in noise)
    d = rules.Oscillation(rules.Oscillation.Config(warmup=0))
    assert not any(d.update(10.0 - 0.04 * i + (0.1 if i % 2 else 0)) for i in range(200))


def test_vanishing_gradients():
    def plant(step, batch, model, opt):
        if step >= 50:
            x, y, w = batch
            return (x, y, w * 0.0)

    m = make_model()
    mon = train(m, torch.optim.SGD(m.parameters(), lr=1e-2), 70, plant=plant)
    van = [e for e in mon.events if e.kind == "vanishing_grad"]
    assert [e.step for e in van] == [52], kinds_at(mon)


def test_a_fitted_batch_is_no_vanishing_gradient():
    """Gradients that vanish with their loss (a memorised batch, loss 1e-7 against a first
    level of 2.3) are convergence; the same gradients under a loss that stayed up, or a loss of
    exactly 0 at every step (masked out), are vanishing."""
    def run(loss_after):
        rule = rules.Vanishing()
        found = []
        for t in range(60):
            fitted = t >= 40
            found += [(t, f.kind) for f in rule.observe(_host(
                t, loss=loss_after if fitted else 2.3, grad_norm=1e-6 if fitted else 1.0))]
        return found

    assert run(1e-7) == []
    assert run(2.3) == [(42, "vanishing_grad")]
    assert run(0.0) == [(42, "vanishing_grad")]


def test_a_loss_of_exactly_0_at_a_fitted_floor_is_no_vanishing_gradient():
    """At a memorised floor float32 rounds some batches' loss to exactly 0 and their gradients
    to rounding noise, a thousand times below the fitted batches' and more in some tensors than
    others: neither the global rule nor the per-tensor one alarms. A loss that falls to 0 from a
    normal level is masked out: the global rule alarms at once. One masked at the fitted floor
    alarms, in both rules, once the floor's last fitted loss is ``FLOOR_STEPS`` behind."""
    from fasthealth.monitor.record import StepHost, StepRecord
    from fasthealth.monitor.rules.vanishing import FLOOR_STEPS

    def run(losses):
        both = (rules.Vanishing(), rules.TensorNorm(ctx=Context(names=["a.w", "b.w"])))
        found = []
        for t, loss in enumerate(losses):
            per = [1.0, 1.0] if loss > 1e-3 else [1e-2, 1e-2] if loss > 0 else [1e-12, 5e-5]
            values = dict(loss=loss, loss_finite=1.0, grads_finite=1.0, skipped=0.0,
                          loss_scale=math.nan, nan_count=0.0, inf_count=0.0,
                          grad_norm=math.hypot(*per), optimizer_nonfinite=math.nan)
            s = StepRecord(t, values, per, [0.0, 0.0], StepHost(t))
            found += [(t, r.name, f.kind) for r in both for f in r.observe(s)]
        return found

    normal, fitted = [2.3] * 40, [1e-6] * 100
    at_floor = [0.0 if t % 20 < 3 else 1e-6 for t in range(300)]  # three zeros in a row
    assert run(normal + fitted + at_floor) == []
    assert run(normal + [0.0] * 10) == [(42, "vanishing", "vanishing_grad")]
    masked = len(normal + fitted) + FLOOR_STEPS + 2  # the third step past the floor's reach
    assert run(normal + fitted + [0.0] * (FLOOR_STEPS + 10)) == [
        (masked, "vanishing", "vanishing_grad"), (masked, "tensor_norm", "vanishing_grad")]


def test_optimizer_state_nonfinite():
    def plant(step, batch, model, opt):
        if step == 40:
            p = next(iter(model.parameters()))
            opt.state[p]["exp_avg_sq"][0, 0] = float("inf")

    m = make_model()
    mon = train(m, torch.optim.Adam(m.parameters(), lr=1e-3), 45, plant=plant,
                   optimizer_check_every=10)
    ev = [e for e in mon.events if e.kind == "optimizer_state_nonfinite"]
    assert [e.step for e in ev] == [40]
    assert ev[0].details["tensors"] == ["0.weight.exp_avg_sq"]


def test_loss_scale_collapse_with_grad_scaler():
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1000)

    def plant(step, batch, model, opt):
        if step >= 30:  # every step overflows from here: the scaler halves its scale each time
            x, y, w = batch
            return (x, y, w * float("inf"))

    m = make_model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    mon = train(m, opt, 45, plant=plant, scaler=scaler)
    col = [e for e in mon.events if e.kind == "loss_scale_collapse"]
    # the scale after each step's update: 8 (step 30), 4, 2 (step 32): down 8x from 16 within
    # 10 steps, three back-offs in a row; reported once, not again at 1 or 0.5
    assert [e.step for e in col] == [32], kinds_at(mon)
    assert col[0].details["scale"] == 2.0 and "down from 16" in col[0].message
    assert all(torch.isfinite(p).all() for p in m.parameters())


def _cuda_scaler_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GradScaler disables itself only where CUDA is unavailable")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        return torch.amp.GradScaler("cuda")


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.amp.GradScaler("cpu", enabled=False), id="disabled"),
    pytest.param(_cuda_scaler_without_cuda, id="cuda-without-cuda"),
    pytest.param(lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), id="cpu-fresh"),
])
def test_any_grad_scaler_a_user_passes_trains_like_the_plain_loop(make):
    """nanoGPT passes GradScaler(enabled=(dtype == "float16")): disabled in float32/bfloat16.
    A disabled scaler, a CUDA scaler on a machine without CUDA (torch disables it), and a CPU
    scaler never stepped before: the run steps, ends with the plain loop's weights, and raises
    nothing; the NaN planted at step 12 is skipped under each."""
    def plant(step, batch, model, opt):
        if step == 12:
            x, y, w = batch
            return (x, y, w * float("nan"))

    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    batch = (*data(), torch.ones(64, 1))
    for step in range(20):
        if step != 12:
            ref_opt.zero_grad()
            loss_fn(ref, batch).backward()
            ref_opt.step()
    m = make_model()
    scaler = make()
    mon = train(m, torch.optim.SGD(m.parameters(), lr=0.05), 20, plant=plant, scaler=scaler)
    assert {e.step for e in mon.events} == {12}, kinds_at(mon)
    assert "nonfinite_loss" in {e.kind for e in mon.events}
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert (mon.scaler is scaler) == scaler.is_enabled()


def test_loss_scale_rule_below_minimum_and_overflow_steps_under_a_scaler():
    """A scale below min_loss_scale is a collapse at once; an isolated overflow step under a
    GradScaler (finite loss, the scaler skips) is the scaler at work: no event."""
    from fasthealth.monitor.record import StepHost, StepRecord

    def step(t, scale, skipped=0.0, grads_finite=1.0, nan=0.0):
        values = dict(loss=1.0, loss_finite=1.0, grads_finite=grads_finite, skipped=skipped,
                      loss_scale=scale, nan_count=nan, inf_count=3.0 * (1 - grads_finite),
                      grad_norm=1.0, optimizer_nonfinite=float("nan"))
        return StepRecord(t, values, [1.0], [3.0 * (1 - grads_finite)], StepHost(t))

    rule = rules.LossScale(rules.LossScale.Config(min_loss_scale=1.0))
    assert rule.observe(step(0, 4.0)) == []
    assert [f.kind for f in rule.observe(step(1, 0.5))] == ["loss_scale_collapse"]
    grads = rules.NonFiniteGrad(ctx=Context(names=["w"], scaler=True))
    assert grads.observe(step(2, 1024.0, skipped=1.0, grads_finite=0.0)) == []
    # a NaN is no overflow: reported under a scaler too
    assert [f.kind for f in grads.observe(step(3, 512.0, skipped=1.0, grads_finite=0.0,
                                                nan=1.0))] == ["nonfinite_grad"]
    plain = rules.NonFiniteGrad(ctx=Context(names=["w"], scaler=False))
    assert [f.kind for f in plain.observe(step(2, 1024.0, skipped=1.0, grads_finite=0.0))] \
        == ["nonfinite_grad"]


def test_max_grad_norm_matches_clip_grad_norm():
    m = make_model()
    x, y = data()
    loss = loss_fn(m, (x, y, torch.ones(64, 1))) * 100
    loss.backward()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in m.parameters()]
    for r, p in zip(ref, m.parameters()):
        r.grad = p.grad.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    obs = fh.Monitor(m, None, max_grad_norm=0.5).check(loss)
    assert obs.stats.total.norm.item() == pytest.approx(total.item(), rel=1e-5)
    for p, r in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=0)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m.parameters()])) \
        == pytest.approx(0.5, rel=1e-4)


def test_capture_replay_and_logs(tmp_path):
    fault = {}

    def plant(step, batch, model, opt):
        if step == 15:
            return nan_batch_at(15)(step, batch, model, opt)
        if step == 33:
            x, y, w = batch
            return (x, y * 40.0, w)

    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, fused=True)
    mon = fh.Monitor(m, opt, log_dir=tmp_path, flush_every=10, warmup_steps=10,
                     per_tensor_every=5)
    x, y = data()
    for step in range(40):
        batch = plant(step, (x, y, torch.ones(64, 1)), m, opt) or (x, y, torch.ones(64, 1))
        opt.zero_grad()
        loss = loss_fn(m, batch)
        loss.backward()
        if step == 24:  # a transient fault: a bit flip in one gradient, not in the data
            next(iter(m.parameters())).grad[0, 0] = NAN
            fault["step"] = 24
        mon.step(loss, batch=batch, sample_ids=torch.arange(64) + 1000 * step)
    mon.close()
    ks = kinds_at(mon)
    assert (15, "nonfinite_loss") in ks and (24, "nonfinite_grad") in ks
    assert (24, "nonfinite_loss") not in ks and (33, "loss_spike") in ks

    by_step = {e.step: e for e in mon.events}
    dump = torch.load(by_step[15].dump, weights_only=False)
    assert dump["step"] == 15 and dump["params"] is not None
    assert torch.equal(dump["sample_ids"], torch.arange(64) + 15000)
    assert torch.isnan(dump["batch"][0][3, 2])

    r = fh.replay(by_step[15].dump, m, loss_fn)
    assert r.reproduced and r.exact and not math.isfinite(r.loss)
    assert r.source == "batch" and "the batch itself holds NaN" in r.verdict
    assert r.culprit_ids == [15003] and r.replays > 1  # x[3, 2] is NaN: sample 3 of step 15
    r = fh.replay(by_step[24].dump, m, loss_fn)
    assert not r.reproduced and r.grads.ok and "transient" in r.verdict
    assert r.source is None and r.culprit_ids is None
    r = fh.replay(by_step[33].dump, m, loss_fn)
    assert r.reproduced
    assert r.loss == pytest.approx(by_step[33].details["step_loss"], rel=1e-6)

    lines = [json.loads(s) for s in (mon.run_dir / "steps.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in lines] == list(range(40))
    assert lines[15]["loss"] is None and lines[15]["loss_finite"] is False
    assert lines[15]["skipped"] is True and lines[16]["skipped"] is False
    assert lines[3]["lr"] == pytest.approx(3e-3) and lines[3]["grad_norm"] > 0
    assert "per_tensor_norms" in lines[5] and "per_tensor_norms" not in lines[6]
    assert set(lines[5]["per_tensor_norms"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    events = [json.loads(s) for s in (mon.run_dir / "events.jsonl").read_text().splitlines()]
    assert {(e["step"], e["kind"]) for e in events} == set(ks)


def test_explicit_step_numbers_and_context_manager():
    m = make_model()
    x, y = data()
    with fh.Monitor(m, None, flush_every=4) as mon:
        for step in (100, 101, 102):
            loss = loss_fn(m, (x, y, torch.ones(64, 1)))
            m.zero_grad()
            loss.backward()
            obs = mon.check(loss * (NAN if step == 101 else 1), step=step)
            assert obs.step == step
    assert kinds_at(mon) == [(101, "nonfinite_loss")]


def test_a_step_runs_code_in_at_most_ten_fasthealth_modules(tmp_path):
    """A usual step (not a flush) of a Monitor at its defaults with a log_dir, on a two-layer
    MLP with AdamW, runs code in at most ten fasthealth modules, the fused op's included: the
    step's path stays short enough to read top to bottom (docs/design.md draws it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    root = str(Path(fh.__file__).parent)
    mon = fh.Monitor(model, opt, log_dir=tmp_path)
    seen: set[str] = set()

    def profile(frame, event, arg):
        if frame.f_code.co_filename.startswith(root):
            seen.add(frame.f_code.co_filename)

    for t in range(12):  # past the first step's scans; step 11 neither flushes nor scans
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        loss.backward()
        if t == 11:
            sys.setprofile(profile)
        try:
            mon.step(loss, batch=x)
        finally:
            sys.setprofile(None)
        opt.zero_grad()
    mon.close()
    names = sorted(f[len(root) + 1:] for f in seen)
    assert "monitor/monitor.py" in names and "ops/__init__.py" in names
    assert len(names) <= 10, names


def test_monitor_argument_errors():
    m = make_model()
    with pytest.raises(TypeError, match="nn.Module"):
        fh.Monitor([1, 2])
    with pytest.raises(ValueError, match="flush_every"):
        fh.Monitor(m, flush_every=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        fh.Monitor(m, max_grad_norm=-1)


def test_a_small_bump_at_a_flat_plateau_is_no_spike():
    """At a plateau whose losses differ by 0.1% a step, a batch 1.4% above the level scored 7
    noise units; the log-scale floor (MIN_LOG_NOISE) needs a spike to stand 3% above it. A real
    bad batch at the same plateau still is one."""
    g = torch.Generator().manual_seed(0)
    flat = [2.303 * (1 + 0.001 * e) for e in torch.randn(60, generator=g).tolist()]
    rule = rules.Spike()
    assert not [f for t, v in enumerate(flat) for f in rule.observe(_host(t, loss=v))]
    assert rule.observe(_host(60, loss=2.303 * 1.014)) == []
    assert [f.kind for f in rule.observe(_host(61, loss=2.303 * 1.5))] == ["loss_spike"]


def test_a_run_noisier_than_its_window_is_judged_by_its_present_noise():
    """A classifier leaving its plateau: a window of 108 flat steps, then 20 of a fast, noisy
    descent whose batches bounce 30%: the last 32 values' noise unit is the larger, and a batch
    1.8x the recent level scores under 6 with it, 12 with the whole window's."""
    g = torch.Generator().manual_seed(2)
    flat = [2.3 * (1 + 0.002 * e) for e in torch.randn(108, generator=g).tolist()]
    fall = [2.3 * math.exp(-0.03 * t + 0.3 * e)
            for t, e in enumerate(torch.randn(20, generator=g).tolist())]
    values = flat + fall
    level, noise = robust.level_and_noise(values)
    whole = robust.noise_unit(values)
    assert noise > 3 * whole
    lin, _ = robust.spike_scores(values, 1.8 * level)
    assert lin < 6 < 0.8 * level / whole


def test_a_loss_that_underflowed_to_zero_leaves_the_log_scale_on():
    """A classifier that fits its batches: losses spanning 1e-7..1 with one batch at exactly 0.
    The 0 is a gap on the log scale, which stays on: an ordinary hard batch (1.1, the window
    holds 1.0) scores far below 6 there, where the linear scale alone (what a 0 used to leave)
    calls it a spike."""
    g = torch.Generator().manual_seed(5)
    values = (10 ** (-6 + 2 * torch.randn(128, generator=g))).clamp_max(0.05).tolist()
    values[40] = 0.0
    values[100] = 1.0
    lin, log = robust.spike_scores(values, 1.1)
    assert lin > 6 and log < 3, (lin, log)
    without_zero = robust.spike_scores([v for v in values if v > 0], 1.1)
    assert without_zero[1] == pytest.approx(log, rel=0.1)
    # no positive value among the recent ones: the linear score on both
    assert robust.spike_scores([0.0] * 40, 1.0) == (math.inf, math.inf)
    # a negative value: no log scale
    assert robust.spike_scores([1.0, -1.0] * 20, 3.0)[1] == robust.spike_scores(
        [1.0, -1.0] * 20, 3.0)[0]


@pytest.mark.parametrize("width", [128, 40, 20])
def test_the_spike_window_scores_as_spike_scores_does_bit_for_bit(width):
    """``SpikeWindow`` keeps its statistics sorted as values come and go; its scores are
    ``spike_scores`` of the same values, exactly, through the ways a window fills: a descent,
    a plateau with repeated values, zeros (gaps on the log scale), negative values (no log
    scale), a clear, and values that leave the window."""
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(900, generator=g).tolist()
    stream = [2.3 * math.exp(-0.01 * t + 0.2 * e) for t, e in enumerate(noise[:300])]
    stream += [1.0, 1.0, 1.0, 0.5, 1.0] * 20  # ties
    stream += [0.0 if t % 7 == 0 else 1e-6 * math.exp(3 * e)
               for t, e in enumerate(noise[300:500])]  # zeros among tiny losses
    stream += [e for e in noise[500:700]]  # negative values
    stream += [3.0 + 0.1 * e for e in noise[700:]]
    window = robust.SpikeWindow(width)
    checked = 0
    for t, v in enumerate(stream):
        if t == 650:
            window.clear()
        if len(window) >= 3:
            for x in (v, abs(v) * 3 + 1e-9, -1.0, 0.0):
                assert window.scores(x) == robust.spike_scores(list(window.values), x), (t, x)
                checked += 1
        window.append(v)
        assert len(window) == min(width, t + 1 if t < 650 else t - 649)
    assert checked > 3000
    # made from values, as a restored state makes it
    again = robust.SpikeWindow(width, window.values)
    assert again.scores(3.5) == window.scores(3.5) == robust.spike_scores(
        list(window.values), 3.5)


def test_slope_t_is_the_least_squares_slope_and_its_t_bit_for_bit():
    """``slope_t`` (which takes its centred x from a cache) against the formula written out."""
    import random
    import statistics

    def written_out(ys):
        n = len(ys)
        xm, ym = (n - 1) / 2, statistics.fmean(ys)
        sxx = sum((i - xm) ** 2 for i in range(n))
        slope = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sxx
        resid = sum((y - ym - slope * (i - xm)) ** 2 for i, y in enumerate(ys))
        se = math.sqrt(resid / max(n - 2, 1) / sxx)
        return slope, (slope / se if se > 0 else (math.inf if slope > 0 else 0.0))

    r = random.Random(0)
    for k in range(3000):
        n = r.choice([2, 3, 10, 32, 40, 128])
        ys = [r.gauss(0, 1) * 10 ** r.uniform(-3, 3) + 0.01 * k * i for i in range(n)]
        assert robust.slope_t(ys) == written_out(ys)
    assert robust.slope_t([1.0, 2.0, 3.0]) == (1.0, math.inf)


def test_a_growing_norm_the_loss_does_not_confirm_stays_a_notice():
    """The norm climbs 8% a step while the loss falls from the plateau it left: a notice. The
    same climb with the loss rising above where it was when the climb began is an alarm; with
    the learning rate warming up 4x over it, a notice again."""
    def run(loss_of, lr_of):
        rule = rules.GradNormTrend()
        out = []
        for t in range(160):
            norm = math.exp(0.08 * max(0, t - 100)) * (1 + 0.05 * math.sin(t))
            out += [(t, f.severity or "notice")
                    for f in rule.observe(_host(t, loss=loss_of(t), grad_norm=norm,
                                                      lr=lr_of(t)))]
        return out

    falling = run(lambda t: 2.3 * math.exp(-0.01 * max(0, t - 100)), lambda t: 0.05)
    assert falling and all(sev == "notice" for _, sev in falling), falling
    rising = run(lambda t: 0.5 * math.exp(0.01 * max(0, t - 100)), lambda t: 0.05)
    assert any(sev == "alarm" for _, sev in rising), rising
    warm = run(lambda t: 0.5 * math.exp(0.01 * max(0, t - 100)),
               lambda t: 1e-3 * min(4.0, 1 + 3 * max(0, t - 90) / 30))
    assert warm and all(sev == "notice" for _, sev in warm), warm
