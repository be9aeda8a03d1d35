"""Rolling back in process (``rollback=``): nanoGPT's loop with faults planted for real (a
learning-rate burst that leaves the loss up, a weight corrupted between two steps) recovers by
itself, in the same process, to the loss of its healthy twin; the samples of the incident's
steps are quarantined and survive a resume; the budget stops a run that keeps skipping; a
healthy run never rolls back."""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from nanogpt import ACCUM, GPT, LR, WARM, batch, text

import fasthealth as fh
from fasthealth import report

STEPS, FAULT_AT = 600, 280


def _lr(step: int) -> float:
    return LR * (step + 1) / WARM if step < WARM else LR / 10 + 0.45 * LR * (
        1 + math.cos(math.pi * (step - WARM) / (STEPS - WARM)))


def _train(log_dir: Path | None, fault: str | None, rollback=None, steps: int = STEPS,
           nan_from: int | None = None, seed: int = 0, **options):
    """nanoGPT's train.py loop (AdamW, warm-up and cosine decay, clipping at 1, gradient
    accumulation), its sample ids the batch's global positions; ``fault``: "burst" (the
    learning rate 100x for 20 steps from FAULT_AT) or "weight" (a column of the first MLP's
    weights set to 1e3 after step FAULT_AT, as corrupted memory would)."""
    torch.manual_seed(seed)
    data, g = text(), torch.Generator().manual_seed(seed)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    mon = fh.Monitor(model, opt, max_grad_norm=1.0, log_dir=log_dir, rollback=rollback,
                     **options)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            lr = _lr(step) * (100.0 if fault == "burst" and
                              FAULT_AT <= step < FAULT_AT + 20 else 1.0)
            for group in opt.param_groups:
                group["lr"] = lr
            step_loss, micro = torch.zeros(()), []
            for _ in range(ACCUM):
                x, y = batch(data, g)
                if fault == "garbage" and FAULT_AT <= step < FAULT_AT + 10:
                    y = torch.randint(0, int(data.max()) + 1, y.shape, generator=g)
                micro.append((x, y))
                loss = model(x, y) / ACCUM
                if nan_from is not None and step >= nan_from:
                    loss = loss * math.nan
                loss.backward()
                step_loss += loss.detach()
            ids = torch.arange(ACCUM * len(x)) + step * ACCUM * len(x)
            mon.step(step_loss, batch=micro, sample_ids=ids)
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss.item())
            if fault == "weight" and step == FAULT_AT:
                with torch.no_grad():
                    model.blocks[0].mlp[0].weight[:, 5] = 1e3
        mon.close()
    return mon, model, losses, [str(w.message) for w in caught
                                if "rolled back" in str(w.message) or "replay" in str(w.message)]


def _replay(model, micro) -> torch.Tensor:
    """The step's loss from its micro-batches, as the loop computes it."""
    return sum(model(x, y) for x, y in micro) / ACCUM


def _level(losses: list[float]) -> float:
    return sorted(losses[-50:])[25]


