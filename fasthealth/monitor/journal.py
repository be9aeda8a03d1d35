"""The Monitor's host side at a flush: *analyse + write*.

The device side (``monitor.py``: record + gate) leaves one row per step in the device record;
at a flush the rows come to the host in one copy, as ``StepRecord``s, and reach here in step
order. Each is judged once by the analyser (``analyser.py``: rules, events, incidents), then
each sink (``sinks.py``: the JSONL logs, TensorBoard) writes it, and the dump of the step where
an incident's first alarm fell is saved.

A step leaves the backlog only once its events are in the analyser's and its lines are queued:
an interrupted flush (Ctrl-C in a save) loses and repeats nothing. Writing failures are
recorded in ``errors``, never raised.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from .analyser import Analyser, Filing
from .events import Event, NonFiniteError
from .incidents import dump_due
from .kinds import fatal_kinds
from .record import StepRecord, map_tensors
from .runs import Run
from .sinks import JsonlSink, Sink, TensorBoardSink, write_dump

RECENT_LR = 64  # steps whose learning rate a dump keeps: an earlier level to compare with


class Journal:
    """The flushes of one Monitor: each step through ``analyser``, then into the logs
    (``sinks`` only with a ``log_dir``)."""

    def __init__(self, names: list[str], analyser: Analyser, *, log_dir: Path | None,
                 meta: dict, tensorboard: bool, dumps: str, per_tensor_every: int,
                 on_nonfinite: str) -> None:
        self.names, self.analyser = names, analyser
        self.dumps, self.per_tensor_every = dumps, per_tensor_every
        self.on_nonfinite = on_nonfinite
        # taken from the record, not yet fully flushed: each step with what the analyser made
        # of it (None until then) and whether its dump was tried (written or failed)
        self.backlog: list[tuple[StepRecord, Filing | None, bool]] = []
        # the run's sinks: its folder under log_dir is opened at the first step (open_run)
        # or by continue_run (runs.py)
        self.jsonl = JsonlSink(log_dir, meta, names, per_tensor_every) \
            if log_dir is not None else None
        self.tensorboard = tensorboard
        self.tb: TensorBoardSink | None = None
        self.sinks: list[Sink] = [self.jsonl] if self.jsonl is not None else []
        self._closed_run: Run | None = None
        self.errors: list[str] = self.jsonl.errors if self.jsonl is not None else []
        # for the dumps (fh.replay's verdict): the learning rates of the last steps, and what
        # the latest optimizer scan found
        self.recent_lr: deque[tuple[int, float | None]] = deque(maxlen=RECENT_LR)
        self.optimizer: dict | None = None
        self.previous: StepRecord | None = None  # the step before, its batch a dump's control

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
            self.sinks.append(self.tb)

    def flush(self, steps: list[StepRecord],
              snapshots: list[list[torch.Tensor]] | None) -> list[Event]:
        """Detects, files and writes ``steps`` (and any left from an interrupted flush);
        returns the new events; raises NonFiniteError with ``on_nonfinite="raise"``."""
        self.backlog += [(s, None, False) for s in steps]
        new: list[Event] = []  # every event of these steps, the repeats counted on others too
        while self.backlog:
            s, filing, dumped = self.backlog[0]
            if filing is None:  # the rules see each step once, even when retried
                self._remember(s)
                filing = self.analyser.analyse(s)
                self.backlog[0] = (s, filing, False)
                new.extend(filing.found)
            if self.jsonl is not None and self.jsonl.run is None:
                self.open_run()  # steps pending and no run yet (its opening failed)
            if (self.jsonl is not None and not dumped
                    and dump_due(self.dumps, filing.found, filing.alarmed)):
                self._save_dump(s, filing.found, snapshots)
                self.backlog[0] = (s, filing, True)
            for sink in self.sinks:
                sink.write(s, filing)
            if s.host.batch is not None:
                self.previous = s
            self.backlog.pop(0)
        for sink in self.sinks:
            sink.flush()
        if self.on_nonfinite == "raise":
            fatal = [e for e in new if e.kind in fatal_kinds()]
            if fatal:
                raise NonFiniteError(fatal)
        return new

    def _remember(self, s: StepRecord) -> None:
        """Keeps the step's learning rate and, at an optimizer scan, what it found."""
        self.recent_lr.append((s.step, s.host.lr))
        count = s.values["optimizer_nonfinite"]
        if count == count:  # scanned at this step
            stats = s.host.opt_stats
            self.optimizer = {"step": s.step, "nonfinite": int(count), "tensors": (
                stats.nonfinite() if count and stats is not None else [])}

    def _save_dump(self, s: StepRecord, events: list[Event],
                   snapshots: list[list[torch.Tensor]] | None) -> str | None:
        assert self.jsonl is not None
        params = snapshots[s.host.slot] if snapshots is not None else None
        try:
            prev = self.previous
            control = None if prev is None or prev.step >= s.step else {
                "step": prev.step, "batch": map_tensors(lambda t: t.detach().cpu(),
                                                        prev.host.batch)}
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
        # the incident the events opened or joined; an event outside any (incidents off)
        # leaves every incident's dump as it was
        incident = next((i for i in self.analyser.incidents if i.id == events[0].incident),
                        None)
        if incident is not None and incident.dump is None:
            incident.dump = dump
        return dump

    def close(self) -> None:
        """Closes the open incident (its record written) and the log files."""
        try:
            closed = self.analyser.close()
            if self.jsonl is not None and closed:
                self.jsonl.queue_incidents([inc.to_json("closed") for inc in closed])
        finally:
            if self.jsonl is not None:
                self._closed_run = self.jsonl.run
            for sink in self.sinks:
                sink.close()
            self.jsonl = self.tb = None
            self.sinks = []
