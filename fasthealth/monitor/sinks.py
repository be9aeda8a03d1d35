"""Where the monitor writes: the JSONL logs (``steps.jsonl``, ``events.jsonl``, ``meta.json``),
TensorBoard, and the dumps of the steps behind events (for ``fh.replay``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .events import Event, jsonable
from .record import SCALARS, HostStep


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` (tensors inside dicts, lists, tuples and named tuples) with ``fn`` applied to
    every tensor; other leaves are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def step_json(s: HostStep, names: list[str], events: list[Event], per_tensor: bool) -> dict:
    """One line of steps.jsonl: the step's scalars (counts as ints, flags as bools), the
    learning rate, the kinds of its events and, when asked, every tensor's gradient norm."""
    rec: dict[str, Any] = {"step": s.step, **{k: s.values[k] for k in SCALARS},
                           "lr": s.info.get("lr")}
    for k in ("nan_count", "inf_count", "optimizer_nonfinite"):
        rec[k] = int(rec[k]) if rec[k] == rec[k] else None
    for k in ("grads_finite", "loss_finite", "skipped"):
        rec[k] = bool(rec[k])
    if events:
        rec["events"] = [e.kind for e in events]
    if per_tensor:
        rec["per_tensor_norms"] = dict(zip(names, s.per_norm))
    return jsonable(rec)


class JsonlSink:
    """``steps.jsonl`` and ``events.jsonl`` (appended, one JSON object a line) and ``meta.json``
    under ``log_dir``; ``dumps/`` for the dump files."""

    def __init__(self, log_dir: Path, meta: dict) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "dumps").mkdir(exist_ok=True)
        self._steps = open(log_dir / "steps.jsonl", "a")
        self._events = open(log_dir / "events.jsonl", "a")
        (log_dir / "meta.json").write_text(json.dumps(meta, indent=1))

    def write(self, steps: list[dict], events: list[Event]) -> None:
        for rec in steps:
            self._steps.write(json.dumps(rec) + "\n")
        for e in events:
            self._events.write(json.dumps(e.to_json()) + "\n")
        self._events.flush()
        self._steps.flush()

    def close(self) -> None:
        self._steps.close()
        self._events.close()


class TensorBoardSink:
    """Loss, global gradient norm, loss scale and learning rate as TensorBoard scalars."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir / "tensorboard"))

    def write(self, s: HostStep) -> None:
        for k in ("loss", "grad_norm", "loss_scale"):
            if math.isfinite(s.values[k]):
                self._writer.add_scalar(k, s.values[k], s.step)
        if s.info.get("lr") is not None:
            self._writer.add_scalar("lr", s.info["lr"], s.step)

    def close(self) -> None:
        self._writer.close()


def write_dump(log_dir: Path, s: HostStep, names: list[str], events: list[Event],
               params: list[torch.Tensor] | None) -> str:
    """Saves what ``fh.replay`` needs to re-run step ``s``: the batch and sample ids, the RNG
    state its forward started from, its record and, when captured, the parameters as they were
    before its update. Returns the file's path."""
    path = log_dir / "dumps" / f"step_{s.step:08d}.pt"
    cpu = (lambda t: t.detach().cpu())  # noqa: E731
    torch.save({
        "step": s.step,
        "events": [e.to_json() for e in events],
        "batch": map_tensors(cpu, s.info.get("batch")),
        "sample_ids": map_tensors(cpu, s.info.get("sample_ids")),
        "record": jsonable(s.values),
        "per_tensor": {"names": names, "norm": s.per_norm},
        "rng": s.info.get("rng"),
        "lr": s.info.get("lr"),
        "params": (None if params is None
                   else {n: t.cpu().clone() for n, t in zip(names, params)}),
    }, path)
    return str(path)
