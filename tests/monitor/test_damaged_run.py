"""A run a fault left damaged but finite (nanoGPT's loop, a learning-rate burst): its incident
stays open while the loss stays up beyond its noise, ``safe_to_save()`` says no and what to do,
the run's end closes it as not recovered, lasting to the last step, and the report says so.
A healthy twin of the same run raises nothing and saves freely."""

import json
import math
from pathlib import Path

import pytest
import torch
from nanogpt import ACCUM, GPT, LR, WARM, batch, text

import fasthealth as fh
from fasthealth import report

STEPS, BURST_AT, BURST_FOR, BURST = 600, 280, 20, 100.0


def _train(log_dir: Path, burst: bool):
    """nanoGPT's train.py loop: AdamW, warm-up and cosine decay, clipping at 1, gradient
    accumulation; with ``burst``, the learning rate 100x for 20 steps from step 280."""
    torch.manual_seed(0)
    data, g = text(), torch.Generator().manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    mon = fh.Monitor(model, opt, max_grad_norm=1.0, log_dir=log_dir)
    losses, safe = [], {}
    for step in range(STEPS):
        lr = LR * (step + 1) / WARM if step < WARM else LR / 10 + 0.45 * LR * (
            1 + math.cos(math.pi * (step - WARM) / (STEPS - WARM)))
        if burst and BURST_AT <= step < BURST_AT + BURST_FOR:
            lr *= BURST
        for group in opt.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros(())
        for _ in range(ACCUM):
            loss = model(*batch(data, g)) / ACCUM
            loss.backward()
            step_loss += loss.detach()
        mon.step(step_loss)
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss.item())
        if step % 100 == 99:
            safe[step] = mon.save_verdict()
    open_at_end = [(i.id, i.open) for i in mon.incidents]
    mon.close()
    return mon, losses, safe, open_at_end


@pytest.mark.slow
def test_a_learning_rate_burst_that_leaves_the_loss_up_is_not_called_recovered(tmp_path):
    mon, losses, safe, open_at_end = _train(tmp_path / "burst", burst=True)
    before = sorted(losses[BURST_AT - 32:BURST_AT])[16]
    after = sorted(losses[-50:])[25]
    assert after > 1.1 * before, (before, after)  # the damage this test is about: still up
    alarms = [i for i in mon.incidents if i.severity == "alarm"]
    assert len(alarms) == 1 and alarms[0].cause == "learning_rate", mon.incidents
    inc = alarms[0]
    assert (inc.id, True) in open_at_end  # open to the last step: never called recovered
    assert inc.recovered is False and inc.end == STEPS - 1 and not inc.open
    assert safe[199].safe
    for step in (299, 399, 499, 599):
        v = safe[step]
        assert not v.safe and v.incident is inc, (step, v)
    assert "Resume from a checkpoint saved before step 28" in safe[599].reason, safe[599]

    rec = [json.loads(line) for line in (tmp_path / "burst/run-000/incidents.jsonl").open()]
    last = [r for r in rec if r["id"] == inc.id][-1]
    assert last["state"] == "closed" and last["recovered"] is False and last["end"] == STEPS - 1
    text = report.write(tmp_path / "burst")[1]
    assert f"{inc.start}-{STEPS - 1} not back" in text, text

    twin, _, safe, _ = _train(tmp_path / "healthy", burst=False)
    assert not twin.incidents and all(v.safe for v in safe.values()), twin.incidents
