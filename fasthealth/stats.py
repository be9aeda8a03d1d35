"""TensorStats and MultiTensorStats: typed views over one float64 table on the device.

Every backend returns the same table (``ops/layout.py``): float64 ``[N + 1, TABLE_WIDTH]`` on
the inputs' device, a row per input and one for all elements together.
Attribute access converts a column lazily (counts to int64, ``all_finite`` to bool, the rest to
float32, or float64 for 64-bit inputs) and never synchronizes with the device; only ``ok``,
``to_dict()``, ``nonfinite()`` and ``summary()`` copy to the host, once each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .distributed import flagged_ranks
from .ops.layout import COL, COUNT_FIELDS, FIELDS, TABLE_WIDTH, range_thresholds

_FIELD_DOCS = {
    "numel": "number of elements (int64)",
    "nan_count": "number of NaN elements (int64)",
    "posinf_count": "number of +inf elements (int64)",
    "neginf_count": "number of -inf elements (int64)",
    "inf_count": "posinf_count + neginf_count (int64)",
    "zero_count": "number of elements equal to zero (int64)",
    "min": "t.min(): NaN if any NaN, else may be -inf/+inf; NaN when empty",
    "max": "t.max(): NaN if any NaN, else may be -inf/+inf; NaN when empty",
    "mean": "mean in float64: NaN if any NaN or both infinities, +/-inf if one sign of inf",
    "std": "unbiased std (correction 1): NaN if any non-finite element or numel < 2",
    "norm": "L2 norm: NaN if any NaN, else inf if any inf; 0 when empty; never overflows early",
    "finite_min": "min over the finite elements; NaN when there is none",
    "finite_max": "max over the finite elements; NaN when there is none",
    "finite_mean": "mean over the finite elements; NaN when there is none",
    "finite_std": "unbiased std over the finite elements; NaN when fewer than 2",
    "finite_norm": "L2 norm over the finite elements; 0 when there is none",
    "amax": "max |x| over the finite elements; NaN when there is none",
    "all_finite": "nan_count == 0 and inf_count == 0 (bool)",
}


def float_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Float fields are float64 for 64-bit inputs (float64, int64), float32 otherwise."""
    return torch.float64 if dtype.itemsize >= 8 and not dtype.is_complex else torch.float32


def _column(row: torch.Tensor, name: str, float_dtype: torch.dtype) -> torch.Tensor:
    col = row[..., COL[name]]
    if name in COUNT_FIELDS:
        return col.to(torch.int64)
    if name == "all_finite":
        return col != 0
    return col.to(float_dtype)


class TensorStats:
    """Statistics of one tensor (0-dim fields) or of N tensors (1-D fields of length N).

    Every field of docs/spec.md section 2 is an attribute holding a tensor on the input's device.
    """

    __slots__ = ("_row", "_float_dtype", "_range_dtype")

    # The fields (FIELDS), read-only properties made below from _FIELD_DOCS; declared here so
    # their types are seen (annotations only: no class attribute, nothing against __slots__).
    numel: torch.Tensor
    nan_count: torch.Tensor
    posinf_count: torch.Tensor
    neginf_count: torch.Tensor
    inf_count: torch.Tensor
    zero_count: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    norm: torch.Tensor
    finite_min: torch.Tensor
    finite_max: torch.Tensor
    finite_mean: torch.Tensor
    finite_std: torch.Tensor
    finite_norm: torch.Tensor
    amax: torch.Tensor
    all_finite: torch.Tensor

    def __init__(self, row: torch.Tensor, float_dtype: torch.dtype = torch.float32,
                 range_dtype: torch.dtype | None = None) -> None:
        self._row = row
        self._float_dtype = float_dtype
        self._range_dtype = range_dtype

    @property
    def range(self) -> RangeStats:
        """Mixed-precision range against the ``range_dtype`` the stats were computed with."""
        if self._range_dtype is None:
            raise ValueError("fasthealth: these stats were computed without range_dtype=; "
                             "pass range_dtype=torch.float16 (or bfloat16, float8_*)")
        return RangeStats(self._row, self._float_dtype, self._range_dtype)

    @property
    def raw(self) -> torch.Tensor:
        """The float64 row(s) behind the fields, columns in FIELDS order."""
        return self._row

    def to_dict(self) -> dict[str, Any]:
        """Plain Python numbers (lists for per-tensor stats); one device-to-host copy."""
        host = self._row.detach().cpu()
        out: dict[str, Any] = {}
        for name in FIELDS:
            col = _column(host, name, self._float_dtype)
            out[name] = col.tolist()
        return out

    def __repr__(self) -> str:
        if self._row.dim() != 1:
            return f"TensorStats(per_tensor, n={self._row.shape[0]})"
        d = self.to_dict()
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in d.items())
        return f"TensorStats({body})"


