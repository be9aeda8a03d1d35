"""What replicas under torch.distributed hold beside their gradients (docs/spec.md section 8):
their parameters, compared once per flush by a bitwise checksum per tensor, and, under DDP,
where a NaN started: a communication hook that sees each rank's own gradients before the
all-reduce. Both use ``distributed.py``'s replica sets and its fixed-size all-reduces."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from .distributed import (
    check_group,
    comm_device,
    fingerprint,
    local_view,
    odd_member,
    replica_set,
    row_fingerprint,
    verdict,
)

_NEG = float("-inf")



def param_checksums(params: list[torch.Tensor]) -> torch.Tensor:
    """A float64 integer below 2**52 per tensor, from the bits of its elements: the sum of
    their bit patterns as integers, its bits above 52 folded into the low ones, so a single
    flipped bit anywhere changes it. On the device, no sync; a DTensor's local shard."""
    out = []
    for p in params:
        x = local_view(p.detach())[0].reshape(-1)
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[x.element_size()]
        s = x.view(bits).sum(dtype=torch.int64)
        out.append((s & 0xFFFFFFFFFFFFF) ^ ((s >> 52) & 0xFFF))
    return torch.stack(out).double() if out else torch.zeros(0, dtype=torch.float64)


def replica_key(names: list[str], params: list[torch.Tensor]) -> tuple[str, float] | None:
    """(the kind of replica sets, this rank's key in them) for comparing ``params`` across
    replicas: plain tensors by their names, shapes and dtypes (DDP: the gradients' sets);
    DTensor shards (FSDP2, HSDP) also by their coordinates on the mesh dimensions that shard
    them, so that the ranks holding the same shard are a set (HSDP's replicate dimension;
    none under FSDP2 alone). None for a mix of the two."""
    views = [local_view(p.detach()) for p in params]
    if all(owned is None for _, owned in views):
        return "plain", fingerprint(names, params)
    if not all(owned is not None for _, owned in views):
        return None
    from torch.distributed.tensor import Replicate  # DTensors only reach here

    def sharded(p: Any) -> str:  # the coordinates on the mesh dimensions that shard it
        return ",".join(str(c) for c, pl in zip(p.device_mesh.get_coordinate() or (),
                                                 p.placements) if not isinstance(pl, Replicate))

    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{sharded(p)}"
                    for n, p in zip(names, params))
    return "shards", float(zlib.crc32(text.encode()))


def compare_replicas(checksums: torch.Tensor, process_group: Any, replica_group: Any,
                     key: float, kind: str = "plain") -> dict[str, torch.Tensor | None]:
    """Whether the replicas of each set hold the same tensors (``param_checksums`` of the same
    parameters on every member), by two all-reduces: a MAX of each set's fingerprint (high,
    -low) and of each tensor's checksum in its set's row; a SUM of each set's sides
    (``verdict``). Returns ``replica_mismatch``, ``replica_mismatch_mask``, ``replica_named``,
    ``replica_odd`` as ``global_table``'s check, and ``tensors``: per tensor whether its
    replicas differ in any set. Per tensor only where every rank holds as many (one set of
    every rank, or DTensor shards: ``kind`` "shards"); else ``tensors`` is None."""
    check_group(process_group)
    slot, _, sizes = replica_set(process_group, replica_group, key, kind)
    dev, k = checksums.device, len(sizes)
    if not k:  # no two ranks hold the same tensors (the same on every rank: no collective)
        return {**verdict(torch.zeros(0, 2), torch.zeros(0, 4), sizes, dev), "tensors": None,
                "replica_odd": torch.zeros((), dtype=torch.float64, device=dev)}
    comm = comm_device(process_group, dev)
    alike = kind == "shards" or (k == 1 and sizes[0] == dist.get_world_size(process_group))
    n = checksums.numel() if alike else 0
    top = torch.full((2 * k + 2 * n * k,), _NEG, dtype=torch.float64, device=dev)
    h = row_fingerprint(checksums)
    if slot is not None:
        top[2 * slot:2 * slot + 2] = torch.stack([h, -h])
        if n:
            at = 2 * k + 2 * n * slot
            top[at:at + 2 * n] = torch.cat([checksums, -checksums])
    top = top.to(comm)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=process_group)
    top = top.to(dev)
    add = torch.zeros(4 * k, dtype=torch.float64, device=dev)
    if slot is not None:
        on = torch.stack([h == top[2 * slot], h == -top[2 * slot + 1]]).double()
        add[4 * slot:4 * slot + 4] = torch.cat([on, on * float(dist.get_rank(process_group))])
    add = add.to(comm)
    dist.all_reduce(add, op=dist.ReduceOp.SUM, group=process_group)
    sides = add.to(dev).view(k, 4)
    out: dict[str, torch.Tensor | None] = dict(verdict(top[:2 * k].view(k, 2), sides, sizes,
                                                        dev))
    out["replica_odd"] = torch.zeros((), dtype=torch.float64, device=dev) if slot is None else \
        odd_member(h, top[2 * slot], -top[2 * slot + 1], sides[slot, 0], sides[slot, 1])
    rows = top[2 * k:].view(k, 2, n) if n and k else None
    out["tensors"] = (rows[:, 0] != -rows[:, 1]).any(0) if rows is not None else None
    return out


