"""The learning-rate schedule as evidence (docs/spec.md section 6, "The schedule is part of the
evidence").

A change of learning rate that the user's own scheduler made is expected: a warm restart
(SGDR, ``cosine_with_restarts``) takes the rate from ~0 back to its peak in one step and the
loss climbs for some steps after it; a milestone decay or a warm-up moves it too. The rules'
windows measure a level and a noise under the old rate, which the new rate does not have, so
at a restart every rule that keeps a window starts it again (``Rule.rearm``): a new level and
a new noise, measured after the restart, as at the start of the run. Only a change no schedule
explains is suspect: ``lr_jump`` judges it (``rules/lr_jump.py``).

Which scheduler set the rate: the one the Monitor was given (``scheduler=``; the trainer
callbacks pass theirs). Each step records the rate of the optimizer's first parameter group
(``lr``) and the rate the scheduler last set for it (``lr_scheduled``, None without one): they
agree when the scheduler set it. torch's and transformers' schedulers say it
(``get_last_lr()``); timm's keep no last rate, and their rate is found among the schedule's
positions (``PositionRates``). Without a scheduler, a rise back to at most the peak so far
is taken as a restart and a rise above it is left to ``lr_jump``; a rate set by hand (a bug, a
misread config) is then told from the schedule by its size alone, so a loop with a scheduler
passes it.

``ScheduleView`` reads those two per step, on the host, and says whether the step is a
restart: the rate more than ``rise`` times the step before's, set by the scheduler (or, with no
scheduler known, not above 1.5x the peak so far: a restart returns to its old peak). Its
thresholds are in ``ScheduleConfig``, each with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ScheduleConfig:
    rise: float = 2.0
    """The rate more than this many times the step before's is a restart: a warm restart
    multiplies it by 10 to 1e6 in one step (SGDR's eta_min; transformers' cosine_with_restarts
    ends its cycles at 0); milestone schedules, OneCycle and cosine move it a few percent a
    step, warm-ups at most 2x a step after their first (linear from 0: 2x, 1.5x, ...), and a
    warm-up's first step lies inside the rules' own warm-up. One step, not a span: a gradual
    climb, however steep in the end, is not a new regime at one step, and a span would fire
    again at every doubling of a long warm-up."""
    peak_slack: float = 1.5
    """Without a known scheduler, a rise to at most this many times the highest rate so far is
    the schedule's (a restart to the old peak, 1x; a cycle whose peak grows a little); above
    it, a rise is lr_jump's to judge and no rule re-arms."""
    rel_tol: float = 1e-6
    """The rate and the scheduler's rate agree to this relative tolerance: both are the same
    float, computed once; the tolerance admits a float32 copy."""


def _last_lr(scheduler: Any) -> float | None:
    try:
        lrs = scheduler.get_last_lr()
    except Exception:  # a scheduler not stepped yet, or one without a last rate
        return None
    if not lrs:
        return None
    lr = lrs[0]
    if isinstance(lr, torch.Tensor):
        return float(lr.detach().cpu()) if lr.numel() == 1 and lr.device.type == "cpu" else None
    return float(lr) if isinstance(lr, (int, float)) else None