class RangeStats:
    """How tensors would fare if cast to ``dtype`` (fields are tensors on the device):

    - ``overflow_count`` / ``overflow_frac``: finite values with |x| above dtype's max, over
      the finite values (they would become inf, or saturate);
    - ``underflow_count`` / ``underflow_frac``: non-zero values with |x| below dtype's smallest
      normal, over the non-zero finite values (they would flush to zero or lose precision as
      subnormals);
    - ``headroom``: amax / dtype's max (above 1 means overflow; tiny means unused range).
    """

    def __init__(self, row: torch.Tensor, float_dtype: torch.dtype, dtype: torch.dtype):
        self._row, self._float_dtype, self.dtype = row, float_dtype, dtype
        self.max, self.tiny = range_thresholds(dtype)

    def _c(self, name: str) -> torch.Tensor:
        return self._row[..., COL[name]]

    @property
    def overflow_count(self) -> torch.Tensor:
        return self._c("overflow_count").to(torch.int64)

    @property
    def underflow_count(self) -> torch.Tensor:
        return self._c("underflow_count").to(torch.int64)

    @property
    def overflow_frac(self) -> torch.Tensor:
        finite = self._c("numel") - self._c("nan_count") - self._c("inf_count")
        return (self._c("overflow_count") / finite).to(self._float_dtype)

    @property
    def underflow_frac(self) -> torch.Tensor:
        nonzero = (self._c("numel") - self._c("nan_count") - self._c("inf_count")
                   - self._c("zero_count"))
        return (self._c("underflow_count") / nonzero).to(self._float_dtype)

    @property
    def headroom(self) -> torch.Tensor:
        return (self._c("amax") / self.max).to(self._float_dtype)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k).detach().cpu().tolist() for k in (
            "overflow_count", "underflow_count", "overflow_frac", "underflow_frac", "headroom")}


def _make_property(name: str) -> property:
    def get(self: TensorStats) -> torch.Tensor:
        return _column(self._row, name, self._float_dtype)

    get.__doc__ = _FIELD_DOCS[name]
    return property(get)


if tuple(TensorStats.__annotations__) != FIELDS:  # the declarations above follow FIELDS
    raise ImportError("fasthealth: TensorStats' annotations differ from ops.layout.FIELDS")
for _name in FIELDS:
    setattr(TensorStats, _name, _make_property(_name))


def decode_ranks(mask: float) -> list[int]:
    """The ranks of a bit mask held in a float64 (exact below 2**53)."""
    m = int(mask) if mask == mask else 0
    return [r for r in range(52) if m >> r & 1]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.6g}"
    return str(v)


