"""What the monitor reports: ``Event``, ``Incident``, ``Observation`` and ``NonFiniteError``.

Severity is by consequence (docs/spec.md section 6). An *alarm* says something is wrong for the
run: a non-finite value, the loss harmed (a spike, a sustained rise, a stall, oscillation),
the learning rate far above anything it has been, gradients vanished, optimizer state or loss
scale broken, replicas that disagree. A *notice* is a signal worth seeing that has not harmed
the loss: the gradient norm jumping or climbing while the loss is fine (an extreme gradient
that the loss then confirms joins the loss's alarm in one incident), a precursor. Notices are
logged, plotted and counted; only alarms warn, raise or reach a trainer's logs as problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..stats import MultiTensorStats
from .kinds import ALARM, NOTICE, severity_of

# The detail by which a finding of a periodic scan (``weight_corruption``) names the step of the
# scan before: what it found happened at some step after it, not necessarily at its own.
SCANNED_SINCE = "scanned_since"


# The detail by which ``weight_corruption`` says that several tensors jumped together: a run
# that diverged, which any open incident can explain (an LR far too high: loss spikes first),
# where one tensor's jump (a flipped bit) is a cause of its own.
SEVERAL_TENSORS = "several_tensors"

__all__ = ["ALARM", "NOTICE", "Event", "Incident", "NonFiniteError", "Observation", "jsonable",
           "severity_of"]


def jsonable(v: Any) -> Any:
    """``v`` with tensors as lists and non-finite floats as None (JSON has neither)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return jsonable(v.tolist())
    return v


@dataclass
class Event:
    """One finding at one step: ``kind`` (``kinds.KINDS``), a readable ``message``, the numbers
    behind it in ``details``, ``dump`` (the saved batch and state, for ``fh.replay``; the first
    alarm step of each incident has one), ``severity`` ("alarm" or "notice") and ``incident``,
    the id of the ``Incident`` it belongs to.

    Within one incident only the first event of each kind and severity is recorded (in
    ``mon.events`` and events.jsonl); the same finding at later steps of that incident counts
    on it: ``repeats`` (how many more steps it was seen at) and ``last_step`` (the latest)."""

    step: int
    kind: str
    message: str
    details: dict = field(default_factory=dict)
    dump: str | None = None
    severity: str = ""
    incident: int | None = None
    repeats: int = 0
    last_step: int | None = None

    def __post_init__(self) -> None:
        if not self.severity:
            self.severity = severity_of(self.kind)

    def to_json(self) -> dict:
        """The event as events.jsonl has it: as first seen (its repeats are counted on its
        incident's record)."""
        return {"step": self.step, "kind": self.kind, "severity": self.severity,
                "incident": self.incident, "message": self.message,
                "details": jsonable(self.details), "dump": self.dump}


@dataclass
class Incident:
    """The events of one fault: from ``start`` to ``end`` (steps), the ``kinds`` seen in order of
    first appearance, ``trigger`` (the kind of its first alarm, else of its first event),
    ``cause`` (its likely cause, one of ``kinds.CAUSES``, judged from its evidence:
    ``causes.py``), ``check_first`` (what to check first for that cause) and ``why`` (the
    evidence that named it), ``severity`` ("alarm" once any of its events is one), ``events``
    (the first of each kind and severity: later ones are counted on it, ``Event.repeats``),
    ``counts`` (the steps each kind was seen at) and ``dump`` (the saved step of its first
    alarm). ``open`` until it is over (``incidents.py``); ``recovered``, once an alarm incident
    is closed: whether the run came back from it (False: the run ended with its loss still up
    beyond its noise, or broken, and ``end`` is then the run's last step); ``basis``, what
    named its cause: "direct" (a kind or a fact that names it), "recovery" (whether the loss
    came back) or "default" (its first alarm's default); a replay's cause replaces the last
    two (``causes.py``)."""

    id: int
    start: int
    end: int
    kinds: list[str]
    cause: str
    severity: str
    events: list[Event] = field(default_factory=list)
    dump: str | None = None
    open: bool = True
    counts: dict[str, int] = field(default_factory=dict)
    trigger: str = ""
    check_first: str = ""
    why: str = ""
    recovered: bool | None = None
    basis: str = ""
    rolled_back: bool = False
    """Closed by a rollback (``rollback.py``): the state from before it was restored, so the
    run is back where it was (``recovered``); the fault coming back is a new incident."""

    @property
    def message(self) -> str:
        """The first alarm's message (else the first event's): what a log line shows. With a
        ``check_first``, the rule's own "Check first: ..." advice gives way to it (a spike's
        "this step's batch" is wrong when the weights are the cause)."""
        first = next((e for e in self.events if e.severity == ALARM), self.events[0])
        text = first.message
        if self.check_first:
            text = text.split(" Check first:")[0].split("Check first:")[0].rstrip(" .;,")
            text += f". Likely cause: {self.cause}; check first: {self.check_first}"
        return text

    def to_json(self, state: str) -> dict:
        return {"record": "incident", "state": state, "id": self.id, "start": self.start,
                "end": self.end, "kinds": list(self.kinds), "cause": self.cause,
                "trigger": self.trigger, "check_first": self.check_first, "why": self.why,
                "severity": self.severity, "events": len(self.events),
                "counts": dict(self.counts), "dump": self.dump, "message": self.message,
                "recovered": self.recovered, "basis": self.basis,
                "rolled_back": self.rolled_back}


@dataclass
class RollbackRecord:
    """One rollback: at the flush after ``step``, the state of the end of ``to_step`` was
    restored for ``incident`` (its id); ``quarantined``: the sample ids put in quarantine."""

    step: int
    to_step: int
    incident: int
    reason: str
    quarantined: list[int] = field(default_factory=list)
    replay: str | None = None
    """With ``RollbackConfig.replay``: "batch" (the incident's first alarm batch is bad on the
    restored state too) or "state" (it is not: the batch and the state the run had reached,
    together); None: not replayed (no replay function, or that batch was not kept)."""
    replay_loss: float | None = None
    """That batch's loss on the restored state."""
    level: float | None = None
    """The loss level before the incident, which ``replay_loss`` was judged against."""

    def to_json(self) -> dict:
        return {"record": "rollback", "step": self.step, "to_step": self.to_step,
                "incident": self.incident, "reason": self.reason,
                "quarantined": list(self.quarantined), "replay": self.replay,
                "replay_loss": self.replay_loss, "level": self.level}


@dataclass
class Observation:
    """What ``Monitor.step`` saw: ``skip`` is a 0-dim bool tensor on the device (no sync);
    ``stats`` the gradients' statistics, None on a micro-batch that an engine's optimizer does
    not step on (accelerate's ``accumulate``: nothing was checked or stepped)."""

    step: int
    skip: torch.Tensor
    loss: torch.Tensor
    stats: MultiTensorStats | None


class NonFiniteError(RuntimeError):
    """Raised at a flush that saw a non-finite loss or gradient with ``on_nonfinite="raise"``."""

    def __init__(self, events: list[Event]):
        self.events = events
        first = events[0]
        super().__init__(f"fasthealth: step {first.step}: {first.message}"
                         + (f" (and {len(events) - 1} more)" if len(events) > 1 else ""))
