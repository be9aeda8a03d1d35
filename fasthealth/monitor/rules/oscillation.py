"""``oscillation``: the loss swinging up and down, beyond the run's own noise, going nowhere.

Over the last ``window`` log-losses, the deviations from their trend line alternate (lag-1
autocorrelation below ``autocorr``), the mean swing is ``amplitude`` times the run's usual one
(the median of the swings of its past ``HISTORY`` windows), and the loss does not trend down.
Minibatch noise goes up and down too, but with the swings of its own past.
"""

from __future__ import annotations

import math
import operator
import statistics
from dataclasses import dataclass
from typing import ClassVar

from ..robust import WARMUP_STEPS, RollingMedian, WindowValues, slope_t
from .base import Context, Finding
from .trend import LossTrend

HISTORY: int = 512
"""Past windows whose swings make the usual one."""


@dataclass(frozen=True)
class OscillationConfig:
    window: int = 32
    """Log-losses the autocorrelation is taken over: 16 full up-down cycles."""
    autocorr: float = -0.8
    """Lag-1 autocorrelation of the detrended losses: near 0 for minibatch noise, near -1 for
    steps that alternate."""
    amplitude: float = 3.0
    """Times the run's usual swing: tests/monitor/test_monitor.py plants swings 5x the noise
    (found); the corpus's healthy runs raise none (the detector evaluation)."""
    warmup: int = WARMUP_STEPS
    """Losses seen before the rule judges (``warmup_steps``)."""


class Oscillation(LossTrend[OscillationConfig]):
    name = "oscillation"
    kinds = ("oscillation",)
    Config = OscillationConfig
    STATE: ClassVar[tuple[str, ...]] = (*LossTrend.STATE, "swings")
    DERIVED: ClassVar[tuple[str, ...]] = ("usual",)  # made from ``swings`` (which reads it)
    REARM = True

    def __init__(self, config: OscillationConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        self.usual = RollingMedian(HISTORY)

    swings = WindowValues("usual")  # the past windows' swings, oldest first

    def judge(self, ys: list[float], value: float) -> list[Finding]:
        c = self.config
        n = len(ys)
        slope, _ = slope_t(ys)
        xm, ym = (n - 1) / 2, statistics.fmean(ys)
        r = [y - ym - slope * (i - xm) for i, y in enumerate(ys)]
        var = sum(map(operator.mul, r, r))
        rho = sum(map(operator.mul, r, r[1:])) / var if var > 0 else 0.0
        swing = statistics.fmean(map(abs, map(operator.sub, ys[1:], ys)))
        ref = self.usual.median() if len(self.usual) >= n else None
        self.usual.append(swing)
        oscillating = (ref is not None and rho < c.autocorr
                       and swing > c.amplitude * ref and -slope * (n - 1) < swing)
        if not oscillating or ref is None:
            self.active = False
            return []
        return self.once(Finding(
            "oscillation",
            f"loss oscillating: successive steps alternate (autocorrelation {rho:.2f}), swings "
            f"of {math.expm1(swing):.0%} a step, {swing / ref:.1f}x the run's usual minibatch "
            "noise, and no downward trend. Check first: the learning rate (too high for this "
            "stage: lower it or lengthen the warm-up), then alternating data (unshuffled "
            "sources)",
            {"autocorrelation": rho, "swing": swing, "usual_swing": ref, "loss": value}))
