"""One cause per incident, right on the five faults a nanoGPT user plants (nanoGPT's loop,
gradient accumulation, the step's micro-batches passed as its batch): the incident's cause and
its replay's agree, or the report shows the one that has the evidence. A NaN embedding row and
a weight set to 1e4 after a step: the weights; a NaN made in the loss code after the forward:
outside the model and the batch (the loss code first); a learning-rate burst: the learning
rate; a garbage batch: the batch."""

import re
from pathlib import Path

import pytest
import torch
from nanogpt import ACCUM, CHARS, GPT, LR, VOCAB, WARM, batch, text

import fasthealth as fh
from fasthealth import report

STEPS, AT = 200, 120
EXPECTED = {"nan_row": "weights", "weight_1e4": "weights", "loss_nan": "outside",
            "lr_burst": "learning_rate", "garbage": "batch"}


def _loss_fn(model, micro):
    """The step's loss from its dumped micro-batches, as the loop scales it."""
    return sum(model(x, y) for x, y in micro) / len(micro)


def _train(fault: str, log_dir: Path):
    torch.manual_seed(0)
    data, g = text(), torch.Generator().manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    mon = fh.Monitor(model, opt, max_grad_norm=1.0, log_dir=log_dir)
    for step in range(STEPS):
        lr = LR * min(1.0, (step + 1) / WARM)
        if fault == "lr_burst" and AT <= step < AT + 20:
            lr *= 100
        for group in opt.param_groups:
            group["lr"] = lr
        if fault == "nan_row" and step == AT:
            with torch.no_grad():  # the row of the letter "e": in nearly every batch
                model.wte.weight[CHARS.index("e")] = float("nan")
        micro, step_loss = [], torch.zeros(())
        for k in range(ACCUM):
            x, y = batch(data, g)
            if fault == "garbage" and step == AT:
                y = torch.randint(VOCAB, y.shape, generator=g)
            loss = model(x, y) / ACCUM
            if fault == "loss_nan" and step == AT and k == ACCUM - 1:
                loss = loss * float("nan")  # made in the loss code, after the forward
            loss.backward()
            step_loss += loss.detach()
            micro.append((x, y))
        mon.step(step_loss, batch=micro)
        opt.zero_grad(set_to_none=True)
        if fault == "weight_1e4" and step == AT:
            with torch.no_grad():  # after the step: a stray write
                model.blocks[0].qkv.weight[0, 0] = 1e4
    mon.close()
    return model, mon


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(EXPECTED))
def test_each_planted_fault_has_one_right_cause(tmp_path, fault):
    model, mon = _train(fault, tmp_path)
    alarms = [i for i in mon.incidents if i.severity == "alarm"]
    assert alarms, mon.incidents
    for inc in alarms:
        if inc.dump:
            fh.replay(inc.dump, model, _loss_fn)
    log = report.read_log(mon.run_dir)
    shown = [i for i in log.incidents if i["severity"] == "alarm"]
    assert [i["cause"] for i in shown] == [EXPECTED[fault]] * len(shown), shown
    first = shown[0]
    if first.get("replay") and first["replay"].get("cause"):
        # the replay agrees, or the incident's own evidence named the cause directly
        assert first["replay"]["cause"] == first["cause"] or first["cause_by"] == "incident", \
            first
    _, text_ = report.write(tmp_path)
    # the summary's incident rows: the cause column of every alarm incident is the one cause
    rows = re.findall(r"#\d+\s+\d+-\d+(?: not back| open)?\s+alarm\s+\d+\s+(\S+)", text_)
    assert rows == [EXPECTED[fault]] * len(shown), text_
