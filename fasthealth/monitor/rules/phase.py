"""A warm restart's high-rate phase: from the restart until the rate falls below
``RESTART_HIGH`` of the rate it set (for a cosine cycle, its first half). The schedule itself
makes the loss unstable there: a fitted model thrown back to a high rate loses its fit for tens
of steps and finds it again (``spike.RESTART_RISE``, ``divergence``)."""

from __future__ import annotations

RESTART_HIGH: float = 0.5
"""The share of the restart's rate below which its high-rate phase is over."""


class RestartPhase:
    """Tracks the phase for a rule: ``lr`` (the rate of the step observed last) and
    ``restart_lr`` (the rate the restart set, None outside the phase), both in the rule's
    ``STATE``."""

    lr: float | None
    restart_lr: float | None

    def track(self, lr: float | None) -> None:
        """At each step, before judging it: the step's rate; ends the phase below
        ``RESTART_HIGH``."""
        self.lr = lr
        if self.restart_lr is not None and not (lr is not None and
                                                lr >= RESTART_HIGH * self.restart_lr):
            self.restart_lr = None

    def restarted(self) -> None:
        """At a warm restart (``rearm``, after the restart's own step): the phase begins at
        that step's rate."""
        self.restart_lr = self.lr if self.lr is not None and self.lr > 0 else None

    @property
    def in_restart(self) -> bool:
        return self.restart_lr is not None
