"""Where the monitor writes: the JSONL logs (``steps.jsonl``, ``events.jsonl``, ``meta.json``),
TensorBoard, and the dumps of the steps behind events (for ``fh.replay``).

A sink is anything with the three methods of ``Sink``: the journal (``journal.py``) hands it
each step of a flush in step order with what the analyser made of it (``write``), says when the
flush's steps are all handed over (``flush``), and closes it at the end of the run (``close``).
A sink never raises for a failed write: training goes on (``JsonlSink`` keeps what it could not
write and retries it)."""

from __future__ import annotations

import errno
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .events import Event, jsonable
from .record import SCALARS, StepHost, StepRecord, map_tensors
from .runs import Run, open_existing, open_new
from .schedule import ScheduleView
from .schema import cast

if TYPE_CHECKING:
    from .analyser import Filing


class Sink(Protocol):
    """What the journal writes to (see the module docstring)."""

    def write(self, s: StepRecord, filing: Filing) -> None:
        """One step of the flush, in step order, and what the analyser made of it."""

    def flush(self) -> None:
        """The flush's steps are all written: push them out."""

    def close(self) -> None:
        """The run's end: write what is left, release the files."""


def step_json(s: StepRecord, names: list[str], events: list[Event], per_tensor: bool) -> dict:
    """One line of steps.jsonl: the step's scalars (counts as ints, flags as bools), the
    learning rate, the kinds of its events and, when asked, every tensor's gradient norm."""
    rec: dict[str, Any] = {"step": s.step, **{k: cast(k, s.values[k]) for k in SCALARS},
                           "lr": s.host.lr}
    if events:
        rec["events"] = [e.kind for e in events]
    if per_tensor:
        rec["per_tensor_norms"] = dict(zip(names, s.per_norm))
    return jsonable(rec)


