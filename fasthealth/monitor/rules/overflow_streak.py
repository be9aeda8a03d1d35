"""``overflow_streak``: under a GradScaler, every step for ``steps`` steps in a row skipped for
an overflow (a finite loss, non-finite gradients). One overflow skip is the scaler at work: it
halves the scale and goes on. A streak is a run that has stopped learning, which the scale
cannot get out of: a scale forced high (set back at every step, a ``backoff_factor`` of 1),
or gradients that overflow float16 whatever the scale. Built only with a GradScaler; reported
once per streak. A scale that does back off is ``loss_scale_collapse`` as well."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..record import StepRecord
from .base import Context, Finding, Rule, skipped


@dataclass(frozen=True)
class OverflowStreakConfig:
    steps: int = 20
    """Overflow skips in a row: from the default scale 2**16, sixteen back-offs reach 1, below
    which an overflow is no longer the scale's; a healthy scaler skips one step after each
    growth (every growth_interval, 2000 steps) and a few at the start."""


class OverflowStreak(Rule[OverflowStreakConfig]):
    name = "overflow_streak"
    kinds = ("overflow_streak",)
    Config = OverflowStreakConfig
    STATE = ("streak", "start")
    OPTIONS: ClassVar[dict[str, str]] = {}

    @classmethod
    def build(cls, ctx: Context) -> Rule | None:
        return super().build(ctx) if ctx.scaler else None

    def __init__(self, config: OverflowStreakConfig | None = None,
                 ctx: Context | None = None) -> None:
        super().__init__(config, ctx)
        self.streak = 0
        self.start = 0

    def observe(self, s: StepRecord) -> list[Finding]:
        v = s.values
        if not (skipped(s) and v["loss_finite"] and not v["grads_finite"]):
            self.streak = 0
            return []
        if self.streak == 0:
            self.start = s.step
        self.streak += 1
        if self.streak != self.config.steps:
            return []
        return [Finding(
            "overflow_streak",
            f"{self.streak} steps in a row (since step {self.start}) skipped for a float16 "
            f"overflow, the loss scale now {v['loss_scale']:.3g}: the run has stopped learning. "
            "Check first: a scale forced high (GradScaler init_scale, backoff_factor, "
            "growth_interval; code that resets it), then activations beyond float16's range "
            "(ActivationMonitor(range_dtype=torch.float16)), or train in bfloat16",
            {"steps": self.streak, "since_step": self.start, "scale": v["loss_scale"]})]
