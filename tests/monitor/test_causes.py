"""Likely causes (docs/spec.md section 6): each cause reached from a planted fault, in the
incident and in fh.replay's verdict; the group test's culprit set; the first non-finite module
of a Hugging Face model; an incident that stays open while the run is broken."""

import json
import math
import random

import pytest
import torch
from torch import nn

import fasthealth as fh
from fasthealth import report
from fasthealth.monitor.causes import CHECK_FIRST
from fasthealth.monitor.events import ALARM, Event
from fasthealth.monitor.incidents import IncidentTracker

N = 16  # samples a batch


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def run(tmp_path, plant=None, steps=40, lr=1e-2, loss_of=None, opt=None, model=None, **kw):
    """A plain loop of a small classifier under fh.Monitor; ``plant(step, batch, model, opt)``
    may return another batch; ``loss_of(step, model, batch)`` replaces the loss code."""
    model = model or make_model()
    opt = opt or torch.optim.Adam(model.parameters(), lr=lr)
    teacher = torch.Generator().manual_seed(1)
    proj = torch.randn(8, 4, generator=teacher)
    g = torch.Generator().manual_seed(0)
    kw.setdefault("warmup_steps", 5)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=5, **kw) as mon:
        for step in range(steps):
            x = torch.randn(N, 8, generator=g)
            batch = (x, (x @ proj).argmax(1))
            if plant is not None:
                batch = plant(step, batch, model, opt) or batch
            opt.zero_grad()
            loss = loss_of(step, model, batch) if loss_of else loss_fn(model, batch)
            loss.backward()
            mon.step(loss.detach(), batch=batch, sample_ids=torch.arange(N) + 100 * step)
    return mon, model


def alarm_incidents(mon):
    return [i for i in mon.incidents if i.severity == "alarm"]


def test_a_garbage_batch_is_the_batch_and_every_garbage_sample_is_named(tmp_path):
    bad = [2, 5, 6, 11, 15]

    def plant(step, batch, model, opt):
        if step == 25:
            x, y = batch
            x, y = x.clone(), y.clone()
            x[bad] *= 300.0  # corrupt samples: far out of distribution, and mislabelled
            with torch.no_grad():
                y[bad] = (model(x[bad]).argmax(1) + 1) % 4
            return x, y

    mon, model = run(tmp_path, plant)
    (inc,) = alarm_incidents(mon)
    assert inc.start == 25 and inc.trigger == "loss_spike", mon.incidents
    assert inc.cause == "batch" and inc.check_first == CHECK_FIRST["batch"], inc.why
    assert "Likely cause: batch" in inc.message
    r = fh.replay(inc.dump, model, loss_fn)
    assert r.reproduced and r.cause == "batch", r.verdict
    assert r.culprit_ids == [2500 + i for i in bad], r.verdict  # all of them, not one
    assert not r.capped and r.replays <= 1 + 4 * N
    assert "Likely cause: batch" in r.verdict
    # the report: the cause and trigger in the incidents' table, what to check first under it,
    # and replay's cause with what it found
    _, text = report.write(tmp_path)
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("#0 "))
    assert lines[row].split()[4:6] == ["batch", "loss_spike"], lines[row]
    assert lines[row + 1].strip() == f"check first: {CHECK_FIRST['batch']}"
    assert lines[row + 2].rstrip().endswith("likely cause batch, as the incident's"), \
        lines[row + 2]
    few = fh.replay(inc.dump, model, loss_fn, max_replays=4, save=False)
    # 1 + 4 replays, and the batch before as a control (the samples found reproduce together)
    assert few.capped and few.replays == 6 and "cap of 4 replays" in few.verdict, few.verdict
    assert "smallest part found" in few.verdict and set(few.culprit_ids) & set(r.culprit_ids)


def test_a_batch_of_garbage_only_is_the_batch_the_batch_before_as_control(tmp_path):
    """A batch of 16 garbage samples: every sample alone reproduces it, as with damaged
    weights; the batch of the step before, replayed on the same weights, does not: the batch is
    the cause, all 16 named (not one)."""
    def plant(step, batch, model, opt):
        if step == 25:
            x = torch.full_like(batch[0], 300.0)  # a loader that filled the batch with junk
            with torch.no_grad():
                return x, (model(x).argmax(1) + 1) % 4

    mon, model = run(tmp_path, plant)
    (inc,) = alarm_incidents(mon)
    assert inc.start == 25 and inc.cause == "batch", inc.why
    r = fh.replay(inc.dump, model, loss_fn)
    assert r.culprit_ids == [2500 + i for i in range(N)], r.verdict
    assert r.cause == "batch" and "the batch of step 24" in r.verdict, r.verdict


