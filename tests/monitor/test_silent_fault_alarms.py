"""The alarms for faults that do not show in the loss (docs/spec.md section 6): a corrupted
weight, a repeated batch, an fp16 overflow streak, and no gradients at all; each planted for
real in a plain loop under ``fh.Monitor``, and each quiet on a healthy run."""

import math

import pytest
import torch
from runlog import run_of

import fasthealth as fh
from fasthealth.monitor.rules import Rule
from fasthealth.monitor.scans import fingerprint, ids_key

NEW = {"weight_corruption", "repeated_batch", "no_grad", "overflow_streak"}


class LoRAish(torch.nn.Module):
    """An MLP with a ReLU and a low-rank adapter whose B starts at zero (LoRA)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 1)
        self.lora_a = torch.nn.Parameter(torch.randn(4, 8) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.zeros(32, 4))

    def forward(self, x):
        h = self.fc1(x) + x @ self.lora_a.t() @ self.lora_b.t()
        return self.fc2(torch.relu(h))


def dataset(n=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5 + 0.1 * torch.randn(n, 1, generator=g)


def run(steps=60, *, plant=None, batch_of=None, ids=True, lr=1e-2, backward=True,
        after_backward=None, after_step=None, scaler=None, seed=0, **kw):
    """A plain loop: shuffled batches of 16 (``batch_of(step)`` overrides), Adam, the Monitor
    with flush_every 10; ``plant(step, model)`` touches the weights before the step's forward."""
    torch.manual_seed(seed)
    model = LoRAish()
    opt = model.opt = torch.optim.Adam(model.parameters(), lr=lr)
    kw.setdefault("flush_every", 10)
    kw.setdefault("warmup_steps", 10)
    mon = fh.Monitor(model, opt, scaler=scaler, **kw)
    x, y = dataset()
    g = torch.Generator().manual_seed(seed + 7)
    for step in range(steps):
        idx = batch_of(step) if batch_of is not None else torch.randperm(512, generator=g)[:16]
        batch = (x[idx], y[idx])
        if plant is not None:
            plant(step, model)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        if backward:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if after_backward is not None:
            after_backward(step, model)
        mon.step(loss, batch=batch, sample_ids=idx if ids else None)
        if after_step is not None:
            after_step(step, model)
    mon.close()
    return mon, model


def events(mon, kind):
    return [e for e in mon.events if e.kind == kind]


def flip_exponent_bit(t: torch.Tensor, i: int, bit: int = 30) -> None:
    with torch.no_grad():
        t.view(-1).view(torch.int32)[i] ^= 1 << bit


# ---- weight corruption --------------------------------------------------------------------


def test_a_flipped_exponent_bit_is_an_alarm_naming_the_tensor_by_the_next_flush():
    seen = {}

    def plant(step, model):
        if step == 23:
            w = model.fc1.weight.detach().view(-1)
            i = int(torch.argmin(w))  # a negative weight: its ReLU channel dies silently
            seen["old"] = float(w[i])
            flip_exponent_bit(model.fc1.weight, i)
            seen["new"] = float(w[i])

    mon, _ = run(40, plant=plant)
    assert seen["old"] < 0 and abs(seen["new"]) > 1e30
    found = events(mon, "weight_corruption")
    assert len(found) == 1, [(e.step, e.kind) for e in mon.events]
    e = found[0]
    assert 23 <= e.step <= 29 and e.severity == "alarm"  # the scan of the flush 20..29
    assert list(e.details["jumps"]) == ["fc1.weight"] and "fc1.weight" in e.message
    jump = e.details["jumps"]["fc1.weight"]
    assert jump["old_amax"] < 10 and jump["new_amax"] == pytest.approx(abs(seen["new"]),
                                                                       rel=1e-6)
    assert e.details["since_step"] == 19
    # what it found happened after the scan of step 19; one tensor: a cause of its own
    assert e.details["scanned_since"] == 19 and e.details["several_tensors"] is False


