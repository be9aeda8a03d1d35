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
agree when the scheduler set it. Without a scheduler, a rise back to at most the peak so far
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


class ScheduleSource:
    """The Monitor's side: the step's rate and the rate its scheduler set (``lr``,
    ``lr_scheduled`` in the step's host info)."""

    def __init__(self, optimizer: Any, scheduler: Any = None) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler

    def rates(self) -> tuple[float | None, float | None]:
        """(this step's rate, the rate the scheduler set), host floats, no sync."""
        if self.optimizer is None:
            return None, None
        lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            lr = float(lr.detach().cpu()) if lr.device.type == "cpu" and lr.numel() == 1 else None
        lr = float(lr) if isinstance(lr, (int, float)) else None
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
