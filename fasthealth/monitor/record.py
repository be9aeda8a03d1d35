"""The monitor's step record: one row per step on the device, copied to the host once per
flush, and what the step keeps on the host beside it.

A row holds the ``SCALARS`` of the step (declared in ``schema.py``), then each watched tensor's
gradient norm, then each one's NaN + Inf count (NaN where a tensor had no gradient that step).
Rows are written on the device with no sync; what the step knows on the host (its learning
rate, the schedule's verdict, references to its batch) is a ``StepHost``, named and frozen.
``take()`` copies the filled rows to the host in one transfer and returns one ``StepRecord``
per step: the record every reader of a step reads (the rules, the sinks, the dumps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import GradPass
from ..ops.layout import COL
from ..optim import optimizer_state_tensors
from .schema import DEVICE

SCALARS = DEVICE  # the columns of a row, declared in schema.py
# the step's totals, written from the fused pass's last row in one operation
FROM_TOTAL = {"grad_norm": "norm", "grad_finite_norm": "finite_norm", "grad_amax": "amax",
              "nan_count": "nan_count", "inf_count": "inf_count", "grads_finite": "all_finite"}


@dataclass(frozen=True)
class StepHost:
    """What a step knows on the host, set once at the step and read at its flush."""

    step: int
    slot: int = 0
    """The row of the device record (and of the parameter snapshots) the step was written to."""
    lr: float | None = None
    """The rate of the optimizer's first parameter group (``schedule.py``)."""
    lr_scheduled: float | None = None
    """The rate the scheduler last set for it; None without a scheduler."""
    restart: bool = False
    """The schedule restarted at this step: the rules' windows start again."""
    unexplained: bool = False
    """The rate differs from the one the scheduler set (``lr_jump`` judges it)."""
    batch: Any = None
    """The step's batch, by reference (no copy), with a log_dir: for its dump."""
    sample_ids: Any = None
    rng: dict[str, Any] | None = None
    """The RNG state the step's forward started from: for its dump."""
    opt_stats: Any = None
    """The optimizer-state scan's statistics, at a scan (``optimizer_check_every``)."""
    grads_present: int | None = None
    """How many watched parameters had a ``.grad`` (``no_grad``)."""
    weight_table: Any = None
    """The weight scan's per-tensor table, at a scan (``weight_corruption``)."""
    batch_key: Any = None
    """A hashable key of the step's sample ids, when ``repeated_batch`` runs."""
    alike: dict[str, list[int]] | None = None
    """Under a process group, at the first step of a spell of replicas that differ, when
    several do: every rank that differs, by the count's field (``scans.AlikeRanks``)."""


@dataclass(frozen=True)
class StepRecord:
    """One step on the host: ``values`` by the schema's field name (``SCALARS``), the
    per-tensor gradient norms and NaN + Inf counts in the order of the record's names, and
    ``host``."""

    step: int
    values: Mapping[str, float]
    per_norm: list[float]
    per_bad: list[float]
    host: StepHost