def test_several_tensors_that_jumped_together_are_reported_as_a_diverging_run():
    def plant(step, model):
        if step == 23:
            with torch.no_grad():
                model.fc1.weight.mul_(1e5)
                model.fc2.weight.mul_(1e5)

    mon, _ = run(30, plant=plant)
    found = events(mon, "weight_corruption")
    assert found, [(e.step, e.kind) for e in mon.events]
    e = found[0]
    assert set(e.details["jumps"]) == {"fc1.weight", "fc2.weight"}
    assert e.details["several_tensors"] is True and "diverging run" in e.message


def test_a_low_exponent_bit_is_not_orders_of_magnitude():
    """Bit 23 doubles the element at most: healthy-sized, below the factor; no alarm."""
    def plant(step, model):
        if step == 23:
            flip_exponent_bit(model.fc1.weight, 0, bit=23)

    mon, _ = run(40, plant=plant)
    assert not events(mon, "weight_corruption")


@pytest.mark.parametrize("on_nonfinite", ["skip", "warn"])
def test_a_nan_weight_is_one_incident_holding_the_corruption(on_nonfinite):
    def plant(step, model):
        if step == 15:
            with torch.no_grad():
                model.fc2.weight[0, 3] = math.nan

    mon, _ = run(40, plant=plant, on_nonfinite=on_nonfinite)
    found = events(mon, "weight_corruption")
    assert len(found) == 1 and 15 <= found[0].step <= 19
    assert found[0].details["nonfinite"] == {"fc2.weight": 1} or (
        on_nonfinite == "warn" and "fc2.weight" in found[0].details["nonfinite"])
    if on_nonfinite == "skip":  # the weights never change again: one fault
        assert len(mon.incidents) == 1
        assert "weight_corruption" in mon.incidents[0].kinds


def test_a_scan_every_k_steps_finds_it_sooner():
    def plant(step, model):
        if step == 12:
            flip_exponent_bit(model.fc2.weight, 5)

    mon, _ = run(20, plant=plant, flush_every=10, rules={"weight_corruption": {"every": 2}})
    found = events(mon, "weight_corruption")
    assert len(found) == 1 and found[0].step == 13, [(e.step, e.kind) for e in mon.events]


def test_a_healthy_run_with_a_zero_initialised_adapter_raises_no_new_alarm():
    """200 steps at a high learning rate after a first step at a tiny one (a warm-up from
    near 0): the LoRA B is ~1e-5 at the first scan and 1e4 times that at the next, yet, the
    model's own scale being the floor, nothing new fires (and the weight scans did run)."""
    def warm_up(step, model):
        if step == 0:
            for group in model.opt.param_groups:
                group["lr"] = 3e-2

    mon, model = run(200, lr=1e-5, after_step=warm_up)
    assert model.lora_b.detach().abs().max() > 1e-2  # it grew from zero
    assert not [e for e in mon.events if e.kind in NEW], [(e.step, e.kind) for e in mon.events]
    rule = next(d for d in mon.detectors if d.name == "weight_corruption")
    assert rule.prev is not None and rule.prev[0] == 199


# ---- repeated batch ---------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [True, False], ids=["by_ids", "by_fingerprint"])
def test_a_stuck_loader_is_caught_within_a_few_steps(ids):
    g = torch.Generator().manual_seed(3)
    stuck = torch.randperm(512, generator=g)[:16]

    def batch_of(step):
        return stuck if step >= 30 else torch.randperm(512, generator=g)[:16]

    mon, _ = run(60, batch_of=batch_of, ids=ids)
    found = events(mon, "repeated_batch")
    assert len(found) == 1, [(e.step, e.kind) for e in mon.events]
    assert found[0].step == 32 and found[0].details["since_step"] == 30
    assert found[0].details["by"] == ("sample ids" if ids else "fingerprint")


@pytest.mark.parametrize("ids", [True, False], ids=["by_ids", "by_fingerprint"])
def test_full_batch_training_does_not_alarm(ids):
    everything = torch.arange(512)
    planted = torch.arange(16)  # and a few odd batches in it

    mon, _ = run(60, batch_of=lambda s: planted if s in (20, 21) else everything, ids=ids)
    assert not events(mon, "repeated_batch")


