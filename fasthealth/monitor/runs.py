"""Runs in a log directory (docs/spec.md section 11): ``LOG_DIR/run-NNN/``, one per Monitor
that did not continue a run, each with its own ``steps.jsonl``, ``events.jsonl``,
``incidents.jsonl``, ``meta.json``, ``dumps/``, TensorBoard's files and ``writer.lock``.

- A new run takes the next free number with an atomic ``os.mkdir``: two processes starting
  together get two runs.
- The writer holds ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``writer.lock`` (which says its pid,
  host, command line and start) for the Monitor's life. A second writer of the same run is
  refused with a RuntimeError naming the holder. The kernel drops the lock of a killed process,
  so a run left by a SIGKILL is taken over: its partial last lines (a write cut by the kill) are
  cut off so that each file stays one JSON object a line, and meta.json's resume record says
  what was cut (its start, as text; the whole of it in ``<file>.cut-<offset>`` beside the
  file), so nothing the old writer wrote is lost.
  Limits: ``flock`` is advisory and per host; on NFS (v4, or v3 with a lock manager) it is
  emulated with POSIX locks by Linux and may not be seen across clients on other setups, and a
  network file system may keep a dead client's lock until its lease expires. Two machines
  writing the same run through a file system without working locks are not detected. A
  process forked from the writer (a DataLoader worker) shares its lock: a killed writer's run
  can be taken over once those children are gone too.
- ``continue_run`` opens an existing run again (a Monitor that loaded a run's state). When the
  run's files already hold steps after the step resumed from, those records are an *abandoned
  branch*: they stay as they are (nothing is rewritten) and meta.json's ``resumes`` list gets
  ``{"step": k, "offsets": {file: bytes}, ...}``. A line of a file that lies before
  ``offsets[file]`` of some resume and belongs to a step after that resume's ``step`` is
  abandoned (``abandoned_lines``; the report leaves such lines out).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

JSONL = ("steps.jsonl", "events.jsonl", "incidents.jsonl")
RUN_NAME = re.compile(r"run-(\d{3,})")
CUT_SHOWN = 4096  # characters of a cut partial line shown in meta.json (all of it: its file)


def writer_root(log_dir: Path, process_group: Any, all_ranks: bool) -> Path | None:
    """Where this process writes its runs: ``log_dir``; under torch.distributed (a process
    group given, or a default group of more than one process) rank 0 alone, unless
    ``all_ranks`` (then rank k > 0 under ``log_dir/rank-k``). None: this rank writes nothing."""
    if not (dist.is_available() and dist.is_initialized()):
        return log_dir
    if process_group is None and dist.get_world_size() <= 1:
        return log_dir
    rank = dist.get_rank()
    if rank == 0:
        return log_dir
    return log_dir / f"rank-{rank}" if all_ranks else None


def is_run_name(name: str) -> bool:
    return RUN_NAME.fullmatch(name) is not None


def run_dirs(root: Path) -> list[Path]:
    """The run directories under ``root``, by number."""
    try:
        found = [p for p in root.iterdir() if is_run_name(p.name) and p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: int(p.name[4:]))


def new_run_dir(root: Path) -> Path:
    """Makes and returns the next free ``root/run-NNN`` (an atomic mkdir: never shared)."""
    root.mkdir(parents=True, exist_ok=True)
    existing = run_dirs(root)
    n = int(existing[-1].name[4:]) + 1 if existing else 0
    while True:
        path = root / f"run-{n:03d}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def who() -> dict[str, Any]:
    """This process, as a run's meta.json and writer.lock name it."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": " ".join(sys.argv) if sys.argv else sys.executable,
            "started": time.time()}


