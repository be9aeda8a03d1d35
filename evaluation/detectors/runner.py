"""One corpus run: a real training loop under ``fh.Monitor``, and the replay of its recorded
steps through fresh Monitors with other thresholds (no second training run).

The Monitor's detectors look only at each step's record (``record.StepRecord``), so a run
recorded once can be judged under any detector settings: ``replay`` feeds the recorded steps,
step by step, to the analyser a Monitor with those settings has
(``fasthealth.monitor.analyser_for``), and reads its events and incidents back.
``evaluation/eval_detectors.py`` checks that the replay at the Monitor's defaults gives the very
events of the training run (``faithful``).

Events are read as ``(step, kind, severity, incident)``: ``severity`` is the event's
``"alarm"`` or ``"notice"`` (``"alarm"`` for a Monitor that has none), ``incident`` its
incident id or None; incidents as ``(id, start, end, severity, kinds)``, or None for a
Monitor without them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fasthealth as fh
from fasthealth.monitor import analyser_for
from fasthealth.monitor.incidents import IncidentConfig
from fasthealth.monitor.record import StepRecord
from fasthealth.monitor.rules import Rule

# ---- what a run trains ----------------------------------------------------------------------


@dataclass
class Setup:
    """model, optimizer, ``data(step) -> batch``, ``loss(model, batch) -> loss``; optionally a
    scheduler stepped every step, a GradScaler, Monitor options (``max_grad_norm``), the
    user's own ``clip_grad_norm_`` before ``mon.step`` (``clip``), and an autocast dtype."""

    model: nn.Module
    opt: torch.optim.Optimizer
    data: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    sched: Any = None
    scaler: Any = None
    monitor: dict = field(default_factory=dict)
    clip: float | None = None
    autocast: torch.dtype | None = None


def mse(model, batch):
    x, y = batch[:2]
    return F.mse_loss(model(x), y)


def cross_entropy(smoothing: float = 0.0):
    def loss(model, batch):
        x, y = batch[:2]
        return F.cross_entropy(model(x).float(), y, label_smoothing=smoothing)
    return loss


ce = cross_entropy()


def bce(model, batch):
    x, y = batch[:2]
    return F.binary_cross_entropy_with_logits(model(x)[:, 0].float(), y.float())


def autoencoder(model, batch):
    x = batch[0]
    return F.mse_loss(model(x).float(), x)


def lm(smoothing: float = 0.0):
    """Next-token cross-entropy; a batch ``(ids, targets, pad)`` masks keys in attention, and
    ``(ids, targets, None, weight)`` weighs the targets (the loss is the weighted mean: an
    all-zero weight, a batch of padding only, is 0/0)."""
    def loss(model, batch):
        ids, targets = batch[:2]
        pad = batch[2] if len(batch) > 2 else None
        logits = model(ids, pad).float()
        flat = logits.reshape(-1, logits.shape[-1])
        if len(batch) > 3:
            w = batch[3].reshape(-1).float()
            each = F.cross_entropy(flat, targets.reshape(-1), reduction="none",
                                   label_smoothing=smoothing)
            return (each * w).sum() / w.sum()
        return F.cross_entropy(flat, targets.reshape(-1), label_smoothing=smoothing)
    return loss


# ---- schedules ------------------------------------------------------------------------------

def warmup_linear(opt, warm: int, steps: int):
    """Linear warm-up over ``warm`` steps, then linear decay to 5%."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: min((t + 1) / warm, max(0.05, (steps - t) / (steps - warm))))


def warmup_cosine(opt, warm: int, steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: min((t + 1) / warm,
                           0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))))


def cosine(opt, steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps)))


def one_cycle(opt, max_lr: float, steps: int, pct: float = 0.3):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps + 1,
                                               pct_start=pct)


def restarts(opt, first: int, mult: int = 2):
    return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=first, T_mult=mult)


def step_decay(opt, every: int, gamma: float):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=every, gamma=gamma)


# ---- recording and replay -------------------------------------------------------------------

class Recorder(Rule):
    """Keeps every step's record (its batch and RNG state left out) for ``replay``: raises no
    event."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[StepRecord] = []

    def observe(self, s: StepRecord) -> list:
        host = dataclasses.replace(s.host, batch=None, sample_ids=None, rng=None)
        self.steps.append(StepRecord(s.step, dict(s.values), list(s.per_norm),
                                     list(s.per_bad), host))
        return []


def read_events(mon) -> list[tuple]:
    return [(e.step, e.kind, getattr(e, "severity", "alarm"), getattr(e, "incident", None))
            for e in mon.events]


def read_incidents(mon) -> list[tuple] | None:
    incidents = getattr(mon, "incidents", None)
    if incidents is None:
        return None
    out = []
    for inc in incidents:
        kinds = getattr(inc, "kinds", None) or sorted({e.kind for e in getattr(inc, "events", [])})
        out.append((getattr(inc, "id", None), getattr(inc, "start", None),
                    getattr(inc, "end", None), getattr(inc, "severity", "alarm"), list(kinds)))
    return out


def monitor_for(setup: Setup, options: dict) -> fh.Monitor:
    return fh.Monitor(setup.model, setup.opt, flush_every=50, scaler=setup.scaler,
                      **{"scheduler": setup.sched, **setup.monitor, **options})


def replay(setup: Setup, steps: list[StepRecord], options: dict) -> dict:
    """The events and incidents a Monitor with ``options`` raises over the recorded ``steps``:
    its analyser, built on its own, fed the records step by step."""
    options = dict(options)
    tracker = options.pop("incidents", None)  # IncidentConfig fields (evaluation/ablate_rules.py)
    an = analyser_for(
        setup.model, setup.opt, scaler=setup.scaler,
        incidents=IncidentConfig(**tracker) if tracker is not None else None,
        **{"scheduler": setup.sched, **setup.monitor, **options})
    for s in steps:
        an.analyse(s)
    an.close()
    return {"events": read_events(an), "incidents": read_incidents(an)}


Fault = Callable[[int, Any, Setup], Any]


def train(setup: Setup, steps: int, before: Fault | None = None,
          after_backward: Fault | None = None, options: dict | None = None) -> dict:
    """Trains ``steps`` steps under a Monitor (with ``options``); ``before(step, batch, setup)``
    may replace the batch or touch the model and optimizer, ``after_backward`` the gradients.
    Returns the events, the incidents, every step's record and the loss curve."""
    m = setup.model
    mon = monitor_for(setup, options or {})
    rec = Recorder()
    mon.detectors.append(rec)
    params = [p for p in m.parameters() if p.requires_grad]
    for step in range(steps):
        batch = setup.data(step)
        if before is not None:
            batch = before(step, batch, setup)
        setup.opt.zero_grad(set_to_none=True)
        if setup.autocast is not None:
            with torch.autocast("cpu", dtype=setup.autocast):
                loss = setup.loss(m, batch)
        else:
            loss = setup.loss(m, batch)
        (setup.scaler.scale(loss) if setup.scaler is not None else loss).backward()
        if after_backward is not None:
            after_backward(step, batch, setup)
        if setup.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, setup.clip)
        mon.step(loss, batch=batch)
        if setup.sched is not None:
            setup.sched.step()
    mon.close()
    return {"events": read_events(mon), "incidents": read_incidents(mon), "steps": rec.steps,
            "loss": [s.values["loss"] for s in rec.steps]}