def test_a_shuffled_full_batch_is_not_a_repeat():
    g = torch.Generator().manual_seed(5)
    mon, _ = run(40, batch_of=lambda s: torch.randperm(512, generator=g), ids=False)
    assert not events(mon, "repeated_batch")


def test_fingerprints_tell_batches_apart_and_micro_batches_count():
    x = torch.randn(4, 8)
    tok = torch.randint(0, 100, (4, 16))
    cpu = torch.device("cpu")
    same = [fingerprint({"x": x.clone(), "t": tok.clone()}, cpu) for _ in range(2)]
    assert same[0].item() == same[1].item()
    assert fingerprint({"x": x[[1, 0, 2, 3]], "t": tok}, cpu).item() != same[0].item()
    t2 = tok.clone()
    t2[3, 15] += 1
    assert fingerprint({"x": x, "t": t2}, cpu).item() != same[0].item()
    micro = [(x, tok), (x, t2)]  # gradient accumulation: a list of micro-batches
    assert fingerprint(micro, cpu).item() != fingerprint([(x, tok), (x, tok)], cpu).item()
    assert fingerprint("no tensors", cpu) is None
    assert ids_key(torch.arange(4)) == ids_key(torch.arange(4)) != ids_key(torch.arange(1, 5))
    assert ids_key([1, 2, 3]) == ids_key([1, 2, 3]) and ids_key(None) is None


def test_a_stuck_loader_of_micro_batches_is_caught():
    torch.manual_seed(0)
    model = LoRAish()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, flush_every=10)
    x, y = dataset()
    for step in range(30):
        micro = [(x[i:i + 8], y[i:i + 8]) for i in ((step if step < 15 else 15) * 16,
                                                     (step if step < 15 else 15) * 16 + 8)]
        opt.zero_grad()
        for mx, my in micro:
            (torch.nn.functional.mse_loss(model(mx), my) / 2).backward()
        mon.step(torch.tensor(1.0), batch=micro)
    mon.close()
    found = events(mon, "repeated_batch")
    assert len(found) == 1 and found[0].step == 17


# ---- fp16 overflow streak ----------------------------------------------------------------------


def test_an_overflow_at_every_step_under_a_scale_forced_high_alarms_once():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)

    def overflow(step, model):
        if step >= 10:
            model.fc1.weight.grad[0, 0] = math.inf  # what float16 makes of a too-large grad

    def forced_high(step, model):
        scaler._scale.fill_(2.0 ** 40)  # code that resets the scale: it cannot back off

    mon, _ = run(80, after_backward=overflow, after_step=forced_high, scaler=scaler)
    found = events(mon, "overflow_streak")
    assert len(found) == 1 and found[0].step == 29, [(e.step, e.kind) for e in mon.events]
    assert "stopped learning" in found[0].message and found[0].severity == "alarm"
    assert not events(mon, "loss_scale_collapse")


def test_a_scale_that_backs_off_in_vain_is_one_incident_with_its_collapse():
    """The default scaler halves at every overflow: the scale's collapse comes first, the
    streak joins its incident."""
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)

    def overflow(step, model):
        if step >= 10:
            model.fc1.weight.grad[0, 0] = math.inf

    mon, _ = run(80, after_backward=overflow, scaler=scaler)
    assert [e.step for e in events(mon, "overflow_streak")] == [29]
    assert len(mon.incidents) == 1
    assert mon.incidents[0].kinds == ["loss_scale_collapse", "overflow_streak"]


def test_a_few_overflow_skips_are_the_scaler_at_work():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)

    def overflow(step, model):
        if step % 10 == 5:
            model.fc1.weight.grad[0, 0] = math.inf

    mon, _ = run(60, after_backward=overflow, scaler=scaler)
    assert not events(mon, "overflow_streak")


# ---- no gradients ----------------------------------------------------------------------------