class JsonlSink:
    """``steps.jsonl``, ``events.jsonl`` and ``incidents.jsonl`` (a record when an incident
    opens and when it closes) of one run under ``root`` (``runs.py``: ``root/run-NNN/``): one
    JSON object a line, each carrying ``"run": <run id>`` and appended by one ``write`` (so that
    a killed process leaves at most one partial last line, which ``fasthealth report`` skips
    and a writer taking the run over cuts), ``meta.json``, and ``dumps/`` for the dump files.

    The run is opened by ``open_new`` (a new run: the next free number) or ``open_existing``
    (a run continued from a Monitor's state), else at the first ``drain`` with lines pending.

    Writing never stops training: a line that cannot be written (disk full, directory removed,
    permissions) stays pending, in order, and is retried at the next ``write``; a partial line
    is cut back off the file, so nothing is ever written twice or half. The first failure warns;
    every failure is kept in ``errors``.
    """

    MAX_PENDING = 200_000  # lines kept while writing fails; the oldest go first past that

    def __init__(self, root: Path, meta: dict, names: list[str] | None = None,
                 per_tensor_every: int = 0) -> None:
        self.root = root
        self.meta = meta
        # steps.jsonl's per-tensor norms: every ``per_tensor_every`` steps and at every event
        self.names, self.per_tensor_every = names or [], per_tensor_every
        self.run: Run | None = None
        self.pending: list[tuple[str, dict]] = []
        self.errors: list[str] = []
        self.dropped = 0
        self._fds: dict[str, int] = {}

    @property
    def log_dir(self) -> Path | None:
        """The run's folder (None until it is opened)."""
        return self.run.dir if self.run is not None else None

    def open_new(self) -> bool:
        """Opens a new run (once); False (recorded, retried at the next drain) when it cannot."""
        if self.run is not None:
            return True
        return self._guard(self._open_new)

    def _open_new(self) -> None:
        self.run = open_new(self.root, jsonable(self.meta))
        # made empty at once: a run without incidents then reads as 0 incidents, not as a
        # log from before incidents.jsonl existed ("not recorded")
        self._fd("incidents.jsonl")

    def open_existing(self, run_id: str, step: int | None) -> None:
        """Continues run ``run_id`` from ``step`` (``runs.open_existing``); raises RuntimeError
        when another writer holds it, OSError when it cannot be written."""
        if self.run is not None:
            raise RuntimeError(f"fasthealth: this Monitor already writes run {self.run.id}; "
                               "a run can be continued only before the first step")
        self.run = open_existing(self.root, run_id, step, jsonable(self.meta), _read_meta)

    def _mkdirs(self) -> None:
        if self.run is not None:  # made again when the folder was removed under it
            (self.run.dir / "dumps").mkdir(parents=True, exist_ok=True)

    def write(self, s: StepRecord, filing: Filing) -> None:
        """Queues the step's line (naming every kind seen at it, a repeat included), its
        recorded events and the incidents opened or closed at it; ``flush`` writes them."""
        found = filing.found
        per_tensor = bool(found) or bool(self.per_tensor_every) and \
            s.step % self.per_tensor_every == 0
        self.queue(step_json(s, self.names, found, per_tensor), filing.events)
        self.queue_incidents([inc.to_json(state) for inc, state in filing.incidents])

    def flush(self) -> None:
        self.drain()

    def queue(self, step: dict, events: list[Event]) -> None:
        """Adds one step's line and its events' lines, to be written by ``drain``."""
        self.pending.append(("steps.jsonl", step))
        self.pending += [("events.jsonl", e.to_json()) for e in events]
        self._bound()

    def queue_record(self, name: str, record: dict) -> None:
        """Adds one record to the run's JSONL file ``name`` (``rollbacks.jsonl``)."""
        self.pending.append((name, jsonable(record)))
        self._bound()

    def queue_incidents(self, records: list[dict]) -> None:
        """Adds incident records (opened, closed) to ``incidents.jsonl``."""
        self.pending += [("incidents.jsonl", jsonable(r)) for r in records]
        self._bound()

    def _bound(self) -> None:
        if len(self.pending) > self.MAX_PENDING:
            self.dropped += len(self.pending) - self.MAX_PENDING
            del self.pending[: len(self.pending) - self.MAX_PENDING]

    def drain(self) -> bool:
        """Writes what is pending, in order; False (recorded, not raised) when it cannot."""
        return self._guard(self._drain)

    def _drain(self) -> None:
        if not self.pending:
            return
        if self.run is None:
            self._open_new()
        self._mkdirs()
        assert self.run is not None
        while self.pending:
            name, rec = self.pending[0]
            line = (json.dumps({**rec, "run": self.run.id}) + "\n").encode()
            fd = self._fd(name)
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                n = os.write(fd, line)
                if n != len(line):
                    raise OSError(errno.ENOSPC, f"wrote {n} of {len(line)} bytes")
            except OSError:
                os.ftruncate(fd, end)  # no half line left behind
                raise
            self.pending.pop(0)

    def _fd(self, name: str) -> int:
        """The file's descriptor, opened again when the file was removed under it."""
        assert self.run is not None
        path = self.run.dir / name
        fd = self._fds.get(name)
        if fd is not None and not path.exists():
            os.close(fd)
            fd = None
        if fd is None:
            fd = self._fds[name] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return fd

    def _guard(self, fn: Callable[[], Any]) -> bool:
        """Runs ``fn``; a failure to write is recorded (warned the first time), not raised."""
        try:
            fn()
            return True
        except OSError as exc:
            self.fail(exc)
            return False

    def fail(self, exc: BaseException) -> None:
        self.errors.append(f"{type(exc).__name__}: {exc}")
        if len(self.errors) == 1:
            warnings.warn(
                f"fasthealth: cannot write to {self.log_dir or self.root} ({exc}); training "
                "goes on, events stay in Monitor.events, and the logs are written when it can "
                "(Monitor.write_errors lists the failures)", RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            if self.run is not None:
                self.run.lock.release()


def _read_meta(path: Path) -> dict | None:
    """A log_dir's meta.json; one that is not a JSON object is moved aside (to
    ``meta.json.unreadable``, or with a number after it), with a warning, and None returned:
    nothing is overwritten."""
    try:
        meta = json.loads(path.read_bytes())
        if isinstance(meta, dict):
            return meta
        why = f"{json_kind(meta)}, not an object"
    except (ValueError, RecursionError) as exc:
        why = f"not JSON: {exc}"
    aside, k = path.with_name("meta.json.unreadable"), 1
    while aside.exists():
        aside, k = path.with_name(f"meta.json.unreadable-{k}"), k + 1
    os.replace(path, aside)
    warnings.warn(f"fasthealth: {path} could not be read ({why}); moved to {aside.name}, and "
                  "a new meta.json written", RuntimeWarning, stacklevel=5)
    return None


def read_jsonl(path: Path) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """The records of a JSONL file as (line number, record), and (line number, what is wrong)
    for each other non-blank line: not UTF-8 text, not JSON, or JSON but not an object. A bad
    line the file ends in, with no newline after it, is called a partial last line (what a
    process killed mid-write leaves). Raises OSError when the file cannot be read, or is not a
    regular file (a FIFO would block the reader, a device never end)."""
    if path.exists() and not path.is_file():
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket, device or folder)",
                      str(path))
    lines = path.read_bytes().split(b"\n")
    records: list[tuple[int, dict]] = []
    problems: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec, why = _parse(line)
        if why is None:
            if isinstance(rec, dict):
                records.append((n, rec))
                continue
            why = f"{json_kind(rec)}, not a record (a JSON object)"
        if n == len(lines):
            why = f"a partial last line, as a process killed mid-write leaves: {why}"
        problems.append((n, why))
    return records, problems


