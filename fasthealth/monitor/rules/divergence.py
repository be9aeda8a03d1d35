"""``divergence``: the loss rising steadily (``trend.Rising`` on the log-loss)."""

from __future__ import annotations

from dataclasses import dataclass

from ..robust import WARMUP_STEPS
from .base import Finding
from .trend import Rising


@dataclass(frozen=True)
class DivergenceConfig:
    window: int = 40
    """Losses the line is fitted through: long enough for minibatch noise to average out,
    short enough to fire within the corpus's allowed delays (slow_divergence: 13-19 steps of the
    40 allowed, the detector evaluation, bench/results/detectors.json)."""
    t_min: float = 5.0
    """The slope's t-statistic: a climb that stands out of the noise; no healthy run of the
    corpus reaches it (the detector evaluation, bench/results/detectors.json)."""
    rise: float = 0.2
    """The rise over the window and above the best level: a 20% climb is what a user would act
    on."""
    short: int = 10
    """Losses in the recent median compared with the best."""
    warmup: int = WARMUP_STEPS
    """Losses seen before the rule judges (``warmup_steps``)."""


class Divergence(Rising[DivergenceConfig]):
    name = "divergence"
    kinds = ("divergence",)
    Config = DivergenceConfig
    REARM = True
    BEST_OF_WINDOW = True
    """The best is the lowest median of ``window`` losses, not of ``short``: the lowest of the
    10-loss medians of a long noisy run is the noise's, not the loss's (a word-level
    transformer whose batches' losses spread 2-3.5: after 5,000 steps its best 10-median stood
    17% below its level, and an ordinary noisy stretch read as 23% above it, a divergence
    alarm; evaluation/eval_long_runs.py)."""

    def finding(self, trend: dict, window: int, value: float) -> Finding:
        return Finding(
            "divergence",
            f"loss rising steadily: {trend['slope_per_step']:+.1%} a step over the last "
            f"{window} steps (t = {trend['t']:.1f}), {trend['above_best']:.0%} above its best "
            f"({trend['best']:.4g}). Check first: the learning rate (schedule, warm-up end), "
            "then the data stream (a shift in what the batches hold), then the optimizer state",
            {**trend, "loss": value})