class WriterLock:
    """``run_dir/writer.lock``, held with ``flock(LOCK_EX | LOCK_NB)`` until ``release``.
    Raises RuntimeError naming the holder when another writer (another process, or another
    Monitor of this one: flock locks belong to an open file) holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "writer.lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            raise RuntimeError(
                f"fasthealth: run {run_dir.name} in {run_dir.parent} is being written by "
                f"another Monitor ({holder}); two writers of one run would mix their records. "
                "Resume from this run's state in one process only, or close the other "
                "Monitor first") from exc
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(who()) + "\n").encode())
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 65536, 0))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
        return (f"pid {info.get('pid')} on host {info.get('host')}, command "
                f"{info.get('command')!r}, started {when}")
    except (OSError, ValueError, TypeError, AttributeError):
        return "a process whose writer.lock cannot be read"


def cut_partial_lines(run_dir: Path) -> list[dict]:
    """Cuts a partial last line (no newline after it: a write cut short by a kill) off each
    JSONL file of a run taken over; returns what was cut, for meta.json."""
    cut = []
    for name in JSONL:
        path = run_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        if not data or data.endswith(b"\n"):
            continue
        keep = data.rfind(b"\n") + 1
        tail = data[keep:]
        # the whole tail beside the file before the file is cut (meta.json shows its start):
        # a kill between the two leaves the bytes twice, never nowhere
        saved = f"{name}.cut-{keep}"
        with open(run_dir / saved, "wb") as f:
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "r+b") as f:
            f.truncate(keep)
        cut.append({"file": name, "offset": keep, "bytes": len(tail), "saved": saved,
                    "text": tail[:CUT_SHOWN].decode("utf-8", "backslashreplace")})
    return cut


def record_step(name: str, rec: dict) -> Any:
    """The step a record belongs to: its ``step``, an incident record's end (closed) or start."""
    if name == "incidents.jsonl":
        return rec.get("end") if rec.get("state") == "closed" else rec.get("start")
    return rec.get("step")


def last_step(path: Path) -> int | None:
    """The largest step of a run's steps.jsonl (None: no step)."""
    best = None
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return None
    for line in lines:
        try:
            s = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        if isinstance(s, int) and not isinstance(s, bool) and (best is None or s > best):
            best = s
    return best


def abandoned_lines(run_dir: Path, resumes: Any) -> dict[str, set[int]]:
    """The line numbers (from 1), by file, of a run's abandoned branches: lines before a
    resume's offset in their file whose step is after that resume's step."""
    marks = [(r["step"], r["offsets"]) for r in resumes or []
             if isinstance(r, dict) and isinstance(r.get("step"), int)
             and isinstance(r.get("offsets"), dict)]
    out: dict[str, set[int]] = {}
    if not marks:
        return out
    for name in JSONL:
        try:
            if not (run_dir / name).is_file():  # never block on a FIFO in its place
                continue
            data = (run_dir / name).read_bytes()
        except OSError:
            continue
        at, gone = 0, set()
        for n, line in enumerate(data.split(b"\n"), 1):
            try:
                rec = json.loads(line)
                s = record_step(name, rec) if isinstance(rec, dict) else None
            except (ValueError, RecursionError):
                s = None
            if isinstance(s, (int, float)) and any(
                    at < (off.get(name) or 0) and s > k for k, off in marks):
                gone.add(n)
            at += len(line) + 1
        if gone:
            out[name] = gone
    return out


@dataclass
class Run:
    """A run this Monitor writes: its id, folder and lock."""

    id: str
    dir: Path
    lock: WriterLock
    resume: dict | None = field(default=None)


def write_meta(path: Path, meta: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path)


def open_new(root: Path, meta: dict) -> Run:
    """A new run under ``root``: its folder, lock and meta.json."""
    d = new_run_dir(root)
    lock = WriterLock(d)
    (d / "dumps").mkdir(exist_ok=True)
    write_meta(d / "meta.json", {**meta, "run": d.name, **who()})
    return Run(d.name, d, lock)


def open_existing(root: Path, run_id: str, step: int | None, meta: dict,
                  read_meta: Any) -> Run:
    """Run ``root/run_id`` continued from ``step`` (made when it is not there): locked,
    partial last lines cut, and the resume recorded in meta.json's ``resumes``.
    ``read_meta(path)``: the old meta.json or None (``sinks._read_meta``)."""
    if not isinstance(run_id, str) or not is_run_name(run_id):
        raise ValueError(f"fasthealth: the state's run id {run_id!r} is not a run's name "
                         "(run-NNN)")
    d = root / run_id
    d.mkdir(parents=True, exist_ok=True)
    lock = WriterLock(d)
    try:
        cut = cut_partial_lines(d)
        offsets = {}
        for name in JSONL:
            try:
                offsets[name] = (d / name).stat().st_size
            except FileNotFoundError:
                offsets[name] = 0
        reached = last_step(d / "steps.jsonl")
        path = d / "meta.json"
        old = read_meta(path) if path.exists() else None
        base = old if old is not None else {**meta, "run": run_id, "created_by_resume": True}
        resume = {**who(), "step": step, "offsets": offsets, "reached": reached,
                  "abandons": reached is not None and step is not None and reached > step,
                  "cut": cut}
        base.setdefault("resumes", []).append(resume)
        (d / "dumps").mkdir(exist_ok=True)
        write_meta(path, base)
    except BaseException:
        lock.release()
        raise
    return Run(run_id, d, lock, resume)
