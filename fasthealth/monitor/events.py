"""What the monitor reports: ``Event``, ``Observation`` and ``NonFiniteError``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..stats import MultiTensorStats

FATAL_KINDS = ("nonfinite_loss", "nonfinite_grad")


def jsonable(v: Any) -> Any:
    """``v`` with tensors as lists and non-finite floats as None (JSON has neither)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return jsonable(v.tolist())
    return v


@dataclass
class Event:
    """One finding at one step: ``kind`` (see detectors.py), a readable ``message``, the numbers
    behind it in ``details``, and ``dump`` (the saved batch and state, for ``fh.replay``)."""

    step: int
    kind: str
    message: str
    details: dict = field(default_factory=dict)
    dump: str | None = None

    def to_json(self) -> dict:
        return {"step": self.step, "kind": self.kind, "message": self.message,
                "details": jsonable(self.details), "dump": self.dump}


@dataclass
class Observation:
    """What ``Monitor.step`` saw: ``skip`` is a 0-dim bool tensor on the device (no sync)."""

    step: int
    skip: torch.Tensor
    loss: torch.Tensor
    stats: MultiTensorStats


class NonFiniteError(RuntimeError):
    """Raised at a flush that saw a non-finite loss or gradient with ``on_nonfinite="raise"``."""

    def __init__(self, events: list[Event]):
        self.events = events
        first = events[0]
        super().__init__(f"fasthealth: step {first.step}: {first.message}"
                         + (f" (and {len(events) - 1} more)" if len(events) > 1 else ""))
