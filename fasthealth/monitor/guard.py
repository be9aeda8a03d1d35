"""Whether a checkpoint may be written now (docs/spec.md section 11): ``Monitor.safe_to_save``.

A checkpoint written while the weights or the optimizer's state are damaged is worse than none:
a rotation (HF ``save_total_limit``, Lightning ``save_top_k``) then pushes out the last healthy
one for it. ``verdict`` says no in two cases:

1. an open *alarm* incident says the model state may be damaged. Of the incident tracker's
   (``incidents.py``) findings, these count:

   - its cause (``causes.py``) is ``weights`` or ``optimizer_state``: a corrupted weight, broken
     optimizer moments, or a loss spike or non-finite step the loss did not come back from
     within ``BACK_WITHIN`` steps (the cause rules' own judgement that the state, not the
     batch, is at fault);
   - it holds ``weight_corruption`` or ``optimizer_state_nonfinite`` whatever its cause (the
     damage was seen directly, even where the incident was opened by something else first);
   - the run is broken at its last step (a non-finite loss or gradient, or a loss a million
     times its level: ``IncidentTracker.broken``), or the incident has harmed the loss and it
     is not back yet (``harmed`` and ``_unrecovered``: a learning-rate jump whose divergence
     moved the weights far from where they were), or its last step's loss is not back within
     ``back_share`` of its level before the incident (a loss 7x then 130x its level in the
     two steps after a rate jump, before the median that ``harmed`` reads had moved: the
     weights that made it may be damaged; a batch the run comes back from delays the save
     by a step or two).

   Not counted: notice incidents (nothing confirmed), and an alarm incident whose cause is the
   batch, the learning rate, the numeric range or the outside once the loss is back: a bad
   batch skipped, an overflow the scaler backed off from, or a rate spike the run came back
   from left the weights as a checkpoint should hold them. An incident that counts stops
   counting when it closes, which for an alarm incident is only once the run has recovered
   (``quiet`` steps without an event after the loss came back): saving resumes then.
2. the parameters (the Monitor's, those that train), the buffers a forward writes (BatchNorm's
   running statistics: ``buffers.py``) or the optimizer's state hold NaN or Inf now, named:
   one fused pass over all of them (``multi_tensor_stats``, the kernels the gradients go
   through), whatever the incidents say. This sees a weight poisoned since the last flush, or
   by something outside the step (a bad checkpoint loaded, a hand-written update).

The flush before (so that the incidents are up to date) and the pass's total are read on the
host: this is the call's one sync (besides the flush's own copy), and it happens only when
``verdict`` is called, never per step. With the Monitor's ``process_group``, both cases are
every rank's (one all-reduce of three numbers before that copy): a checkpoint is saved by all
ranks or by none (a rank's local shard may be the one that is NaN, and a rank that left a
collective save would leave the others waiting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..checks import multi_tensor_stats
from ..ops.layout import COL
from ..optim import optimizer_state_tensors
from .causes import back
from .events import ALARM, Incident
from .record import StepRecord

if TYPE_CHECKING:
    from .view import RunView

# ``run`` below is the Monitor's ``RunView`` (view.py): what of the run a verdict reads
DAMAGED_CAUSES = frozenset({"weights", "optimizer_state"})
"""Incident causes that say the model state itself may be damaged."""
DAMAGE_KINDS = frozenset({"weight_corruption", "optimizer_state_nonfinite"})
"""Kinds that see damaged state directly, whatever cause their incident names."""


@dataclass(frozen=True)
class Verdict:
    """``safe``: a checkpoint may be written; otherwise ``incident`` is the open incident that
    forbids it (None when only the direct pass found non-finite values) and ``reason`` says
    why in words."""

    safe: bool
    reason: str = ""
    incident: Incident | None = None


def _damaged_tensors(inc: Incident) -> str:
    """The tensors (parameters, buffers) that the incident's weight scans found non-finite,
    as a clause: ``: NaN/Inf in 1.running_var``; empty when none."""
    names = [n for e in inc.events if e.kind == "weight_corruption"
             for n in e.details.get("nonfinite", {})]
    return f"; NaN/Inf in {', '.join(names[:5])}" if names else ""


def incident_reason(run: RunView, *, pending: bool = False) -> tuple[Incident, str] | None:
    """The open alarm incident that says the model state may be damaged, and why (the module
    docstring, case 1); None when there is none."""
    tracker = run.tracker
    cur = tracker.current
    if cur is None and run.closed():  # the incident open when the run ended still judges
        cur = tracker.ended
    elif cur is not None and not cur.open:
        cur = None
    if cur is None:
        return None
    if cur.severity != ALARM:
        # a rate jump no known scheduler made is a notice until the loss suffers from it
        # (rules/lr_jump.py); the weights one such step made wait for the loss all the same
        # (``pending``: for saving, not for a rollback, which only an alarm calls for)
        return _not_back(tracker, cur) if pending and "lr_jump" in cur.kinds else None
    if cur.cause in DAMAGED_CAUSES:
        return cur, f"its cause is {cur.cause} ({cur.why})" + _damaged_tensors(cur)
    seen = next((k for k in cur.kinds if k in DAMAGE_KINDS), None)
    if seen is not None:
        return cur, f"it holds {seen}" + _damaged_tensors(cur)
    if tracker.broken():
        return cur, "the run is broken at its last step (non-finite or a runaway loss)"
    if tracker.harmed and tracker._unrecovered():
        return cur, (f"the loss it harmed has not come back to its level before step "
                     f"{cur.start} yet, beyond its noise: the weights are finite but damaged")
    return _not_back(tracker, cur)


RATE_OFF = 2.0
"""Times the rate the known scheduler set: a rate this far above it at a flush's last step,
with a ``learning_rate`` alarm open, is still in force (``rate_not_scheduled``); the factor
``lr_jump`` calls a rise no scheduler made (``LRJumpConfig.unexplained``)."""


def rate_not_scheduled(run: RunView, last: StepRecord) -> tuple[Incident, str] | None:
    """The open ``learning_rate`` alarm incident (``lr_jump`` in it), and why, while the rate at
    ``last`` (a flush's last step) is still more than ``RATE_OFF`` times the one the known
    scheduler set; None otherwise. A reason to roll back (``rollback.py``: the restore puts the
    optimizer's rate back; the code that set it, if it sets it again, stops the run), not to
    refuse a save: a loss that is fine says the weights are."""
    cur = run.tracker.current
    h = last.host
    if cur is None or not cur.open or cur.severity != ALARM or cur.cause != "learning_rate" \
            or "lr_jump" not in cur.kinds or not h.unexplained or h.lr is None \
            or h.lr_scheduled is None or not h.lr > RATE_OFF * h.lr_scheduled > 0:
        return None
    return cur, (f"the learning rate at step {last.step} ({h.lr:.4g}) is still "
                 f"{h.lr / h.lr_scheduled:.3g}x the one the scheduler set "
                 f"({h.lr_scheduled:.4g})")


def _not_back(tracker: Any, cur: Incident) -> tuple[Incident, str] | None:
    """The incident and why, when the loss at the last step is not back at its level before
    the incident."""
    loss, level = tracker.last[0], tracker.baseline[0]
    # a loss not captured at that step (NaN, with the step finite) says nothing either way
    if level is not None and math.isfinite(loss) \
            and not back(loss, level, tracker.config.causes.back_share):
        return cur, (f"the loss at its last step ({loss:.4g}) is not back at its level before "
                     f"the incident ({level:.4g}) yet")
    return None


def _state_tensors(run: RunView) -> tuple[list[str], list[torch.Tensor], int]:
    """(names, tensors, how many of them are the model's): the parameters, the buffers a
    forward writes (``buffers.py``), those of the averaged models (``averaged=``), then the
    optimizer's state."""
    s = run.state
    model = [*s.params, *s.buffers, *s.averaged]
    names = [n for n, _ in model]
    tensors = [t.detach() for _, t in model]
    if s.optimizer is not None:
        state_names, state = optimizer_state_tensors(s.optimizer, s.names_by_id)
        names, tensors = names + list(state_names), tensors + list(state)
    return names, tensors, len(model)


def _bad_rows(run: RunView, tensors: list[torch.Tensor]) -> torch.Tensor:
    table = multi_tensor_stats(tensors, backend=run.state.backend).raw.to(run.device)
    return (table[:-1, COL["nan_count"]] + table[:-1, COL["inf_count"]]).to(torch.float64)


def nonfinite_state(run: RunView) -> torch.Tensor:
    """(non-finite values in the model's parameters and buffers, in the optimizer's state),
    float64 on the device: one fused pass over both, no sync."""
    _, tensors, n = _state_tensors(run)
    bad = _bad_rows(run, tensors)
    return torch.stack([bad[:n].sum(), bad[n:].sum()])


def nonfinite_names(run: RunView) -> list[str]:
    """The tensors (parameters, buffers, optimizer state) holding NaN/Inf: a second pass and
    a sync, only once a verdict has found some."""
    names, tensors, _ = _state_tensors(run)
    return [n for n, b in zip(names, _bad_rows(run, tensors).cpu().tolist()) if b]


def verdict(run: RunView) -> Verdict:
    """Flushes, then judges (the module docstring). With the Monitor's ``process_group`` the
    answer is every rank's (one all-reduce): a checkpoint is saved by all ranks or none, and
    a rank left out of a collective save would hang the others."""
    if not run.closed():  # closed: its last flush was done, and flush() refuses
        run.flush()
    found = incident_reason(run, pending=True)
    flags = torch.cat([nonfinite_state(run),
                       torch.tensor([float(found is not None)], dtype=torch.float64,
                                    device=run.device)])
    if run.process_group is not None:
        dist.all_reduce(flags, group=run.process_group)
    params, state, incidents = (int(x) for x in flags.cpu().tolist())  # the one sync
    if found is not None:
        inc, why = found
        if why.startswith("the loss it harmed"):  # what to do, for the one who saves
            why += (f". Resume from a checkpoint saved before step {inc.start} (skipping the "
                    "incident's batches or lowering the learning rate that hurt it), or wait: "
                    "saving resumes once the loss is back")
        return Verdict(False, why, inc)
    if incidents:
        return Verdict(False, f"another rank's open incident ({incidents} of the ranks) says "
                       "the weights or the optimizer's state may be damaged")
    if params or state:
        where = " and ".join(w for w, n in (("the model's parameters and buffers", params),
                                            ("the optimizer's state", state)) if n)
        named = nonfinite_names(run)
        shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
        return Verdict(False, f"{params + state} NaN/Inf values in {where}"
                       + (f" ({shown})" if named else ""))
    return Verdict(True)
