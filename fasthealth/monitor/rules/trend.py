"""The base of the rules judged over a window of recent finite log-losses (``divergence``,
``oscillation``), and the rise test ``divergence`` and ``exploding_grad`` share."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, ClassVar, Protocol, TypeVar

from ..record import StepRecord
from ..robust import slope_t
from .base import Finding, Rule
from .phase import RestartPhase
from .spike import EARLY_VALUES


class TrendConfig(Protocol):
    """What a trend rule's config holds (each rule's own dataclass gives the reasons)."""

    @property
    def window(self) -> int: ...
    @property
    def warmup(self) -> int: ...


class RiseConfig(TrendConfig, Protocol):
    @property
    def short(self) -> int: ...
    @property
    def t_min(self) -> float: ...
    @property
    def rise(self) -> float: ...


C = TypeVar("C", bound=TrendConfig)
T = TypeVar("T", bound=RiseConfig)


class LossTrend(Rule[C]):
    """``judge`` runs once the window holds ``min_len`` log-losses and more than ``warmup``
    finite losses have been seen; a loss <= 0 leaves no log scale to judge on."""

    STATE: ClassVar[tuple[str, ...]] = ("history", "seen", "active")

    def __init__(self, config: C | None = None, ctx: Any = None) -> None:
        super().__init__(config, ctx)
        self.history: deque[float] = deque(maxlen=self.config.window)
        self.seen = 0
        self.active = False

    def observe(self, s: StepRecord) -> list[Finding]:
        return self.update(s.values["loss"])

    def update(self, value: float) -> list[Finding]:
        if not math.isfinite(value):
            return []
        self.seen += 1
        self.history.append(math.log(value) if value > 0 else math.nan)
        if self.seen <= self.config.warmup or len(self.history) < self.config.window:
            return []
        ys = list(self.history)
        if any(map(math.isnan, ys)):
            return []
        return self.judge(ys, value)

    def judge(self, ys: list[float], value: float) -> list[Finding]:
        raise NotImplementedError

    def once(self, found: Finding) -> list[Finding]:
        """``found``, the first time in an episode (until ``active`` is cleared)."""
        if self.active:
            return []
        self.active = True
        return [found]



class PhasedTrend(LossTrend[C], RestartPhase):
    """A trend rule that judges a rise against the loss the run started from (``start``: the
    median of its first ``EARLY_VALUES`` finite losses, as for the spike rule) and knows a warm
    restart's high-rate phase (``phase.py``). At a restart it starts again as made, keeping
    the run's first losses and the rates seen (``divergence``, ``level_shift``)."""

    STATE: ClassVar[tuple[str, ...]] = (*LossTrend.STATE, "first", "lr", "lr_peak",
                                        "restart_lr")

    def __init__(self, config: C | None = None, ctx: Any = None) -> None:
        super().__init__(config, ctx)
        self.first: list[float] = []  # the run's first losses, kept through restarts
        self.lr: float | None = None
        self.restart_lr: float | None = None
        self.lr_peak = 0.0

    def observe(self, s: StepRecord) -> list[Finding]:
        self.track(s.host.lr)
        return super().observe(s)

    def rearm(self) -> None:
        """Starts again as made (``REARM``), keeping the run's first losses, and marks the
        restart's high-rate phase."""
        first, lr, peak = self.first, self.lr, self.lr_peak
        super().rearm()
        self.first, self.lr, self.lr_peak = first, lr, peak
        self.restarted()

    def update(self, value: float) -> list[Finding]:
        if math.isfinite(value) and len(self.first) < EARLY_VALUES:
            self.first.append(value)
        return super().update(value)

    @property
    def start(self) -> float:
        """The loss the run started from (NaN before its first finite loss)."""
        return statistics.median(self.first) if self.first else math.nan

class Rising(LossTrend[T]):
    """A steady rise of the log of a series: a line through the window climbs with a
    t-statistic above ``t_min`` and by more than ``rise``, and the median of the last ``short``
    values stands ``rise`` above the best: the lowest such median seen, or, with
    ``BEST_OF_WINDOW``, the lowest median of the whole window seen. The episode ends once the
    recent median is back within half of ``rise``."""

    STATE: ClassVar[tuple[str, ...]] = (*LossTrend.STATE, "best")
    BEST_OF_WINDOW: ClassVar[bool] = False

    def __init__(self, config: T | None = None, ctx: Any = None) -> None:
        super().__init__(config, ctx)
        self.best = math.inf  # lowest median of `short` values seen

    def rising(self, ys: list[float]) -> dict | None:
        c = self.config
        recent = statistics.median(ys[-c.short:])
        self.best = min(self.best, statistics.median(ys) if self.BEST_OF_WINDOW else recent)
        slope, t = slope_t(ys)
        total = math.expm1(slope * (len(ys) - 1))
        above = math.expm1(recent - self.best)
        if t > c.t_min and total > c.rise and above > c.rise:
            return {"slope_per_step": math.expm1(slope), "t": t, "rise": total,
                    "above_best": above, "best": math.exp(self.best)}
        if above < c.rise / 2:
            self.active = False
        return None

    def judge(self, ys: list[float], value: float) -> list[Finding]:
        trend = self.rising(ys)
        return [] if trend is None else self.once(self.finding(trend, len(ys), value))

    def finding(self, trend: dict, window: int, value: float) -> Finding:
        raise NotImplementedError
