"""What the Monitor measures for the rules that look past the loss and the gradients
(docs/spec.md section 6): a periodic fused pass over the weights themselves, and a key per step
for the batch it was given.

- ``weight_scan``: every parameter's (and written buffer's: ``buffers.py``) NaN + Inf count and
  largest finite |w| in one fused pass (``multi_tensor_stats`` on the detached values, as the
  gradients are read): no host sync; the table stays on the device until the flush
  (``rules/weight_corruption.py`` reads it).
- ``ids_key``: the sample ids a step was given, hashed on the host (no sync: ids are CPU
  tensors or lists); None for ids on an accelerator, which are fingerprinted instead.
- ``AlikeRanks``: under a process group, at a flush, names every rank of replicas that differ
  alike (one all-gather of a byte per rank, only where a spell of them begins).
- ``fingerprint``: a float64 0-dim tensor on the device that is the same for the same batch and
  differs for another with high probability (``rules/repeated_batch.py`` compares them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import torch

from ..checks import multi_tensor_stats
from ..distributed import flagged_ranks
from ..ops.layout import COL
from ..replicas import compare_replicas, param_checksums, replica_key
from .record import StepRecord

SAMPLE = 1 << 16  # elements of a tensor the position-weighted sum reads (strided), at most


def weight_scan(params: list[tuple[str, Any]], backend: str | None, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NaN + Inf count over every parameter, their largest finite |w|, the per-tensor table
    of section 2's statistics, its last row the total): one fused pass, results on the device.
    Only the table is kept, not the tensors: a recorded step holds no reference to the
    weights."""
    table = multi_tensor_stats([p.detach() for _, p in params], backend=backend).raw
    total = table[-1].to(device)
    return total[COL["nan_count"]] + total[COL["inf_count"]], total[COL["amax"]], table


def scan_table(table: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per tensor (NaN + Inf count, largest finite |w|) on the host: one copy, at the flush."""
    t = table[:-1].cpu()
    bad = (t[:, COL["nan_count"]] + t[:, COL["inf_count"]]).tolist()
    return bad, t[:, COL["amax"]].tolist()


def _leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors inside ``obj`` (dicts, lists, tuples), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in obj for t in _leaves(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    return []


def ids_key(sample_ids: Any) -> int | None:
    """A hash of the sample ids (order included) taken on the host; None when there are none,
    or when a tensor of them lives on an accelerator (reading it would sync)."""
    if sample_ids is None:
        return None
    leaves = _leaves(sample_ids)
    if leaves:
        if any(t.device.type != "cpu" for t in leaves):
            return None
        h = hashlib.blake2b(digest_size=8)
        for t in leaves:
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return int.from_bytes(h.digest(), "little")
    try:
        return hash(tuple(sample_ids)) if isinstance(sample_ids, (list, tuple)) \
            else hash(sample_ids)
    except TypeError:
        return None


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """``n`` fixed float64 weights in [1, 2) (the fractional parts of multiples of the golden
    ratio, which never repeat), made once per length and device."""
    w = _WEIGHTS.get((n, device))
    if w is None:
        if len(_WEIGHTS) > 32:
            _WEIGHTS.clear()
        w = torch.arange(1, n + 1, dtype=torch.float64, device=device)
        w = w.mul_((math.sqrt(5) - 1) / 2).frac_().add_(1.0)  # made there: no copy
        _WEIGHTS[(n, device)] = w
    return w


def fingerprint(batch: Any, device: torch.device) -> torch.Tensor | None:
    """The batch's fingerprint (a float64 0-dim tensor on ``device``), or None without a
    floating or integer tensor in it. Per tensor: the float64 sum of every element, and the
    sum of at most ``SAMPLE`` evenly strided elements each times a fixed weight of its
    position (a shuffled batch differs); each tensor's pair weighted by its place in the batch.
    Kernels only: no sync."""
    parts = []
    for i, t in enumerate(_leaves(batch)):
        if not (t.is_floating_point() or (not t.is_complex() and t.dtype != torch.bool)):
            continue
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        step = max(1, flat.numel() // SAMPLE)
        sample = flat[::step].to(torch.float64)
        total = flat.sum(dtype=torch.float64)
        weighted = torch.dot(sample, _weights(sample.numel(), sample.device))
        # a CPU batch of a model elsewhere: its scalar travels without waiting for the device
        parts.append((total * (i + 1) + weighted * math.pi * (i + 2)).to(device,
                                                                         non_blocking=True))
    if not parts:
        return None
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


class Scans:
    """What a Monitor measures for these rules at each step, only where the rule that reads it
    is in the Monitor's set: the weight scan on the first step and every ``every`` steps (the
    last step of each flush by default), the batch's key (sample ids hashed on the host, else
    the batch's fingerprint on the device). No sync."""

    def __init__(self, every: int, keyed: bool, params: list[tuple[str, Any]],
                 backend: str | None, replicas: tuple[int, Any, Any] | None = None,
                 buffers: list[tuple[str, Any]] | None = None) -> None:
        self.every, self.keyed, self.params, self.backend = every, keyed, params, backend
        # the weight scan reads the buffers a forward writes after the parameters (their rows
        # follow the parameters' in its table): a NaN that reached BatchNorm's running
        # statistics breaks the model in eval mode while every weight is finite
        self.scanned = list(params) + list(buffers or [])
        self.device = params[0][1].device
        # under a process group: (every, process group, replica group) of the comparison of
        # the parameters across replicas, and the kind and key of this rank's replica set
        # (plain tensors, or DTensor shards; not a mix of the two)
        self._key = None if replicas is None or not replicas[0] else replica_key(
            [n for n, _ in params], [p for _, p in params])
        self.replicas = replicas if self._key is not None else None

    @classmethod
    def for_rules(cls, rules: list[Any], flush_every: int, params: list[tuple[str, Any]],
                  backend: str | None, process_group: Any = None,
                  replica_group: Any = None, buffers: list[tuple[str, Any]] | None = None
                  ) -> Scans:
        by_name = {getattr(r, "name", None): r for r in rules}
        wc = by_name.get("weight_corruption")
        every = 0
        if wc is not None:  # never less often than once per flush
            every = min(getattr(wc.config, "every", 0) or flush_every, flush_every)
        replicas = None
        if process_group is not None and "replica_divergence" in by_name:
            replicas = (flush_every, process_group, replica_group)
        return cls(every, "repeated_batch" in by_name, params, backend, replicas, buffers)

    def measure(self, n: int, batch: Any, sample_ids: Any
                ) -> tuple[dict[str, torch.Tensor], Any, Any]:
        """(the record's fields, the weight scan's table or None, the sample ids' key or None)
        for step number ``n`` of the Monitor (0 for its first)."""
        out: dict[str, torch.Tensor] = {}  # a field left out is not measured (NaN)
        table = key = None
        if self.every and (n == 0 or (n + 1) % self.every == 0):
            out["weight_nonfinite"], out["weight_amax"], table = weight_scan(
                self.scanned, self.backend, self.device)
        if self.replicas is not None and (n + 1) % self.replicas[0] == 0:
            out.update(self._compare_replicas())
        if self.keyed:
            key = ids_key(sample_ids)
            if key is None:
                fp = fingerprint(batch if sample_ids is None else sample_ids, self.device)
                if fp is not None:
                    out["batch_fingerprint"] = fp
        return out, table, key

    def _compare_replicas(self) -> dict[str, torch.Tensor]:
        """The parameters compared across replicas after the step (``compare_replicas``): how
        many ranks' copies differ, the lowest rank named, the first tensor that differs."""
        _, group, replica_group = self.replicas  # type: ignore[misc]
        sums = param_checksums([p for _, p in self.params]).to(self.device)
        assert self._key is not None  # set with self.replicas
        check = compare_replicas(sums, group, replica_group, self._key[1], self._key[0])
        count, named, differ = (check["replica_mismatch"], check["replica_named"],
                                check["tensors"])
        out: dict[str, torch.Tensor] = {}
        if count is not None:
            out["weight_replica_mismatch"] = count
        if named is not None and named.numel():
            out["weight_replica_rank"] = _lowest(named)
        if check["replica_odd"] is not None:
            out["weight_replica_odd"] = check["replica_odd"]
        if differ is not None and differ.numel():
            at = torch.arange(differ.numel(), device=self.device, dtype=torch.float64)
            out["weight_replica_tensor"] = _lowest(torch.where(differ, at, math.nan))
        return out


