"""Events of one fault, grouped into one ``Incident`` (docs/spec.md section 6).

A fault rarely makes one event: a garbage batch spikes the loss and the gradient norm at its
step, and the damaged model then spikes again while it recovers; an LR jump shows as the jump,
spikes and a rising loss. The tracker sees each flushed step in order. An event joins the open
incident when there is one (the aftermath of a fault explains what follows it); otherwise it
opens a new one. An incident closes after ``quiet`` steps without an event; sooner when it
cannot explain what comes later: after ``notice_quiet`` steps while it holds only notices (a
notice that nothing confirms should not hold the door open for an unrelated alarm much later),
and after ``skipped_quiet`` steps while every event in it was at a skipped step (the update
never reached the weights, so there is no aftermath: a NaN ten steps later is a fault of its
own, a NaN at every step is still one). A notice incident that an alarm joins becomes an alarm:
a gradient spike that the loss then confirms.

Some alarms are causes, never the aftermath of another fault: a learning rate far above its
peak is a change of configuration, and is explained only by an open incident that already
holds one. Broken optimizer state and a collapsing loss scale are explained only by an
incident that already holds them, a non-finite value or an exploding gradient (whose square
overflows Adam's second moment; overflow after overflow backs a scaler off). Such an alarm
closes the open incident and opens its own.
"""

from __future__ import annotations

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
    """Assigns each event an incident; ``incidents`` lists them all, in order of opening."""

    def __init__(self, quiet: int = 50, notice_quiet: int = 10, skipped_quiet: int = 3) -> None:
        if min(quiet, notice_quiet, skipped_quiet) < 1:
            raise ValueError("fasthealth: incident quiet periods must be at least 1 step")
        self.quiet, self.notice_quiet, self.skipped_quiet = quiet, notice_quiet, skipped_quiet
        self.incidents: list[Incident] = []
        self.current: Incident | None = None
        self.closed_early: list[Incident] = []  # closed by a cause it cannot explain

    def take_closed(self) -> list[Incident]:
        """The incidents ``add`` closed early since the last call."""
        out, self.closed_early = self.closed_early, []
        return out

    def _expired(self, step: int) -> bool:
        cur = self.current
        if cur is None:
            return False
        if all(e.details.get("skipped") for e in cur.events):
            limit = self.skipped_quiet
        else:
            limit = self.quiet if cur.severity == ALARM else self.notice_quiet
        return step - cur.end > limit

    def advance(self, step: int) -> Incident | None:
        """Closes the open incident if ``step`` lies past its quiet period; returns it if so."""
        if not self._expired(step):
            return None
        closed, self.current = self.current, None
        assert closed is not None
        closed.open = False
        return closed

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
        """Files ``events`` (all of ``step``) under an incident: (that incident, whether it was
        opened here, whether it became an alarm here). (None, False, False) without events.
        When the open incident cannot explain them, it is closed first: ``closed_early``
        holds it until ``take_closed`` reads it."""
        if not events:
            return None, False, False
        if self.current is not None and not self._explains(events):
            self.current.open = False
            self.closed_early.append(self.current)
            self.current = None
        opened = self.current is None
        if opened:
            first = next((e for e in events if e.severity == ALARM), events[0])
            self.current = Incident(id=len(self.incidents), start=step, end=step, kinds=[],
                                    cause=first.kind, severity=NOTICE)
            self.incidents.append(self.current)
        cur = self.current
        assert cur is not None
        was_alarm = cur.severity == ALARM
        for e in events:
            e.incident = cur.id
            cur.events.append(e)
            if e.kind not in cur.kinds:
                cur.kinds.append(e.kind)
            if e.severity == ALARM and cur.severity != ALARM:
                cur.severity, cur.cause = ALARM, e.kind
        cur.end = step
        return cur, opened, cur.severity == ALARM and not was_alarm

    def close_all(self) -> list[Incident]:
        """Closes the open incident (the run ended); returns it in a list, or an empty one."""
        if self.current is None:
            return []
        closed, self.current = self.current, None
        closed.open = False
        return [closed]