@pytest.fixture(scope="module")
def healthy():
    """The healthy twin's final loss level, and the seed-to-seed gap (the largest distance of
    two other seeds' levels from it); the healthy run never rolls back."""
    mon, _, losses, said = _train(None, None, rollback=fh.RollbackConfig(every=100))
    assert not mon.rollbacks and not said and not mon.incidents
    assert len(mon.rollback.snapshots) == 2  # taken all along, kept two
    level = _level(losses)
    gap = max(abs(_level(_train(None, None, seed=s)[2]) - level) for s in (1, 2))
    return level, gap


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["burst", "weight"])
def test_a_damaging_fault_is_rolled_back_and_the_run_ends_as_its_healthy_twin(
        tmp_path, fault, healthy):
    """The fault left alone keeps the loss up by more than three seed gaps; rolled back (at
    the first flush after it, to the snapshot before it) the run ends within the seed gap of
    its healthy twin, its incident closed as recovered."""
    level, gap = healthy
    _, _, damaged, _ = _train(None, fault)
    assert _level(damaged) - level > 3 * gap  # the harm the rollback undoes
    mon, model, losses, said = _train(tmp_path, fault,
                                      rollback=fh.RollbackConfig(every=100, replay=_replay))
    (rb,) = mon.rollbacks
    # the first alarm's batch, run again on the restored state, is fine there: not the data
    assert rb.replay == "state" and rb.replay_loss < 1.2 * rb.level, rb
    assert rb.to_step < FAULT_AT <= rb.step < FAULT_AT + 50, rb
    assert rb.step - rb.to_step <= 100 + 50  # at most `every` and a flush lost
    assert len(said) == 1 and f"rolled back at step {rb.step}" in said[0]
    assert abs(_level(losses) - level) <= gap, (_level(losses), level, gap)
    assert torch.isfinite(torch.cat([p.flatten() for p in model.parameters()])).all()
    inc = next(i for i in mon.incidents if i.id == rb.incident)
    assert inc.severity == "alarm" and not inc.open and inc.recovered, inc
    assert inc.rolled_back and inc.end <= rb.step  # closed by the rollback, at it
    # the cause is not the data (a learning rate, the weights): no sample is quarantined
    assert inc.cause == ("learning_rate" if fault == "burst" else "weights")
    assert rb.quarantined == []
    (line,) = [json.loads(s) for s in (mon.run_dir / "rollbacks.jsonl").read_text().splitlines()]
    assert (line["step"], line["to_step"], line["quarantined"], line["replay"]) == (
        rb.step, rb.to_step, rb.quarantined, "state")
    text = report.write(tmp_path)[1]  # and the report says it
    assert f"rollbacks: 1\n    at step {rb.step} back to the end of step {rb.to_step} " \
        f"(incident #{inc.id}: " in text, text


@pytest.mark.slow
def test_the_quarantine_survives_a_resume_and_a_sampler_skips_it(tmp_path):
    mon, _, _, _ = _train(tmp_path, "garbage", rollback=fh.RollbackConfig(replay=_replay),
                          steps=400)
    (rb,) = mon.rollbacks
    assert rb.quarantined
    state = mon.state_dict()
    model = GPT()
    opt = torch.optim.AdamW(model.parameters())
    again = fh.Monitor(model, opt, rollback=True)
    again.load_state_dict(state)
    assert again.rollback.quarantine == rb.quarantined and again.rollbacks == mon.rollbacks
    kept = list(fh.skip_quarantined(range(400 * ACCUM * 8), again))
    assert set(range(400 * ACCUM * 8)) - set(kept) == set(rb.quarantined)
    again.close()