def test_a_weight_set_to_1e30_is_the_weights(tmp_path):
    def plant(step, batch, model, opt):
        if step == 25:
            with torch.no_grad():
                model[0].weight[3, 1] = 1e30

    mon, model = run(tmp_path, plant, steps=35)
    (inc,) = alarm_incidents(mon)
    assert inc.start == 25, mon.incidents
    assert inc.cause == "weights", (inc.trigger, inc.kinds, inc.why)
    # the weight scan's weight_corruption (the direct evidence) or, without it, the loss that
    # stayed up
    assert "weight_corruption" in inc.why or "stayed up" in inc.why, inc.why
    # the loss was astronomical at once: the incident led to the weights from its first step
    # (the record written when it opened, what the trainer callbacks log)
    opened = json.loads((mon.run_dir / "incidents.jsonl").read_text().splitlines()[0])
    assert opened["state"] == "opened" and opened["cause"] == "weights", opened
    # the spike rule's "this step's batch" gives way to the incident's check-first
    assert "this step's batch" not in inc.message and CHECK_FIRST["weights"] in inc.message
    r = fh.replay(inc.dump, model, loss_fn)
    assert r.reproduced and r.cause == "weights", r.verdict
    # only the samples that reach that weight reproduce it; the weight itself is named
    assert 0 < len(r.culprit_ids) < N and "1e+10 or more: 0.weight" in r.verdict, r.verdict


