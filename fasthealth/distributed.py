"""Whole-model statistics under torch.distributed (SPEC section 8): one collective per call.

Each rank reduces its local data with the fused kernel, as always. Then every rank contributes
one row: the merge of the local tensors it *owns* (each element of the model is owned by
exactly one rank), plus a flag that is set when anything local is non-finite. A single
all-gather (``all_gather_single``, formerly ``all_gather_into_tensor``) of those rows
(TABLE_WIDTH + 1 float64 values per rank) lets every
rank merge them exactly (counts add, extremes combine, moments merge with Chan's formula) into
the same total, and OR the flags, so a NaN on any rank is seen by all of them and all make the
same skip decision.

Ownership:
- a DTensor gradient: its local shard is owned on the rank whose coordinate is 0 on every mesh
  dimension where the placement is ``Replicate`` (FSDP2's ``Shard`` shards are each owned once;
  HSDP's replicas are counted once);
- a plain tensor (DDP, where gradients are replicated after the all-reduce): owned by the
  group's rank 0.

Per-tensor statistics stay those of the local shards (with the global parameter names).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import ops
from .ops.inputs import dtensor_cls
from .ops.layout import COL, TABLE_WIDTH
from .ops.reference import merge_rows


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the local data of ``t``, whether this rank owns it for the totals)."""
    dtensor = dtensor_cls()
    if dtensor is not None and isinstance(t, dtensor):
        from torch.distributed.tensor import Replicate

        mesh = t.device_mesh
        coords = mesh.get_coordinate()
        if coords is None:  # this rank is not in the mesh
            return t.to_local(), False
        owned = all(c == 0 for c, p in zip(coords, t.placements) if isinstance(p, Replicate))
        return t.to_local(), owned
    return t, None  # type: ignore[return-value]  # decided by the caller (group rank 0)


def global_table(grads: list[torch.Tensor], names: list[str], backend: str | None,
                 rng: tuple[float, float], process_group: Any,
                 extra_bad: torch.Tensor | None = None) -> torch.Tensor:
    """The local per-tensor table of ``grads`` with the model-wide total as its last row."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("fasthealth: process_group= needs torch.distributed to be initialized "
                         "(init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"fasthealth: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD), got {type(process_group).__name__}")
    rank0 = dist.get_rank(process_group) == 0
    local, owned = [], []
    for g in grads:
        data, own = local_view(g)
        local.append(data)
        owned.append(rank0 if own is None else own)
    table = ops.table(local, names, backend, rng) if local else ops.empty_table()
    total = global_total(table, owned, process_group, extra_bad)
    return torch.cat([table[:-1], total[None].to(table.device)])


def global_total(table: torch.Tensor, owned: list[bool], process_group: Any,
                 extra_bad: torch.Tensor | None = None) -> torch.Tensor:
    """The model-wide total row from each rank's local per-tensor ``table`` ([N + 1, W]).

    One all_gather of one row per rank. ``extra_bad`` (0-dim bool) joins the non-finite flag
    (the Monitor passes its loss check). Returns a [W] row whose ``all_finite`` is False when
    anything on any rank was non-finite.
    """
    n = table.shape[0] - 1
    dev = table.device
    if all(owned):
        mine = table[-1]
    elif not any(owned):
        mine = merge_rows(table[:0])
    else:
        mask = torch.tensor(owned, device=dev)
        empty = merge_rows(table[:0])
        mine = merge_rows(torch.where(mask[:, None], table[:n], empty))
    bad = table[-1, COL["all_finite"]] == 0
    if extra_bad is not None:
        bad = bad | extra_bad.to(dev)
    row = torch.cat([mine.to(torch.float64), bad.to(torch.float64).reshape(1)])
    backend = dist.get_backend(process_group)
    comm_dev = dev if backend != "gloo" else torch.device("cpu")
    row = row.to(comm_dev)
    world = dist.get_world_size(process_group)
    flat = torch.empty(world * (TABLE_WIDTH + 1), dtype=torch.float64, device=comm_dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, row, group=process_group)
    gathered = flat.view(world, TABLE_WIDTH + 1).to(dev)
    total = merge_rows(gathered[:, :TABLE_WIDTH])
    any_bad = gathered[:, TABLE_WIDTH].amax() > 0
    total[COL["all_finite"]] = torch.where(any_bad, 0.0, total[COL["all_finite"]])
    return total
