"""The op's data layout and shared numerics: the Python twin of ``csrc/stats.h``.

- The output table: float64 ``[N + 1, TABLE_WIDTH]``, row ``i < N`` for input ``i`` and row ``N``
  for all elements together; columns ``TABLE_COLUMNS`` (``FIELDS``, the fields of docs/spec.md
  section 2, then the mixed-precision range counts), counts stored as exact integers (< 2**53).
  ``COL`` maps a column name to its index.
- The partial record the Triton kernels keep per chunk and per tensor (``PARTIAL_COLUMNS``, the
  fields of ``struct Partial`` plus the path that finished a chunk).
- The dtype codes of ``enum DType``, which the CUDA emulation test passes to the kernels.
- The fast path's limits, explained once in ``csrc/stats.h``: ``FAST_MIN_AMAX`` and
  ``CANCEL_BUDGET``.
"""

from __future__ import annotations

import math

import torch

FIELDS: tuple[str, ...] = (
    "numel",
    "nan_count",
    "posinf_count",
    "neginf_count",
    "inf_count",
    "zero_count",
    "min",
    "max",
    "mean",
    "std",
    "norm",
    "finite_min",
    "finite_max",
    "finite_mean",
    "finite_std",
    "finite_norm",
    "amax",
    "all_finite",
)
COUNT_FIELDS: tuple[str, ...] = FIELDS[:6]
FLOAT_FIELDS: tuple[str, ...] = FIELDS[6:17]
# Mixed-precision range counts, after the fields: finite |x| above the call's range_hi, and
# non-zero |x| below its range_lo (both 0 when no range was asked for).
RANGE_FIELDS: tuple[str, ...] = ("overflow_count", "underflow_count")
TABLE_COLUMNS: tuple[str, ...] = FIELDS + RANGE_FIELDS
TABLE_WIDTH = len(TABLE_COLUMNS)
COL: dict[str, int] = {name: i for i, name in enumerate(TABLE_COLUMNS)}

# struct Partial (counts as exact float64 integers), then which path finished a chunk
PARTIAL_COLUMNS: tuple[str, ...] = (
    "n", "finite", "posinf", "neginf", "zero", "over", "under",
    "fmin", "fmax", "mean", "m2", "scale", "ssq", "path",
)
PARTIAL: dict[str, int] = {name: i for i, name in enumerate(PARTIAL_COLUMNS)}
PARTIAL_WIDTH = len(PARTIAL_COLUMNS)
# the masked pass of a chunk holding NaN/Inf (Triton's record; the CUDA kernel's path counter 3)
PATH_FAST, PATH_SHIFTED, PATH_EXACT, PATH_MASKED = 0, 1, 2, 3

# enum DType in csrc/stats.h
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 4,
    torch.uint8: 5, torch.int16: 6, torch.int32: 7, torch.int64: 8, torch.bool: 9,
    torch.float8_e4m3fn: 10, torch.float8_e5m2: 11,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {c: d for d, c in DTYPE_CODES.items()}

FAST_MIN_AMAX = 2.0 ** -40  # stats.h kFastMinAmax
CANCEL_BUDGET = 512.0  # stats.h kCancelBudget: cancellation x terms per float32 lane


def range_thresholds(dtype: torch.dtype | None) -> tuple[float, float]:
    """(range_hi, range_lo) for a target dtype: its largest finite value and smallest normal;
    (inf, 0) when no dtype is asked for (no value counts)."""
    if dtype is None:
        return math.inf, 0.0
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"fasthealth: range_dtype must be a floating torch.dtype, got {dtype!r}")
    fi = torch.finfo(dtype)
    return float(fi.max), float(fi.tiny)