class NonFiniteOrigin:
    """Notes what this rank's own gradients were before the data-parallel reduction averages
    them into every rank's: whether they held NaN/Inf, and their norm. Under DDP a
    communication hook (then each bucket all-reduced as DDP's default hook does), under
    FSDP2/HSDP a reduce-scatter that looks at its input (then reduce-scatters as FSDP2's
    default does). ``take()`` gives what the reductions since the last take saw, as a float64
    tensor on the device (no sync; None when none ran): [NaN/Inf seen (0 or 1), the sum of
    the squares of the gradients], and starts again. The Monitor passes it to the step's
    collectives, which name the lowest rank that saw NaN/Inf and the rank whose own gradients
    stand far above the others' (``distributed.global_table``: silent data corruption in that
    rank's arithmetic, averaged into every replica by the reduction)."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self.flag: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None

    def note(self, buffer: torch.Tensor) -> None:
        """One bucket's flat gradients, before the reduction: NaN/Inf in any of them, and the
        square of their norm, added up in float64. Two reductions in the bucket's own dtype,
        no copy; where the sum of squares overflows that dtype (a corrupted element of 1e36),
        the largest element stands for the norm: a lower bound, far above any healthy rank's."""
        amax = torch.linalg.vector_norm(buffer, float("inf"))
        bad = ~torch.isfinite(amax)
        norm = torch.linalg.vector_norm(buffer, 2)
        norm = torch.where(torch.isinf(norm) & ~bad, amax, norm).double()
        self.flag = bad if self.flag is None else self.flag | bad
        sq = norm.square()
        self.squares = sq if self.squares is None else self.squares + sq

    def take(self) -> torch.Tensor | None:
        flag, squares, self.flag, self.squares = self.flag, self.squares, None, None
        if flag is None or squares is None:
            return None
        if flag.is_cuda:
            # FSDP2 notes on its reduce-scatter stream; what it saw is read on this one
            for t in (flag, squares):
                t.record_stream(torch.cuda.current_stream(t.device))
        return torch.stack([flag.double(), squares])

    @classmethod
    def attach(cls, model: Any, process_group: Any) -> NonFiniteOrigin | None:
        """Watching ``model``'s reduction: a DistributedDataParallel with no communication
        hook of its own, or a model whose FSDP2 modules reduce-scatter with FSDP2's default
        (each one that does gets the watching reduce-scatter; a module with a custom one keeps
        it). None where neither holds."""
        origin = cls(process_group)
        ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
        if ddp is not None and isinstance(model, ddp):
            return origin if _hook_ddp(model, origin) else None
        return origin if _watch_fsdp2(model, origin) else None


def _hook_ddp(model: Any, origin: NonFiniteOrigin) -> bool:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (  # DDP only
        allreduce_hook,
    )

    def fasthealth_nonfinite_origin(state, bucket):
        # unannotated: DDP takes a hook whose bucket is annotated dist.GradBucket or not
        # at all, and this module's annotations are strings
        origin.note(bucket.buffer())
        return allreduce_hook(state, bucket)

    try:
        # DDP's own group (its data-parallel group), whatever the Monitor's
        model.register_comm_hook(model.process_group, fasthealth_nonfinite_origin)
    except RuntimeError:  # the model has a communication hook already: not replaced
        return False
    return True


def _watch_fsdp2(model: Any, origin: NonFiniteOrigin) -> bool:
    """FSDP2's reduce-scatter input is this rank's own unsharded gradients (accumulated over
    the micro-batches without sync): each module's default reduce-scatter is swapped for one
    that notes it first. The watching one is a ``DefaultReduceScatter``, so FSDP2's own
    switches (symmetric memory, the process group's allocator) still replace it."""
    try:  # FSDP2's comm classes and the default's type live in private modules
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:  # a torch without FSDP2's custom comms
        return False

    class _Watching(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: Any, op: Any, async_op: bool = False) -> Any:
            origin.note(input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    watched = False
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
        if not groups or any(type(getattr(g, "_reduce_scatter_comm", None))
                             is not DefaultReduceScatter for g in groups):
            continue  # a custom reduce-scatter (the user's), or FSDP2's layout changed
        try:
            module.set_custom_reduce_scatter(_Watching())
        except ValueError:  # several parameter groups (a per-parameter mesh)
            continue
        watched = True
    return watched
