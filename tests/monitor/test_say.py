"""Alarms as they happen (docs/spec.md section 6): each incident's opening and closing is a
line on the ``fasthealth`` logger (WARNING for alarms, INFO for notices), silenced by the usual
logging configuration; a rollback's warning points at the user's line; a checkpoint after
``close()`` is judged by the incident open when the run ended."""

import logging
import warnings

import torch
from torch import nn

import fasthealth as fh


def _run(mon, model, opt, steps, nan_at=(), scale_at=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if t in nan_at:
            x[3, 1] = float("nan")
        if scale_at is not None and t == scale_at:
            with torch.no_grad():
                model[0].weight.mul_(1e4)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        mon.step(loss, batch=(x, y))  # the user's line


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=0.05)


def test_an_alarm_is_one_warning_line_when_it_opens_and_one_when_it_closes(caplog):
    m, opt = _model()
    mon = fh.Monitor(m, opt, flush_every=5)
    with caplog.at_level(logging.INFO, logger="fasthealth"):
        _run(mon, m, opt, 60, nan_at={20})
        mon.close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fasthealth"]
    opened = [msg for lvl, msg in lines if "nonfinite_loss" in msg and "closed" not in msg]
    closed = [msg for lvl, msg in lines if "nonfinite_loss" in msg and "closed" in msg]
    assert len(opened) == 1 and opened[0].startswith("fasthealth: step 20: alarm #0"), lines
    assert "cause: batch" in opened[0] and "Check first" in opened[0]
    assert len(closed) == 1 and "the loss came back" in closed[0], lines
    assert all(lvl == logging.WARNING for lvl, msg in lines if "alarm" in msg)


def test_the_usual_logging_configuration_silences_it(caplog):
    m, opt = _model()
    mon = fh.Monitor(m, opt, flush_every=5)
    logging.getLogger("fasthealth").setLevel(logging.ERROR)
    try:
        with caplog.at_level(logging.WARNING):
            _run(mon, m, opt, 30, nan_at={20})
            mon.close()
    finally:
        logging.getLogger("fasthealth").setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == "fasthealth"]


def test_a_rollback_warns_at_the_users_line_once_and_logs_it(caplog):
    m, opt = _model()
    mon = fh.Monitor(m, opt, flush_every=5, rollback=fh.RollbackConfig(every=5))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        _run(mon, m, opt, 60, scale_at=40)
    mon.close()
    assert mon.rollbacks, [e.kind for e in mon.events]
    rolled = [w for w in caught if "rolled back" in str(w.message)]
    assert rolled and all(w.filename == __file__ for w in rolled), \
        [(w.filename, w.lineno) for w in rolled]
    text = str(rolled[0].message)
    assert "Resume from a checkpoint" not in text and "or wait" not in text, text
    assert any("rolled back" in r.getMessage() for r in caplog.records)


def test_safe_to_save_stays_false_after_close_for_an_incident_the_run_did_not_come_back_from():
    m, opt = _model()
    mon = fh.Monitor(m, opt, flush_every=5)
    _run(mon, m, opt, 50, scale_at=40)  # a weight x1e4 at step 40: finite, damaged
    assert not mon.safe_to_save()
    mon.close()
    v = mon.save_verdict()
    assert not v.safe and v.incident is not None, v
