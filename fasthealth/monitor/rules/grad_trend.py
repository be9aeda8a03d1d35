"""``exploding_grad`` (the global form): the gradient norm climbing steadily, several-fold.

Weights growing without bound show in the gradient norm long before the loss moves. The rise
test of ``divergence`` on the log of the norm, stricter. A notice while the loss is fine (a
growing norm with the loss still falling is how many healthy runs leave a plateau); an alarm
when the loss confirms it: the median of the last ``short`` losses stands ``confirm`` above
both the lowest such median and the median the loss had when the climb began (the ``short``
losses before the window's first step), at the finding or later in the same episode. Against
the best alone, a run leaving its plateau would confirm its own healthy climb: its loss falls
fast while the norm grows, and a noisy stretch of that descent stands above the best it reached
on the way down, yet far below where the climb began. Never an alarm in an episode whose climb
came with the learning rate's (``lr_rise`` above its lowest over the window and the ``short``
steps before it): a warm-up or a warm restart raises the norm and the loss by design; a rate
above its old peak is ``lr_jump``'s to judge. A fitted model thrown back to a high rate by a
warm restart climbs in norm and loss by itself and finds its fit again: an episode that began
in the restart's high-rate phase (``phase.py``) is confirmed as ``divergence`` judges a climb
there. In the phase, by a loss risen ``RESTART_LIMIT`` of the loss the run started from above
that reference (the run undone); after it, with the episode still on, by a loss standing
``FLOOR_RISE`` of it above (a rise that matters to the run, not a floor of 1e-9 still x1000).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..record import StepRecord
from ..robust import FLOOR_RISE, WARMUP_STEPS
from .base import Context, Finding
from .divergence import FIRST_VALUES, RESTART_LIMIT
from .phase import RestartPhase
from .trend import Rising


@dataclass(frozen=True)
class GradTrendConfig:
    window: int = 24
    """Gradient norms the line is fitted through: weights growing 8% a step show within it."""
    t_min: float = 6.0
    """Stricter than the loss's 5: healthy norms climb steadily while a run leaves a plateau or
    warms up, so a steady climb alone says less than the loss's."""
    rise: float = 2.5
    """3.5x over the window and above the lowest level: above the healthy 2.5x early climb
    that tests/monitor/test_monitor.py plants (no finding), below an 8%-a-step one (found)."""
    short: int = 10
    """Values in the recent medians (of the norm and of the loss)."""
    warmup: int = WARMUP_STEPS
    """Norms seen before the rule judges (``warmup_steps``)."""
    confirm: float | None = 0.1
    """The loss's recent median this far above its best and its level at the climb's start
    makes the notice an alarm; None: never an alarm."""
    lr_rise: float = 2.0
    """The learning rate this many times its recent low at the finding: the schedule's climb,
    never confirmed (a warm-up, a warm restart)."""


class GradNormTrend(Rising[GradTrendConfig], RestartPhase):
    name = "grad_trend"
    kinds = ("exploding_grad",)
    Config = GradTrendConfig
    STATE: ClassVar[tuple[str, ...]] = (*Rising.STATE, "losses", "window_losses", "lrs",
                                        "best_loss", "climb_start", "lr_climb", "unconfirmed",
                                        "first", "lr", "lr_peak", "restart_lr",
                                        "restart_climb")
    # added since the state's format (state.py): a state saved before starts them again
    STATE_ADDED: ClassVar[dict[str, Callable[[dict], Any]]] = {
        "first": lambda f: [], "lr": lambda f: None, "lr_peak": lambda f: 0.0,
        "restart_lr": lambda f: None,
        "restart_climb": lambda f: False}

    def __init__(self, config: GradTrendConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        c = self.config
        self.losses: deque[float] = deque(maxlen=c.short)
        # the losses of the window's steps and of the ``short`` before it
        self.window_losses: deque[float] = deque(maxlen=c.window + c.short)
        self.best_loss = math.inf
        self.climb_start = math.inf  # the loss median when the episode's climb began
        self.lrs: deque[float] = deque(maxlen=c.window + c.short)
        self.lr_climb = False  # the learning rate rose lr_rise-fold with the episode's climb
        self.unconfirmed: Finding | None = None  # the episode's notice, until confirmed
        self.first: list[float] = []  # the run's first losses
        self.lr: float | None = None
        self.restart_lr: float | None = None
        self.lr_peak = 0.0
        self.restart_climb = False  # the episode's climb began in a restart's high-rate phase

    def rearm(self) -> None:
        """At a warm restart: the restart's high-rate phase begins; the windows go on (the
        learning rate's own climb is in them)."""
        self.restarted()

    def observe(self, s: StepRecord) -> list[Finding]:
        loss = s.values["loss"]
        lr = s.host.lr
        self.track(lr)
        if isinstance(lr, (int, float)) and lr > 0:
            self.lrs.append(float(lr))
        if math.isfinite(loss):
            if len(self.first) < FIRST_VALUES:
                self.first.append(loss)
            self.losses.append(loss)
            self.window_losses.append(loss)
            if len(self.losses) == self.losses.maxlen:
                self.best_loss = min(self.best_loss, statistics.median(self.losses))
        if not s.values["grads_finite"]:
            return []
        was_active = self.active
        found = self.update(s.values["grad_norm"])
        if not self.active:
            self.unconfirmed = None
        if found:
            if not was_active:
                before = list(self.window_losses)[:self.losses.maxlen or 1]
                self.climb_start = statistics.median(before) if before else math.inf
                self.lr_climb = bool(self.lrs) and self.lrs[-1] > self.config.lr_rise * min(
                    self.lrs)
                self.restart_climb = self.in_restart
            self.unconfirmed = None if self._confirmed() else found[0]
            return [self._as_alarm(f) if self.unconfirmed is None else f for f in found]
        if self.unconfirmed is not None and self._confirmed():
            confirmed, self.unconfirmed = self._as_alarm(self.unconfirmed), None
            return [confirmed]
        return []

    def _confirmed(self) -> bool:
        confirm = self.config.confirm
        if confirm is None or len(self.losses) < (self.losses.maxlen or 1) \
                or not math.isfinite(self.best_loss):
            return False
        if self.lr_climb:
            return False  # the schedule's doing: a warm-up, a warm restart (lr_jump judges it)
        ref = max(self.best_loss, self.climb_start if math.isfinite(self.climb_start) else 0.0)
        recent = statistics.median(self.losses)
        if self.restart_climb and self.first:
            start = statistics.median(self.first)
            share = RESTART_LIMIT if self.in_restart else FLOOR_RISE
            return start > 0 and recent - ref >= share * max(start, ref)
        return recent > (1 + confirm) * ref

    def _as_alarm(self, found: Finding) -> Finding:
        return Finding(
            found.kind, found.message + ". The loss confirms it: its recent median stands "
            f"{self.config.confirm:.0%} or more above its best and above where it was when the "
            "climb began",
            {**found.details, "loss_confirms": True, "loss_at_climb_start": self.climb_start},
            severity="alarm")

    def finding(self, trend: dict, window: int, value: float) -> Finding:
        return Finding(
            "exploding_grad",
            f"global gradient norm climbing steadily: {trend['slope_per_step']:+.1%} a step, "
            f"{trend['rise'] + 1:.2g}x over the last {window} steps (t = {trend['t']:.1f}), now "
            f"{value:.3g} against a low of {trend['best']:.3g}. Check first: the weights "
            "(check_params: a layer growing without bound, weight decay off or negative), then "
            "the learning rate, then clipping (max_grad_norm)",
            {**trend, "grad_norm": value})
