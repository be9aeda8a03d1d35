"""Events of one fault, grouped into one ``Incident`` (docs/spec.md section 6).

A fault rarely makes one event: a garbage batch spikes the loss and the gradient norm at its
step, and the damaged model then spikes again while it recovers; an LR jump shows as the jump,
spikes and a rising loss. The tracker sees each flushed step in order. An event joins the open
incident when there is one (the aftermath of a fault explains what follows it); otherwise it
opens a new one. An alarm incident stays open while the run has not come back from it: the
median of the last ``recent`` (10) finite losses more than ``recover`` (20%) above the median of
the 32 before the incident opened, or a GradScaler's scale still 8x or more below where it was
(a persistent fault, a data change or a collapsed scale, spikes again 100 steps later: that is
still its aftermath). Otherwise an incident closes after ``quiet`` steps without an event;
sooner when it cannot explain what comes later: after ``notice_quiet`` steps while it holds
only notices (a notice that nothing confirms should not hold the door open for an unrelated
alarm much later), and after ``skipped_quiet`` steps while every event in it was at a skipped
step (the update never reached the weights, so there is no aftermath: a NaN ten steps later is
a fault of its own, a NaN at every step is still one). A notice incident that an alarm joins
becomes an alarm: a gradient spike that the loss then confirms.

Within an incident only the first event of each kind and severity is recorded; the same
finding at its later steps counts on that event (``Event.repeats``, ``last_step``) and on the
incident (``counts``): a NaN in Adam's moments makes every later step non-finite, one fault,
one event of each kind, not hundreds.

Some alarms are causes, never the aftermath of another fault: a learning rate far above its
peak is a change of configuration, and is explained only by an open incident that already
holds one. Broken optimizer state and a collapsing loss scale are explained only by an
incident that already holds them, a non-finite value or an exploding gradient (whose square
overflows Adam's second moment; overflow after overflow backs a scaler off). Such an alarm
closes the open incident and opens its own.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from .events import ALARM, NOTICE, Event, Incident

# What overflows optimizer state or a loss scale: non-finite values, or gradients so large that
# their squares do (Adam's second moment).
OVERFLOW = frozenset({"nonfinite_loss", "nonfinite_grad", "grad_norm_spike", "exploding_grad"})
# alarm kind -> the kinds of an open incident that can explain it (its own kind always can)
CAUSES: dict[str, frozenset[str]] = {
    "lr_jump": frozenset(),
    "optimizer_state_nonfinite": OVERFLOW,
    "loss_scale_collapse": OVERFLOW,
}

SCALE_DROP = 8.0  # a loss scale this many times below its level before: not recovered (the
# loss-scale rule's back-off of three halvings)

# Which steps get a dump (the batch, stats, RNG and parameters, for fh.replay): the first alarm
# step of each incident (the default: one dump per fault), every step with an alarm, every step
# with an event, or none.
DUMPS = ("incident", "alarm", "event", "none")


def dump_due(policy: str, events: list[Event], alarmed: bool) -> bool:
    """Whether a step with ``events`` gets a dump; ``alarmed``: its incident became an alarm
    at this step (opened by an alarm, or a notice incident that an alarm joined)."""
    if policy == "incident":
        return alarmed
    if policy == "alarm":
        return any(e.severity == ALARM for e in events)
    return policy == "event" and bool(events)


class IncidentTracker:
    """Assigns each event an incident; ``incidents`` lists them all, in order of opening.
    ``observe`` is given every step's loss and loss scale (after its events are filed)."""

    def __init__(self, quiet: int = 50, notice_quiet: int = 10, skipped_quiet: int = 3,
                 recover: float = 0.2, recent: int = 10, before: int = 32) -> None:
        if min(quiet, notice_quiet, skipped_quiet) < 1:
            raise ValueError("fasthealth: incident quiet periods must be at least 1 step")
        self.quiet, self.notice_quiet, self.skipped_quiet = quiet, notice_quiet, skipped_quiet
        self.recover, self.recent = recover, recent
        self.incidents: list[Incident] = []
        self.current: Incident | None = None
        self.closed_early: list[Incident] = []  # closed by a cause it cannot explain
        self.losses: deque[float] = deque(maxlen=before)  # the last finite losses
        self.scale = math.nan  # the last finite loss scale
        self.baseline: tuple[float | None, float] = (None, math.nan)  # the open one's before
        # the first recorded event of each (kind, severity) in the open incident
        self.firsts: dict[tuple[str, str], Event] = {}
        self.skipped_only = False  # every event of the open incident was at a skipped step

    def observe(self, loss: float, scale: float) -> None:
        if math.isfinite(loss):
            self.losses.append(loss)
        if math.isfinite(scale):
            self.scale = scale

    def take_closed(self) -> list[Incident]:
        """The incidents ``add`` closed early since the last call."""
        out, self.closed_early = self.closed_early, []
        return out

    def _unrecovered(self) -> bool:
        """Whether the run is still below where it was before the open incident (see the module
        docstring); never for a notice incident or one of skipped steps only."""
        loss, scale = self.baseline
        recent = list(self.losses)[-self.recent:]
        if loss is not None and loss > 0 and len(recent) == self.recent \
                and statistics.median(recent) > (1 + self.recover) * loss:
            return True
        return math.isfinite(scale) and math.isfinite(self.scale) \
            and self.scale * SCALE_DROP <= scale

    def _expired(self, step: int) -> bool:
        cur = self.current
        if cur is None:
            return False
        if self.skipped_only:
            limit = self.skipped_quiet
        elif cur.severity == ALARM:
            if self._unrecovered():
                return False
            limit = self.quiet
        else:
            limit = self.notice_quiet
        return step - cur.end > limit

    def _close(self) -> Incident:
        closed, self.current = self.current, None
        assert closed is not None
        closed.open = False
        self.firsts = {}
        return closed

    def advance(self, step: int) -> Incident | None:
        """Closes the open incident if ``step`` lies past its quiet period; returns it if so."""
        return self._close() if self._expired(step) else None

    def _explains(self, events: list[Event]) -> bool:
        """Whether the open incident can be the cause of ``events`` (see the module doc)."""
        cur = self.current
        if cur is None:
            return False
        held = set(cur.kinds)
        for e in events:
            if e.severity == ALARM and e.kind in CAUSES and e.kind not in held \
                    and not held & CAUSES[e.kind]:
                return False
        return True

    def add(self, step: int, events: list[Event]) -> tuple[Incident | None, bool, bool]:
        """``file`` without the list of recorded events."""
        return self.file(step, events)[:3]

    def file(self, step: int, events: list[Event]
             ) -> tuple[Incident | None, bool, bool, list[Event]]:
        """Files ``events`` (all of ``step``) under an incident: (that incident, whether it was
        opened here, whether it became an alarm here, the events recorded: the others repeat
        an event of the incident and are counted on it). (None, False, False, []) without
        events. When the open incident cannot explain them, it is closed first:
        ``closed_early`` holds it until ``take_closed`` reads it."""
        if not events:
            return None, False, False, []
        if self.current is not None and not self._explains(events):
            self.closed_early.append(self._close())
        opened = self.current is None
        if opened:
            first = next((e for e in events if e.severity == ALARM), events[0])
            self.current = Incident(id=len(self.incidents), start=step, end=step, kinds=[],
                                    cause=first.kind, severity=NOTICE)
            self.incidents.append(self.current)
            level = statistics.median(self.losses) if len(self.losses) >= self.recent else None
            self.baseline = (level, self.scale)
            self.skipped_only = True
        cur = self.current
        assert cur is not None
        was_alarm = cur.severity == ALARM
        kept = []
        for e in events:
            e.incident = cur.id
            self.skipped_only &= bool(e.details.get("skipped"))
            cur.counts[e.kind] = cur.counts.get(e.kind, 0) + 1
            seen = self.firsts.get((e.kind, e.severity))
            if seen is not None:
                seen.repeats += 1
                seen.last_step = step
                continue
            self.firsts[(e.kind, e.severity)] = e
            kept.append(e)
            cur.events.append(e)
            if e.kind not in cur.kinds:
                cur.kinds.append(e.kind)
            if e.severity == ALARM and cur.severity != ALARM:
                cur.severity, cur.cause = ALARM, e.kind
        cur.end = step
        return cur, opened, cur.severity == ALARM and not was_alarm, kept

    def close_all(self) -> list[Incident]:
        """Closes the open incident (the run ended); returns it in a list, or an empty one."""
        return [] if self.current is None else [self._close()]
