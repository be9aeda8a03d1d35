"""Replay the step behind an event: tell a data problem (it reproduces) from a transient fault.

``fh.replay(event.dump, model, loss_fn)`` loads the dump a Monitor saved (batch, sample ids, RNG
state and, when they fit the snapshot budget, the parameters as they were before that step's
update), re-runs that forward and backward on a deep copy of ``model`` with activation hooks,
and compares with what was recorded. ``loss_fn(model, batch) -> loss``.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..activations import ActivationMonitor
from ..checks import check_grads
from ..stats import MultiTensorStats
from .events import FATAL_KINDS
from .sinks import map_tensors


@dataclass
class ReplayResult:
    reproduced: bool
    loss: float
    grads: MultiTensorStats
    first_nonfinite: str | None
    verdict: str
    exact: bool  # parameters restored from the dump (else: the model's current ones)
    kinds: list[str] = field(default_factory=list)
    recorded: dict = field(default_factory=dict)


def _spike_reproduced(value: float, details: dict) -> bool:
    std = details.get("window_std") or 0.0
    mean = details.get("window_mean", 0.0)
    thr = details.get("threshold", 6.0)
    if not math.isfinite(value):
        return True
    return (value - mean) / std > thr if std > 0 else value > mean


def replay(dump: str, model: torch.nn.Module, loss_fn: Any, *,
           device: torch.device | str | None = None) -> ReplayResult:
    """Re-run the captured step on a copy of ``model``; see the module docstring."""
    if dump is None:
        raise ValueError("fasthealth: this event has no dump (was the Monitor given log_dir?)")
    d = torch.load(dump, map_location="cpu", weights_only=False)
    m = copy.deepcopy(model)
    exact = d.get("params") is not None
    if exact:
        own = dict(m.named_parameters())
        with torch.no_grad():
            for name, value in d["params"].items():
                if name not in own:
                    raise ValueError(f"fasthealth: the dump has parameter {name!r}, "
                                     "which this model lacks: is it the same model?")
                own[name].copy_(value)
    m.zero_grad(set_to_none=True)
    dev = torch.device(device) if device is not None else next(m.parameters()).device
    batch = map_tensors(lambda t: t.to(dev), d["batch"])
    rng = d.get("rng") or {}
    cpu_state = torch.get_rng_state()
    try:
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        am = ActivationMonitor(m)
        try:
            with warnings.catch_warnings():  # hooks on modules whose inputs need no grad
                warnings.filterwarnings("ignore", message="Full backward hook")
                loss = loss_fn(m, batch)
                loss.backward()
            grads = check_grads(m)
            first = am.first_nonfinite
            bad_input = am.nonfinite_input if am.source == "input" else None
        finally:
            am.remove()
    finally:
        torch.set_rng_state(cpu_state)
    loss_v = float(loss.detach().float())
    events = d.get("events", [])
    kinds = [e["kind"] for e in events]
    checks = []
    for e in events:
        if e["kind"] in FATAL_KINDS:
            checks.append(not math.isfinite(loss_v) or not grads.ok)
        elif e["kind"] == "loss_spike":
            checks.append(_spike_reproduced(loss_v, e["details"]))
        elif e["kind"] == "grad_norm_spike":
            checks.append(_spike_reproduced(float(grads.total.norm), e["details"]))
        else:  # trends and state problems: the step itself replays to the same loss
            rec = d["record"].get("loss")
            checks.append(rec is not None and math.isclose(loss_v, rec, rel_tol=1e-3))
    reproduced = bool(checks) and all(checks)
    what = ", ".join(dict.fromkeys(kinds)) or "the step"
    if reproduced:
        verdict = (f"{what} reproduces on replay of step {d['step']}: the batch itself (or the "
                   "model state) causes it")
        if first:
            verdict += f"; the first non-finite value comes from module {first}"
        elif bad_input:
            verdict += f"; the batch already holds NaN/Inf (seen at the input of {bad_input})"
    else:
        verdict = (f"{what} does not reproduce on replay of step {d['step']}: a transient "
                   "fault (hardware, communication, a race), not this batch")
    if not exact:
        verdict += " [parameters were not captured: replayed with the model's current ones]"
    return ReplayResult(reproduced, loss_v, grads, first, verdict, exact, kinds, d["record"])