def test_a_forgotten_backward_is_no_grad_not_vanishing():
    mon, _ = run(20, backward=False)
    kinds = {e.kind for e in mon.events}
    assert "no_grad" in kinds and "vanishing_grad" not in kinds, kinds
    e = events(mon, "no_grad")[0]
    assert e.step == 1 and e.severity == "alarm" and len(events(mon, "no_grad")) == 1
    assert e.message.startswith("no gradients at all: no parameter has a .grad (was "
                                "loss.backward() called?")


def test_gradients_that_are_exactly_zero_are_vanishing_not_no_grad():
    def zero(step, model):
        for p in model.parameters():
            p.grad.zero_()

    mon, _ = run(20, after_backward=zero)
    kinds = {e.kind for e in mon.events}
    assert "vanishing_grad" in kinds and "no_grad" not in kinds, kinds


# ---- the record ------------------------------------------------------------------------------


def test_the_scans_reach_steps_jsonl_at_their_steps_only(tmp_path):
    import json

    run(25, ids=False, log_dir=tmp_path)
    lines = (run_of(tmp_path) / "steps.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    rows = [r for r in rows if "step" in r and "loss" in r]
    scanned = [r["step"] for r in rows if r["weight_nonfinite"] is not None]
    assert scanned == [0, 9, 19]
    assert all(r["weight_nonfinite"] == 0 and r["weight_amax"] > 0 for r in rows
               if r["step"] in scanned)
    fps = [r["batch_fingerprint"] for r in rows]
    assert all(isinstance(f, float) for f in fps) and len(set(fps)) == len(fps)


def test_without_their_rules_nothing_is_scanned():
    """A rule set of one's own without the two rules: no weight scan, no fingerprint."""
    torch.manual_seed(0)
    model = LoRAish()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, flush_every=5, detectors=[])
    x, y = dataset()
    seen = []

    class Spy(Rule):
        name = "spy"

        def observe(self, s):
            seen.append(s)
            return []

    mon.detectors.append(Spy())
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
        mon.step(torch.tensor(1.0), batch=(x[:16], y[:16]))
    mon.close()
    assert len(seen) == 6 and mon.scans.every == 0 and not mon.scans.keyed
    assert all(s.host.weight_table is None and s.host.batch_key is None for s in seen)
    assert all(math.isnan(s.values["batch_fingerprint"]) for s in seen)


@pytest.mark.parametrize("rules", [{"weight_corruption": {"every": -1}},
                                   {"weight_corruption": {"factor": 1.0}},
                                   {"repeated_batch": {"repeats": 1}}])
def test_settings_that_cannot_work_are_refused_when_the_monitor_is_built(rules):
    with pytest.raises(ValueError, match=next(iter(rules))):
        fh.Monitor(LoRAish(), rules=rules)


def test_a_tiny_gpt2_bit_flip_and_stuck_dict_batches():
    """A transformers GPT-2 built from its config, dict batches as a tokenizer gives them: a
    flipped exponent bit in one attention weight is named; a loader stuck on one dict batch is
    caught by its fingerprint."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = fh.Monitor(model, opt, flush_every=10)
    g = torch.Generator().manual_seed(1)
    stuck = torch.randint(0, 64, (4, 16), generator=g)
    target = "transformer.h.1.attn.c_attn.weight"
    for step in range(40):
        ids = stuck if step >= 25 else torch.randint(0, 64, (4, 16), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        if step == 12:
            w = dict(model.named_parameters())[target]
            flip_exponent_bit(w, int(torch.argmax(w.detach().abs())) + 1)
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        mon.step(loss, batch=batch)
    mon.close()
    wc = events(mon, "weight_corruption")
    assert wc and wc[0].step == 19 and target in wc[0].details["jumps"] | wc[0].details[
        "nonfinite"], [(e.step, e.kind, e.details) for e in wc]
    rb = events(mon, "repeated_batch")
    assert len(rb) == 1 and rb[0].step == 27 and rb[0].details["by"] == "fingerprint"
