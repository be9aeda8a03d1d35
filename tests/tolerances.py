"""docs/spec.md section 2's accuracy contract, in one table, and the comparison every test uses.

kind      fields                                                  bound
exact     counts, min, max, finite_min, finite_max, amax,         equal (NaN equals NaN)
          all_finite
norm      norm, finite_norm                                       |err| <= 1e-5 * |ref|
                                                                  (64-bit input: 1e-12)
mean      mean, finite_mean                                       |err| <= 1e-5 * mean(|finite x|)
std       std, finite_std                                         |err| <= 1e-4 * ref, checked
                                                                  when |mean|/std <= 1e3
"""

from __future__ import annotations

import math

import torch

from fasthealth.ops.layout import COL, TABLE_COLUMNS, range_thresholds
from fasthealth.ops.reference import tensor_stats_row

EXACT = (
    "numel", "nan_count", "posinf_count", "neginf_count", "inf_count", "zero_count",
    "min", "max", "finite_min", "finite_max", "amax", "all_finite",
    "overflow_count", "underflow_count",
)
TOLERANCES = {
    "norm": ("rel", 1e-5), "finite_norm": ("rel", 1e-5),
    "mean": ("abs_mean_abs", 1e-5), "finite_mean": ("abs_mean_abs", 1e-5),
    "std": ("rel_conditioned", 1e-4), "finite_std": ("rel_conditioned", 1e-4),
}
NORM_RTOL_64BIT = 1e-12
STD_MAX_CONDITION = 1e3
assert set(EXACT) | set(TOLERANCES) == set(TABLE_COLUMNS)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_row(got: torch.Tensor, ref: torch.Tensor, mean_abs: float, wide: bool, what: str):
    """Compare a FIELDS row against the reference row; ``mean_abs`` = mean(|finite x|)."""
    g = got.detach().double().cpu().tolist()
    r = ref.detach().double().cpu().tolist()
    errors = []
    for name in EXACT:
        i = COL[name]
        if not _same(g[i], r[i]):
            errors.append(f"{name}: got {g[i]!r}, want {r[i]!r}")
    for name, (kind, tol) in TOLERANCES.items():
        i = COL[name]
        gv, rv = g[i], r[i]
        if math.isnan(rv) or math.isinf(rv) or math.isnan(gv) or math.isinf(gv):
            if not _same(gv, rv):
                errors.append(f"{name}: got {gv!r}, want {rv!r}")
            continue
        if kind == "rel":
            bound = (NORM_RTOL_64BIT if wide else tol) * abs(rv)
        elif kind == "abs_mean_abs":
            bound = tol * mean_abs
        else:
            mean = r[COL["finite_mean" if name == "finite_std" else "mean"]]
            if rv == 0 or abs(mean) / rv > STD_MAX_CONDITION:
                continue
            bound = tol * rv
        if abs(gv - rv) > bound:
            errors.append(f"{name}: got {gv!r}, want {rv!r} "
                          f"(|err| {abs(gv - rv):.3g} > {bound:.3g})")
    assert not errors, f"{what}:\n  " + "\n  ".join(errors)


def mean_abs_finite(t: torch.Tensor) -> float:
    d = t.detach().double().flatten()
    f = d[torch.isfinite(d)]
    return f.abs().mean().item() if f.numel() else 0.0


def is_wide(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float64, torch.int64)


def check_tensor(got_row: torch.Tensor, t: torch.Tensor, what: str = "tensor",
                 range_dtype=None):
    ref = tensor_stats_row(t, *range_thresholds(range_dtype))
    check_row(got_row, ref, mean_abs_finite(t), is_wide(t), what)


def check_multi(table: torch.Tensor, tensors: list[torch.Tensor], what: str = "call",
                range_dtype=None):
    """Every per-tensor row and the total row (against torch.cat of all elements)."""
    assert tuple(table.shape) == (len(tensors) + 1, len(TABLE_COLUMNS))
    for i, t in enumerate(tensors):
        check_tensor(table[i], t, f"{what}, tensor {i} ({t.dtype}, {tuple(t.shape)})",
                     range_dtype)
    flat = torch.cat([t.detach().double().flatten().cpu() for t in tensors])
    ref = torch.stack([tensor_stats_row(t, *range_thresholds(range_dtype)) for t in tensors])
    total = tensor_stats_row(flat)
    total[-2:] = ref[:, -2:].sum(0)  # range counts: per input dtype's thresholds, summed
    check_row(table[-1], total, mean_abs_finite(flat),
              all(is_wide(t) for t in tensors), f"{what}, total")
