"""A warm restart's high-rate phase: from the restart until the rate falls below
``RESTART_HIGH`` of the rate it set (for a cosine cycle, its first half). The schedule itself
makes the loss unstable there: a fitted model thrown back to a high rate loses its fit for tens
of steps and finds it again (``spike.RESTART_RISE``, ``divergence``, ``grad_trend``).

Only a return to a high rate is one: the restart's rate at least ``RESTART_HIGH`` of the
highest rate before it. A warm-up's first step from a rate of 0 is a restart to the schedule
(its windows start again) but throws back nothing: the run has had no rate, and its phase would
last as long as the rate stays above half of the warm-up's first, smallest one, the whole run.
"""

from __future__ import annotations

RESTART_HIGH: float = 0.5
"""The share of the restart's rate below which its high-rate phase is over; and the share of
the highest rate before the restart that its rate must reach to begin one."""


class RestartPhase:
    """Tracks the phase for a rule: ``lr`` (the rate of the step observed last), ``lr_peak``
    (the highest rate before it) and ``restart_lr`` (the rate the restart set, None outside the
    phase), all three in the rule's ``STATE``."""

    lr: float | None
    lr_peak: float
    restart_lr: float | None

    def track(self, lr: float | None) -> None:
        """At each step, before judging it: the step's rate; ends the phase below
        ``RESTART_HIGH``."""
        if self.lr is not None and self.lr > self.lr_peak:
            self.lr_peak = self.lr
        self.lr = lr
        if self.restart_lr is not None and not (lr is not None and
                                                lr >= RESTART_HIGH * self.restart_lr):
            self.restart_lr = None

    def restarted(self) -> None:
        """At a warm restart (``rearm``, after the restart's own step): the phase begins at
        that step's rate, when it returns to at least ``RESTART_HIGH`` of the highest before."""
        lr = self.lr
        high = lr is not None and self.lr_peak > 0 and lr >= RESTART_HIGH * self.lr_peak
        self.restart_lr = lr if high else None

    @property
    def in_restart(self) -> bool:
        return self.restart_lr is not None
