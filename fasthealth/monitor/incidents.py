"""Events of one fault, grouped into one ``Incident`` (docs/spec.md section 6).

A fault rarely makes one event: a garbage batch spikes the loss and the gradient norm at its step,
and the damaged model then spikes again while it recovers; an LR jump shows as the jump, spikes and
a rising loss. The tracker sees each flushed step in order. An event joins the open incident when
there is one (the aftermath of a fault explains what follows it); otherwise it opens a new one. An
alarm incident stays open while the run has not come back from it: the median of the last ``RECENT``
(10) finite losses above the median of the 32 before the incident opened by more than that median's
noise allows (``noise_units`` (3) times the noise of a median of ``RECENT`` losses, judged from the
32 losses' step-to-step spread; at least ``NOISE_FLOOR`` (2%) of the level, at most ``recover``
(20%) of it), or a GradScaler's scale still 8x or more below the highest of those 32 steps (a
persistent fault, a data change or a collapsed scale, spikes again 100 steps later: that is still
its aftermath). An incident the run ended in without coming back is closed ``recovered=False``, its
``end`` the run's last step. Above all it stays open while the run is broken: the last step's loss
or gradients non-finite (a NaN in the gradients under a GradScaler; its overflow steps are the
scaler at work), or its loss ``BROKEN`` (1e6) times its level before the incident (a loss of 3e38 is
no model at all, whatever the median of the finite losses says): it closes only on recovery,
whatever its quiet periods. An incident that opens before the loss has a level (fewer than
``RECENT`` losses: a fault from the first steps, an LR far too high) stays open until the loss has
fallen ``recover`` below its first value, the model at its initialization: a run that never learns
is one fault, however often it spikes. Otherwise an incident closes after ``quiet`` steps without an
event; sooner when it cannot explain what comes later: after ``notice_quiet`` steps while it holds
only notices (a notice that nothing confirms should not hold the door open for an unrelated alarm
much later), and after ``skipped_quiet`` steps while every event in it was at a skipped step (the
update never reached the weights, so there is no aftermath: a NaN ten steps later is a fault of its
own, a NaN at every step is still one). A notice incident that an alarm joins becomes an alarm: a
gradient spike that the loss then confirms.

When the run is not (or no longer) harmed by an alarm incident and ``settle`` (10) steps have
passed since its last new finding, an alarm of a kind the incident does not hold is a new fault
(a finding of a periodic scan, a weight that jumped between two weight scans, counts from the
scan before: an LR far too high from the first step blows the weights up within the incident it
opens, and the next scan, 40 steps on, finds them grown 1000x):
it closes the incident and opens its own (a damaged model spikes and diverges while it recovers;
an oscillation 30 steps after a broken optimizer state that never moved the loss is not its
aftermath); a loss spike back to the level before the incident is the run coming back, not a new
fault. Except for causes whose harm comes later (``Kind.delayed``: a learning rate ramping up shows
in the loss only some steps after the rate rule fired): such an incident keeps explaining until the
loss has been harmed (stood ``recover`` above its level before) and is back. Repeats of the
incident's own findings (a broken optimizer state seen at every scan) keep it open, but explain
nothing new.

Within an incident only the first event of each kind and severity is recorded; the same finding
at its later steps counts on that event (``Event.repeats``, ``last_step``) and on the incident
(``counts``): a NaN in Adam's moments makes every later step non-finite, one fault, one event of
each kind, not hundreds.

Some alarms are causes, never the aftermath of another fault: a learning rate far above its peak
is a change of configuration, and is explained only by an open incident that already holds one.
Broken optimizer state is explained only by an incident that already holds it, or a non-finite
value, or a gradient so large that its square overflows float32 (Adam's second moment): norm
1.8e19 or more; a collapsing loss scale by one that holds it, a non-finite value, or any
gradient spike (scaled for float16, a spike is what overflows: overflow after overflow backs a
scaler off); a weight that jumped by one that holds a non-finite value, a gradient event or
broken optimizer state, unless several tensors jumped together (a diverging run, which any
incident can explain). Such an alarm closes the open incident and opens its own.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from .causes import CHECK_FIRST, CauseConfig, judge
from .events import ALARM, NOTICE, SCANNED_SINCE, SEVERAL_TENSORS, Event, Incident
from .kinds import GRADIENT, KINDS, cause_of

SQUARE_OVERFLOWS = math.sqrt(torch.finfo(torch.float32).max)  # 1.8e19: its square is inf


NOISE_FLOOR: float = 0.02
"""The least margin, as a share of the level, whatever the noise (a full-batch loss has almost
none): a loss within 2% of its level is back."""

RECENT: int = 10
"""Finite losses in the recent median."""

BEFORE: int = 32
"""Finite losses (and loss scales) whose median (highest) is the level before an incident."""

SCALE_DROP: float = 8.0
"""A loss scale this many times below its level before: not recovered (the loss-scale rule's
three back-offs)."""

BROKEN: float = 1e6
"""A last loss this many times its level before the incident (or the run's first loss) is a
broken run and holds an alarm incident open, like a non-finite one: no real loss moves a
million-fold while training (a cross-entropy that fell to 1e-3 and climbs back to its uniform
value, about 10, moves 1e4-fold), while a NaN-filled stretch leaves the median of the finite
losses at its old level, where a loss of 3e38 would close the incident
(tests/monitor/test_causes.py plants one)."""


@dataclass(frozen=True)
class IncidentConfig:
    quiet: int = 50
    """Steps without an event after which an alarm incident the run has recovered from closes:
    a damaged model's follow-on spikes come within tens of steps."""
    notice_quiet: int = 10
    """The same while an incident holds only notices: a notice that nothing confirms should not
    hold the door open for an unrelated alarm much later."""
    skipped_quiet: int = 3
    """The same while every event was at a skipped step: the update never reached the weights,
    so there is no aftermath (a NaN ten steps later is a fault of its own)."""
    recover: float = 0.2
    """The loss's recent median more than this share above its level before the incident: not
    recovered, the incident stays open, whatever the loss's noise (and, before the loss had a
    level, it must fall this share below its first value)."""
    noise_units: float | None = 3.0
    """Below ``recover``: the recent median more than this many of its own noise units above the
    level before is not recovered either (the noise of a median of ``RECENT`` losses, from the
    step-to-step spread of the losses before the incident). A learning-rate burst that leaves
    a nanoGPT-shaped run's loss 18% up, where a median of 10 losses moves by 2%, has damaged
    the model though it is within 20%. None: ``recover`` alone."""
    settle: int | None = 10
    """Steps after an incident's last new finding after which, the run not harmed, an alarm of
    a new kind is a new fault with its own incident; None: never (everything joins the open
    incident)."""
    returns: bool = True
    """A loss spike back to (not above) the level before the incident is the run coming back
    (after a stretch of zero losses, say), not a new fault."""
    overflow_explains: bool = True
    """Broken optimizer state is explained by a gradient whose square overflows float32 (Adam's
    second moment), as well as by a non-finite value."""
    causes: CauseConfig = CauseConfig()
    """The evidence rules that name an incident's likely cause (``causes.py``)."""

    def __post_init__(self) -> None:
        if min(self.quiet, self.notice_quiet, self.skipped_quiet, self.settle or 1) < 1:
            raise ValueError("fasthealth: incident quiet periods must be at least 1 step")


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


def step_finite(values: Mapping[str, float]) -> bool:
    """Whether a step's loss and gradients were finite; under a GradScaler, Inf without NaN in
    the gradients at a finite loss is an overflow step, the scaler at work."""
    scale = values.get("loss_scale")
    scaled = isinstance(scale, float) and scale == scale  # not NaN: a scaler
    grads = bool(values["grads_finite"]) or (scaled and values.get("nan_count", 1) == 0)
    return bool(values["loss_finite"]) and grads


def _since(e: Event) -> int:
    """The earliest step at which what ``e`` found may have happened."""
    since = e.details.get(SCANNED_SINCE)
    return min(e.step, since + 1) if isinstance(since, int) else e.step


def _norm(e: Event) -> float:
    """The gradient norm a gradient event reports (NaN when it names none)."""
    v = e.details.get("value", e.details.get("grad_norm", math.nan))
    return float(v) if isinstance(v, (int, float)) else math.nan


class IncidentTracker:
    """Assigns each event an incident; ``incidents`` lists them all, in order of opening.
    ``observe`` is given every step's loss, loss scale and gradient norm (after its events are
    filed)."""

    # what it keeps of the run, by name (``state.py``); the rest is its config's
    STATE = ("incidents", "current", "closed_early", "losses", "scales", "first_loss", "scale",
             "baseline", "last_new", "harmed", "peak_norm", "firsts", "skipped_only", "last",
             "after", "scaled", "last_step", "state_bad")
    # added since the state's format (state.py): a state saved before starts it again
    STATE_ADDED: ClassVar[dict[str, Callable[[dict], Any]]] = {"state_bad": lambda f: False}

    def __init__(self, config: IncidentConfig | None = None, **fields: object) -> None:
        c = self.config = replace(config or IncidentConfig(), **fields)  # type: ignore[arg-type]
        self.quiet, self.notice_quiet, self.skipped_quiet = c.quiet, c.notice_quiet, \
            c.skipped_quiet
        self.recover, self.recent, self.settle = c.recover, RECENT, c.settle
        before = BEFORE
        self.incidents: list[Incident] = []
        self.current: Incident | None = None
        self.ended: Incident | None = None  # the incident open when the run ended (close_all)
        self.state_bad = False  # the last weight scan found NaN/Inf in the weights or buffers
        self.closed_early: list[Incident] = []  # closed by a cause it cannot explain
        self.losses: deque[float] = deque(maxlen=before)  # the last finite losses
        self.scales: deque[float] = deque(maxlen=before)  # the last finite loss scales
        self.first_loss = math.nan  # the run's first finite loss
        self.scale = math.nan  # the last finite loss scale
        # the open incident's before: (loss level, or None before there is one; loss scale;
        # how far above the level the recent median may be and still be back)
        self.baseline: tuple[float | None, float, float] = (None, math.nan, math.nan)
        self.last_new = -1  # the step of the open incident's last new finding
        self.harmed = False  # the open incident's run has been unrecovered at some step
        self.peak_norm = 0.0  # the largest finite gradient norm since the open one opened
        # the first recorded event of each (kind, severity) in the open incident
        self.firsts: dict[tuple[str, str], Event] = {}
        self.skipped_only = False  # every event of the open incident was at a skipped step
        self.last = (math.nan, True)  # the last step's loss, and whether it was finite
        self.after: list[float] | None = None  # losses after the open incident's first alarm
        self.scaled = False  # a GradScaler's scale has been seen
        self.last_step = -1  # the last step observed

    def observe(self, loss: float, scale: float, grad_norm: float = math.nan,
                finite: bool = True, step: int | None = None) -> None:
        """The step's loss, loss scale and gradient norm; ``finite``: its loss and gradients
        were finite (``step_finite``); ``step``: its number (the last one ends an incident the
        run never came back from)."""
        self.last = (loss, finite)
        if step is not None:
            self.last_step = step
        if math.isfinite(grad_norm) and self.current is not None:
            self.peak_norm = max(self.peak_norm, grad_norm)
        cur = self.current
        if cur is not None and cur.severity == ALARM:
            if self.after is None:
                self.after = []  # the first alarm's own step
            else:
                self.after.append(loss if finite else math.nan)
        if math.isfinite(loss):
            self.losses.append(loss)
            if not math.isfinite(self.first_loss):
                self.first_loss = loss
        if math.isfinite(scale):
            self.scale = scale
            self.scales.append(scale)
            self.scaled = True
        if cur is not None and cur.severity == ALARM and not self.harmed:
            self.harmed = self._unrecovered()
        self._judge()

    def _judge(self) -> None:
        """Names the open incident's likely cause from its evidence so far (``causes.py``)."""
        cur = self.current
        if cur is None:
            return
        level = self.baseline[0]
        if level is None and math.isfinite(self.first_loss):
            level = self.first_loss
        cur.cause, cur.why, cur.basis = judge(cur, self.after, level, self.scaled,
                                              self.config.causes)
        # a cause that is only the trigger's default: the kind's own advice is more specific
        # (a stall from the start: whether gradients reach every layer, then the rate) than
        # the cause's
        kind = KINDS.get(cur.trigger or "") if cur.why.startswith("the default cause") else None
        cur.check_first = kind.advice if kind is not None else CHECK_FIRST[cur.cause]

    def scanned(self, nonfinite: float) -> None:
        """A step's weight scan (NaN: none at that step): NaN/Inf in the weights or buffers
        keep the run broken until a scan finds none (a rollback, a reload)."""
        if nonfinite == nonfinite:
            self.state_bad = nonfinite > 0

    def broken(self) -> bool:
        """Whether the run is broken at the last step: its loss or gradients non-finite, or
        its loss ``BROKEN`` times its level before the open incident (the module docstring)."""
        loss, finite = self.last
        if not finite or self.state_bad:  # a NaN buffer: training's loss need not show it
            return True
        level = self.baseline[0]
        if level is None:
            level = self.first_loss
        return math.isfinite(level) and level > 0 and loss > BROKEN * level

    def take_closed(self) -> list[Incident]:
        """The incidents ``add`` closed early since the last call."""
        out, self.closed_early = self.closed_early, []
        return out

    def _unrecovered(self) -> bool:
        """Whether the run is still below where it was before the open incident (see the module
        docstring); never for a notice incident or one of skipped steps only."""
        loss, scale, margin = self.baseline
        recent = list(self.losses)[-self.recent:]
        now = statistics.median(recent) if len(recent) == self.recent else math.nan
        first = self.first_loss
        if loss is None:  # opened before the loss had a level: back once it has learned
            if math.isfinite(first) and not now <= (1 - self.recover) * first:
                return True  # (too few losses yet to judge, NaN, counts as not back)
        elif loss > 0 and now > loss + margin:
            return True
        return math.isfinite(scale) and math.isfinite(self.scale) \
            and self.scale * SCALE_DROP <= scale

    def _margin(self, level: float | None) -> float:
        """How far above ``level`` the recent median may stand and the run be back: the noise
        of a median of ``RECENT`` losses (a robust spread of the step-to-step changes of the
        losses before, over sqrt(2) for one loss, times 1.2533 / sqrt(recent) for the median)
        times ``noise_units``, within [``NOISE_FLOOR``, ``recover``] of the level."""
        if level is None:
            return math.nan
        cap = self.recover * abs(level)
        units = self.config.noise_units
        steps = list(self.losses)
        if units is None or len(steps) < self.recent + 1:
            return cap
        diffs = [b - a for a, b in zip(steps, steps[1:])]
        mid = statistics.median(diffs)
        one = 1.4826 * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2)
        noise = one * 1.2533 / math.sqrt(self.recent)
        return min(cap, max(NOISE_FLOOR * abs(level), units * noise))

    def _expired(self, step: int) -> bool:
        cur = self.current
        if cur is None:
            return False
        if cur.severity == ALARM and self.broken():
            return False  # the run is still broken: it closes only on recovery
        if self.skipped_only:
            limit = self.skipped_quiet
        elif cur.severity == ALARM:
            if self._unrecovered():
                return False
            limit = self.quiet
        else:
            limit = self.notice_quiet
        return step - cur.end > limit

    def _close(self, ended: bool = False) -> Incident:
        """Closes the open incident; ``ended``: because the run ended, when an alarm incident
        the run has not come back from is closed unrecovered and lasts to the last step."""
        closed, self.current = self.current, None
        assert closed is not None
        closed.open = False
        if closed.severity == ALARM:
            damaged = ended and not self.skipped_only and (
                self.broken() or self.harmed and self._unrecovered())
            closed.recovered = not damaged
            if damaged:
                closed.end = max(closed.end, self.last_step)
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
            k = KINDS.get(e.kind)
            by = k.explained_by if k is not None else None
            if e.details.get(SEVERAL_TENSORS):
                by = None  # a diverging run: any open incident can be its cause
            if e.severity != ALARM or by is None or e.kind in held or held & by:
                continue
            if e.kind == "optimizer_state_nonfinite" and self.config.overflow_explains \
                    and self._overflowed():
                continue  # the incident's gradients could overflow Adam's second moment
            return False
        new = [e for e in events
               if e.severity == ALARM and e.kind not in held and not self._returns(e)]
        # a finding of a periodic scan dates from its window's start: what it found may have
        # happened at any step since the scan before (``SCANNED_SINCE``)
        step = min((_since(e) for e in new), default=events[0].step)
        new_alarm = bool(new)
        delayed = any(KINDS[k].delayed for k in held if k in KINDS)
        waits = delayed and not self.harmed  # its harm is still to come
        if new_alarm and cur.severity == ALARM and not waits and self.settle is not None \
                and step - self.last_new >= self.settle and not self._unrecovered() \
                and not self.broken():
            return False  # the run got over it: a new kind of alarm is a new fault
        return True

    def _overflowed(self) -> bool:
        """Whether a gradient of the open incident was large enough for its square to overflow
        float32 (its norm, or a gradient event's)."""
        cur = self.current
        return self.peak_norm >= SQUARE_OVERFLOWS or cur is not None and any(
            _norm(e) >= SQUARE_OVERFLOWS for e in cur.events if e.kind in GRADIENT)

    def _returns(self, e: Event) -> bool:
        """Whether ``e`` is a loss spike back to (not above) the loss before the open incident:
        the run coming back (after a stretch of zero losses, say), not a new fault."""
        level = self.baseline[0]
        value = e.details.get("value")
        return self.config.returns and e.kind == "loss_spike" and level is not None \
            and isinstance(value, (int, float)) and value <= (1 + self.recover) * level

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
                                    cause=cause_of(first.kind), severity=NOTICE,
                                    trigger=first.kind)
            self.incidents.append(self.current)
            level = statistics.median(self.losses) if len(self.losses) >= self.recent else None
            self.baseline = (level, max(self.scales) if self.scales else math.nan,
                             self._margin(level))
            self.harmed = False
            self.peak_norm = 0.0
            self.skipped_only = True
            self.after = None
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
            self.last_new = step
            kept.append(e)
            cur.events.append(e)
            if e.kind not in cur.kinds:
                cur.kinds.append(e.kind)
            if e.severity == ALARM and cur.severity != ALARM:
                cur.severity, cur.trigger = ALARM, e.kind
                self.after = None
        cur.end = step
        self._judge()
        return cur, opened, cur.severity == ALARM and not was_alarm, kept

    def rolled_back(self, inc: Incident) -> None:
        """Closes ``inc``, the open incident, as rolled back (``Incident.rolled_back``): the
        state from before it is restored, the run is back. ``take_closed`` reports it."""
        if self.current is not inc:
            return
        inc.rolled_back = True
        self.harmed = False
        closed = self._close()
        closed.recovered = True if closed.severity == ALARM else None
        self.closed_early.append(closed)

    def close_all(self) -> list[Incident]:
        """Closes the open incident (the run ended); returns it in a list, or an empty one.
        ``ended`` keeps it: what was open when the run ended still judges its last state
        (``guard.py``: a checkpoint after ``close()``)."""
        self.ended = self.current
        return [] if self.current is None else [self._close(ended=True)]
