"""``divergence``: the loss rising steadily (``trend.Rising`` on the log-loss).

A rise judged on the log scale is relative: at a floor of 1e-3 a climb to 1e-1 is a factor of
100 and a sliver of the way the run has come. In a warm restart's high-rate phase
(``phase.py``), where the schedule itself shakes a fitted model, a climb is judged by its
outcome, not by its size alone. A rise of less than ``FLOOR_RISE`` of the loss the run started
from (of the best level, when higher) is a notice, as for a loss spike. A larger one is a notice
whose verdict waits: an alarm if the loss has not come back to its level when the phase ends,
none if it has; a rise of ``RESTART_LIMIT`` of it (the loss back where the run began) is an
alarm at once. Elsewhere a rise is judged as it was: a language model's loss climbing 20% from
3.0 (from 10.8) is a divergence to act on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..kinds import NOTICE
from ..robust import FLOOR_RISE, WARMUP_STEPS
from .base import Finding
from .spike import EARLY_VALUES
from .trend import PhasedTrend, Rising

FIRST_VALUES = EARLY_VALUES
"""Losses whose median is the loss the run started from, as for the spike rule."""

RESTART_LIMIT: float = 1.0
"""In a restart's high-rate phase, a climb of this share of the loss the run started from
above its best is an alarm at once: the loss back where the run began has undone it, whatever
the phase's end will show. A regression memorised under Nesterov momentum (from 0.84 to 2e-4),
thrown back to a rate of 0.01 every 2,000 steps, climbed 28% of its first loss 74-97 steps
after a restart and was back at its level 700 steps later, within the phase
(the long runs)."""


@dataclass(frozen=True)
class DivergenceConfig:
    window: int = 40
    """Losses the line is fitted through: long enough for minibatch noise to average out,
    short enough to fire within the corpus's allowed delays (a slow divergence: 13-19 steps of the
    40 allowed, the detector evaluation)."""
    t_min: float = 5.0
    """The slope's t-statistic: a climb that stands out of the noise; no healthy run of the
    corpus reaches it (the detector evaluation)."""
    rise: float = 0.2
    """The rise over the window and above the best level: a 20% climb is what a user would act
    on."""
    short: int = 10
    """Losses in the recent median compared with the best."""
    warmup: int = WARMUP_STEPS
    """Losses seen before the rule judges (``warmup_steps``)."""


class Divergence(Rising[DivergenceConfig], PhasedTrend[DivergenceConfig]):
    name = "divergence"
    kinds = ("divergence",)
    Config = DivergenceConfig
    REARM = True
    STATE = (*Rising.STATE, "first", "noticed", "pending", "lr", "lr_peak", "restart_lr")
    # added since the state's format (state.py): a state saved before starts them again
    STATE_ADDED: dict[str, Callable[[dict], Any]] = {
        "first": lambda f: [], "noticed": lambda f: False, "pending": lambda f: None,
        "lr": lambda f: None, "lr_peak": lambda f: 0.0, "restart_lr": lambda f: None}
    BEST_OF_WINDOW = True
    """The best is the lowest median of ``window`` losses, not of ``short``: the lowest of the
    10-loss medians of a long noisy run is the noise's, not the loss's (a word-level
    transformer whose batches' losses spread 2-3.5: after 5,000 steps its best 10-median stood
    17% below its level, and an ordinary noisy stretch read as 23% above it, a divergence
    alarm; the long runs)."""

    def __init__(self, config: DivergenceConfig | None = None, ctx: Any = None) -> None:
        super().__init__(config, ctx)
        self.noticed = False  # this episode was reported as a notice (a rise small at a floor)
        self.pending: float | None = None  # a climb in a restart's phase awaiting its verdict

    def judge(self, ys: list[float], value: float) -> list[Finding]:
        trend = self.rising(ys)
        c = self.config
        back = math.expm1(statistics.median(ys[-c.short:]) - self.best) < c.rise / 2
        if back:
            self.pending = None  # the loss came back: the schedule's
        found = self.verdict(ys, value) if self.pending is not None and not self.in_restart \
            else []
        if trend is None:
            if back:
                self.noticed = False  # the episode is over, as for ``active``
            return found
        start = self.start
        recent = math.exp(statistics.median(ys[-c.short:]))
        share = (recent - trend["best"]) / max(start, trend["best"]) if start > 0 else math.nan
        if not (self.in_restart and share < RESTART_LIMIT):
            self.pending = None
            return found + self.once(self.finding(trend, len(ys), value))
        if share >= FLOOR_RISE:
            self.pending = max(share, self.pending or 0.0)
        if self.noticed or self.active:
            return found
        self.noticed = True
        wait = (f"the verdict waits for the phase's end: an alarm then if the loss is not back "
                f"at its level, or at once from {RESTART_LIMIT:.0%}" if share >= FLOOR_RISE else
                f"a notice (an alarm from {FLOOR_RISE:.0%} if the loss is not back at its level "
                f"when the phase ends)")
        head, advice = self.finding(trend, len(ys), value).message.split(". Check first", 1)
        return found + [Finding(
            "divergence", f"{head}, a rise of {share:.1%} of the loss the run started from "
            f"({start:.4g}), in a warm restart's high-rate phase: {wait}. Check first{advice}",
            {**trend, "loss": value, "rise_share": share, "start": start}, severity=NOTICE)]

    def verdict(self, ys: list[float], value: float) -> list[Finding]:
        """The verdict on a climb of a restart's phase, at the phase's end with the loss not
        back at its level: an alarm (once in the episode)."""
        share, self.pending = self.pending, None
        above = math.expm1(statistics.median(ys[-self.config.short:]) - self.best)
        return self.once(Finding(
            "divergence",
            f"loss rose {share:.0%} of the loss the run started from in a warm restart's "
            f"high-rate phase and had not come back when the phase ended: still {above:.0%} "
            f"above its best ({math.exp(self.best):.4g}). Check first: the learning rate the "
            "restart set (too high for the fitted model?), then the data stream, then the "
            "optimizer state", {"rise_share": share, "above_best": above,
                                "best": math.exp(self.best), "loss": value, "restart": True}))

    def finding(self, trend: dict, window: int, value: float) -> Finding:
        return Finding(
            "divergence",
            f"loss rising steadily: {trend['slope_per_step']:+.1%} a step over the last "
            f"{window} steps (t = {trend['t']:.1f}), {trend['above_best']:.0%} above its best "
            f"({trend['best']:.4g}). Check first: the learning rate (schedule, warm-up end), "
            "then the data stream (a shift in what the batches hold), then the optimizer state",
            {**trend, "loss": value})