def test_a_weight_set_to_1e30_in_a_bf16_llama_is_the_weights(tmp_path):
    """A weight set to 1e30 in a bf16 Llama: the incident and its replay lead to the weights,
    and replay names the tensor."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def lm_loss(m, b):
        return m(input_ids=b["input_ids"], labels=b["input_ids"]).loss

    g = torch.Generator().manual_seed(0)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=5, warmup_steps=5) as mon:
        for step in range(35):
            if step == 25:
                with torch.no_grad():
                    model.model.layers[0].mlp.down_proj.weight[3, 5] = 1e30
            batch = {"input_ids": torch.randint(1, 64, (8, 12), generator=g)}
            opt.zero_grad()
            loss = lm_loss(model, batch)
            loss.backward()
            mon.step(loss.detach(), batch=batch, sample_ids=torch.arange(8) + 10 * step)
    inc = alarm_incidents(mon)[0]
    assert inc.start >= 25 and inc.cause == "weights", (inc.trigger, inc.kinds, inc.why)
    assert "this step's batch" not in inc.message
    r = fh.replay(inc.dump, model, lm_loss)
    assert r.cause == "weights" and "model.layers.0.mlp.down_proj.weight" in r.verdict, \
        r.verdict


def test_an_lr_x20_is_the_learning_rate(tmp_path):
    def plant(step, batch, model, opt):
        if step == 25:
            for group in opt.param_groups:
                group["lr"] *= 20

    mon, model = run(tmp_path, plant, lr=2e-2, steps=35, dumps="alarm")
    (inc,) = alarm_incidents(mon)
    assert inc.trigger == "lr_jump" and "loss_spike" in inc.kinds, inc.kinds
    assert inc.cause == "learning_rate", inc.why
    # every alarm step's dump: the jump itself, and the spikes of the model it damaged (some
    # samples reproduce those: the dump's learning rate is what names the cause)
    dumps = {e.kind: e.dump for e in mon.events if e.dump and e.incident == inc.id}
    results = {k: fh.replay(d, model, loss_fn) for k, d in dumps.items()}
    assert {"lr_jump", "loss_spike"} <= set(results)
    for r in results.values():
        assert r.reproduced and r.cause == "learning_rate", r.verdict
    assert "3x or more its earlier level" in results["loss_spike"].verdict


def test_a_loss_x100_in_the_loss_code_is_outside_with_the_loss_code_first(tmp_path):
    def loss_of(step, model, batch):
        loss = loss_fn(model, batch)
        return loss * 100 if step == 25 else loss  # a loss computed differently at one step

    mon, model = run(tmp_path, loss_of=loss_of)
    inc = alarm_incidents(mon)[0]
    assert inc.start == 25 and inc.trigger == "loss_spike"
    r = fh.replay(inc.dump, model, loss_fn)
    assert not r.reproduced and r.cause == "outside", r.verdict
    assert r.verdict.index("the loss code") < r.verdict.index("hardware"), r.verdict


def test_nan_optimizer_state_is_the_optimizer_state(tmp_path):
    def plant(step, batch, model, opt):
        if step == 25:
            state = opt.state[model[2].weight]
            state["exp_avg_sq"][0, 0] = math.nan

    mon, model = run(tmp_path, plant, steps=35, optimizer_check_every=1)
    inc = alarm_incidents(mon)[0]
    assert inc.trigger == "optimizer_state_nonfinite", mon.incidents
    assert inc.cause == "optimizer_state" and "optimizer" in inc.check_first
    r = fh.replay(inc.dump, model, loss_fn)
    assert r.cause == "optimizer_state", r.verdict


def test_an_fp16_overflow_under_a_grad_scaler_is_the_numeric_range(tmp_path):
    """float16 autocast on the CPU with a loss scale raised far above what float16 gradients
    hold: the scaled backward overflows (the loss stays finite) and the scaler backs off."""
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1000)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    proj = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=5, warmup_steps=5,
                    scaler=scaler) as mon:
        for step in range(40):
            x = torch.randn(N, 8, generator=g)
            batch = (x, (x @ proj).argmax(1))
            if step == 25:
                scaler.update(new_scale=2.0 ** 24)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            mon.step(loss.detach(), batch=batch, sample_ids=torch.arange(N) + 100 * step)
    (inc,) = alarm_incidents(mon)
    assert inc.start == 25 and inc.trigger == "nonfinite_grad", inc.kinds
    assert inc.cause == "numeric_range" and "float16" in inc.check_first, inc.why
    r = fh.replay(inc.dump, model, loss_fn)  # replay runs unscaled, in float32
    assert not r.reproduced and r.cause == "numeric_range", r.verdict


def test_first_nonfinite_of_a_gpt2_with_a_nan_embedding_row_is_the_embedding(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                  n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)

    def lm_loss(m, batch):
        return m(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=4, warmup_steps=3) as mon:
        for step in range(8):
            if step == 5:
                with torch.no_grad():
                    model.transformer.wte.weight[5] = math.nan
            ids = torch.randint(6, 64, (4, 8), generator=g)
            ids[1, 3] = 5  # one sample reads the NaN row
            opt.zero_grad()
            loss = lm_loss(model, {"input_ids": ids})
            loss.backward()
            mon.step(loss.detach(), batch={"input_ids": ids},
                     sample_ids=torch.arange(4) + 10 * step)
    inc = alarm_incidents(mon)[0]
    r = fh.replay(inc.dump, model, lm_loss)
    assert r.first_nonfinite == "transformer.wte", r.verdict  # its own weight, not an input
    # the LM head shares that weight: every sample's logits hold NaN, and the weights hold it
    assert r.culprit_ids == [50, 51, 52, 53] and r.cause == "weights", r.verdict

    # a NaN arriving as a keyword argument (inputs_embeds=) is an input: GPT2Model, which
    # only passes it on, is not its producer
    clean = transformers.GPT2LMHeadModel(cfg)
    emb = clean.transformer.wte(ids).detach().clone()
    emb[0, 3] = math.nan
    am = fh.ActivationMonitor(clean, modules="all", grads="leaves")
    clean(inputs_embeds=emb, labels=ids).loss.backward()
    assert am.first_nonfinite is None and am.source == "input", am.first_nonfinite
    am.remove()


def ev(step, kind, **details):
    return Event(step, kind, kind, details)


def test_a_loss_of_3e38_then_nan_gradients_is_one_incident():
    """NaN losses at skipped steps, 3 quiet steps, a loss of 3.06e38, then NaN gradients: one
    incident, not closed at the huge loss and reopened by the NaN gradients."""
    t = IncidentTracker()
    for step in range(40):
        events = {20: [ev(20, "nonfinite_loss", skipped=True)],
                  26: [ev(26, "nonfinite_grad", skipped=True)]}.get(step, [])
        t.advance(step)
        t.file(step, events)
        loss = {20: math.nan}.get(step, 3.06e38 if 20 < step < 26 else 2.0 - step / 100)
        finite = step not in (20, 26)
        t.observe(loss if step != 26 else 3.06e38, math.nan, 1.0 if finite else math.nan,
                  finite)
        if step < 26:
            assert t.current is not None or step < 20, step
    assert [i.start for i in t.incidents] == [20], [(i.start, i.kinds) for i in t.incidents]
    assert t.incidents[0].kinds == ["nonfinite_loss", "nonfinite_grad"]
    assert t.incidents[0].cause == "weights", t.incidents[0].why  # the run stayed broken


def test_an_incident_of_skipped_steps_still_closes_once_the_run_is_back():
    t = IncidentTracker()
    for step in range(40):
        events = [ev(20, "nonfinite_loss", skipped=True)] if step == 20 else []
        t.advance(step)
        t.file(step, events)
        t.observe(math.nan if step == 20 else 2.0 - step / 100, math.nan, 1.0, step != 20)
    assert t.current is None and t.incidents[0].end == 20
    assert t.incidents[0].cause == "batch", t.incidents[0].why  # back at once


@pytest.mark.parametrize("weight_finding, cause", [
    ({"jumps": {"q.weight": {"old_amax": 0.04, "new_amax": 1.2e37}}, "nonfinite": {}}, "weights"),
    ({"jumps": {}, "nonfinite": {"q.weight": 3}}, "optimizer_state"),
])
def test_broken_optimizer_state_then_a_weight_that_jumped_is_the_weights(weight_finding, cause):
    """Adafactor's factored moments overflow on a flipped weight's gradient before the weight
    scan sees the weight: a finite jump in the same incident names the weights; NaN weights
    after broken moments are the moments' effect, and the optimizer's state stays the cause."""
    t = IncidentTracker()
    for step in range(30):
        events = {10: [ev(10, "optimizer_state_nonfinite")],
                  12: [ev(12, "weight_corruption", **weight_finding)]}.get(step, [])
        t.advance(step)
        t.file(step, events)
        t.observe(2.0 - step / 100, math.nan, 1.0, True)
    inc = t.incidents[0]
    assert inc.kinds == ["optimizer_state_nonfinite", "weight_corruption"], inc.kinds
    assert inc.cause == cause, inc.why


@pytest.mark.parametrize("several", [True, False])
def test_weights_that_all_jumped_in_an_lr_incident_leave_it_the_learning_rate(several):
    """An LR jump, then the weight scan finds every layer 1000x up: a diverging run, one
    incident whose cause stays the learning rate. One tensor's jump (a flipped bit) is a fault
    of its own, the weights."""
    t = IncidentTracker()
    for step in range(60):
        events = {40: [ev(40, "lr_jump")],
                  49: [ev(49, "weight_corruption", scanned_since=39, several_tensors=several,
                          jumps={"a": {}, "b": {}} if several else {"a": {}})]}.get(step, [])
        t.advance(step)
        t.file(step, events)
        t.observe(2.0 if step < 40 else 9.0, math.nan, 1.0, True)
    causes = [(i.kinds, i.cause) for i in t.incidents]
    if several:
        assert causes == [(["lr_jump", "weight_corruption"], "learning_rate")], causes
    else:
        assert causes == [(["lr_jump"], "learning_rate"), (["weight_corruption"], "weights")]


def _stretch_run(trigger, losses, alarm_at=20, before=None):
    """An incident tracker fed ``losses`` (a level of 0.3 before ``alarm_at``), ``trigger``
    an alarm at ``alarm_at`` (its value the loss there), ``before`` a notice of that kind at
    the step before; its incidents."""
    t = IncidentTracker()
    for step, loss in enumerate(losses):
        t.advance(step)
        events = [Event(step, trigger, trigger, {"value": loss}, ALARM)] if step == alarm_at \
            else [Event(step, before, before, {}, "notice")] if step == alarm_at - 1 and before \
            else []
        t.file(step, events)
        t.observe(loss, math.nan, 1.0, True, step=step)
    t.close_all()
    return t.incidents


def test_a_loss_that_jumps_on_ordinary_weights_and_stays_up_is_the_data():
    """Shuffled labels for 20 steps: the loss jumps to 2.3 (noisy) from a level of 0.3 at a step
    whose weights ordinary steps made, holds there while the stretch lasts, and comes down
    slowly after it (the stretch harmed the model): ``batch``, from the steps it stood up on,
    whether it came back or not. The weights are named where the update before the jump raised
    an event itself (a gradient norm spike), or for a divergence (its default: the rate)."""
    rng = random.Random(0)
    level = [0.3 + rng.uniform(-0.05, 0.05) for _ in range(20)]
    stretch = [2.3 + rng.uniform(-0.4, 0.4) for _ in range(20)]
    healing = [0.3 + 1.5 * 0.9 ** k for k in range(40)]
    (inc,) = _stretch_run("loss_spike", level + stretch + healing)
    assert inc.cause == "batch" and "the data from that step on" in inc.why, inc.why
    (inc,) = _stretch_run("loss_spike", level + stretch[:5])  # still up at the end
    assert inc.cause == "batch" and not inc.recovered, inc.why
    (inc,) = _stretch_run("loss_spike", level + stretch + healing, before="grad_norm_spike")
    assert inc.cause == "weights", inc.why
    (inc,) = _stretch_run("divergence", level + stretch + healing)
    assert inc.cause == "learning_rate", inc.why
    (inc,) = _stretch_run("loss_spike", level + [1e9] * 10)  # astronomical: broken weights
    assert inc.cause == "weights", inc.why
