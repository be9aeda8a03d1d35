"""``loss_shift``: the loss stepped up to a higher level and stayed there.

What neither a spike nor a steady rise is: a stretch of bad data (labels shuffled, a shard of
another task, a tokenizer mix-up) lifts every batch's loss at once, a little each, and holds it
there. One batch of it stands a few noise units above the level, under the spike rule's
threshold; the window's line barely tilts before the new level is the level. What stands out is
the median: the median of the last ``recent`` log-losses against the median of the
``window - recent`` before them, in the noise of a difference of two medians (a median of ``n``
values from noise of unit sigma has a spread of about ``1.2533 sigma / sqrt(n)``; the unit is
the before-part's own, ``robust.noise_unit``). A single garbage batch moves a median of 8 by
one rank, not by its size.

An alarm when the shift scores ``zscore`` and the new level stands at least ``rise`` of the
loss the run started from above the old one: at a floor a memorised set's healthy wobbles
shift the log-median far in noise units and by a sliver of the run's loss. In a warm restart's
high-rate phase (``phase.py``) the schedule itself throws a fitted model back: a notice there.
The episode ends when the recent median falls back under half the threshold; a new level held
for a whole window is the level.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..kinds import NOTICE
from ..robust import MIN_LOG_NOISE, WARMUP_STEPS, noise_unit
from .base import Finding
from .trend import PhasedTrend

MEDIAN_SPREAD: float = math.sqrt(math.pi / 2)
"""The spread of the median of ``n`` values drawn from a normal of unit sigma, times
``sqrt(n)`` (its asymptotic efficiency against the mean)."""


@dataclass(frozen=True)
class LevelShiftConfig:
    window: int = 40
    """Log-losses the rule keeps: the ``recent`` ones and the level before them."""
    recent: int = 8
    """Log-losses in the recent median: enough that one garbage batch moves it by a rank, few
    enough that a stretch of shuffled labels is seen within 4-8 steps of its onset."""
    zscore: float = 4.5
    """Noise units of a median difference (above). The detector corpus's healthy tuning runs
    stay under it where the shift also rises ``rise`` (the largest healthy score with such a
    rise: 4.2); 20 steps of shuffled labels on the zoo's MobileNetV3 (batch 16) score 5.2-5.8,
    on its ViT in timm's loop 10-12."""
    rise: float = 0.25
    """The share of the loss the run started from that the new level must stand above the
    old one for an alarm: healthy shifts of the tuning runs that score ``zscore`` rose 15% at
    most (a classifier leaving a plateau under momentum); shuffled labels rise 40-100%."""
    warmup: int = WARMUP_STEPS
    """Losses seen before the rule judges (``warmup_steps``); it also needs a full ``window``."""


class LevelShift(PhasedTrend[LevelShiftConfig]):
    name = "level_shift"
    kinds = ("loss_shift",)
    Config = LevelShiftConfig
    REARM = True
    STATE = PhasedTrend.STATE

    def shift(self, ys: list[float]) -> tuple[float, float, float]:
        """(the score, the median before, the recent median) of the log-losses ``ys``."""
        k = self.config.recent
        before, recent = ys[:-k], ys[-k:]
        noise = max(noise_unit(before), MIN_LOG_NOISE)
        was, now = statistics.median(before), statistics.median(recent)
        unit = MEDIAN_SPREAD * noise * math.sqrt(1 / k + 1 / len(before))
        return (now - was) / unit, was, now

    def judge(self, ys: list[float], value: float) -> list[Finding]:
        c = self.config
        z, was, now = self.shift(ys)
        start = self.start
        share = (math.exp(now) - math.exp(was)) / start if start > 0 else math.nan
        if not (z > c.zscore and share >= c.rise):
            if z < c.zscore / 2 or share < c.rise / 2:
                self.active = False  # back: the episode is over
            return []
        details = {"z": z, "level_before": math.exp(was), "level": math.exp(now),
                   "rise_share": share, "start": start, "loss": value,
                   "recent": c.recent, "restart": self.in_restart}
        phase = (", in a warm restart's high-rate phase (the schedule's doing, until the "
                 "phase ends)" if self.in_restart else "")
        return self.once(Finding(
            "loss_shift",
            f"loss stepped up and held: the median of the last {c.recent} losses "
            f"({math.exp(now):.4g}) is {math.exp(now - was):.2f}x the median of the "
            f"{len(ys) - c.recent} before ({math.exp(was):.4g}), {z:.1f} noise units, a rise "
            f"of {share:.0%} of the loss the run started from ({start:.4g}){phase}. Check "
            "first: the data of these steps (labels, a shard or source that changed, the "
            "loader's order: replay the dump), then the learning rate",
            details, severity=NOTICE if self.in_restart else None))
