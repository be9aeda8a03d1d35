"""``vanishing_grad``, globally: the global gradient norm vanishingly small for ``patience``
steps, below ``abs_threshold`` or ``rel_drop`` times below its recent median (a constant or
masked-out loss, a learning-rate schedule at 0, a collapsed loss scale), on steps whose loss
has not itself fallen to a fitted batch's (``FITTED``, ``FitFloor``; the per-tensor rule,
``tensor_norm.py``, exempts the same steps)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..record import StepRecord
from ..robust import (
    SPIKE_WINDOW,
    VANISHING_THRESHOLD,
    WARMUP_STEPS,
    RollingMedian,
    WindowValues,
)
from .base import Context, Finding, Rule

FITTED: float = 1e-3
"""A step whose loss is below this share of the run's first level is a batch the model fits: its
gradient vanishes with its loss (cross-entropy's gradient is p - y), which is convergence, not a
fault. A memorised digits batch at a loss of 2e-7 (first level 2.3) had a gradient norm of 8e-6
against a median of 1.5 and alarmed (the trainer evaluation, under Lightning). A loss
of exactly 0 is exempt only at a fitted floor (``FLOOR_STEPS``): a masked-out or
multiplied-away loss is 0 at every step."""

FLOOR_STEPS: int = 64
"""A loss of exactly 0 is a fitted batch when a positive loss below ``FITTED`` of the first level
came at most this many steps before it: float32 rounds a fitted batch's loss to 0 when every
sample's probability rounds to 1, and its gradient is then rounding noise, a thousand times
below the fitted batches' around it. A set memorised under dropout (wine, loss 1e-8 from
0.66) had three such steps in a row, whose per-tensor gradient norms collapsed and alarmed
(the long runs). A loss that drops to 0 from a normal level is a masked loss at
once; one masked at a fitted floor is one from this many steps on."""


class FitFloor:
    """Which steps' losses are batches the model fits: a loss below ``FITTED`` of the run's
    first level (the median of its first ``warmup`` finite losses), or exactly 0 within
    ``FLOOR_STEPS`` of such a loss. Mixed into the vanishing rules, whose state holds
    ``first_losses`` and ``last_fitted``."""

    first_losses: list[float]
    last_fitted: int | None
    # the first level, made once the first losses are all in, and the list it was made from
    # (a restored state brings a new one): listed in the rules' DERIVED
    _level: float = math.nan
    _level_of: list[float] | None = None

    def note_loss(self, step: int, loss: float, warmup: int) -> bool:
        """Notes ``loss`` (among the first losses while they are being gathered; a fitted
        positive loss's step) and returns whether it is a fitted batch's."""
        if not math.isfinite(loss):
            return False
        if len(self.first_losses) < warmup:
            self.first_losses.append(loss)
            return False
        if self._level_of is not self.first_losses:
            self._level, self._level_of = statistics.median(self.first_losses), self.first_losses
        if loss > 0:
            if loss < FITTED * self._level:
                self.last_fitted = step
                return True
            return False
        return loss == 0 and self.last_fitted is not None and \
            0 <= step - self.last_fitted <= FLOOR_STEPS


@dataclass(frozen=True)
class VanishingConfig:
    abs_threshold: float = VANISHING_THRESHOLD
    """A global norm below it has stopped training (``vanishing_threshold``): a gradient of
    that size moves no weight measurably."""
    rel_drop: float = 1e4
    """Times below the recent median: far beyond the fall of healthy norms within a window;
    no healthy run of the corpus alarms (the detector evaluation)."""
    patience: int = 3
    """Steps in a row: one batch of all-masked tokens is not a fault."""
    window: int = SPIKE_WINDOW
    """Norms in the recent median (``spike_window``)."""
    warmup: int = WARMUP_STEPS
    """Norms before the relative test (``warmup_steps``); also the first losses the run's
    first level (their median) is taken over."""


class Vanishing(FitFloor, Rule[VanishingConfig]):
    name = "vanishing"
    kinds = ("vanishing_grad",)
    Config = VanishingConfig
    STATE = ("norms", "first_losses", "last_fitted", "low", "active")
    # added since the state's format (state.py)
    STATE_ADDED: dict[str, Callable[[dict], Any]] = {"last_fitted": lambda f: None}
    DERIVED = ("recent", "_level", "_level_of")  # made from ``norms`` and ``first_losses``

    OPTIONS = {"abs_threshold": "vanishing_threshold", "window": "spike_window",
               "warmup": "warmup_steps"}

    def __init__(self, config: VanishingConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        self.recent = RollingMedian(self.config.window)
        self.first_losses = []
        self.last_fitted = None
        self.low = 0
        self.active = False

    norms = WindowValues("recent")  # the recent level's norms, oldest first

    def observe(self, s: StepRecord) -> list[Finding]:
        if s.host.grads_present == 0:  # no .grad at all: ``no_grad``'s finding
            return []
        fitted = self.note_loss(s.step, s.values["loss"], self.config.warmup)
        return self.update(s.values["grad_norm"], fitted) if s.values["grads_finite"] else []

    def update(self, norm: float, fitted: bool = False) -> list[Finding]:
        c = self.config
        if not math.isfinite(norm):
            return []
        if fitted:  # neither low nor a level: the streak starts again
            self.low = 0
            return []
        ref = self.recent.median() if len(self.recent) >= c.warmup else None
        low = norm < c.abs_threshold or (ref is not None and norm * c.rel_drop < ref)
        self.low = self.low + 1 if low else 0
        if not low:
            self.recent.append(norm)
            self.active = False
            return []
        if self.low >= c.patience and not self.active:
            self.active = True
            return [Finding(
                "vanishing_grad",
                f"global gradient norm {norm:.3g} has been vanishingly small for {self.low} "
                "steps" + (f" (recent median {ref:.3g})" if ref else "") + ". Check first: the "
                "loss (constant? masked out?), then the learning rate schedule and the loss "
                "scale", {"grad_norm": norm, "recent_median": ref, "steps": self.low})]
        return []
