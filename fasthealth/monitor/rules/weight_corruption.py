"""``weight_corruption``: a parameter that became non-finite, or whose largest |w| jumped by
orders of magnitude, between two weight scans (silent data corruption, a bad load, a stray
write: a flipped exponent bit turns -0.068 into -2.3e37 and a ReLU channel dies without the
loss showing it).

The Monitor scans the weights on its first step and then every ``every`` steps (by default
once per flush, on its last step): one fused pass over the detached parameters, its per-tensor
table kept on the device until the flush (``scans.weight_scan``). Each scan is compared with
the one before: NaN/Inf in a tensor that had none, or a tensor's largest finite |w| more than
``factor`` times above its level at the scan before. That level is floored at ``FLOOR`` times
the model's own largest |w| then, so that a tensor initialised at zero (a LoRA B, a bias) that
grows healthily is never a jump. Reported once per tensor: a scan that finds the same NaN, or
the jumped value again, compares with what it found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..events import SCANNED_SINCE, SEVERAL_TENSORS
from ..record import StepRecord
from ..scans import scan_table
from .base import Context, Finding, Rule, listed

FLOOR: float = 1e-2
"""The level a tensor is compared at is at least this share of the model's largest |w| at the
scan before: a zero-initialised tensor (LoRA B, biases, zero-init output layers) must reach 10x
the model's largest weight within one scan to count, which healthy growth from zero does not
(tests/monitor/test_silent_fault_alarms.py grows a LoRA-style B from 0 at a high rate)."""


@dataclass(frozen=True)
class WeightCorruptionConfig:
    every: int = 0
    """Steps between weight scans; 0: once per flush (``flush_every``), and never more than
    that. One fused read of every weight, a small share of a step once per flush
    (docs/performance.md); corrupted weights stay corrupted, so a scan per flush
    finds them by the flush that reports them."""
    factor: float = 1e3
    """Times above a tensor's level at the scan before: three orders of magnitude. A healthy
    tensor's largest |w| moves by a few times at most over a flush (weight decay, warm-up, a
    tensor growing from small); an exponent bit that flips multiplies by 2**(2**k), so a flip of
    one of the high exponent bits, the ones that matter (x 2**16 and up), is far beyond it."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.factor <= 1:
            raise ValueError("fasthealth: rules={'weight_corruption': ...}: every must be >= 0 "
                             f"and factor > 1, got every={self.every}, factor={self.factor}")


class WeightCorruption(Rule[WeightCorruptionConfig]):
    name = "weight_corruption"
    kinds = ("weight_corruption",)
    Config = WeightCorruptionConfig
    STATE = ("prev",)
    OPTIONS: ClassVar[dict[str, str]] = {}

    def __init__(self, config: WeightCorruptionConfig | None = None,
                 ctx: Context | None = None) -> None:
        super().__init__(config, ctx)
        self.prev: tuple[int, list[float], list[float]] | None = None  # step, bad, amax

    def observe(self, s: StepRecord) -> list[Finding]:
        table = s.host.weight_table
        if table is None:
            return []
        bad, amax = scan_table(table)
        prev, self.prev = self.prev, (s.step, bad, amax)
        scanned = [*self.ctx.names, *self.ctx.buffer_names]
        names = scanned if len(scanned) == len(bad) else [str(i) for i in range(len(bad))]
        # the buffers' rows (after the parameters') are judged for NaN/Inf only: a running
        # variance moves by orders of magnitude healthily (from 1 to an input's variance)
        weights = len(self.ctx.names) if len(scanned) == len(bad) else len(bad)
        old_bad = prev[1] if prev is not None else [0.0] * len(bad)
        nonfinite = {names[i]: int(b) for i, b in enumerate(bad) if b > 0 and old_bad[i] == 0}
        jumps: dict[str, tuple[float, float]] = {}
        if prev is not None:
            old = prev[2][:weights]
            scale = max((a for a in old if math.isfinite(a)), default=0.0)
            for i, (a0, a1) in enumerate(zip(old, amax[:weights])):
                level = max(a0 if math.isfinite(a0) else 0.0, FLOOR * scale)
                if level > 0 and math.isfinite(a1) and a1 > self.config.factor * level:
                    jumps[names[i]] = (a0, a1)
        if not nonfinite and not jumps:
            return []
        since = f"steps {prev[0]}..{s.step}" if prev is not None else f"step {s.step}"
        # several tensors blown up together: a run that diverged (what the corpus's learning-
        # rate faults do), more likely than one corrupted element
        many = len(jumps) + len(nonfinite) > 1
        parts = []
        if nonfinite:
            parts.append(f"NaN/Inf in {len(nonfinite)} weight or buffer tensor(s) that had "
                         f"none: {listed(nonfinite)}")
        if jumps:
            parts.append(f"{len(jumps)} weight tensor(s) whose largest |w| jumped: " + listed(
                f"{n} {a0:.3g} -> {a1:.3g}" for n, (a0, a1) in jumps.items()))
        return [Finding(
            "weight_corruption",
            "; ".join(parts) + f" (between the weight scans of {since}). Check first: "
            + ("the learning rate and the run's other alarms (several tensors at once: a "
               "diverging run), then " if many else "")
            + "a checkpoint or state_dict loaded into the model, code that writes to the "
            "weights (in-place ops on .data, a custom init or EMA), then the hardware (ECC "
            "errors, a failing GPU: silent data corruption); fh.check_params(model) names the "
            "tensors",
            {"nonfinite": nonfinite, "jumps": {n: {"old_amax": a0, "new_amax": a1}
                                               for n, (a0, a1) in jumps.items()},
             "since_step": prev[0] if prev is not None else None, "step": s.step,
             SCANNED_SINCE: prev[0] if prev is not None else None,
             SEVERAL_TENSORS: bool(many and not nonfinite)})]
