"""``repeated_batch``: the same batch ``repeats`` steps in a row after the run has shown
distinct batches (a stuck loader, an exhausted iterator cycling one batch, a batch variable
never reassigned): the loss slides as the model memorises it, and nothing else looks wrong.

The same batch is told by its sample ids when the step was given them (hashed on the host,
``scans.ids_key``), else by the batch's fingerprint computed on the device
(``scans.fingerprint``): equal for the same tensors, in the same order. Full-batch training, or
a dataset of one batch, shows the same batch from the first step and never alarms; a shuffled
loader never gives the same samples in the same order twice. The repeats must follow a stretch
of ``MOVING`` steps whose batches changed at every step, so a full batch with a few odd ones
planted in it is not a stuck loader either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..record import StepRecord
from .base import Context, Finding, Rule

MOVING: int = 8
"""Steps in a row, each with a batch other than the step before's, that must come before the
repeats: a run moving through its data. Full-batch training shows the same batch from the start,
and with a few odd batches planted in it (a bad batch, the detector corpus's faults of one to a
few steps) it moves for fewer steps than that."""


@dataclass(frozen=True)
class RepeatedBatchConfig:
    repeats: int = 3
    """Steps in a row with the same batch: a stuck loader gives it at every step, a shuffled
    one never twice; 3 and not 2, so that one step fed twice on purpose (a retry after a
    skipped step, a resumed run replaying its last batch) is not an alarm."""

    def __post_init__(self) -> None:
        if self.repeats < 2:
            raise ValueError("fasthealth: rules={'repeated_batch': ...}: repeats must be >= 2, "
                             f"got repeats={self.repeats}")


class RepeatedBatch(Rule[RepeatedBatchConfig]):
    name = "repeated_batch"
    kinds = ("repeated_batch",)
    Config = RepeatedBatchConfig
    STATE = ("last", "run", "start", "fired", "changes", "moved")
    OPTIONS: ClassVar[dict[str, str]] = {}

    def __init__(self, config: RepeatedBatchConfig | None = None,
                 ctx: Context | None = None) -> None:
        super().__init__(config, ctx)
        self.last: Any = None
        self.run = 0  # steps in a row with the batch ``last``
        self.start = 0  # the first of them
        self.changes = 0  # steps in a row whose batch differed from the step before's
        self.moved = 0  # how long the run had been moving when the batch ``last`` came
        self.fired = False

    def observe(self, s: StepRecord) -> list[Finding]:
        key: Any = s.host.batch_key
        by = "sample ids"
        if key is None:
            fp = s.values.get("batch_fingerprint", math.nan)
            key, by = (("fp", fp) if math.isfinite(fp) else None), "fingerprint"
        if key is None:
            self.last, self.run, self.fired = None, 0, False
            return []
        if key != self.last:
            self.changes = self.changes + 1 if self.last is not None else 0
            self.moved = self.changes
            self.last, self.run, self.start, self.fired = key, 1, s.step, False
            return []
        self.changes = 0
        self.run += 1
        if self.run < self.config.repeats or self.moved < MOVING or self.fired:
            return []
        self.fired = True
        return [Finding(
            "repeated_batch",
            f"the same batch (by its {by}) at {self.run} steps in a row, steps {self.start}.."
            f"{s.step}, after {self.moved} steps of different batches: the model is fed one batch "
            "over and over. Check first: the data loader (an iterator re-created at each step, "
            "next(iter(loader)) in the loop, a batch variable not reassigned, a sampler stuck "
            "on one index, a cycling iterator over an exhausted stream)",
            {"since_step": self.start, "steps": self.run, "by": by, "moving": self.moved})]
