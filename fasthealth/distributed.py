"""Whole-model statistics under torch.distributed (docs/spec.md section 8): one collective per
call, right for every layout.

Each rank reduces its local data with the fused kernel, as always, then contributes one row to
a single all-gather: the merge of its DTensor shards it owns, the merge of its plain tensors, and
a few flags. Every rank then merges the gathered rows exactly (counts add, extremes combine,
moments merge with Chan's formula) into the same total, on the device, with no host sync.

- DTensor gradients (FSDP2, HSDP): a shard is owned by the rank whose coordinate is 0 on every
  mesh dimension where the placement is ``Replicate``: each element is counted once.
- Plain tensors: ranks form *replica sets*, whose plain tensors are copies of one another (DDP's
  gradients after the all-reduce); each set counts once, the sets add up (pipeline stages, or
  hand-written tensor parallelism, are sets of one rank each). The sets come from
  ``replica_group`` (each rank's group of replicas, e.g. its data-parallel group), or ``False``
  (no two ranks hold the same tensors), or, by default, from a fingerprint of each rank's tensor
  names, shapes and dtypes: ranks with the same fingerprint are replicas (hand-written tensor
  parallelism with identical names and shapes needs ``replica_group``).
- Replicas that disagree (silent data corruption, desynchronised ranks) are found by comparing
  their rows: ``replica_mismatch`` counts the ranks that differ from the rest of their set (every
  member, when a set of two disagrees) and ``replica_mismatch_mask`` has bit r set for such a
  rank r < 52. The set's row in the total is its member with the most NaN/Inf, so a bad
  replica's NaN/Inf are counted.
- The non-finite flag ORs every rank's local data and ``extra_bad`` (the Monitor's loss check).
- ``extra_loss`` (the Monitor's loss, under ``on_spike="skip"``) rides in the same row: every
  rank gets the mean over ranks, so that every rank's skip rule sees the same numbers.
- A rank whose input is bad still joins the collective, with an error flag, and raises after it:
  no rank waits for another's error; the others get a total of NaN with ``all_finite`` False.

Per-tensor statistics stay those of the local shards (with the global parameter names).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from .ops.inputs import dtensor_cls
from .ops.layout import COL, TABLE_WIDTH
from .ops.reference import merge_rows

W = TABLE_WIDTH
# the gathered row: owned DTensor shards' merge, plain tensors' merge, then these flags and
# the rank's loss
F_BAD, F_SET, F_ERROR, F_LOSS = 2 * W, 2 * W + 1, 2 * W + 2, 2 * W + 3
ROW = 2 * W + 4
MASK_RANKS = 52  # ranks a float64 bit mask holds exactly


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, bool | None]:
    """(the local data of ``t``, whether this rank owns it for the totals: None for a plain
    tensor, whose count depends on the replica sets)."""
    dtensor = dtensor_cls()
    if dtensor is not None and isinstance(t, dtensor):
        from torch.distributed.tensor import Replicate  # only DTensors reach here (dtensor_cls)

        coords = t.device_mesh.get_coordinate()
        if coords is None:  # this rank is not in the mesh
            return t.to_local(), False
        owned = all(c == 0 for c, p in zip(coords, t.placements) if isinstance(p, Replicate))
        return t.to_local(), owned
    return t, None


def fingerprint(names: list[str], tensors: list[torch.Tensor]) -> float:
    """A CRC32 of the plain tensors' names, shapes and dtypes, the same on every rank that holds
    the same tensors (Python's own hash differs from process to process)."""
    text = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in zip(names, tensors))
    return float(zlib.crc32(text.encode()))


def _replica_set(replica_group: Any, plain_fp: float, process_group: Any) -> float:
    """This rank's replica-set id: the lowest global rank of its replica group, its own rank
    (``False``: no replicas), or the fingerprint (default)."""
    if replica_group is None:
        return plain_fp
    if replica_group is False:
        return float(dist.get_rank())
    if not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError("fasthealth: replica_group must be a ProcessGroup, False or None, got "
                        f"{type(replica_group).__name__}")
    return float(min(dist.get_process_group_ranks(replica_group)))


def _check_group(process_group: Any) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("fasthealth: process_group= needs torch.distributed to be initialized "
                         "(init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"fasthealth: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD), got {type(process_group).__name__}")