def test_a_batch_holding_a_quarantined_sample_is_skipped_and_spares_the_budget(tmp_path):
    """A loop whose sampler still serves quarantined samples (a trainer's): a resumed Monitor
    skips each step whose batch holds one, on the device, the weights and the optimizer as they
    were; steps.jsonl marks it quarantine_skip, and max_skips=0 is not spent on it. Sample ids
    as a tensor or a list of ints; a batch without ids or without quarantined samples steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = fh.Monitor(model, opt, rollback=True)
    first.rollback.quarantine = [13, 40]  # as a rollback before the checkpoint left it
    state = first.state_dict()
    first.close()
    mon = fh.Monitor(model, opt, rollback=fh.RollbackConfig(max_skips=0), log_dir=tmp_path,
                     flush_every=5)
    mon.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    held = {1: torch.tensor([12, 13, 14, 15]), 3: [40, 41, 42, 43]}
    for t in range(10):
        ids = held.get(t, torch.arange(4) + 100 * t) if t != 5 else None
        x = torch.randn(4, 4, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        steps_before = [float(s["step"]) for s in opt.state.values()]
        mon.step(loss, sample_ids=ids)
        opt.zero_grad()
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert same == (t in held), t
        assert ([float(s["step"]) for s in opt.state.values()] == steps_before) == (t in held), t
    mon.close()
    lines = [json.loads(line) for line in (mon.run_dir / "steps.jsonl").open()]
    assert [r["step"] for r in lines if r["quarantine_skip"]] == [1, 3]
    assert [r["step"] for r in lines if r["skipped"]] == [1, 3]
    assert not mon.events and mon.rollback.skips == 0


@pytest.mark.slow
def test_the_budget_stops_a_run_that_skips_without_end():
    """NaN losses from step 100 on: each is skipped, until more than max_skips, then the flush
    that sees it (every 10 steps here: at step 119, 20 skipped) raises RollbackBudgetError
    naming the count and the incident."""
    with pytest.raises(fh.RollbackBudgetError, match=r"20 steps skipped, more than "
                       r"max_skips=10.*#0 steps 100-\d+ nonfinite_loss") as err:
        _train(None, None, rollback=fh.RollbackConfig(max_skips=10), steps=200, nan_from=100,
               flush_every=10)
    # rolled back at the first flush (the run broken), the NaN coming back a new incident
    first, *rest = err.value.incidents
    assert first.rolled_back and rest and {i.trigger for i in rest} == {"nonfinite_loss"}


def test_rollback_needs_the_optimizer_and_names_bad_settings():
    model = GPT()
    with pytest.raises(ValueError, match="rollback needs the optimizer"):
        fh.Monitor(model, rollback=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="rollback must be a fh.RollbackConfig"):
        fh.Monitor(model, opt, rollback="yes")
    with pytest.raises(ValueError, match="rollback.every"):
        fh.Monitor(model, opt, rollback=fh.RollbackConfig(every=0))
    with pytest.raises(TypeError, match=r"rollback.replay must be a loss function "
                       r"replay\(model, batch\) or None, got 'loss'"):
        fh.Monitor(model, opt, rollback=fh.RollbackConfig(replay="loss"))


def test_a_snapshot_holds_its_step_though_buffers_are_used_again():
    """Snapshots reuse the buffers of the one that goes; each still restores exactly the model
    and optimizer state of its own step, and a restored optimizer shares no tensor with it."""
    from fasthealth.monitor.rollback import Rollback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rb = Rollback(fh.RollbackConfig(keep=2), model, opt)
    states = {}
    for step in range(5):
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        rb._take(step)
        states[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                        [s["exp_avg"].clone() for s in opt.state.values()])
    assert [s.step for s in rb.snapshots] == [3, 4]
    rb._restore(rb.snapshots[0])
    assert all(torch.equal(v, states[3][0][k]) for k, v in model.state_dict().items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), states[3][1]))
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()  # changes the live state, not the snapshot's
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(
        rb.snapshots[0].optimizer["state"].values(), states[3][1]))


@pytest.mark.slow
def test_a_run_of_bad_batches_is_quarantined_whole(healthy):
    """Ten steps of labels drawn at random: rolled back at the flush after them, and every
    sample of the ten steps in quarantine (some of them raised no event of their own), the run
    ending within the seed gap of its healthy twin (as it does left alone: this fault is
    harmless here, and the rollback costs it nothing)."""
    mon, _, losses, said = _train(None, "garbage", rollback=fh.RollbackConfig(replay=_replay))
    level, gap = healthy
    assert abs(_level(losses) - level) <= gap
    (rb,) = mon.rollbacks
    # its first alarm's batch (random labels) is bad on the restored state too: the data
    assert rb.replay == "batch" and rb.replay_loss > 1.2 * rb.level, rb
    assert "bad alone (the data)" in said[0]
    assert rb.to_step < FAULT_AT <= rb.step
    steps = {i // (ACCUM * 8) for i in rb.quarantined}
    assert set(range(FAULT_AT, FAULT_AT + 10)) <= steps
    assert max(steps) < FAULT_AT + 20  # and a few steps of its aftermath, no more


@pytest.mark.slow
def test_a_replay_that_fails_leaves_the_rollback_standing_without_a_verdict():
    """The user's replay raising (a batch without the key it reads) does not stop the run: the
    rollback stands, says why there is no verdict, and the run ends healthy."""
    def broken(model, micro):
        raise KeyError("labels")

    mon, model, _, said = _train(None, "weight", rollback=fh.RollbackConfig(every=100,
                                                                             replay=broken))
    (rb,) = mon.rollbacks
    assert rb.replay is None and rb.replay_loss is None, rb
    (failed,) = [m for m in said if "failed" in m]
    assert f"replay of incident #{rb.incident}'s batch failed (KeyError: 'labels')" in failed
    assert torch.isfinite(torch.cat([p.flatten() for p in model.parameters()])).all()
