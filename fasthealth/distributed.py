"""Whole-model statistics under torch.distributed (docs/spec.md section 8): two fixed-size
all-reduces per call, whatever the world size, right for every layout.

Each rank reduces its local data with the fused kernel, as always, then joins two all-reduces
over the process group, on the device, with no host sync:

1. a MAX of a few numbers: the finite extremes and the largest norm (a shift and a scale for
   step 2), whether any rank's data or ``extra_bad`` (the Monitor's loss check) is non-finite,
   whether any rank's input was refused, and, for each replica set, the largest and the
   smallest fingerprint of its members' plain rows (equal when the replicas agree);
2. a SUM of the counts and of the shifted, scaled moments (merged exactly as Chan's formula
   merges groups), the loss (``extra_loss``: every rank gets the mean over ranks, so that every
   rank's skip rule sees the same numbers), and, for each replica set, how many members hold
   its largest and its smallest fingerprint and the sums of their ranks: where one member
   disagrees, that sum is its rank.

The bytes sent per rank are the same at 8 ranks and at 100,000; the replica sets add four
numbers each (one set under DDP).

- DTensor gradients (FSDP2, HSDP): a shard is owned by the rank whose coordinate is 0 on every
  mesh dimension where the placement is ``Replicate``: each element is counted once.
- Plain tensors: ranks form *replica sets*, whose plain tensors are copies of one another (DDP's
  gradients after the all-reduce); each set counts once, through its lowest rank, the sets add
  up (pipeline stages, or hand-written tensor parallelism, are sets of one rank each). The sets
  come from ``replica_group`` (each rank's group of replicas, e.g. its data-parallel group), or
  ``False`` (no two ranks hold the same tensors), or, by default, from a fingerprint of each
  rank's tensor names, shapes and dtypes: ranks with the same fingerprint are replicas
  (hand-written tensor parallelism with identical names and shapes needs ``replica_group``).
  The sets are found once per process group, at its first call (one all-gather of one number
  per rank); a rank whose tensors change later keeps its set, and a rank whose fingerprint was
  not seen then counts as a set of its own.
- Replicas that disagree (silent data corruption, desynchronised ranks) are found by comparing
  a bitwise fingerprint of their rows: ``replica_mismatch`` counts the ranks that differ from
  the rest of their set (the smaller side; both sides when they are as many, so every member
  of a set of two; every member not on either side when a set holds three or more versions),
  and ``replica_named`` names those on a side of one (the usual case of one bad rank), at any
  world size. Several ranks that differ alike are named by one extra step, only when asked
  and needed: each rank knows whether it is one of them (``replica_odd``), and
  ``flagged_ranks`` all-gathers that flag, a byte per rank. Every rank's extremes and NaN/Inf
  flag count, so a bad replica's NaN is seen.
- A rank whose input is bad still joins both collectives, with an error flag, and raises after
  them: no rank waits for another's error; the others get a total of NaN with ``all_finite``
  False.

Per-tensor statistics stay those of the local shards (with the global parameter names).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from .ops.inputs import dtensor_cls
from .ops.layout import COL, TABLE_WIDTH
from .ops.reference import finalize, merge_rows

W = TABLE_WIDTH
MASK_RANKS = 52  # ranks a float64 bit mask holds exactly
# the MAX vector's head: finite max, -finite min, largest finite norm, non-finite, refused
# and the lowest (as -rank) and highest rank whose own gradients held NaN/Inf before DDP's
# all-reduce (``replicas.NonFiniteOrigin``)
# and whether any rank's ``extra_skip`` is set (a batch a rollback quarantined), and the
# largest norm of a rank's own gradients before that reduction
(M_FMAX, M_FMIN, M_SCALE, M_BAD, M_ERROR, M_ORIGIN_LOW, M_ORIGIN_HIGH, M_SKIP, M_OWN,
 M_HEAD) = range(10)
# the SUM vector's head: the counts, then the moments and the loss
SUM_COUNTS = ("numel", "nan_count", "posinf_count", "neginf_count", "zero_count",
              "overflow_count", "underflow_count")
# ... and of the ranks' own gradient norms: the sum of those below the largest, how many
# ranks measured one, how many stand at the largest and the sum of those ranks
(S_NF, S_MEAN, S_M2, S_NORM, S_LOSS, S_LOSSES, S_ORIGINS, S_OWN, S_OWNS, S_TOP,
 S_TOP_RANK) = range(len(SUM_COUNTS), len(SUM_COUNTS) + 11)
S_HEAD = S_TOP_RANK + 1
_LOW, _MID = 2**26 - 1, 2**26  # the fingerprint's pieces of a float64's bits
_NEG = float("-inf")
RANKS = 2.0**20  # the representative's key: NaN/Inf count * RANKS + (RANKS - 1 - rank)


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


@dataclass(frozen=True)
class _Sets:
    """A process group's replica sets, found at its first call: each key's lowest rank, the
    index of each set of two or more ranks (its slot in the collectives), their sizes."""

    first: dict[float, int]
    slot: dict[float, int]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, keys: list[float]) -> _Sets:
        first: dict[float, int] = {}
        size: dict[float, int] = {}
        for r, k in enumerate(keys):
            first.setdefault(k, r)
            size[k] = size.get(k, 0) + 1
        shared = sorted((k for k in first if size[k] > 1), key=first.__getitem__)
        return cls(first, {k: i for i, k in enumerate(shared)}, tuple(size[k] for k in shared))


# (id of the process group, id of the replica group or None) -> (the group, its sets): kept
# for the life of the process, one entry per group a caller checks with
_SETS: dict[tuple[int, int | None, str], tuple[Any, _Sets]] = {}


def replica_set(process_group: Any, replica_group: Any, plain_fp: float, kind: str = "plain"
                ) -> tuple[int | None, bool, tuple[int, ...]]:
    """(this rank's set's slot, or None outside a set of two or more; whether it counts its
    set's plain tensors: its lowest rank; the sizes of the sets with a slot). The sets are
    found at the process group's first call, one all-gather of one number per rank: by the
    plain tensors' fingerprint (``replica_group=None``), or by each rank's replica group.
    ``kind`` keeps sets found from other keys apart (``replicas.py``'s DTensor shards)."""
    if replica_group is False:
        return None, True, ()
    if replica_group is not None and not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError("fasthealth: replica_group must be a ProcessGroup, False or None, got "
                        f"{type(replica_group).__name__}")
    key = plain_fp if replica_group is None else float(
        min(dist.get_process_group_ranks(replica_group)))
    where = (id(process_group), None if replica_group is None else id(replica_group), kind)
    entry = _SETS.get(where)
    if entry is None or entry[0] is not process_group:  # an id reused by a new group
        entry = (process_group, _Sets.of(_gather_keys(key, process_group)))
        _SETS[where] = entry
    sets = entry[1]
    if key not in sets.first:  # tensors not seen at the first call: a set of its own
        return None, True, sets.sizes
    return sets.slot.get(key), sets.first[key] == dist.get_rank(process_group), sets.sizes


def _gather_keys(key: float, process_group: Any) -> list[float]:
    world = dist.get_world_size(process_group)
    dev = comm_device(process_group, _default_device(process_group))
    out = torch.empty(world, dtype=torch.float64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, torch.tensor([key], dtype=torch.float64, device=dev), group=process_group)
    return out.tolist()


def _default_device(process_group: Any) -> torch.device:
    if dist.get_backend(process_group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_device(process_group: Any, device: torch.device) -> torch.device:
    """Where a collective of ``process_group`` takes its tensors: the CPU for Gloo, else
    ``device``."""
    return device if dist.get_backend(process_group) != "gloo" else torch.device("cpu")


def check_group(process_group: Any) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("fasthealth: process_group= needs torch.distributed to be initialized "
                         "(init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"fasthealth: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD), got {type(process_group).__name__}")


def row_fingerprint(row: torch.Tensor) -> torch.Tensor:
    """A float64 integer below 2**52 from the bits of a float64 row: a single flipped bit of
    any field changes it (each field's bits in three pieces, each times an odd weight of its
    own, summed without overflow)."""
    bits = row.double().contiguous().view(torch.int64)
    pieces = torch.stack([bits & _LOW, (bits >> 26) & _LOW, (bits >> 52) & 0xFFF])
    n = row.numel()
    weights = torch.arange(1, 2 * 3 * n, 2, dtype=torch.int64, device=row.device).view(3, n)
    return (pieces * weights).sum().double()


def global_table(grads: list[torch.Tensor], names: list[str], backend: str | None,
                 rng: tuple[float, float], process_group: Any,
                 extra_bad: torch.Tensor | None = None, replica_group: Any = None,
                 extra_loss: torch.Tensor | None = None, origin: torch.Tensor | None = None,
                 extra_skip: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the local per-tensor table of ``grads`` with the model-wide total as its last row, the
    replica check: ``replica_mismatch``, ``replica_mismatch_mask``, ``replica_named``,
    ``loss_mean``, the mean of every rank's ``extra_loss``, and ``origin_rank`` and
    ``origin_count``: the lowest rank whose ``origin`` flag was set (its own gradients held
    NaN/Inf before the data-parallel reduction; NaN for none) and how many were,
    ``own_ratio`` and ``own_rank``: the largest norm of a rank's own gradients before that
    reduction over the mean of the other ranks', and that rank (NaN where fewer than two
    ranks measured one, or several share the largest), ``skip_any``: whether any rank's
    ``extra_skip`` is set, and ``replica_odd``: whether this rank is one that
    ``replica_mismatch`` counts, for ``flagged_ranks``). ``origin``: what
    ``replicas.NonFiniteOrigin.take`` gives (its NaN/Inf flag, its sum of squares), or a
    0-dim flag alone."""
    check_group(process_group)
    views = [local_view(g) for g in grads]
    local = [v for v, _ in views]
    owned = [o for _, o in views]
    error: Exception | None = None
    table: torch.Tensor | None = None
    try:
        table = ops.table(local, names, backend, rng) if local else ops.empty_table()
    except (TypeError, ValueError, RuntimeError) as exc:  # joins the collectives, raises after
        error = exc
    plain = [i for i, o in enumerate(owned) if o is None]
    fp = fingerprint([names[i] for i in plain], [local[i] for i in plain])
    slot, own, sizes = replica_set(process_group, replica_group, fp)
    dev = table.device if table is not None else _default_device(process_group)
    part = _Part(table, owned, extra_bad, slot, own, len(sizes),
                 float(dist.get_rank(process_group)), dev, origin, extra_skip)
    comm = comm_device(process_group, dev)
    # 1. MAX: extremes, the norms' scale, the flags, each set's fingerprints and representative
    top = part.maxima().to(comm)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=process_group)
    top = top.to(dev)
    # 2. SUM: counts, moments about the finite values' midrange and norms over the largest
    # one (exact merges, no overflow), the loss, each set's sides
    fmax, fmin = top[M_FMAX], -top[M_FMIN]
    shift = torch.where(torch.isfinite(fmax) & torch.isfinite(fmin), fmin / 2 + fmax / 2, 0.0)
    scale = torch.where(top[M_SCALE] > 0, top[M_SCALE], 1.0)
    add = part.sums(top, shift, scale, extra_loss).to(comm)
    dist.all_reduce(add, op=dist.ReduceOp.SUM, group=process_group)
    add = add.to(dev)
    if error is not None:
        raise error
    assert table is not None  # set when there was no error
    total = _total(top, add, shift, scale)
    check = _replica_check(top, add, sizes)
    check["loss_mean"] = add[S_LOSS] / add[S_LOSSES]
    check["origin_rank"] = torch.where(torch.isinf(top[M_ORIGIN_LOW]), float("nan"),
                                       -top[M_ORIGIN_LOW])
    check["origin_count"] = add[S_ORIGINS]
    check["own_ratio"], check["own_rank"] = _own(top, add)
    check["skip_any"] = top[M_SKIP] > 0
    check["replica_odd"] = part.odd(top, add)
    return torch.cat([table[:-1], total[None]]), check


def _own(top: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the largest of the ranks' own gradient norms over the mean of the others', the rank
    that holds it), from the reductions; NaN where fewer than two ranks measured a finite
    norm, the others' mean is 0, or several ranks share the largest (no rank named)."""
    below, largest = add[S_OWNS] - add[S_TOP], top[M_OWN]
    others = add[S_OWN] / below.clamp(min=1)
    ratio = torch.where((below >= 1) & (others > 0) & torch.isfinite(largest),
                        largest / others.clamp(min=torch.finfo(torch.float64).tiny), math.nan)
    rank = torch.where(add[S_TOP] == 1, add[S_TOP_RANK], math.nan)
    return ratio, torch.where(torch.isnan(ratio), math.nan, rank)


class _Part:
    """This rank's part of the two reductions: its owned DTensor shards' and its plain
    tensors' merged rows (NaN rows, flagged, when its input was refused: ``table`` None)."""

    def __init__(self, table: torch.Tensor | None, owned: list[bool | None], extra_bad: Any,
                 slot: int | None, own: bool, sets: int, rank: float, dev: torch.device,
                 origin: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        self.table, self.slot, self.own, self.sets, self.rank, self.dev = (
            table, slot, own, sets, rank, dev)
        seen = None if origin is None else origin.to(dev, torch.float64).reshape(-1)
        self.origin = None if seen is None else seen[0] > 0
        # this rank's own gradient norm before the reduction (NaN/Inf: not compared)
        self.own_norm = None if seen is None or seen.numel() < 2 else seen[1].sqrt()
        self.skip = None if skip is None else skip.to(dev).reshape(())
        if table is None:
            return
        dt, self.pl = _parts(table, owned)
        self.every = torch.stack([dt, self.pl])
        self.bad = table[-1, COL["all_finite"]] == 0
        if extra_bad is not None:
            self.bad = self.bad | extra_bad.to(dev)
        if slot is not None:
            self.h = row_fingerprint(self.pl)
            # the set's representative: the member with the most NaN/Inf, lowest rank on ties
            self.key = (self.pl[COL["nan_count"]] + self.pl[COL["inf_count"]]) * RANKS + (
                RANKS - 1 - rank)

    def odd(self, top: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """Whether this rank is one ``verdict`` counts as differing from its set (0 or 1)."""
        if self.table is None or self.slot is None:
            return torch.zeros((), dtype=torch.float64, device=self.dev)
        at, base = M_HEAD + 3 * self.slot, S_HEAD + 4 * self.slot
        return odd_member(self.h, top[at], -top[at + 1], add[base], add[base + 1])

    def maxima(self) -> torch.Tensor:
        top = torch.full((M_HEAD + 3 * self.sets,), _NEG, dtype=torch.float64, device=self.dev)
        if self.origin is not None:
            top[M_ORIGIN_LOW:M_ORIGIN_HIGH + 1] = torch.stack([
                torch.where(self.origin, -self.rank, _NEG),
                torch.where(self.origin, self.rank, _NEG)]).double()
        if self.skip is not None:
            top[M_SKIP] = self.skip.double()
        if self.own_norm is not None:
            top[M_OWN] = torch.where(torch.isfinite(self.own_norm), self.own_norm, _NEG)
        if self.table is None:
            top[M_BAD] = top[M_ERROR] = 1.0
            return top
        e = self.every
        has = e[:, COL["numel"]] - e[:, COL["nan_count"]] - e[:, COL["inf_count"]] > 0
        top[:M_ORIGIN_LOW] = torch.stack([
            torch.where(has, e[:, COL["finite_max"]], _NEG).max(),
            torch.where(has, -e[:, COL["finite_min"]], _NEG).max(),
            e[:, COL["finite_norm"]].max(), self.bad.double(),
            torch.zeros((), dtype=torch.float64, device=self.dev)])
        if self.slot is not None:
            at = M_HEAD + 3 * self.slot
            top[at:at + 3] = torch.stack([self.h, -self.h, self.key])
        return top

    def sums(self, top: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
             loss: Any) -> torch.Tensor:
        add = torch.zeros(S_HEAD + 4 * self.sets, dtype=torch.float64, device=self.dev)
        if loss is not None:
            add[S_LOSS:S_LOSSES + 1] = torch.stack([
                loss.reshape(()).to(self.dev, torch.float64),
                torch.ones((), dtype=torch.float64, device=self.dev)])
        if self.origin is not None:
            add[S_ORIGINS] = self.origin.double()
        if self.own_norm is not None:
            mine = self.own_norm
            fine = torch.isfinite(mine)
            top_here = (fine & (mine == top[M_OWN])).double()
            add[S_OWN:S_TOP_RANK + 1] = torch.stack([
                torch.where(fine & (top_here == 0), mine, 0.0), fine.double(), top_here,
                top_here * self.rank])  # the others' sum without the largest: no cancellation
        if self.table is None:
            return add
        weight = torch.ones(2, dtype=torch.float64, device=self.dev)  # the plain row's: 1, 0
        if self.slot is not None:
            at = M_HEAD + 3 * self.slot
            weight[1] = (top[at + 2] == self.key).double()
            on = torch.stack([self.h == top[at], self.h == -top[at + 1]]).double()
            base = S_HEAD + 4 * self.slot
            add[base:base + 4] = torch.cat([on, on * self.rank])
        elif not self.own:
            weight[1] = 0.0
        _sums(add, self.every, weight, shift, scale)
        return add


def _sums(add: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor,
          scale: torch.Tensor) -> None:
    """This rank's part of the SUM: ``rows`` (merged rows of disjoint groups) each times its
    ``weight`` (0: counted by another rank), moments about ``shift``, norms over ``scale``."""
    cols = [COL[name] for name in SUM_COUNTS]
    add[:len(cols)] = (weight[:, None] * rows[:, cols]).sum(0)
    nf = weight * (rows[:, COL["numel"]] - rows[:, COL["nan_count"]] - rows[:, COL["inf_count"]])
    mean = torch.where(nf > 0, rows[:, COL["finite_mean"]], shift) - shift
    m2 = torch.where(nf > 1, rows[:, COL["finite_std"]].square() * (nf - 1), 0.0)
    add[S_NF:S_NORM + 1] = torch.stack([
        nf.sum(), (nf * mean).sum(), (m2 + nf * mean.square()).sum(),
        (weight * (rows[:, COL["finite_norm"]] / scale).square()).sum()])


_EMPTY: dict[torch.device, torch.Tensor] = {}


def _parts(table: torch.Tensor, owned: list[bool | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the merged row of the DTensor shards this rank owns, that of its plain tensors)."""
    dev = table.device
    n = table.shape[0] - 1
    empty = _EMPTY.get(dev)
    if empty is None:  # the row of no elements, made once per device
        empty = _EMPTY.setdefault(dev, merge_rows(torch.zeros(0, W, dtype=torch.float64,
                                                             device=dev)))

    def merged(mask: list[bool]) -> torch.Tensor:
        if not any(mask):
            return empty
        if all(mask):
            return table[-1] if n == len(mask) else merge_rows(table[:n])
        m = torch.tensor(mask, device=dev)
        return merge_rows(torch.where(m[:, None], table[:n], empty))

    return (merged([o is True for o in owned]).double(),
            merged([o is None for o in owned]).double())


def _total(top: torch.Tensor, add: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor
           ) -> torch.Tensor:
    """The total row from the two reductions (``merge_rows``'s merge, its sums taken by the
    collective)."""
    counts = {name: add[i] for i, name in enumerate(SUM_COUNTS)}
    nf = add[S_NF]
    rel = add[S_MEAN] / nf.clamp(min=1)  # the finite mean, less the shift
    m2 = add[S_M2] - nf * rel.square()
    total = finalize(counts["numel"], counts["nan_count"], counts["posinf_count"],
                     counts["neginf_count"], counts["zero_count"], -top[M_FMIN], top[M_FMAX],
                     shift + rel, m2, scale * add[S_NORM].sqrt(), counts["overflow_count"],
                     counts["underflow_count"])
    failed = top[M_ERROR] > 0  # a rank's input was refused: no total to give
    total = torch.where(failed, torch.full_like(total, float("nan")), total)
    bad = (top[M_BAD] > 0) | failed
    total[COL["all_finite"]] = torch.where(bad, 0.0, total[COL["all_finite"]])
    return total


_SIZES: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _replica_check(top: torch.Tensor, add: torch.Tensor, sizes: tuple[int, ...]
                   ) -> dict[str, torch.Tensor]:
    """``global_table``'s replica check: each set's slot of the MAX (high, -low, its
    representative) and of the SUM (its sides)."""
    k = len(sizes)
    return verdict(top[M_HEAD:].view(k, 3), add[S_HEAD:].view(k, 4), sizes, top.device)


def verdict(slots: torch.Tensor, sides: torch.Tensor, sizes: tuple[int, ...],
             dev: torch.device) -> dict[str, torch.Tensor]:
    """Each set's verdict from its two fingerprints (``slots[:, 0]``, ``-slots[:, 1]``) and its
    sides (how many members hold each, the sums of their ranks): the ranks on the smaller side
    differ (both sides when they are as many; every member on neither side when the set holds
    three versions or more); a side of one is named by its rank sum."""
    if not sizes:
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        return {"replica_mismatch": zero, "replica_mismatch_mask": zero,
                "replica_named": torch.zeros(0, dtype=torch.float64, device=dev)}
    size = _SIZES.get((sizes, dev))
    if size is None:  # on the device once: no copy from the host in the step
        size = _SIZES.setdefault((sizes, dev), torch.tensor(sizes, dtype=torch.float64,
                                                            device=dev))
    n_hi, n_lo = sides[:, 0], sides[:, 1]
    # a set none of whose members reported (their tensors changed since the sets were found:
    # each is a set of its own now) has nothing to compare
    differ = (slots[:, 0] != -slots[:, 1]) & (n_hi + n_lo > 0)
    hi_odd = differ & (n_hi <= n_lo)
    lo_odd = differ & (n_lo <= n_hi)
    others = torch.where(differ, size - n_hi - n_lo, 0.0)
    count = (torch.where(hi_odd, n_hi, 0.0) + torch.where(lo_odd, n_lo, 0.0) + others).sum()
    nan = torch.full_like(n_hi, float("nan"))
    named = torch.stack([torch.where(hi_odd & (n_hi == 1), sides[:, 2], nan),
                         torch.where(lo_odd & (n_lo == 1), sides[:, 3], nan)], 1).view(-1)
    low = torch.where(named < MASK_RANKS, named, float("nan"))
    mask = torch.where(low.isnan(), 0.0, torch.exp2(low.nan_to_num(0.0))).sum()
    return {"replica_mismatch": count, "replica_mismatch_mask": mask, "replica_named": named}



def odd_member(h: torch.Tensor, high: torch.Tensor, low: torch.Tensor, n_hi: torch.Tensor,
               n_lo: torch.Tensor) -> torch.Tensor:
    """Whether the member of fingerprint ``h`` is one that ``verdict`` counts in its set of
    fingerprints ``high`` and ``low``, held by ``n_hi`` and ``n_lo`` members (0 or 1)."""
    differ = high != low
    on_hi, on_lo = h == high, h == low
    return (differ & ((on_hi & (n_hi <= n_lo)) | (on_lo & (n_lo <= n_hi)) | ~(on_hi | on_lo))
            ).double()


def flagged_ranks(flag: bool, process_group: Any) -> list[int]:
    """The ranks of ``process_group`` whose ``flag`` is set: one all-gather of a byte per rank
    (131 kB at 131,072 ranks), a collective that every rank of the group must call. The
    cheap extra step that names replicas differing alike (``replica_odd``), rarely needed."""
    check_group(process_group)
    world = dist.get_world_size(process_group)
    dev = comm_device(process_group, _default_device(process_group))
    out = torch.empty(world, dtype=torch.uint8, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, torch.tensor([int(flag)], dtype=torch.uint8, device=dev), group=process_group)
    return torch.nonzero(out).flatten().tolist()