def _lowest(x: torch.Tensor) -> torch.Tensor:
    """The smallest of ``x`` leaving NaN out; NaN when all are."""
    low = x.nan_to_num(math.inf).min()
    return torch.where(torch.isinf(low), math.nan, low)


class AlikeRanks:
    """Names the ranks whose replicas differ, when several do, at the steps where
    ``replica_divergence`` reports them: the first of a spell (the gradients' count above 0
    after a step where it was not; the parameters' after a comparison that found none) with a
    count above 1 (one rank is named by the reductions themselves). There, at the flush, one
    all-gather of each rank's own flag (``replica_odd``, ``weight_replica_odd``): a byte per
    rank, on every rank alike, since the counts are all-reduced. The ranks go into the step's
    ``StepHost.alike``. Nothing without a process group, nor at the Monitor's close (a rank
    that closes on an error must not leave the others waiting in a collective)."""

    FIELDS = (("replica_mismatch", "replica_odd", True),
              ("weight_replica_mismatch", "weight_replica_odd", False))

    def __init__(self, process_group: Any) -> None:
        self.group = process_group
        self.before = {count: math.nan for count, _, _ in self.FIELDS}

    def name(self, steps: list[StepRecord], closing: bool = False) -> list[StepRecord]:
        if self.group is None or closing:
            return steps
        out = []
        for s in steps:
            alike: dict[str, list[int]] = {}
            for count, odd, every_step in self.FIELDS:
                v = s.values.get(count, math.nan)
                if v != v and not every_step:  # the parameters: compared at flushes only
                    continue
                if v > 1 and not self.before[count] > 0:
                    alike[count] = flagged_ranks(s.values.get(odd, 0.0) > 0, self.group)
                self.before[count] = v
            out.append(dataclasses.replace(s, host=dataclasses.replace(s.host, alike=alike))
                       if alike else s)
        return out
