"""``loss_scale_collapse``: a GradScaler's scale below ``min_loss_scale`` or NaN, or down
``drop`` times or more within ``within`` steps; reported when it falls. Built only with a
GradScaler."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..record import StepRecord
from ..robust import MIN_LOSS_SCALE
from .base import Context, Finding, Rule


@dataclass(frozen=True)
class LossScaleConfig:
    min_loss_scale: float = MIN_LOSS_SCALE
    """A scale below 1 shrinks the loss, the opposite of its purpose (``min_loss_scale``)."""
    drop: float = 8.0
    """Three back-offs (each halves): one overflow is the scaler at work, three in a row the
    overflow persists."""
    within: int = 10
    """Steps the drop must happen within: a scaler grows back every 2000 steps by default."""


class LossScale(Rule[LossScaleConfig]):
    name = "loss_scale"
    kinds = ("loss_scale_collapse",)
    Config = LossScaleConfig
    STATE = ("recent", "collapsed")

    OPTIONS = {"min_loss_scale": "min_loss_scale"}

    @classmethod
    def build(cls, ctx: Context) -> Rule | None:
        return super().build(ctx) if ctx.scaler else None

    def __init__(self, config: LossScaleConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        self.recent: deque[float] = deque(maxlen=self.config.within + 1)
        self.collapsed = False

    def observe(self, s: StepRecord) -> list[Finding]:
        c = self.config
        scale = s.values["loss_scale"]
        self.recent.append(scale)
        peak = max((x for x in self.recent if math.isfinite(x)), default=math.nan)
        fell_fast = math.isfinite(scale) and peak >= c.drop * scale
        collapsed = not math.isfinite(scale) or scale < c.min_loss_scale or fell_fast
        fell, self.collapsed = collapsed and not self.collapsed, collapsed
        if not fell:
            return []
        why = (f"below {c.min_loss_scale:g}" if not fell_fast or scale < c.min_loss_scale
               else f"down from {peak:.3g} within {len(self.recent) - 1} steps")
        return [Finding(
            "loss_scale_collapse",
            f"GradScaler scale fell to {scale:.3g} ({why}): float16 gradients overflow step "
            "after step. Check first: activations or losses beyond float16's range "
            "(ActivationMonitor(range_dtype=torch.float16)), then bfloat16 instead",
            {"scale": scale, "peak": peak, "min_loss_scale": c.min_loss_scale})]
