"""The contract in plain torch (docs/spec.md section 2), and the ``torch`` backend.

``tensor_stats_row`` is written as the contract states each field, computed in float64; every
test compares the compiled and Triton kernels against it. It masks instead of indexing
(``where(isfinite(d), d, 0)`` rather than ``d[isfinite(d)]``) so that it, too, runs without a
host sync on the GPU. ``merge_rows`` combines the rows of disjoint groups of elements (tensors,
devices, ranks) exactly: counts add, extremes combine, moments merge with Chan's formula, norms
combine scaled by their maximum so they do not overflow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import COL, TABLE_WIDTH

_INF = float("inf")
_NAN = float("nan")


_F32_MAX = 3.4028234663852886e38
_F32_ROUNDS_TO_INF = 3.4028235677973366e38  # float32 max + half an ulp (the tie goes to inf)


def float32_threshold(x: float, dev: torch.device) -> torch.Tensor:
    """A threshold rounded to float32, as a float64 0-dim tensor: a fill (no host copy, traced
    by torch.compile without a graph break)."""
    x = _INF if x >= _F32_ROUNDS_TO_INF else min(x, _F32_MAX)
    return torch.full((), x, dtype=torch.float32, device=dev).double()


def _norm(d: torch.Tensor, scaled: bool) -> torch.Tensor:
    """The 2-norm of float64 ``d``; ``scaled``: divided by its largest finite magnitude first,
    so that float64 subnormals (whose squares underflow to 0) and magnitudes near float64's
    maximum (whose squares overflow) keep their norm, as the kernels' scaled sums do. Inputs of
    32 bits or fewer, widened to float64, need no scaling."""
    if not scaled:
        return torch.linalg.vector_norm(d)
    m = torch.where(torch.isfinite(d), d.abs(), 0.0).max()
    m = torch.where(m > 0, m, 1.0)
    return torch.linalg.vector_norm(d / m) * m


def tensor_stats_row(t: torch.Tensor, range_hi: float = _INF, range_lo: float = 0.0
                     ) -> torch.Tensor:
    """docs/spec.md section 2 for one tensor, then the range counts: a float64 row of
    TABLE_COLUMNS on ``t``'s device. Thresholds apply as float32 to inputs of 32 bits or fewer,
    as the kernels compare in float32 lanes there."""
    d = t.detach().double()
    dev = d.device
    n = d.numel()
    out = torch.empty(TABLE_WIDTH, dtype=torch.float64, device=dev)
    if range_hi == _INF and range_lo == 0.0:  # no range asked: both counts are 0 by definition
        out[COL["overflow_count"]] = 0.0
        out[COL["underflow_count"]] = 0.0
    else:
        hi: float | torch.Tensor = range_hi
        lo: float | torch.Tensor = range_lo
        if t.dtype.itemsize <= 4:
            hi, lo = float32_threshold(range_hi, dev), float32_threshold(range_lo, dev)
        a = d.abs()
        out[COL["overflow_count"]] = ((a > hi) & (a < _INF)).sum()
        out[COL["underflow_count"]] = ((a < lo) & (a > 0)).sum()
    nan_count = torch.isnan(d).sum()
    posinf = (d == _INF).sum()
    neginf = (d == -_INF).sum()
    finite = torch.isfinite(d)
    nf = finite.sum()
    out[COL["numel"]] = n
    out[COL["nan_count"]] = nan_count
    out[COL["posinf_count"]] = posinf
    out[COL["neginf_count"]] = neginf
    out[COL["inf_count"]] = posinf + neginf
    out[COL["zero_count"]] = (d == 0).sum()
    nan = torch.full((), _NAN, dtype=torch.float64, device=dev)  # a fill, not a host copy
    if n == 0:
        for name in ("min", "max", "mean", "std", "amax"):
            out[COL[name]] = _NAN
        for name in ("finite_min", "finite_max", "finite_mean", "finite_std"):
            out[COL[name]] = _NAN
        out[COL["norm"]] = 0.0
        out[COL["finite_norm"]] = 0.0
        out[COL["all_finite"]] = 1.0
        return out
    out[COL["min"]] = d.min()
    out[COL["max"]] = d.max()
    out[COL["mean"]] = d.mean()
    out[COL["std"]] = d.std() if n > 1 else nan  # (torch would warn for one element)
    scaled = t.dtype == torch.float64
    out[COL["norm"]] = _norm(d, scaled)
    f0 = torch.where(finite, d, 0.0)
    has_f = nf > 0
    fmin = torch.where(finite, d, _INF).min()
    fmax = torch.where(finite, d, -_INF).max()
    fmean = f0.sum() / nf
    fvar = torch.where(finite, d - fmean, 0.0).square().sum() / (nf - 1)
    out[COL["finite_min"]] = torch.where(has_f, fmin, nan)
    out[COL["finite_max"]] = torch.where(has_f, fmax, nan)
    out[COL["finite_mean"]] = torch.where(has_f, fmean, nan)
    out[COL["finite_std"]] = torch.where(nf > 1, fvar.sqrt(), nan)
    out[COL["finite_norm"]] = _norm(f0, scaled)
    out[COL["amax"]] = torch.where(has_f, f0.abs().max(), nan)
    out[COL["all_finite"]] = (nan_count == 0) & (posinf + neginf == 0)
    return out


def finalize(
    numel: torch.Tensor,
    nan_count: torch.Tensor,
    posinf: torch.Tensor,
    neginf: torch.Tensor,
    zero: torch.Tensor,
    fmin: torch.Tensor,
    fmax: torch.Tensor,
    fmean: torch.Tensor,
    fm2: torch.Tensor,
    fnorm: torch.Tensor,
    over: torch.Tensor,
    under: torch.Tensor,
) -> torch.Tensor:
    """Rows of TABLE_COLUMNS from sufficient statistics (float64 tensors of one shape).

    The torch twin of ``partial_finalize`` in csrc/stats.h: ``fmin``/``fmax``/``fmean`` are over
    the finite elements (any value when there is none), ``fm2`` their sum of squared deviations.
    """
    nf = numel - nan_count - posinf - neginf
    inf_count = posinf + neginf
    nan = torch.full_like(numel, _NAN)
    inf = torch.full_like(numel, _INF)
    has_f = nf > 0
    f_min = torch.where(has_f, fmin, nan)
    f_max = torch.where(has_f, fmax, nan)
    f_mean = torch.where(has_f, fmean, nan)
    f_std = torch.where(nf > 1, (fm2.clamp(min=0) / (nf - 1).clamp(min=1)).sqrt(), nan)
    bad = (numel == 0) | (nan_count > 0)
    mn = torch.where(neginf > 0, -inf, torch.where(has_f, fmin, inf))
    mx = torch.where(posinf > 0, inf, torch.where(has_f, fmax, -inf))
    mean = torch.where(
        (posinf > 0) & (neginf > 0),
        nan,
        torch.where(posinf > 0, inf, torch.where(neginf > 0, -inf, f_mean)),
    )
    cols = {
        "numel": numel,
        "nan_count": nan_count,
        "posinf_count": posinf,
        "neginf_count": neginf,
        "inf_count": inf_count,
        "zero_count": zero,
        "min": torch.where(bad, nan, mn),
        "max": torch.where(bad, nan, mx),
        "mean": torch.where(bad, nan, mean),
        "std": torch.where((nan_count > 0) | (inf_count > 0), nan, f_std),
        "norm": torch.where(nan_count > 0, nan, torch.where(inf_count > 0, inf, fnorm)),
        "finite_min": f_min,
        "finite_max": f_max,
        "finite_mean": f_mean,
        "finite_std": f_std,
        "finite_norm": fnorm,
        "amax": torch.where(has_f, torch.maximum(-fmin, fmax), nan),
        "all_finite": ((nan_count == 0) & (inf_count == 0)).double(),
        "overflow_count": over,
        "underflow_count": under,
    }
    return torch.stack([cols[name] for name in COL], dim=-1)


def merge_rows(rows: torch.Tensor) -> torch.Tensor:
    """The FIELDS row of the union of disjoint groups, given their rows ``[G, FIELDS]``."""
    rows = rows.double()
    if rows.shape[0] == 0:
        return tensor_stats_row(torch.empty(0, dtype=torch.float64, device=rows.device))

    def c(name: str) -> torch.Tensor:
        return rows[:, COL[name]]

    nf_i = c("numel") - c("nan_count") - c("inf_count")
    has = nf_i > 0
    nf = nf_i.sum()
    fmin = torch.where(has, c("finite_min"), _INF).min()
    fmax = torch.where(has, c("finite_max"), -_INF).max()
    mean_i = torch.where(has, c("finite_mean"), 0.0)
    fmean = (nf_i * mean_i).sum() / nf.clamp(min=1)
    m2_i = torch.where(nf_i > 1, c("finite_std").square() * (nf_i - 1), 0.0)
    m2 = m2_i.sum() + (nf_i * (mean_i - fmean).square()).sum()
    norms = c("finite_norm")
    scale = norms.max()
    safe = torch.where(scale > 0, scale, 1.0)
    fnorm = safe * (norms / safe).square().sum().sqrt()
    return finalize(
        c("numel").sum(),
        c("nan_count").sum(),
        c("posinf_count").sum(),
        c("neginf_count").sum(),
        c("zero_count").sum(),
        fmin,
        fmax,
        fmean,
        m2,
        fnorm,
        c("overflow_count").sum(),
        c("underflow_count").sum(),
    )


# The torch backend reads a large tensor in pieces of this many elements: tensor_stats_row's
# float64 copies and masks take about 33 bytes an element, 2 GB for a 128 MiB bfloat16
# gradient; in pieces they stay under ~140 MB whatever the input.
CHUNK = 1 << 22


def chunked_row(t: torch.Tensor, range_hi: float = _INF, range_lo: float = 0.0) -> torch.Tensor:
    """``tensor_stats_row`` of ``t``, computed ``CHUNK`` elements at a time and merged."""
    n = t.numel()
    if n <= CHUNK:
        return tensor_stats_row(t, range_hi, range_lo)
    flat = t.detach().reshape(-1)
    return merge_rows(torch.stack([tensor_stats_row(flat[i:i + CHUNK], range_hi, range_lo)
                                   for i in range(0, n, CHUNK)]))


def multi_tensor_stats(tensors: Sequence[torch.Tensor], range_hi: float = _INF,
                       range_lo: float = 0.0) -> torch.Tensor:
    """The ``torch`` backend: a per-tensor loop of reference rows, plus their merge."""
    if len(tensors) == 0:
        raise ValueError("fasthealth: reference.multi_tensor_stats needs at least one tensor")
    per = torch.stack([chunked_row(t, range_hi, range_lo) for t in tensors])
    return torch.cat([per, merge_rows(per)[None]])
