"""The Monitor's host side: *detect + file + write*, once per flush.

The device side (``monitor.py``: record + gate) leaves one row per step in the device record;
at a flush the rows come to the host in one copy and reach here in step order. For each step
the rules of ``rules/`` run once, their events are filed under incidents
(``incidents.py``: an event that repeats one of its open incident's is counted on it, not
recorded again; the step's line in steps.jsonl still names every kind seen), and the sinks
(``sinks.py``) write the JSONL lines, TensorBoard and the dump of the step where an incident's
first alarm fell.

A step leaves the backlog only once its events are in ``events`` and its lines are queued: an
interrupted flush (Ctrl-C in a save) loses and repeats nothing. Writing failures are recorded
in ``errors``, never raised.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from .events import Event, Incident, NonFiniteError
from .incidents import IncidentTracker, dump_due, step_finite
from .kinds import fatal_kinds
from .record import HostStep
from .rules import Rule, as_finding
from .runs import Run
from .schedule import ScheduleView
from .sinks import JsonlSink, TensorBoardSink, map_tensors, step_json, write_dump

RECENT_LR = 64  # steps whose learning rate a dump keeps: an earlier level to compare with


class Journal:
    """Events, incidents and logs of one Monitor; ``sinks`` only with a ``log_dir``."""

    def __init__(self, names: list[str], detectors: list[Rule], *, log_dir: Path | None,
                 meta: dict, tensorboard: bool, dumps: str, per_tensor_every: int,
                 on_nonfinite: str) -> None:
        self.names, self.detectors = names, detectors
        self.dumps, self.per_tensor_every = dumps, per_tensor_every
        self.on_nonfinite = on_nonfinite
        self.events: list[Event] = []
        self.tracker = IncidentTracker()
        self.schedule = ScheduleView()
        self.backlog: list[HostStep] = []  # taken from the record, not yet fully flushed
        # the run's sinks: its folder under log_dir is opened at the first step (open_run)
        # or by continue_run (runs.py)
        self.jsonl = JsonlSink(log_dir, meta) if log_dir is not None else None
        self.tensorboard = tensorboard
        self.tb: TensorBoardSink | None = None
        self._closed_run: Run | None = None
        self.errors: list[str] = self.jsonl.errors if self.jsonl is not None else []
        # called once per incident, when it becomes an alarm (Monitor.on_alarm)
        self.alarm_listeners: list[Callable[[Incident], None]] = []
        # for the dumps (fh.replay's verdict): the learning rates of the last steps, and what
        # the latest optimizer scan found
        self.recent_lr: deque[tuple[int, float | None]] = deque(maxlen=RECENT_LR)
        self.optimizer: dict | None = None
        self.previous: HostStep | None = None  # the step before, its batch a dump's control

    @property
    def run(self) -> Run | None:
        """The run written (opened, and kept after close), else None."""
        return self.jsonl.run if self.jsonl is not None else self._closed_run

    @property
    def log_dir(self) -> Path | None:
        """The run's folder, once opened."""
        return self.run.dir if self.run is not None else None

    def open_run(self) -> None:
        """A new run, at the first step (a write failure is recorded and retried)."""
        if self.jsonl is not None and self.jsonl.run is None and self.jsonl.open_new():
            self._open_tb()

    def continue_run(self, run_id: str | None, step: int | None) -> None:
        """Continues run ``run_id`` from ``step`` instead of a new run (made when it is not
        there: a checkpoint moved to a new log_dir); records it holds for steps after ``step``
        become an abandoned branch (kept, marked in its meta.json: ``runs.py``). Nothing to do
        without a log_dir, on a rank that does not write, or for a state with no run.
        RuntimeError when another live Monitor writes it (the message names it) or this one
        has opened its run already."""
        if run_id is not None and self.jsonl is not None:
            self.jsonl.open_existing(run_id, step)
            self._open_tb()

    def _open_tb(self) -> None:
        if self.tensorboard and self.tb is None and self.log_dir is not None:
            self.tb = TensorBoardSink(self.log_dir)

    def flush(self, steps: list[HostStep],
              snapshots: list[list[torch.Tensor]] | None) -> list[Event]:
        """Detects, files and writes ``steps`` (and any left from an interrupted flush);
        returns the new events; raises NonFiniteError with ``on_nonfinite="raise"``."""
        self.backlog += steps
        new: list[Event] = []  # every event of these steps, the repeats counted on others too
        while self.backlog:
            s = self.backlog[0]
            if "events" not in s.info:  # the rules see each step once, even when retried
                self._file(s)
                new.extend(s.info["found"])
            events = s.info["events"]
            if self.jsonl is not None and self.jsonl.run is None:
                self.open_run()  # steps pending and no run yet (its opening failed)
            if s.info["dump_due"] and self.jsonl is not None and "dump" not in s.info:
                s.info["dump"] = self._save_dump(s, s.info["found"], snapshots)
            if self.jsonl is not None:
                found = s.info["found"]  # the step's line names every kind seen at it
                per_tensor = s.step % self.per_tensor_every == 0 or bool(found)
                self.jsonl.queue(step_json(s, self.names, found, per_tensor), events)
                self.jsonl.queue_incidents([inc.to_json(state)
                                            for inc, state in s.info["incidents"]])
            if self.tb is not None:
                self.tb.write(s)
            if s.info.get("batch") is not None:
                self.previous = s
            self.backlog.pop(0)
        if self.jsonl is not None:
            self.jsonl.drain()
        if self.on_nonfinite == "raise":
            fatal = [e for e in new if e.kind in fatal_kinds()]
            if fatal:
                raise NonFiniteError(fatal)
        return new

    def _rearm(self, before: bool) -> None:
        """Re-arms the rules whose ``REARM_BEFORE`` is ``before`` (a user's rule without it:
        after)."""
        for rule in self.detectors:
            rearm = getattr(rule, "rearm", None)  # a user's rule may not be a Rule
            if callable(rearm) and bool(getattr(rule, "REARM_BEFORE", False)) == before:
                rearm()

    def _file(self, s: HostStep) -> None:
        """Runs the rules on step ``s`` and files its events under incidents; what the step
        then writes is kept in ``s.info``: ``found`` (every event), ``events`` (those recorded:
        the others repeat one of their incident's and are counted on it), the incident records
        and whether it dumps."""
        closed = self.tracker.advance(s.step)
        restart, unexplained = self.schedule.observe(s.info.get("lr"),
                                                     s.info.get("lr_scheduled"))
        s.info["lr_restart"], s.info["lr_unexplained"] = restart, unexplained
        # The schedule's own restart: the rules' windows start again. This step's loss and
        # gradients come from the weights the old rate made (the new rate moves them only in
        # this step's update), so the old windows still judge it and the windows start again
        # after it (a garbage batch at the restart's own step went unseen against windows just
        # emptied); a rule that judges the step's update starts again before it.
        if restart:
            self._rearm(before=True)
        details = {"step_loss": s.values["loss"], "lr": s.info["lr"]}
        self._remember(s)
        found = [Event(s.step, f.kind, f.message, dict(f.details, **details),
                       severity=f.severity or "")
                 for rule in self.detectors for f in map(as_finding, rule.observe(s))]
        if restart:
            self._rearm(before=False)
        incident, opened, alarmed, events = self.tracker.file(s.step, found)
        self.tracker.observe(s.values["loss"], s.values["loss_scale"],
                             s.values["grad_norm"], step_finite(s.values), s.step)
        ended = ([closed] if closed else []) + self.tracker.take_closed()
        s.info["incidents"] = [(inc, "closed") for inc in ended] + (
            [(incident, "opened")] if opened else [])
        s.info["dump_due"] = dump_due(self.dumps, found, alarmed)
        s.info["found"], s.info["events"] = found, events
        self.events.extend(events)
        if alarmed and incident is not None:
            for listener in self.alarm_listeners:
                listener(incident)

    def _remember(self, s: HostStep) -> None:
        """Keeps the step's learning rate and, at an optimizer scan, what it found."""
        self.recent_lr.append((s.step, s.info["lr"]))
        count = s.values["optimizer_nonfinite"]
        if count == count:  # scanned at this step
            stats = s.info.get("opt_stats")
            self.optimizer = {"step": s.step, "nonfinite": int(count), "tensors": (
                stats.nonfinite() if count and stats is not None else [])}

    def _save_dump(self, s: HostStep, events: list[Event],
                   snapshots: list[list[torch.Tensor]] | None) -> str | None:
        assert self.jsonl is not None
        params = snapshots[s.info["slot"]] if snapshots is not None else None
        try:
            prev = self.previous
            control = None if prev is None or prev.step >= s.step else {
                "step": prev.step, "batch": map_tensors(lambda t: t.detach().cpu(),
                                                        prev.info["batch"])}
            if self.log_dir is None:
                raise OSError(f"no run folder under {self.jsonl.root} (it could not be made)")
            dump = write_dump(self.log_dir, s, self.names, events, params, {
                "recent_lr": list(self.recent_lr), "optimizer": self.optimizer,
                "control": control})
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            self.jsonl.fail(exc)
            return None
        for e in events:
            e.dump = dump
        incident = self.tracker.incidents[s.info["found"][0].incident or 0]
        if incident.dump is None:
            incident.dump = dump
        return dump

    def close(self) -> None:
        """Closes the open incident (its record written) and the log files."""
        try:
            closed = self.tracker.close_all()
            if self.jsonl is not None and closed:
                self.jsonl.queue_incidents([inc.to_json("closed") for inc in closed])
        finally:
            if self.jsonl is not None:
                self._closed_run = self.jsonl.run
            for sink in (self.jsonl, self.tb):
                if sink is not None:
                    sink.close()
            self.jsonl = self.tb = None
