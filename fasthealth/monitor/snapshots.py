"""What a rollback's snapshot holds (``rollback.py``): the training state (the model with its
buffers, the optimizer, the scaler, the scheduler, the averaged models) copied to host memory,
and the detectors' state at the same step (``detector_state``).

A rollback puts both back. The detectors' windows then measure the level and the noise the
restored state had, not the fault's: the same fault coming back after the rollback is seen as
it was the first time (a new incident, a second rollback, the budget), instead of being taken
in as the run's new level. What is rewound: each rule's ``STATE`` fields (a user's rule through
its own ``state_dict()`` / ``load_state_dict()``, if it has them), the device skip rule's rings
(copied into its tensors in place: a captured CUDA graph keeps its addresses), the schedule's
view of the rate, and the incident tracker's loss history (``TRACKER_WINDOWS``); the incidents
themselves, the events and the journal are the run's history and stay. A rule that has a
``rewound()`` method is told after (``rules/lr_jump.py``: a rate still too high after the
restore is the code's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .record import map_tensors
from .state import _fields, _ours

if TYPE_CHECKING:
    from .view import RunView

TRACKER_WINDOWS = ("losses", "scales", "first_loss", "scale", "last")
"""The incident tracker's fields a rollback rewinds: the losses and loss scales its levels are
measured from, and its last step's loss (the restored state's, finite)."""


@dataclass
class Snapshot:
    """The training state at the end of ``step``, in host memory."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    nbytes: int
    averaged: list[dict[str, torch.Tensor]] = field(default_factory=list)  # EMA/SWA models'
    detect: dict[str, Any] = field(default_factory=dict)  # the detectors' (``detector_state``)


def to_host(x: Any, into: Any = None) -> Any:
    """``x`` with every tensor copied to host memory (always a copy: the live tensors change in
    place), into the tensors of ``into`` (an older snapshot of the same structure) where their
    shape and dtype match, else into new ones: a buffer used again is not faulted in again.
    From a GPU the copies go to pinned memory without waiting (``settle`` waits for them)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if not (isinstance(into, torch.Tensor) and into.shape == t.shape
                and into.dtype == t.dtype):
            into = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                               pin_memory=t.is_cuda and torch.cuda.is_available())
        return into.copy_(t, non_blocking=t.is_cuda)
    if isinstance(x, dict):
        olds: dict = into if isinstance(into, dict) else {}
        return {k: to_host(v, olds.get(k)) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        items = list(into) if isinstance(into, (list, tuple)) and len(into) == len(x) \
            else [None] * len(x)
        return type(x)(to_host(v, o) for v, o in zip(x, items))
    return map_tensors(to_host, x)


def settle() -> None:
    """Waits for a snapshot's copies from a GPU (made without waiting) to land."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def _parts(run: RunView) -> dict[str, Any]:
    """The objects whose state is rewound, by name: the rules, the device skip rule, the
    schedule view (None where the Monitor has none)."""
    parts = {f"rule{i}": r for i, r in enumerate(run.detectors)}
    parts.update(skip_rule=run.skip_rule, restarts=run.restarts)
    return parts


def detector_state(run: RunView) -> dict[str, Any]:
    """The detectors' state now, a copy (``rewind`` puts it back, as often as needed)."""
    out: dict[str, Any] = {}
    for key, obj in _parts(run).items():
        if obj is None:
            continue
        if _ours(type(obj)):
            out[key] = _fields(obj)
        elif callable(getattr(obj, "state_dict", None)):
            out[key] = {"own": obj.state_dict()}
    out["tracker"] = {k: getattr(run.tracker, k) for k in TRACKER_WINDOWS}
    return copy.deepcopy(out)


def _put(obj: Any, name: str, value: Any) -> None:
    old = getattr(obj, name, None)
    if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
            and old.shape == value.shape and old.dtype == value.dtype:
        old.copy_(value)  # in place: a captured graph reads this tensor
    else:
        setattr(obj, name, value)


def rewind(run: RunView, state: dict[str, Any]) -> None:
    """Puts ``state`` (``detector_state``'s) back into the Monitor's detectors; a copy, so
    the same snapshot can be restored again."""
    state = copy.deepcopy(state)
    parts = _parts(run)
    for key, fields in state.items():
        obj: Any = run.tracker if key == "tracker" else parts.get(key)
        if obj is None:
            continue
        if "own" in fields and not _ours(type(obj)):
            obj.load_state_dict(fields["own"])
            continue
        for name, value in fields.items():
            _put(obj, name, value)
    run.tracker.state_bad = False  # a snapshot is only taken of a finite state
    for rule in run.detectors:
        told = getattr(rule, "rewound", None)
        if callable(told):
            told()
