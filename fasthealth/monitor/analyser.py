"""The Monitor's analyser: the host side that judges steps, on its own.

``Analyser.analyse(record)`` takes one ``StepRecord`` (``record.py``) at a time, in step order:
every rule of ``rules/`` looks at it once, its findings become events, and the events are filed
under incidents (``incidents.py``: an event that repeats one of its open incident's is counted
on it, not recorded again). What it made of the step is a ``Filing``. It writes nothing and
needs no model: a live Monitor feeds it the records of each flush (``journal.py`` then writes
them), and an evaluation can feed it recorded steps (``monitor.analyser_for`` builds one
with the rules a Monitor of those options has).

At a warm restart of the learning-rate schedule (the step record's ``host.restart``, decided
once, at the step: ``schedule.py``) the rules' windows start again: this step's loss and
gradients come from the weights the old rate made (the new rate moves them only in this step's
update), so the old windows still judge it and the windows start again after it; a rule that
judges the step's update (``REARM_BEFORE``) starts again before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from . import say
from .events import Event, Incident
from .incidents import IncidentTracker, step_finite
from .record import StepRecord
from .rules import Rule, as_finding


@dataclass
class Filing:
    """What the analyser made of one step: every event found at it (``found``, a repeat
    included), those recorded (``events``: the others repeat one of their incident's and are
    counted on it), the incidents closed or opened at it with that word, and whether an
    incident became an alarm at it (``alarmed``: its first alarm, the step a dump is for)."""

    found: list[Event]
    events: list[Event]
    incidents: list[tuple[Incident, str]] = field(default_factory=list)
    alarmed: bool = False


class Analyser:
    """Rules, events and incidents of one run; see the module docstring. ``events``: every
    event recorded so far, in step order; ``incidents``: every incident, in order of opening;
    ``alarm_listeners``: called once per incident when it becomes an alarm."""

    def __init__(self, rules: list[Rule], tracker: IncidentTracker | None = None) -> None:
        self.rules = rules
        self.tracker = tracker if tracker is not None else IncidentTracker()
        self.events: list[Event] = []
        self.alarm_listeners: list[Callable[[Incident], None]] = []

    @property
    def incidents(self) -> list[Incident]:
        return self.tracker.incidents

    def analyse(self, s: StepRecord) -> Filing:
        """Runs the rules on step ``s`` and files its events under incidents."""
        closed = self.tracker.advance(s.step)
        restart = s.host.restart
        if restart:
            self._rearm(before=True)
        details = {"step_loss": s.values["loss"], "lr": s.host.lr}
        found = [Event(s.step, f.kind, f.message, dict(f.details, **details),
                       severity=f.severity or "")
                 for rule in self.rules for f in map(as_finding, rule.observe(s))]
        if restart:
            self._rearm(before=False)
        incident, opened, alarmed, events = self.tracker.file(s.step, found)
        self.tracker.scanned(s.values.get("weight_nonfinite", math.nan))
        self.tracker.observe(s.values["loss"], s.values["loss_scale"],
                             s.values["grad_norm"], step_finite(s.values), s.step)
        ended = ([closed] if closed else []) + self.tracker.take_closed()
        filing = Filing(found, events, [(inc, "closed") for inc in ended] + (
            [(incident, "opened")] if opened and incident is not None else []), alarmed)
        self.events.extend(events)
        for inc in ended:
            say.incident_closed(inc)
        if incident is not None and (alarmed or opened):
            say.incident_opened(incident, s.step)
        if alarmed and incident is not None:
            for listener in self.alarm_listeners:
                listener(incident)
        return filing

    def _rearm(self, before: bool) -> None:
        """Re-arms the rules whose ``REARM_BEFORE`` is ``before`` (a user's rule without it:
        after)."""
        for rule in self.rules:
            rearm = getattr(rule, "rearm", None)  # a user's rule may not be a Rule
            if callable(rearm) and bool(getattr(rule, "REARM_BEFORE", False)) == before:
                rearm()

    def loss_start(self) -> float:
        """The loss the run started from, as the spike rule keeps it (NaN before it is known,
        or without that rule): what the device's skip rule judges a floor's blips by."""
        for rule in self.rules:
            series = getattr(rule, "series", None) if getattr(rule, "name", None) == "spike" \
                else None
            if isinstance(series, dict) and "loss" in series:
                return float(series["loss"].start)
        return math.nan

    def close(self) -> list[Incident]:
        """Closes the open incident at the run's end; returns the incidents it closed."""
        closed = self.tracker.close_all()
        for inc in closed:
            say.incident_closed(inc)
        return closed