class MultiTensorStats:
    """Statistics of N tensors from one fused pass: per tensor, and all elements together.

    ``total.norm`` is the global gradient norm (as ``clip_grad_norm_`` computes it, without its
    float32 overflow); ``all_finite`` is a 0-dim bool tensor that can gate a step without a sync.
    """

    def __init__(
        self,
        table: torch.Tensor,
        names: Sequence[str],
        dtypes: Iterable[torch.dtype] | Iterable[torch.Tensor],
        missing: Sequence[str] = (),
        range_dtype: torch.dtype | None = None,
    ) -> None:
        """``dtypes``: the inputs' dtypes, or the inputs themselves, whose dtypes are then read
        only when needed (the hot path of check_grads pays no Python loop for them)."""
        if tuple(table.shape) != (len(names) + 1, TABLE_WIDTH):
            raise ValueError(
                f"fasthealth: stats table has shape {tuple(table.shape)}, "
                f"expected {(len(names) + 1, TABLE_WIDTH)}"
            )
        self._table = table
        self.names: list[str] = names if isinstance(names, list) else list(names)
        self._dtypes_of: Iterable[torch.dtype] | Iterable[torch.Tensor] = dtypes
        self._dtypes: list[torch.dtype] | None = None
        self._wide: torch.dtype | None = None
        self.missing: list[str] = list(missing)
        self.range_dtype = range_dtype
        # with a process group: how many ranks' replicas disagree, a bit mask of those named
        # (bit r for rank r < 52), 0-dim tensors, and the ranks named (any rank; NaN where a
        # set's side holds more than one), on the device (see fasthealth.distributed)
        self.replica_mismatch: torch.Tensor | None = None
        self.replica_mismatch_mask: torch.Tensor | None = None
        self.replica_named: torch.Tensor | None = None
        self.replica_odd: torch.Tensor | None = None  # this rank is one of them (0 or 1)
        self.loss_mean: torch.Tensor | None = None  # with a process group: the ranks' mean loss
        # with a process group and fasthealth's DDP hook: the lowest rank whose own gradients
        # held NaN/Inf before the all-reduce (NaN: none), and how many did
        self.origin_rank: torch.Tensor | None = None
        self.origin_count: torch.Tensor | None = None
        # ... and the largest norm of a rank's own gradients before it over the others' mean,
        # and that rank (NaN: not measured, or no rank alone at the largest)
        self.own_ratio: torch.Tensor | None = None
        self.own_rank: torch.Tensor | None = None
        self.skip_any: torch.Tensor | None = None  # any rank's batch quarantined (rollback)

    @property
    def dtypes(self) -> list[torch.dtype]:
        """The inputs' dtypes, in input order."""
        if self._dtypes is None:
            self._dtypes = [d.dtype if isinstance(d, torch.Tensor) else d
                            for d in self._dtypes_of]
            self._dtypes_of = ()
        return self._dtypes

    @property
    def _float_dtype(self) -> torch.dtype:
        """float64 when any input is 64-bit, else float32: the dtype of the total's fields."""
        if self._wide is None:
            wide = any(float_dtype_for(d) == torch.float64 for d in set(self.dtypes))
            self._wide = torch.float64 if wide else torch.float32
        return self._wide

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int | str) -> TensorStats:
        if isinstance(i, str):
            try:
                i = self.names.index(i)
            except ValueError:
                raise KeyError(f"fasthealth: no tensor named {i!r} in these stats") from None
        n = len(self.names)
        if not -n <= i < n:
            raise IndexError(f"fasthealth: index {i} out of range for {n} tensors")
        i %= n
        return TensorStats(self._table[i], float_dtype_for(self.dtypes[i]), self.range_dtype)

    def __iter__(self) -> Iterator[TensorStats]:
        return (self[i] for i in range(len(self)))

    @property
    def per_tensor(self) -> TensorStats:
        """Every field as a 1-D tensor of length N, in input order."""
        return TensorStats(self._table[:-1], self._float_dtype, self.range_dtype)

    @property
    def total(self) -> TensorStats:
        """All elements together, as if of torch.cat([t.flatten() for t in tensors])."""
        return TensorStats(self._table[-1], self._float_dtype, self.range_dtype)

    @property
    def all_finite(self) -> torch.Tensor:
        """0-dim bool tensor on the device: no NaN and no Inf anywhere."""
        return self._table[-1, COL["all_finite"]] != 0

    @property
    def ok(self) -> bool:
        """True when every element is finite (one host sync)."""
        return bool(self.all_finite.item())

    @property
    def table(self) -> torch.Tensor:
        """The raw per-tensor table: float64 [N, TABLE_WIDTH], columns in TABLE_COLUMNS order."""
        return self._table[:-1]

    @property
    def raw(self) -> torch.Tensor:
        """Per-tensor rows and the total row: float64 [N + 1, TABLE_WIDTH]."""
        return self._table

    @property
    def device(self) -> torch.device:
        return self._table.device

    def to_dict(self) -> dict[str, Any]:
        """{'total': {field: number}, 'per_tensor': {name: {field: number}}, 'missing': [...]}.

        One device-to-host copy.
        """
        host = self._table.detach().cpu()
        total = TensorStats(host[-1], self._float_dtype).to_dict()
        per = {
            name: TensorStats(host[i], float_dtype_for(self.dtypes[i])).to_dict()
            for i, name in enumerate(self.names)
        }
        return {"total": total, "per_tensor": per, "missing": list(self.missing)}

    def mismatched_ranks(self, process_group: Any = None) -> list[int]:
        """The ranks whose replicas disagree with the rest of their set, at any world size
        (one host copy): each set's odd one out, or both of a set of two; empty without a
        process group. Where several ranks of a set disagree alike, ``replica_mismatch``
        counts them; given the ``process_group`` of the check, they are named too, by one
        all-gather of a byte per rank when some are not named otherwise: a collective, so
        every rank of the group must call it then (the count and the named ranks, on which
        that depends, are the same on every rank)."""
        if self.replica_named is None:
            return [] if self.replica_mismatch_mask is None else decode_ranks(
                float(self.replica_mismatch_mask))
        named = sorted(int(r) for r in self.replica_named.tolist() if r == r)
        if process_group is None or self.replica_odd is None or self.replica_mismatch is None \
                or float(self.replica_mismatch) <= len(named):
            return named
        return flagged_ranks(bool(self.replica_odd), process_group)

    def nonfinite(self) -> list[str]:
        """Names of the tensors holding NaN or Inf, in input order (one host copy)."""
        flags = (self._table[:-1, COL["all_finite"]] == 0).cpu().tolist()
        return [name for name, bad in zip(self.names, flags, strict=True) if bad]

    def summary(self, k: int = 10) -> str:
        """A readable table: the total, then at most ``k`` tensors: those with NaN/Inf first
        (marked ``!``), then the largest finite norms. Non-finite tensors do not always show:
        past ``k`` of them the rest are left out, and the first line gives how many tensors
        hold NaN/Inf and how many rows are shown."""
        host = self._table.detach().cpu()
        cols = ("numel", "nan_count", "inf_count", "zero_count", "norm", "amax", "mean", "std")
        heads = ("numel", "nan", "inf", "zeros", "norm", "amax", "mean", "std")

        def cells(row: torch.Tensor) -> list[str]:
            out = []
            for c in cols:
                v = row[COL[c]].item()
                out.append(str(int(v)) if c in COUNT_FIELDS else _fmt(float(v)))
            return out

        n = len(self.names)
        k = max(k, 0)
        bad = [i for i in range(n) if host[i, COL["all_finite"]] == 0]
        by_norm = sorted(
            (i for i in range(n) if i not in set(bad)),
            key=lambda i: -float(host[i, COL["finite_norm"]]),
        )[: max(k - len(bad), 0)]
        rows: list[tuple[str, list[str]]] = [("TOTAL", cells(host[-1]))]
        rows += [(f"!{self.names[i]}", cells(host[i])) for i in bad[:k]]
        rows += [(self.names[i], cells(host[i])) for i in by_norm]
        name_w = max([4] + [len(r[0]) for r in rows])
        widths = [max(len(h), *(len(r[1][j]) for r in rows)) for j, h in enumerate(heads)]
        lines = ["  ".join(["name".ljust(name_w)] + [h.rjust(w) for h, w in zip(heads, widths)])]
        for name, cs in rows:
            lines.append("  ".join([name.ljust(name_w)] + [c.rjust(w) for c, w in zip(cs, widths)]))
        status = "all finite" if not bad else f"{len(bad)} tensor(s) with NaN/Inf (marked !)"
        head = f"fasthealth: {n} tensors, {status}"
        if self.missing:
            head += f"; {len(self.missing)} without grad"
        shown = min(len(bad), k) + len(by_norm)
        if shown < n:
            head += f"; showing {shown} (non-finite first, then largest norms)"
        return "\n".join([head, *lines])

    def __repr__(self) -> str:
        return f"MultiTensorStats(n={len(self)}, device={self.device})"
