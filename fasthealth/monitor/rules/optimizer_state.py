"""``optimizer_state_nonfinite``: NaN/Inf in the optimizer's state at a scan (every
``optimizer_check_every`` steps), reported once until a later scan finds it clean."""

from __future__ import annotations

from ..record import StepRecord
from .base import Finding, NoConfig, Rule, listed


class OptimizerState(Rule[NoConfig]):
    name = "optimizer_state"
    kinds = ("optimizer_state_nonfinite",)
    STATE = ("bad",)

    def __init__(self, config=None, ctx=None) -> None:
        super().__init__(config, ctx)
        self.bad = False

    def observe(self, s: StepRecord) -> list[Finding]:
        count = s.values["optimizer_nonfinite"]
        if count != count:  # not scanned this step
            return []
        if count == 0:
            self.bad = False
            return []
        if self.bad:
            return []
        self.bad = True
        stats = s.host.opt_stats
        names = stats.nonfinite() if stats is not None else []
        return [Finding(
            "optimizer_state_nonfinite",
            f"{int(count)} NaN/Inf values in optimizer state: {listed(names)}. Check first: a "
            "checkpoint loaded into the optimizer, then a step that went through with a "
            "non-finite gradient (on_nonfinite='warn'?)", {"tensors": names, "count": int(count)})]