class DeviceRecord:
    """``capacity`` rows of ``[SCALARS | per-tensor norm | per-tensor NaN+Inf]`` on ``device``.

    A field a step does not measure is not written: the rows are NaN (not measured) from the
    start of each flush, so a step writes only what it has, in as few operations as it can
    (each small operation costs a few microseconds inside a training step)."""

    def __init__(self, names: list[str], capacity: int, device: torch.device) -> None:
        n, k = len(names), len(SCALARS)
        self.names, self.capacity, self.device = names, capacity, device
        self.scalars, self.norm, self.bad = slice(0, k), slice(k, k + n), slice(k + n, k + 2 * n)
        self._buf = torch.full((capacity, k + 2 * n), math.nan, dtype=torch.float64,
                               device=device)
        self._host: list[StepHost] = []
        self._index: dict[tuple[int, ...], torch.Tensor] = {}  # rows present, when some aren't
        self._at: dict[tuple[str, ...], torch.Tensor] = {}  # columns of a set of fields
        # the totals' columns of the fused pass's table, and where they go in a row
        at = [SCALARS.index(k) for k in FROM_TOTAL]
        self._total_src = torch.tensor([COL[c] for c in FROM_TOTAL.values()], device=device)
        self._total_dst = slice(at[0], at[-1] + 1) if at == list(range(at[0], at[-1] + 1)) \
            else torch.tensor(at, device=device)

    @property
    def fill(self) -> int:
        return len(self._host)

    @property
    def full(self) -> bool:
        return self.fill == self.capacity

    def write(self, scalars: dict[str, torch.Tensor], table: torch.Tensor, present: list[int],
              host: StepHost) -> int:
        """Records one step: ``scalars`` (0-dim tensors on the record's device, by SCALARS
        name; a field left out is not measured, NaN), the totals and the per-tensor rows of
        the stats ``table`` for the watched tensors ``present``, and what it keeps on the host.
        Returns the slot written (``host.slot``)."""
        slot = self.fill
        if slot == 0:  # a new flush: every field not measured until written
            self._buf.fill_(math.nan)
        row = self._buf[slot]
        if isinstance(self._total_dst, slice):
            torch.index_select(table[-1], 0, self._total_src, out=row[self._total_dst])
        else:
            row.index_copy_(0, self._total_dst, table[-1].index_select(0, self._total_src))
        keys = tuple(scalars)
        at = self._at.get(keys)
        if at is None:  # copied to the device once per set of fields
            at = self._at.setdefault(keys, torch.tensor([SCALARS.index(k) for k in keys],
                                                        device=self.device))
        if keys:
            row.index_copy_(0, at, torch.stack(list(scalars.values())))  # promoted to float64
        per_norm = table[:-1, COL["norm"]]
        if len(present) == len(self.names):
            row[self.norm] = per_norm
            torch.add(table[:-1, COL["nan_count"]], table[:-1, COL["inf_count"]],
                      out=row[self.bad])
        elif present:
            per_bad = table[:-1, COL["nan_count"]] + table[:-1, COL["inf_count"]]
            idx = self._index.get(tuple(present))
            if idx is None:  # copied to the device once per pattern of missing grads
                idx = self._index.setdefault(tuple(present),
                                             torch.tensor(present, device=self.device))
            row[self.norm].index_copy_(0, idx, per_norm)
            row[self.bad].index_copy_(0, idx, per_bad)
        self._host.append(host)
        return slot

    def put(self, slot: int, step: int, scalars: dict[str, torch.Tensor]) -> bool:
        """Fills SCALARS fields of the pending row ``slot`` after it was written (a value that
        comes after the trainer's optimizer step); False when that row has been flushed."""
        if slot >= self.fill or self._host[slot].step != step:
            return False
        for k, v in scalars.items():
            self._buf[slot, SCALARS.index(k)] = v.to(self.device, torch.float64)
        return True

    def take(self) -> list[StepRecord]:
        """The filled rows on the host (one device-to-host copy); the record is then empty.
        It is emptied only once every row is on the host, so that a KeyboardInterrupt during
        the copy or the conversion leaves the rows in it for the exit flush."""
        k = self.fill
        if k == 0:
            return []
        rows = self._buf[:k].tolist()  # one copy to the host, one conversion
        kept = self._host
        out = []
        for row, host in zip(rows, kept):
            out.append(StepRecord(host.step, dict(zip(SCALARS, row[self.scalars])),
                                  row[self.norm], row[self.bad], host))
        self._host = []
        return out


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


_NANS: dict[torch.device, torch.Tensor] = {}