class PositionRates:
    """The rate a scheduler that keeps no last rate set (timm's ``Scheduler``: a pure function
    ``_get_lr(t)`` of a position ``t`` the loop passes to ``step(epoch)`` or
    ``step_update(num_updates)``), found without touching it: a rate is the schedule's when it
    is the schedule's value at a position the loop can have reached since the last one found
    (one more per step at most), or, failing that (a resumed run), at any position of its
    cycles. A rate that is no position's (a hand edit, a bug) leaves the last one found: the
    step's ``lr`` then differs from its ``lr_scheduled``, as with torch's schedulers."""

    SCAN = 100_000
    """Positions tried at most when the near ones fail: a schedule stepped per update over a
    long run."""

    def __init__(self, scheduler: Any, rel_tol: float) -> None:
        self.scheduler, self.rel_tol = scheduler, rel_tol
        self.t = 0  # the position last found
        self.rate: float | None = None  # its rate
        self.steps = 0  # steps since it was found
        self.stray: float | None = None  # the last rate that was no position's

    @staticmethod
    def usable(scheduler: Any) -> bool:
        return callable(getattr(scheduler, "_get_lr", None)) and \
            getattr(scheduler, "optimizer", None) is not None

    def _value(self, t: int) -> float | None:
        s = self.scheduler
        try:
            values = list(s._get_lr(t))
            if callable(getattr(s, "_add_noise", None)):
                values = list(s._add_noise(values, t))
            group = s.optimizer.param_groups[0]
            return float(values[0]) * float(group.get("lr_scale", 1.0))
        except Exception:  # a position past its end, a scheduler of another shape
            return None

    def _found(self, lr: float, ts: range) -> bool:
        for t in ts:
            v = self._value(t)
            if v is not None and math.isclose(lr, v, rel_tol=self.rel_tol):
                self.t, self.rate, self.steps = t, v, 0
                return True
        return False

    def scheduled(self, lr: float) -> float | None:
        """The rate the scheduler last set, given this step's ``lr``; None until one is
        found."""
        self.steps += 1
        close = self.rate is not None and math.isclose(lr, self.rate, rel_tol=self.rel_tol)
        if close or (self.stray is not None and lr == self.stray):
            return self.rate
        if self._found(lr, range(self.t, self.t + self.steps + 2)):
            return self.rate
        length = getattr(self.scheduler, "get_cycle_length", None)
        try:
            end = int(length()) + 1 if callable(length) else self.SCAN
        except Exception:
            end = self.SCAN
        if self._found(lr, range(min(end, self.SCAN))):
            return self.rate
        self.stray = lr
        return self.rate


class ScheduleSource:
    """The Monitor's side: the step's rate and the rate its scheduler set (``lr``,
    ``lr_scheduled`` in the step's host info)."""

    def __init__(self, optimizer: Any, scheduler: Any = None) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler
        self.positions = (PositionRates(scheduler, ScheduleConfig.rel_tol)
                          if scheduler is not None and not callable(
                              getattr(scheduler, "get_last_lr", None))
                          and PositionRates.usable(scheduler) else None)

    def rates(self) -> tuple[float | None, float | None]:
        """(this step's rate, the rate the scheduler set), host floats, no sync."""
        if self.optimizer is None:
            return None, None
        lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            lr = float(lr.detach().cpu()) if lr.device.type == "cpu" and lr.numel() == 1 else None
        lr = float(lr) if isinstance(lr, (int, float)) else None
        if self.positions is not None:
            return lr, (self.positions.scheduled(lr) if lr is not None else None)
        return lr, (_last_lr(self.scheduler) if self.scheduler is not None else None)


class ScheduleView:
    """The host side: whether each flushed step is a restart of the schedule (``restart``) or
    a change of rate the scheduler did not make (``unexplained``)."""

    STATE = ("prev", "peak")

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        self.config = config or ScheduleConfig()
        self.prev: float | None = None
        self.peak = 0.0

    def observe(self, lr: float | None, scheduled: float | None) -> tuple[bool, bool]:
        """(restart, unexplained) for a step whose rate is ``lr`` and whose scheduler last set
        ``scheduled`` (None: no scheduler known)."""
        c = self.config
        if lr is None or not math.isfinite(lr):
            return False, False
        unexplained = scheduled is not None and not math.isclose(lr, scheduled,
                                                                  rel_tol=c.rel_tol)
        prev, peak = self.prev, self.peak
        self.prev, self.peak = lr, max(self.peak, lr)
        rose = prev is not None and (lr > c.rise * prev if prev > 0 else lr > 0)
        if not rose:
            return False, unexplained
        if scheduled is not None:
            return not unexplained, unexplained
        return lr <= c.peak_slack * peak, False