def global_table(grads: list[torch.Tensor], names: list[str], backend: str | None,
                 rng: tuple[float, float], process_group: Any,
                 extra_bad: torch.Tensor | None = None, replica_group: Any = None,
                 extra_loss: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the local per-tensor table of ``grads`` with the model-wide total as its last row, the
    replica check: ``replica_mismatch`` and ``replica_mismatch_mask``, and ``loss_mean``, the
    mean of every rank's ``extra_loss``: 0-dim tensors)."""
    _check_group(process_group)
    views = [local_view(g) for g in grads]
    local = [v for v, _ in views]
    owned = [o for _, o in views]
    error: Exception | None = None
    table: torch.Tensor | None = None
    try:
        table = ops.table(local, names, backend, rng) if local else ops.empty_table()
    except (TypeError, ValueError, RuntimeError) as exc:  # joins the collective, raises after
        error = exc
    plain = [i for i, o in enumerate(owned) if o is None]
    fp = fingerprint([names[i] for i in plain], [local[i] for i in plain])
    row = _local_row(table, owned, extra_bad, _replica_set(replica_group, fp, process_group),
                     error is not None, extra_loss)
    gathered = _all_gather(row, process_group)
    if error is not None:
        raise error
    assert table is not None  # set when there was no error
    total, check = _merge_gathered(gathered)
    return torch.cat([table[:-1], total[None].to(table.device)]), check


def _local_row(table: torch.Tensor | None, owned: list[bool | None], extra_bad: Any,
               replica_set: float, error: bool, loss: Any = None) -> torch.Tensor:
    """[owned DTensor shards' row | plain tensors' row | bad, replica set, error, loss]."""
    empty = merge_rows(torch.zeros(0, W, dtype=torch.float64))
    if table is None:  # this rank's input was bad: a NaN row, flagged
        nan = torch.full((W,), float("nan"), dtype=torch.float64)
        return torch.cat([nan, nan, torch.tensor([1.0, replica_set, 1.0, float("nan")])])
    dev = table.device
    empty = empty.to(dev)
    n = table.shape[0] - 1

    def merged(mask: list[bool]) -> torch.Tensor:
        if not any(mask):
            return empty
        if all(mask):
            return table[-1] if n == len(mask) else merge_rows(table[:n])
        m = torch.tensor(mask, device=dev)
        return merge_rows(torch.where(m[:, None], table[:n], empty))

    dt = merged([o is True for o in owned])
    pl = merged([o is None for o in owned])
    bad = table[-1, COL["all_finite"]] == 0
    if extra_bad is not None:
        bad = bad | extra_bad.to(dev)
    nan = torch.full((), float("nan"), dtype=torch.float64, device=dev)
    flags = torch.stack([bad.double(), torch.full((), replica_set, dtype=torch.float64,
                                                  device=dev),
                         torch.zeros((), dtype=torch.float64, device=dev),
                         nan if loss is None else loss.reshape(()).to(dev, torch.float64)])
    return torch.cat([dt.double(), pl.double(), flags])


def _all_gather(row: torch.Tensor, process_group: Any) -> torch.Tensor:
    comm_dev = row.device if dist.get_backend(process_group) != "gloo" else torch.device("cpu")
    world = dist.get_world_size(process_group)
    flat = torch.empty(world * ROW, dtype=torch.float64, device=comm_dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, row.to(comm_dev), group=process_group)
    return flat.view(world, ROW).to(row.device)


def _merge_gathered(g: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The total row and the replica check from the gathered rows, on the device."""
    world, dev = g.shape[0], g.device
    plain, sets = g[:, W:2 * W], g[:, F_SET]
    same = sets[:, None] == sets[None, :]
    score = plain[:, COL["nan_count"]] + plain[:, COL["inf_count"]]
    idx = torch.arange(world, device=dev)
    better = (score[None, :] > score[:, None]) | (
        (score[None, :] == score[:, None]) & (idx[None, :] < idx[:, None]))
    rep = ~(same & better).any(1)  # the member of each set with the most NaN/Inf
    empty = merge_rows(torch.zeros(0, W, dtype=torch.float64, device=dev))
    rows = torch.cat([g[:, :W], torch.where(rep[:, None], plain, empty)])
    total = merge_rows(rows)
    failed = (g[:, F_ERROR] > 0).any()  # a rank's input was bad: no total to give
    total = torch.where(failed, torch.full_like(total, float("nan")), total)
    bad = (g[:, F_BAD] > 0).any() | failed
    total[COL["all_finite"]] = torch.where(bad, 0.0, total[COL["all_finite"]])
    equal = (plain[:, None, :] == plain[None, :, :]) | (
        plain[:, None, :].isnan() & plain[None, :, :].isnan())
    agree = same & equal.all(-1)
    n_agree = agree.sum(1)  # members of its set equal to it (itself included)
    set_size = same.sum(1)
    best = torch.where(same, n_agree[None, :], 0).amax(1)  # the set's largest agreeing group
    disagree = n_agree < set_size
    mismatch = disagree & ((n_agree < best) | (n_agree == best) & (best * 2 <= set_size))
    weights = torch.where(idx < MASK_RANKS, 2.0 ** idx.clamp(max=MASK_RANKS - 1).double(), 0.0)
    check = {"replica_mismatch": mismatch.sum().double(),
             "replica_mismatch_mask": (mismatch.double() * weights).sum(),
             "loss_mean": g[:, F_LOSS].mean()}
    return total, check