def not_measured(device: torch.device) -> torch.Tensor:
    """A float64 NaN 0-dim tensor on ``device`` (a field not measured this step), made once per
    device: the record only reads it, and a step should not pay a fill kernel per absent
    field (up to four of them)."""
    nan = _NANS.get(device)
    if nan is None:
        nan = torch.full((), math.nan, dtype=torch.float64, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return nan  # in a graph's private pool: not to be kept beyond it
        _NANS[device] = nan
    return nan


def loss_scale(scaler: Any, device: torch.device) -> torch.Tensor:
    """A GradScaler's scale as a 0-dim float64 tensor (read on the device: no sync); NaN
    without one."""
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        return not_measured(device)
    return scale.detach().reshape(()).to(device, torch.float64)


def optimizer_nonfinite(optimizer: Any, names_by_id: dict[int, str], grad_pass: GradPass,
                        device: torch.device) -> tuple[torch.Tensor, Any]:
    """(NaN + Inf count over the optimizer's state, its MultiTensorStats): one fused pass, by
    the Monitor's ``grad_pass``; (NaN, None) without an optimizer or state (not scanned)."""
    nan = not_measured(device)
    if optimizer is None:
        return nan, None
    names, tensors = optimizer_state_tensors(optimizer, names_by_id)
    if not tensors:
        return nan, None
    stats = grad_pass(tensors, names)
    total = stats.raw[-1].to(device)
    return total[COL["nan_count"]] + total[COL["inf_count"]], stats


def across_ranks(stats: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The record's fields that the step's collectives gave (``MultiTensorStats`` of a process
    group): the replicas that disagree, the rank where a NaN was made, the rank whose own
    gradients stood largest; {} without a process group."""
    out: dict[str, torch.Tensor] = {}
    if stats.replica_mismatch is not None:
        out["replica_mismatch"] = stats.replica_mismatch.to(device, torch.float64)
        out["replica_mismatch_mask"] = or_nan(stats.replica_mismatch_mask, device)
        if stats.replica_named is not None and stats.replica_named.numel():
            named = stats.replica_named.to(device).nan_to_num(math.inf).min()
            out["replica_mismatch_rank"] = torch.where(named.isinf(), math.nan, named)
        if stats.replica_odd is not None:
            out["replica_odd"] = stats.replica_odd.to(device, torch.float64)
    if stats.origin_count is not None and stats.origin_rank is not None:  # under DDP, FSDP2
        out["nonfinite_origin_rank"] = stats.origin_rank.to(device, torch.float64)
        out["nonfinite_origins"] = stats.origin_count.to(device, torch.float64)
        if stats.own_ratio is not None and stats.own_rank is not None:
            out["own_grad_ratio"] = stats.own_ratio.to(device, torch.float64)
            out["own_grad_rank"] = stats.own_rank.to(device, torch.float64)
    return out


def or_nan(x: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``x`` as a float64 0-dim tensor on ``device``; NaN (not measured) when None."""
    if x is None:
        return not_measured(device)
    return x.to(device, torch.float64)


def step_host(self: Any, t: int, batch: Any, sample_ids: Any,
               rates: tuple[float | None, float | None], restart: bool, unexplained: bool,
               grads_present: int, weight_table: Any, batch_key: Any) -> StepHost:
    """What the flush needs of this step on the host: references to the batch (no copy,
    kept until the flush), the RNG state its forward started from, the learning rate, the
    rate the scheduler set and the schedule's verdict (``schedule.py``), the scans'
    findings. The batch and the RNG state only with a log_dir: they are for the dumps; the
    sample ids also with ``rollback``, for its quarantine, the batch with its ``replay``."""
    if self.journal.jsonl is None:
        ids = None if self.rollback is None else map_tensors(torch.Tensor.detach,
                                                              sample_ids)
        kept = None if self.rollback is None or self.rollback.config.replay is None else \
            map_tensors(torch.Tensor.detach, batch)  # for the rollback's replay
        return StepHost(t, self.record.fill, rates[0], rates[1], restart, unexplained,
                        batch=kept, sample_ids=ids, opt_stats=self._opt_stats,
                        grads_present=grads_present, weight_table=weight_table,
                        batch_key=batch_key)
    host = StepHost(
        t, self.record.fill, rates[0], rates[1], restart, unexplained,
        map_tensors(torch.Tensor.detach, batch), map_tensors(torch.Tensor.detach, sample_ids),
        self._rng, self._opt_stats, grads_present, weight_table, batch_key)
    self._rng = rng_state()  # the state the next step's forward starts from
    return host


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
