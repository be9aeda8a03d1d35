"""``precursor_update_ratio``: the largest update-to-weight ratio of a weight matrix (measured by
``precursors.PrecursorProbe``), per unit of gradient, more than ``zscore`` noise units above its
recent level on the log scale.

Why the noise unit and not a ratio to the median: small-batch SGD makes healthy updates many
times its median now and then, while an LR jump under clipping moves a steady series by less;
measured against its own step-to-step noise the jump stands out. Why per unit of gradient: with
SGD the update follows the gradient, which grows several-fold while a run leaves a plateau; an
LR jump changes the update for the same gradient.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from ..record import StepRecord
from ..robust import level_and_noise
from .base import Context, Finding, Rule, skipped


@dataclass(frozen=True)
class UpdateRatioConfig:
    zscore: float = 6.0
    """Noise units above the recent level, as the spike rule."""
    window: int = 30
    """Measurements in the level (one every few steps)."""
    warmup: int = 8
    """Measurements before the rule judges."""
    floor: float = 1e-3
    """Ratios below it are never a precursor: healthy training holds the ratio near 1e-3."""


class UpdateRatio(Rule[UpdateRatioConfig]):
    name = "update_ratio"
    kinds = ("precursor_update_ratio",)
    precursor = True
    Config = UpdateRatioConfig
    STATE = ("history", "fired")
    REARM = True
    REARM_BEFORE = True  # the restart's own update is the new rate's
    OPTIONS: ClassVar[dict[str, str]] = {}  # its warmup counts measurements, not steps

    @classmethod
    def build(cls, ctx: Context) -> Rule | None:
        return super().build(ctx) if ctx.probe is not None and ctx.probe.copy is not None \
            else None

    def __init__(self, config: UpdateRatioConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        c = self.config
        self.names = list(ctx.probe.matrix_names) if ctx is not None and ctx.probe else []
        self.history: deque[float] = deque(maxlen=c.window)
        self.fired = False  # reported until the series comes back

    def observe(self, s: StepRecord) -> list[Finding]:
        c = self.config
        v = s.values.get("update_ratio_max", math.nan)
        g = s.values.get("grad_norm", math.nan)
        if not (math.isfinite(v) and v > 0 and math.isfinite(g) and g > 0) or skipped(s):
            return []
        y = math.log(v / g)  # the update per unit of gradient: an effective learning rate
        logs = list(self.history)
        self.history.append(y)
        if len(logs) < c.warmup or v < c.floor:
            return []
        level, noise = level_and_noise(logs, recent=len(logs))
        z = (y - level) / noise if noise > 0 else math.inf
        high = z > c.zscore
        fire = high and not self.fired
        self.fired = high
        if not fire:
            return []
        name = self.names[int(s.values["update_ratio_arg"])]
        median = math.exp(level)
        return [Finding(
            "precursor_update_ratio",
            f"update-to-weight ratio {v:.3g} in {name}, {v / median:.3g}x its recent median "
            f"{median:.3g} ({z:.1f} noise units): this step's update moved the weights far more "
            "than usual. Check first: the learning rate (schedule, warm-up too short, a changed "
            "config), then the gradient norm (clipping: max_grad_norm) and Adam's second "
            "moments", {"value": v, "tensor": name, "window_median": median, "zscore": z})]