def steps_from_log(path: str | os.PathLike, names: list[str] | None = None
                   ) -> list[StepRecord]:
    """The steps of a run's ``steps.jsonl`` (or of the run folder holding it) as step records,
    for an ``Analyser`` (``monitor.analyser_for``) to judge again, with other settings or rules.

    What the log holds is what the records hold: every schema value, the learning rate, and
    each tensor's gradient norm at the steps that logged them (``per_tensor_every`` and every
    step with an event; NaN at the others, as for a tensor without a gradient); the tensors'
    NaN + Inf counts, the batch and the scans' tables are not logged (NaN, None). The
    schedule's restarts are judged again from the learning rates (a rise back to the peak).
    So the rules of the loss and the global norms judge as they did live; those of the
    per-tensor norms see only the logged steps; ``repeated_batch`` and ``weight_corruption``
    see nothing. ``names``: the tensors' order (default: as the first per-tensor line lists
    them). Where a step was logged twice (a run resumed from an older checkpoint goes on from
    there: its first pass's later steps are an abandoned branch), its last line is taken."""
    path = Path(path)
    records, _ = read_jsonl(path / "steps.jsonl" if path.is_dir() else path)
    last: dict[int, dict] = {rec["step"]: rec for _, rec in records if "step" in rec}
    if names is None:
        names = next((list(r["per_tensor_norms"]) for r in last.values()
                      if "per_tensor_norms" in r), [])
    view, out = ScheduleView(), []
    for step in sorted(last):
        rec = last[step]
        values = {k: _as_float(rec.get(k)) for k in SCALARS}
        norms = rec.get("per_tensor_norms") or {}
        lr = rec.get("lr")
        restart, unexplained = view.observe(lr, None)
        out.append(StepRecord(step, values, [_as_float(norms.get(n)) for n in names],
                              [math.nan] * len(names),
                              StepHost(step, lr=lr, restart=restart, unexplained=unexplained)))
    return out


def _as_float(v: Any) -> float:
    """A logged value back as the record's float (null: not measured, NaN; a flag 1.0 or 0.0)."""
    return math.nan if v is None else float(v)


def json_kind(v: Any) -> str:
    """What kind of JSON value ``v`` is, for messages: "an array in JSON", "JSON null", ..."""
    if v is None:
        return "JSON null"
    if isinstance(v, bool):
        return f"JSON {str(v).lower()}"
    kinds = {dict: "an object", list: "an array", str: "a string", int: "a number",
             float: "a number"}
    return f"{kinds.get(type(v), 'a ' + type(v).__name__)} in JSON"


def _parse(line: bytes) -> tuple[Any, str | None]:
    """(the JSON value of ``line``, None), or (None, why it is not JSON)."""
    try:
        return json.loads(line), None
    except UnicodeDecodeError:
        return None, "not UTF-8 text (binary data?)"
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg}, column {exc.colno})"
    except (ValueError, RecursionError) as exc:
        return None, f"not JSON ({type(exc).__name__}: {exc})"


class TensorBoardSink:
    """Loss, global gradient norm, loss scale and learning rate as TensorBoard scalars."""

    def __init__(self, log_dir: Path) -> None:
        # an optional dependency: imported only for tensorboard=True (Monitor checked it imports)
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir / "tensorboard"))

    def write(self, s: StepRecord, filing: Filing | None = None) -> None:
        for k in ("loss", "grad_norm", "loss_scale"):
            if math.isfinite(s.values[k]):
                self._writer.add_scalar(k, s.values[k], s.step)
        if s.host.lr is not None:
            self._writer.add_scalar("lr", s.host.lr, s.step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def write_dump(log_dir: Path, s: StepRecord, names: list[str], events: list[Event],
               params: list[torch.Tensor] | None, context: dict | None = None) -> str:
    """Saves what ``fh.replay`` needs to re-run step ``s``: the batch and sample ids, the RNG
    state its forward started from, its record and, when captured, the parameters as they were
    before its update; ``context``: what the host knows of the steps before it (the journal's
    ``recent_lr``: [(step, lr)], ``optimizer``: the latest scan's non-finite count and
    tensors, ``control``: the step and batch of the step before, replayed by ``fh.replay`` as
    a control), for replay's verdict. Written to a temporary file and renamed (a failure leaves
    no half dump); a name already taken (a reopened run) gets a suffix. Returns the file's
    path."""
    folder = log_dir / "dumps"
    folder.mkdir(parents=True, exist_ok=True)
    path, k = folder / f"step_{s.step:08d}.pt", 1
    while path.exists():
        path, k = folder / f"step_{s.step:08d}-{k}.pt", k + 1
    cpu = (lambda t: t.detach().cpu())  # noqa: E731
    tmp = path.with_suffix(".pt.tmp")
    try:
        torch.save({
            "step": s.step,
            "events": [e.to_json() for e in events],
            "batch": map_tensors(cpu, s.host.batch),
            "sample_ids": map_tensors(cpu, s.host.sample_ids),
            "record": jsonable(s.values),
            "per_tensor": {"names": names, "norm": s.per_norm},
            "rng": s.host.rng,
            "lr": s.host.lr,
            "params": (None if params is None
                       else {n: t.cpu().clone() for n, t in zip(names, params)}),
            **(context or {}),
        }, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(path)
