"""The fused multi-tensor statistics pass in Triton: backend ``"triton"``.

Reference: ``fasthealth/ops/reference.py`` (docs/spec.md section 2); record and finalisation
rules: the same as ``csrc/stats.h``. Read top to bottom: the partial record, the three kernels,
the launcher.

1. ``_chunk_stats_kernel``: one persistent launch per (dtype, 16-byte alignment) group over the
   work list's items (csrc/plan.h: chunk sizes from the total work, largest items first; each
   item carries its tensor's pointer; aligned groups tell the compiler so: vector loads). Each
   program reduces whole chunks to one partial record, written at the item's slot in input
   order (partials are sized by the number of chunks). float32/16/bfloat16 chunks
   take the fast path, the method of the CUDA and CPU kernels: per-lane float32 sums of x and
   x^2 (at most CHUNK / BLOCK terms a lane), min/max and counts, reduced in float64; then
     - a shifted second pass around the chunk's mean when the variance cancels
       (sum x^2 > MAX_CANCEL * M2), and
     - a masked pass when a sum is not finite (NaN or inf in the chunk): the same loop over
       the finite elements only, +inf, -inf and NaN counted (and masked around the mean when
       the variance cancels), so that a NaN-laden gradient reads each chunk twice, not
       through the exact path, and
     - the exact path when a sum is still not finite (squares beyond float32) or the
       largest |x| is below 2^-40 (squares that float32 underflows).
   The exact path (also float64 and integer inputs): per BLOCK, two passes over registers
   merged with Chan's formula and a power-of-two scaled sum of squares.
2. ``_merge_chunks_kernel``, only for a tensor of more than MERGE_RUN chunks: one program
   per run of chunks merges it into one record (the first level of a two-level merge).
3. ``_merge_finalize_kernel``: program i merges tensor i's records (chunks, or runs) in a fixed
   order (vector blocks in closed form, then Chan) and writes its table row; the last program
   to finish, picked by a counter, merges the tensors' records in index order into the total
   row, as the CUDA kernel does. Results are deterministic; the counter is the only atomic.

One chunk launch per dtype group, then one launch (two with the two-level merge), whatever the
number of tensors; each program of the chunk kernel loads an item's metadata one item ahead.
The work list, the staging of float8 and non-dense inputs and their cache are the
CUDA backend's own (csrc/work_list.h, through ``fasthealth._C.work_list``): one policy for
pinning under capture and stream order. A second call with the same tensors launches kernels
only (CUDA-graph capturable after one warm-up call).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fasthealth.ops import compiled, layout

# Triton reads module globals only as constexprs: the named columns of ops/layout.py as such.
# The partial record (struct Partial of csrc/stats.h, plus the path that finished a chunk):
P_N = tl.constexpr(layout.PARTIAL["n"])
P_FINITE = tl.constexpr(layout.PARTIAL["finite"])
P_POSINF = tl.constexpr(layout.PARTIAL["posinf"])
P_NEGINF = tl.constexpr(layout.PARTIAL["neginf"])
P_ZERO = tl.constexpr(layout.PARTIAL["zero"])
P_OVER = tl.constexpr(layout.PARTIAL["over"])
P_UNDER = tl.constexpr(layout.PARTIAL["under"])
P_FMIN = tl.constexpr(layout.PARTIAL["fmin"])
P_FMAX = tl.constexpr(layout.PARTIAL["fmax"])
P_MEAN = tl.constexpr(layout.PARTIAL["mean"])
P_M2 = tl.constexpr(layout.PARTIAL["m2"])
P_SCALE = tl.constexpr(layout.PARTIAL["scale"])
P_SSQ = tl.constexpr(layout.PARTIAL["ssq"])
P_PATH = tl.constexpr(layout.PARTIAL["path"])
P_WIDTH = tl.constexpr(layout.PARTIAL_WIDTH)
# The output table:
C_NUMEL = tl.constexpr(layout.COL["numel"])
C_NAN_COUNT = tl.constexpr(layout.COL["nan_count"])
C_POSINF_COUNT = tl.constexpr(layout.COL["posinf_count"])
C_NEGINF_COUNT = tl.constexpr(layout.COL["neginf_count"])
C_INF_COUNT = tl.constexpr(layout.COL["inf_count"])
C_ZERO_COUNT = tl.constexpr(layout.COL["zero_count"])
C_MIN = tl.constexpr(layout.COL["min"])
C_MAX = tl.constexpr(layout.COL["max"])
C_MEAN = tl.constexpr(layout.COL["mean"])
C_STD = tl.constexpr(layout.COL["std"])
C_NORM = tl.constexpr(layout.COL["norm"])
C_FINITE_MIN = tl.constexpr(layout.COL["finite_min"])
C_FINITE_MAX = tl.constexpr(layout.COL["finite_max"])
C_FINITE_MEAN = tl.constexpr(layout.COL["finite_mean"])
C_FINITE_STD = tl.constexpr(layout.COL["finite_std"])
C_FINITE_NORM = tl.constexpr(layout.COL["finite_norm"])
C_AMAX = tl.constexpr(layout.COL["amax"])
C_ALL_FINITE = tl.constexpr(layout.COL["all_finite"])
C_OVERFLOW_COUNT = tl.constexpr(layout.COL["overflow_count"])
C_UNDERFLOW_COUNT = tl.constexpr(layout.COL["underflow_count"])
# Which path finished a chunk, as stored in its record:
PATH_FAST = tl.constexpr(float(layout.PATH_FAST))
PATH_SHIFTED = tl.constexpr(float(layout.PATH_SHIFTED))
PATH_EXACT = tl.constexpr(float(layout.PATH_EXACT))
PATH_MASKED = tl.constexpr(float(layout.PATH_MASKED))
INF = tl.constexpr(float("inf"))
# The fast path's limits (csrc/stats.h explains them): lanes sum at most CHUNK / BLOCK = 32 terms
TINY_AMAX = tl.constexpr(layout.FAST_MIN_AMAX)
MAX_CANCEL = tl.constexpr(layout.CANCEL_BUDGET / 32)
C21 = tl.constexpr((1 << 21) - 1)  # a count's field in _lane_sums' packed counts


@triton.jit
def _empty_record():
    """The record of no elements, in P_* order (extremes at +-inf, scale 0)."""
    z = tl.zeros((), tl.float64)
    lo = tl.full((), float("inf"), tl.float64)
    hi = tl.full((), -float("inf"), tl.float64)
    return z, z, z, z, z, z, z, lo, hi, z, z, z, z


@triton.jit
def _store_record(row, n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq):
    tl.store(row + P_N, n)
    tl.store(row + P_FINITE, fin)
    tl.store(row + P_POSINF, pinf)
    tl.store(row + P_NEGINF, ninf)
    tl.store(row + P_ZERO, zero)
    tl.store(row + P_OVER, over)
    tl.store(row + P_UNDER, under)
    tl.store(row + P_FMIN, fmin)
    tl.store(row + P_FMAX, fmax)
    tl.store(row + P_MEAN, mean)
    tl.store(row + P_M2, m2)
    tl.store(row + P_SCALE, scale)
    tl.store(row + P_SSQ, ssq)


@triton.jit
def _chan(na, mean_a, m2_a, nb, mean_b, m2_b):
    """Merge (count, mean, M2) of two disjoint groups; either count may be 0."""
    n = na + nb
    w = tl.where(n > 0, nb / tl.maximum(n, 1.0), 0.0)
    delta = mean_b - mean_a
    mean = tl.where(nb > 0, mean_a + delta * w, mean_a)
    mean = tl.where(na > 0, mean, mean_b)
    m2 = tl.where((na > 0) & (nb > 0), m2_a + m2_b + delta * delta * na * w, m2_a + m2_b)
    return n, mean, m2


@triton.jit
def _scaled(sa, qa, sb, qb):
    """Merge sums of squares kept as scale^2 * q (scales are powers of two, 0 when empty)."""
    s = tl.maximum(sa, sb)
    ra = tl.where(s > 0, sa / tl.where(s > 0, s, 1.0), 0.0)
    rb = tl.where(s > 0, sb / tl.where(s > 0, s, 1.0), 0.0)
    return s, qa * ra * ra + qb * rb * rb


@triton.jit
def _pow2_floor(a):
    """The largest power of two <= a (a float64 >= 0; 0 for 0), from the exponent bits: exact
    for subnormals too, where exp2(floor(log2(a))) is computed in float32 and flushes to zero
    on the GPU (ex2.approx.ftz.f32)."""
    e = (a.to(tl.int64, bitcast=True) >> 52) & 0x7FF
    normal = (e << 52).to(tl.float64, bitcast=True)
    return tl.where(a > 0, tl.where(e > 0, normal, 4.9406564584124654e-324), 0.0)


@triton.jit
def _exact_chunk(base, start, end, hi, lo, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """The record of elements [start, end): exact for any input. Per BLOCK: counts, finite
    min/max, moments by two passes over registers merged with Chan's formula, a power-of-two
    scaled sum of squares (no overflow, no underflow), range counts. In float64 whatever the
    input (the callers pass ACC = float64): on the GPU float32's fma flushes subnormals to zero,
    and a block of values all below 2^-126 would come out with a norm, mean and std of 0."""
    inf = float("inf")
    _, fin_n, pinf_n, ninf_n, zero_n, over_n, under_n, fmin, fmax, mean, m2, scale, ssq = (
        _empty_record())
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < end
        x = tl.load(base + idx, mask=m, other=0).to(ACC)
        ax = tl.abs(x)
        fin = m & (x == x) & (ax < inf)
        xf = tl.where(fin, x, 0.0)
        nb = tl.sum(fin.to(tl.int32), axis=0).to(tl.float64)
        pinf_n += tl.sum((m & (x == inf)).to(tl.int32), axis=0).to(tl.float64)
        ninf_n += tl.sum((m & (x == -inf)).to(tl.int32), axis=0).to(tl.float64)
        zero_n += tl.sum((fin & (x == 0)).to(tl.int32), axis=0).to(tl.float64)
        over_n += tl.sum((fin & (ax > hi)).to(tl.int32), axis=0).to(tl.float64)
        under_n += tl.sum((fin & (ax < lo) & (x != 0)).to(tl.int32), axis=0).to(tl.float64)
        fmin = tl.minimum(fmin, tl.min(tl.where(fin, x, inf), axis=0).to(tl.float64))
        fmax = tl.maximum(fmax, tl.max(tl.where(fin, x, -inf), axis=0).to(tl.float64))
        amax = tl.max(tl.abs(xf), axis=0)
        sb = _pow2_floor(amax)
        y = xf / tl.where(sb > 0, sb, 1.0)
        mean_y = tl.sum(y, axis=0) / tl.maximum(nb.to(ACC), 1.0)
        d = tl.where(fin, y - mean_y, 0.0)
        m2_y = tl.sum(d * d, axis=0)
        q_b = tl.sum(y * y, axis=0).to(tl.float64)
        s_b = sb.to(tl.float64)
        fin_n, mean, m2 = _chan(fin_n, mean, m2, nb, mean_y.to(tl.float64) * s_b,
                                m2_y.to(tl.float64) * s_b * s_b)
        scale, ssq = _scaled(scale, ssq, s_b, q_b)
    return fin_n, pinf_n, ninf_n, zero_n, over_n, under_n, fmin, fmax, mean, m2, scale, ssq


@triton.jit
def _acc_tile(x, m, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT: tl.constexpr,
              RANGE: tl.constexpr, MASKED: tl.constexpr, NONFINITE: tl.constexpr):
    """Adds one tile (lanes where m, when MASKED) to the per-lane accumulators. ``cnt`` counts
    zeros; NONFINITE (the masked pass of a chunk holding NaN/Inf): only finite elements enter
    the sums and extremes, and ``cnt`` counts the others too, one code an element: zero 1,
    +inf 64, -inf 4096, NaN 262144 (a lane sees at most CHUNK / BLOCK <= 32 elements: six bits
    a field, 24 in all, exact in float32; decoded by ``_lane_sums``). ``under`` counts
    |x| < lo with the zeros (and, NONFINITE, the non-finite elements): the caller takes them
    out. Flags enter the counts as selects of 1.0 (a compare that sets a float), not as
    converted booleans (a select and a conversion)."""
    inf = float("inf")
    valid = m  # the tile's lanes before the end
    if NONFINITE:
        fin = tl.abs(x) < inf  # (NaN compares false; lanes past the end were loaded as 0)
        m = m & fin
    if SHIFT:
        d = x - c
        if MASKED or NONFINITE:
            d = tl.where(m, d, 0.0)
    elif NONFINITE:
        d = tl.where(m, x, 0.0)  # non-finite elements count as 0 in the sums and the range
    else:
        d = x  # (masked lanes were loaded as 0: no sum changes)
    s += d
    q += d * d
    if not SHIFT:
        if NONFINITE:  # one select chain an element, not a compare and an add a class
            bad = tl.where(x != x, 262144.0, tl.where(x > 0, 64.0, 4096.0))
            cnt += tl.where(valid & (x == 0), 1.0, tl.where(fin, 0.0, bad))
        elif MASKED:
            cnt += tl.where(m & (x == 0), 1.0, 0.0)
        else:
            cnt += tl.where(x == 0, 1.0, 0.0)
        if MASKED or NONFINITE:
            mn = tl.minimum(mn, tl.where(m, x, inf))
            mx = tl.maximum(mx, tl.where(m, x, -inf))
        else:
            mn = tl.minimum(mn, x)
            mx = tl.maximum(mx, x)
        if RANGE:  # (hi > 0: the zeros that d holds for non-finite elements are not over)
            ad = tl.abs(d)
            over += tl.where(ad > hi, 1.0, 0.0)
            if MASKED:
                under += tl.where(valid & (ad < lo), 1.0, 0.0)
            else:
                under += tl.where(ad < lo, 1.0, 0.0)
    return s, q, mn, mx, cnt, over, under


@triton.jit
def _bits(a):
    """A 16- or 32-bit float tile's bits, as integers of its width."""
    if a.dtype.primitive_bitwidth == 16:
        b = a.to(tl.int16, bitcast=True)
    else:
        b = a.to(tl.int32, bitcast=True)
    return b


@triton.jit
def _in_flight(r0, r1, r2, r3, opaque, WAIT_ALL: tl.constexpr):
    """An iteration's four tiles as float32, unchanged (``opaque`` is 0, which the compiler
    cannot know), but made to depend on later loads so that ptxas issues all four loads before
    it uses any: left to itself, under the register cap, it sank loads past the first tile's
    use (one or two tiles in flight, not four: one memory latency a tile). As ``thread_sums``
    does in csrc/cuda/stats_kernels.cuh. WAIT_ALL: every tile waits
    for all four loads (the ptxas of Triton 3.6 needs it); else the first tile waits for the
    fourth (enough for Triton 3.8 and 3.9, where waiting for all costs up to a quarter more
    instructions in the masked loop). ``tests/sass_loops.py`` measures both."""
    b0 = _bits(r0)
    b3 = _bits(r3)
    if WAIT_ALL:
        b1 = _bits(r1)
        b2 = _bits(r2)
        # (b | (b & c) is b whatever c: the compiler may fold some of this; Triton 3.6's keeps
        # enough of it, tests/ops/test_triton_compile.py reads the machine code)
        dep = b0 & b1 & b2 & b3 & opaque.to(b0.dtype)
        x1 = (b1 | dep).to(r1.dtype, bitcast=True)
        x2 = (b2 | dep).to(r2.dtype, bitcast=True)
        x3 = (b3 | dep).to(r3.dtype, bitcast=True)
    else:
        dep = b3 & opaque.to(b0.dtype)
        x1 = r1
        x2 = r2
        x3 = r3
    x0 = (b0 | dep).to(r0.dtype, bitcast=True)
    return x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)


@triton.jit
def _lane_sums(base, start, end, c, hi, lo, BLOCK: tl.constexpr, SHIFT: tl.constexpr,
               RANGE: tl.constexpr, NONFINITE: tl.constexpr):
    """Per-lane float32 sums of (x - c) and (x - c)^2 over [start, end) (c = 0 unless SHIFT),
    with min/max and counts: whole tiles four loads at a time (memory-level parallelism), the
    rest one tile at a time, then one masked tile. Reduced to float64 across lanes, with the
    numbers of +inf, -inf and NaN elements (NONFINITE: finite elements only in the rest; else
    those three are 0)."""
    s = tl.zeros((BLOCK,), tl.float32)
    q = tl.zeros((BLOCK,), tl.float32)
    mn = tl.full((BLOCK,), float("inf"), tl.float32)
    mx = tl.full((BLOCK,), -float("inf"), tl.float32)
    cnt = tl.zeros((BLOCK,), tl.float32)
    over = tl.zeros((BLOCK,), tl.float32)
    under = tl.zeros((BLOCK,), tl.float32)
    lane = tl.arange(0, BLOCK)
    yes = lane >= 0
    n_full = (end - start) // BLOCK
    opaque = -(end < 0).to(tl.int32)  # 0 (end >= 0), which the compiler cannot know
    for k in range(0, n_full // 4):
        p = base + (start + k * (4 * BLOCK) + lane)
        r0 = tl.load(p)
        r1 = tl.load(p + BLOCK)
        r2 = tl.load(p + 2 * BLOCK)
        r3 = tl.load(p + 3 * BLOCK)
        x0, x1, x2, x3 = _in_flight(r0, r1, r2, r3, opaque, WAIT_ALL)
        s, q, mn, mx, cnt, over, under = _acc_tile(
            x0, yes, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT, RANGE, False, NONFINITE)
        s, q, mn, mx, cnt, over, under = _acc_tile(
            x1, yes, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT, RANGE, False, NONFINITE)
        s, q, mn, mx, cnt, over, under = _acc_tile(
            x2, yes, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT, RANGE, False, NONFINITE)
        s, q, mn, mx, cnt, over, under = _acc_tile(
            x3, yes, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT, RANGE, False, NONFINITE)
    for k in range((n_full // 4) * 4, n_full):
        x = tl.load(base + (start + k * BLOCK + lane)).to(tl.float32)
        s, q, mn, mx, cnt, over, under = _acc_tile(
            x, yes, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT, RANGE, False, NONFINITE)
    off = start + n_full * BLOCK
    if off < end:
        m = off + lane < end
        x = tl.load(base + (off + lane), mask=m, other=0).to(tl.float32)
        s, q, mn, mx, cnt, over, under = _acc_tile(
            x, m, s, q, mn, mx, cnt, over, under, c, hi, lo, SHIFT, RANGE, True, NONFINITE)
    # Counts cross the lanes packed three to an int64 (21 bits each; a chunk holds at most
    # 2^20 elements: CHUNK is checked), one reduction (one set of barriers) for three counts
    code = cnt.to(tl.int32)
    counts = (code & 63).to(tl.int64) if NONFINITE else code.to(tl.int64)  # the zeros
    if RANGE:
        counts += (over.to(tl.int64) << 21) + (under.to(tl.int64) << 42)
    pinf = tl.zeros((), tl.float64)
    ninf = tl.zeros((), tl.float64)
    nan = tl.zeros((), tl.float64)
    if NONFINITE:  # the three classes' six-bit fields, packed again, summed with the counts
        bad_n = ((code >> 6) & 63).to(tl.int64) + (((code >> 12) & 63).to(tl.int64) << 21) \
            + ((code >> 18).to(tl.int64) << 42)
        packed, bad_n = tl.split(tl.sum(tl.join(counts, bad_n), axis=0))
        pinf = (bad_n & C21).to(tl.float64)
        ninf = ((bad_n >> 21) & C21).to(tl.float64)
        nan = (bad_n >> 42).to(tl.float64)
    else:
        packed = tl.sum(counts, axis=0)
    under = (packed >> 42).to(tl.float64) - pinf - ninf - nan  # (see _acc_tile)
    # the sums, and the extremes as (-min, max), cross the lanes as pairs: one reduction each
    s64, q64 = tl.split(tl.sum(tl.join(s.to(tl.float64), q.to(tl.float64)), axis=0))
    nmn, mx1 = tl.split(tl.max(tl.join(-mn, mx), axis=0))
    return (s64, q64, (-nmn).to(tl.float64), mx1.to(tl.float64),
            (packed & C21).to(tl.float64), ((packed >> 21) & C21).to(tl.float64), under,
            pinf, ninf, nan)


@triton.jit
def _item(items64, items32, c, has):
    """Item c's pointer, begin, count and slot (0 where not ``has``)."""
    return (tl.load(items64 + 4 * c, mask=has, other=0),
            tl.load(items64 + 4 * c + 1, mask=has, other=0),
            tl.load(items32 + 8 * c + 4, mask=has, other=0),
            tl.load(items32 + 8 * c + 5, mask=has, other=0))


@triton.jit
def _fast_chunk(base, start, end, n, hi, lo, hi64, lo64, masked_first, BLOCK: tl.constexpr,
                RANGE: tl.constexpr):
    """A float32/bf16/fp16 chunk's record fields, path first: the fast pass, the masked pass
    where it met NaN/Inf (or straight away when ``masked_first``: the previous chunk of this
    program held some, so a NaN-laden tensor is read once, not twice; on finite data the
    masked pass gives the same record), a shifted pass when the mean dominates, the exact path
    when float32 squares cannot hold the chunk."""
    z = tl.zeros((), tl.float64)
    s, q, fmin, fmax, zero, over, under, pinf, ninf, nan = z, z, z, z, z, z, z, z, z, z
    fin = n
    path = tl.full((), PATH_FAST, tl.float64)
    finite = masked_first == 0
    if masked_first == 0:
        s, q, fmin, fmax, zero, over, under, pinf, ninf, nan = _lane_sums(
            base, start, end, 0.0, hi, lo, BLOCK, False, RANGE, False)
        finite = (tl.abs(s) < INF) & (tl.abs(q) < INF)
    if ~finite:
        # NaN/Inf (or a square beyond float32): the masked pass
        path = tl.full((), PATH_MASKED, tl.float64)
        s, q, fmin, fmax, zero, over, under, pinf, ninf, nan = _lane_sums(
            base, start, end, 0.0, hi, lo, BLOCK, False, RANGE, True)
        fin = n - pinf - ninf - nan
        finite = (tl.abs(s) < INF) & (tl.abs(q) < INF)
    amax = tl.maximum(-fmin, fmax)  # (-inf with no finite element)
    # a square beyond float32, or squares that float32 underflows: the exact path
    ok = finite & ((amax <= 0) | (amax >= TINY_AMAX))
    nn = tl.maximum(fin, 1.0)
    mean = s / nn
    m2 = q - s * mean
    if ok & (q > MAX_CANCEL * m2):  # the mean dominates: sums around it
        if path == PATH_FAST:
            path = tl.full((), PATH_SHIFTED, tl.float64)
        cf = mean.to(tl.float32)
        if path == PATH_MASKED:
            s2, q2, _, _, _, _, _, _, _, _ = _lane_sums(
                base, start, end, cf, hi, lo, BLOCK, True, False, True)
        else:
            s2, q2, _, _, _, _, _, _, _, _ = _lane_sums(
                base, start, end, cf, hi, lo, BLOCK, True, False, False)
        ok = (tl.abs(s2) < INF) & (tl.abs(q2) < INF)
        mean = cf.to(tl.float64) + s2 / nn
        m2 = q2 - s2 * (s2 / nn)
    m2 = tl.maximum(m2, 0.0)
    scale = tl.where(q > 0, 1.0, 0.0).to(tl.float64)
    ssq = q
    if RANGE:
        under = tl.where(lo > 0, under - zero, 0.0)  # 0 < |x| < lo
    else:
        over = tl.zeros((), tl.float64)
        under = tl.zeros((), tl.float64)
    if ~ok:
        path = tl.full((), PATH_EXACT, tl.float64)
        fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = (
            _exact_chunk(base, start, end, hi64, lo64, BLOCK, tl.float64))
    return path, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq


# The kernels' runtime arguments are not specialized (do_not_specialize: no integer equal to 1
# or divisible by 16, no pointer known 16-byte aligned): they depend on the plan (item ranges,
# tensor counts, the offsets of views into the work list and the scratch), so specializing on
# them compiled and loaded a new variant for many a new set of tensors, eagerly or inside a
# CUDA-graph capture. A variant now depends only on the constexprs (dtype, alignment group,
# range counts), which the first call with such tensors compiles. Nothing here gains from
# those hints: the arguments are scalar loads and stores; the data's alignment is ALIGNED.
@triton.jit(do_not_specialize=["items64", "items32", "item_lo", "item_hi", "part", "thresholds",
                               "done"])
def _chunk_stats_kernel(items64, items32, item_lo, item_hi, part, thresholds, done,
                        BLOCK: tl.constexpr, DTYPE: tl.constexpr, ACC: tl.constexpr,
                        FAST: tl.constexpr, ALIGNED: tl.constexpr, RANGE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if (pid == 0) & (item_lo == 0):  # the first group zeroes _merge_finalize_kernel's counter
        tl.store(done, 0)
    # Inputs of 32 bits or fewer compare against the thresholds rounded to float32, as the
    # reference does (docs/spec.md section 2), whatever ACC (int32's is float64); the exact
    # path compares in float64 the same rounded thresholds
    if DTYPE.primitive_bitwidth <= 32:
        hi = tl.load(thresholds).to(tl.float32).to(ACC)
        lo = tl.load(thresholds + 1).to(tl.float32).to(ACC)
    else:
        hi = tl.load(thresholds).to(ACC)
        lo = tl.load(thresholds + 1).to(ACC)
    hi64 = hi.to(tl.float64)
    lo64 = lo.to(tl.float64)
    # items (struct ChunkItem, csrc/plan.h) loaded one ahead, as the CUDA kernel does
    c0 = item_lo + pid
    n_ptr, n_start, n_count, n_slot = _item(items64, items32, c0, c0 < item_hi)
    masked_first = pid * 0  # this program's previous chunk held NaN/Inf (as the CUDA kernel)
    for c in range(c0, item_hi, nprog):
        base = n_ptr.to(tl.pointer_type(DTYPE))
        start = n_start
        end = start + n_count
        slot = n_slot
        n_ptr, n_start, n_count, n_slot = _item(items64, items32, c + nprog,
                                                c + nprog < item_hi)
        if ALIGNED:
            base = tl.multiple_of(base, 16)  # bytes: 16-byte vector loads
            start = (start // 16) * 16  # (a hint on a loop-carried value is lost)
        n = (end - start).to(tl.float64)
        if FAST:
            path, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = (
                _fast_chunk(base, start, end, n, hi, lo, hi64, lo64, masked_first, BLOCK,
                            RANGE))
            masked_first = (fin != n).to(tl.int32)
        else:
            path = tl.full((), PATH_EXACT, tl.float64)
            fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = (
                _exact_chunk(base, start, end, hi64, lo64, BLOCK, tl.float64))
        row = part + slot * P_WIDTH
        tl.store(row + P_PATH, path)
        _store_record(row, n, fin, pinf, ninf, zero, over,
                      under, fmin, fmax, mean, m2, scale, ssq)


@triton.jit
def _column(rows, col, m, other, CACHE: tl.constexpr):
    return tl.load(rows + col, mask=m, other=other, cache_modifier=CACHE)


@triton.jit
def _merge_records(src, first, count, VBLOCK: tl.constexpr, CACHE: tl.constexpr):
    """Merge records src[first : first + count] in order: vector blocks in closed form (loads
    with the cache modifier CACHE)."""
    inf = float("inf")
    n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = _empty_record()
    for off in range(0, count, VBLOCK):
        k = off + tl.arange(0, VBLOCK)
        m = k < count
        rows = src + (first + k) * P_WIDTH
        f_i = _column(rows, P_FINITE, m, 0.0, CACHE)
        mean_i = tl.where(f_i > 0, _column(rows, P_MEAN, m, 0.0, CACHE), 0.0)
        s_i = _column(rows, P_SCALE, m, 0.0, CACHE)
        n += tl.sum(_column(rows, P_N, m, 0.0, CACHE), axis=0)
        pinf += tl.sum(_column(rows, P_POSINF, m, 0.0, CACHE), axis=0)
        ninf += tl.sum(_column(rows, P_NEGINF, m, 0.0, CACHE), axis=0)
        zero += tl.sum(_column(rows, P_ZERO, m, 0.0, CACHE), axis=0)
        over += tl.sum(_column(rows, P_OVER, m, 0.0, CACHE), axis=0)
        under += tl.sum(_column(rows, P_UNDER, m, 0.0, CACHE), axis=0)
        fmin = tl.minimum(fmin, tl.min(_column(rows, P_FMIN, m, inf, CACHE), axis=0))
        fmax = tl.maximum(fmax, tl.max(_column(rows, P_FMAX, m, -inf, CACHE), axis=0))
        fb = tl.sum(f_i, axis=0)
        mean_b = tl.sum(f_i / tl.maximum(fb, 1.0) * mean_i, axis=0)  # weights <= 1: no overflow
        dev = tl.where(f_i > 0, mean_i - mean_b, 0.0)
        m2_b = tl.sum(_column(rows, P_M2, m, 0.0, CACHE) + f_i * dev * dev, axis=0)
        sb = tl.max(s_i, axis=0)
        r = tl.where(sb > 0, s_i / tl.where(sb > 0, sb, 1.0), 0.0)
        qb = tl.sum(_column(rows, P_SSQ, m, 0.0, CACHE) * r * r, axis=0)
        fin, mean, m2 = _chan(fin, mean, m2, fb, mean_b, m2_b)
        scale, ssq = _scaled(scale, ssq, sb, qb)
    return n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq


@triton.jit
def _merge_segment(src, seg_first, out, VBLOCK: tl.constexpr):
    """Program i merges records src[seg_first[i] : seg_first[i + 1]] into out[i]; returns the
    record."""
    i = tl.program_id(0)
    first = tl.load(seg_first + i)
    n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = _merge_records(
        src, first, tl.load(seg_first + i + 1) - first, VBLOCK, "")
    _store_record(out + i * P_WIDTH, n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean,
                  m2, scale, ssq)
    return n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq


@triton.jit(do_not_specialize=["part", "chunk_first", "tensor_part"])
def _merge_chunks_kernel(part, chunk_first, tensor_part, VBLOCK: tl.constexpr):
    _merge_segment(part, chunk_first, tensor_part, VBLOCK)


@triton.jit
def _store_row(row, n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq):
    """A merged record as a row of the output table (the rules of csrc/stats.h)."""
    inf = float("inf")
    nan = float("nan")
    nan_n = n - fin - pinf - ninf
    inf_n = pinf + ninf
    has = fin > 0
    f_min = tl.where(has, fmin, nan)
    f_max = tl.where(has, fmax, nan)
    f_mean = tl.where(has, mean, nan)
    f_std = tl.where(fin > 1, tl.sqrt(tl.maximum(m2, 0.0) / tl.maximum(fin - 1, 1.0)), nan)
    f_norm = scale * tl.sqrt(ssq)
    bad = (n == 0) | (nan_n > 0)
    mn = tl.where(ninf > 0, -inf, tl.where(has, fmin, inf))
    mx = tl.where(pinf > 0, inf, tl.where(has, fmax, -inf))
    mean_all = tl.where((pinf > 0) & (ninf > 0), nan,
                        tl.where(pinf > 0, inf, tl.where(ninf > 0, -inf, f_mean)))
    tl.store(row + C_NUMEL, n)
    tl.store(row + C_NAN_COUNT, nan_n)
    tl.store(row + C_POSINF_COUNT, pinf)
    tl.store(row + C_NEGINF_COUNT, ninf)
    tl.store(row + C_INF_COUNT, inf_n)
    tl.store(row + C_ZERO_COUNT, zero)
    tl.store(row + C_MIN, tl.where(bad, nan, mn))
    tl.store(row + C_MAX, tl.where(bad, nan, mx))
    tl.store(row + C_MEAN, tl.where(bad, nan, mean_all))
    tl.store(row + C_STD, tl.where((nan_n > 0) | (inf_n > 0), nan, f_std))
    tl.store(row + C_NORM, tl.where(nan_n > 0, nan, tl.where(inf_n > 0, inf, f_norm)))
    tl.store(row + C_FINITE_MIN, f_min)
    tl.store(row + C_FINITE_MAX, f_max)
    tl.store(row + C_FINITE_MEAN, f_mean)
    tl.store(row + C_FINITE_STD, f_std)
    tl.store(row + C_FINITE_NORM, f_norm)
    tl.store(row + C_AMAX, tl.where(has, tl.maximum(-fmin, fmax), nan))
    tl.store(row + C_ALL_FINITE, tl.where((nan_n == 0) & (inf_n == 0), 1.0, 0.0))
    tl.store(row + C_OVERFLOW_COUNT, over)
    tl.store(row + C_UNDERFLOW_COUNT, under)


@triton.jit(do_not_specialize=["src", "src_first", "tensor_part", "table", "done", "n_tensors"])
def _merge_finalize_kernel(src, src_first, tensor_part, table, done, n_tensors,
                           VBLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """The last launch: program i merges tensor i's records src[src_first[i] :
    src_first[i + 1]] in a fixed order, keeps the result in tensor_part and writes row i of
    the table; the last program to finish (counted in ``done``, which the chunk kernel
    zeroed and this program resets) merges the n tensors' records, in index order, into the
    total row. Deterministic, no atomics in the results: the counter only picks the program
    that writes the total, and any program computes the same bits from the same records. The
    barrier and the release of the count order every record before it; its acquire orders
    the last program's reads after all of them (CUDA's merge_finalize_cuda does the same)."""
    i = tl.program_id(0)
    n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = _merge_segment(
        src, src_first, tensor_part, VBLOCK)
    _store_row(table + i * WIDTH, n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2,
               scale, ssq)
    tl.debug_barrier()
    ticket = tl.atomic_add(done, 1, sem="acq_rel", scope="gpu")
    if ticket == n_tensors - 1:
        # reads past L1 (.cg): records other programs wrote
        n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = (
            _merge_records(tensor_part, 0, n_tensors, VBLOCK, ".cg"))
        _store_row(table + n_tensors * WIDTH, n, fin, pinf, ninf, zero, over, under, fmin,
                   fmax, mean, m2, scale, ssq)
        tl.store(done, 0)  # ready for the next call and the next graph replay


# ---- the launcher --------------------------------------------------------------------------

# (element type, accumulator type) by the kernels' dtype code (csrc/stats.h; float8 inputs
# arrive widened to float32, bool as bytes)
_TL = {
    layout.DTYPE_CODES[torch.float32]: (tl.float32, tl.float32),
    layout.DTYPE_CODES[torch.float16]: (tl.float16, tl.float32),
    layout.DTYPE_CODES[torch.bfloat16]: (tl.bfloat16, tl.float32),
    layout.DTYPE_CODES[torch.float64]: (tl.float64, tl.float64),
    layout.DTYPE_CODES[torch.int8]: (tl.int8, tl.float32),
    layout.DTYPE_CODES[torch.uint8]: (tl.uint8, tl.float32),
    layout.DTYPE_CODES[torch.bool]: (tl.int8, tl.float32),
    layout.DTYPE_CODES[torch.int16]: (tl.int16, tl.float32),
    layout.DTYPE_CODES[torch.int32]: (tl.int32, tl.float64),
    layout.DTYPE_CODES[torch.int64]: (tl.int64, tl.float64),
}
_FAST = {layout.DTYPE_CODES[d] for d in (torch.float32, torch.float16, torch.bfloat16)}
# Interpreted on CPU tests run small shapes: small chunks exercise the multi-chunk merge.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CHUNK = int(os.environ.get("FASTHEALTH_TRITON_CHUNK", 1024 if _INTERPRET else 65536))
BLOCK = int(os.environ.get("FASTHEALTH_TRITON_BLOCK", 256 if _INTERPRET else 2048))
_POW2 = CHUNK & (CHUNK - 1) == 0 and BLOCK & (BLOCK - 1) == 0
# A lane sums at most CHUNK / BLOCK terms: the fast path's error bound (MAX_CANCEL) and the
# masked pass's six-bit count fields assume 32 at most.
if not (_POW2 and BLOCK <= CHUNK <= min(32 * BLOCK, (C21.value + 1) // 2)):
    raise ValueError(f"fasthealth: FASTHEALTH_TRITON_CHUNK={CHUNK} and FASTHEALTH_TRITON_BLOCK="
                     f"{BLOCK}: powers of two with BLOCK <= CHUNK <= 32 * BLOCK and CHUNK <= "
                     f"2^20 are expected (a lane sums at most 32 terms; counts are packed 21 "
                     f"bits each)")
VBLOCK = 128
# Each tile of an iteration waits for all four loads (_in_flight), for the ptxas of Triton
# before 3.7 (tests/sass_loops.py: with Triton 3.6 one or two of four 16-byte loads were in
# flight, four with it; Triton 3.8 and 3.9 keep four without it). FASTHEALTH_TRITON_WAIT_ALL=0|1
# forces it either way.
_TRITON = tuple(int(v) for v in triton.__version__.split(".")[:2] if v.isdigit())
_WAIT_ALL = os.environ.get("FASTHEALTH_TRITON_WAIT_ALL", "")
if _WAIT_ALL not in ("", "0", "1"):
    raise ValueError(f"fasthealth: FASTHEALTH_TRITON_WAIT_ALL={_WAIT_ALL!r}: 0, 1 or unset is "
                     f"expected")
WAIT_ALL = tl.constexpr(_WAIT_ALL == "1" or (_WAIT_ALL == "" and _TRITON < (3, 7)))
NUM_WARPS = 8  # BLOCK / (32 * NUM_WARPS) = 8 elements per thread: one or two 16-byte loads
# Registers a thread may use in the chunk kernel: 65536 / (2 programs x 256 threads), so that
# two programs share each SM and keep twice the loads in flight. Left to itself Triton takes a
# few more than this with range counts, which leaves one program per SM; at 128 ptxas fits
# every variant without spilling (tests/ops/test_triton_compile.py checks).
MAX_REGISTERS = 128
PROGRAMS_PER_SM = 65536 // (MAX_REGISTERS * 32 * NUM_WARPS)  # the grid: what the SMs hold
# The plan's limits (csrc/plan.h): chunks from CHUNK down to CHUNK / 8 (at least one BLOCK), an
# item's overhead about CHUNK / 32 elements, merge runs of MERGE_RUN records.
MERGE_RUN = 256
# Programs assumed resident for CPU tensors (the interpreter): 0, unknown, plans chunks of
# CHUNK; tests set it to exercise smaller chunks.
RESIDENT_CPU = 0
_resident: dict[int, int] = {}


def _resident_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return RESIDENT_CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _resident:
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        _resident[index] = sms * PROGRAMS_PER_SM
    return _resident[index]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Views(NamedTuple):
    """The typed views of one work list's buffer the kernels take, made once per buffer: the
    buffer is immutable once built, so its views hold for every call that gets it again."""
    buf: torch.Tensor
    b64: torch.Tensor
    b32: torch.Tensor
    thresholds: torch.Tensor
    chunk_first: torch.Tensor  # each tensor's first chunk record (after the items)
    runs: torch.Tensor | None  # the two-level merge: each run's first chunk record
    run_first: torch.Tensor | None  # and each tensor's first run record


# id(buffer) -> its views, holding the buffer (so the id is not reused while it is here); the
# oldest go first. A buffer the work list cache evicted stays alive until it leaves this one.
_VIEWS: dict[int, _Views] = {}
VIEWS_KEPT = 64


def _views(buf: torch.Tensor, n_tensors: int, n_items: int, n_runs: int) -> _Views:
    v = _VIEWS.get(id(buf))
    if v is not None and v.buf is buf:
        return v
    b64 = buf.view(torch.int64)
    first = 4 * n_items  # (in int64 words, after the items)
    runs = first + n_tensors + 1
    v = _Views(buf, b64, buf.view(torch.int32), buf.view(torch.float64)[len(b64) - 2:],
               b64[first:], b64[runs:] if n_runs else None,
               b64[runs + n_runs + 1:] if n_runs else None)
    while len(_VIEWS) >= VIEWS_KEPT:
        _VIEWS.pop(next(iter(_VIEWS)), None)
    _VIEWS[id(buf)] = v
    return v


def _plan(tensors: list[torch.Tensor], range_hi: float, range_lo: float):
    """(work list, its views) from ``fasthealth._C.work_list``: inputs checked, float8 and
    non-dense ones staged, the plan cached on the device with the range thresholds after it
    (csrc/work_list.h: the policy)."""
    if compiled.C is None:
        raise RuntimeError(f"fasthealth: the triton backend plans its work in fasthealth._C, "
                           f"which is not available ({compiled.load_error})")
    if not tensors:
        raise ValueError("fasthealth: the triton backend needs at least one tensor")
    device = tensors[0].device
    limits = [CHUNK, max(BLOCK, CHUNK // 8), _resident_programs(device), CHUNK // 32, MERGE_RUN]
    wl = compiled.C.work_list(tensors, True, _capturing(device), limits,
                              [float(range_hi), float(range_lo)])
    return wl, _views(wl[0], len(tensors), wl[1], wl[2])


def _launch_chunks(wl, v: _Views, part: torch.Tensor, done: torch.Tensor, ranged: bool) -> None:
    """One chunk launch per (dtype, alignment) group; the first zeroes ``done``
    (_merge_finalize_kernel's counter, int32)."""
    resident = _resident_programs(part.device)
    for code, aligned, lo, hi in wl[4]:
        dtype, acc = _TL[code]
        programs = min(hi - lo, resident if resident > 0 else 4)
        _chunk_stats_kernel[(programs,)](v.b64, v.b32, lo, hi, part, v.thresholds, done,
                                         BLOCK=BLOCK, DTYPE=dtype, ACC=acc, FAST=code in _FAST,
                                         ALIGNED=aligned, RANGE=ranged, num_warps=NUM_WARPS,
                                         maxnreg=MAX_REGISTERS)


def _ranged(range_hi: float, range_lo: float) -> bool:
    return not (math.isinf(range_hi) and range_lo == 0.0)


def _work_list(tensors: list[torch.Tensor], range_hi: float, range_lo: float,
               done: torch.Tensor | None = None):
    """(work list, chunk records [items + runs, PARTIAL_WIDTH]) after the chunk launches, the
    first of which zeroes ``done`` (a scratch counter when None): for tests and chunk_paths."""
    wl, v = _plan(tensors, range_hi, range_lo)
    device = tensors[0].device
    ranged = _ranged(range_hi, range_lo)
    part = torch.empty((wl[1] + wl[2], layout.PARTIAL_WIDTH), dtype=torch.float64,
                       device=device)
    if done is None:
        done = torch.empty(1, dtype=torch.int32, device=device)
    _launch_chunks(wl, v, part, done, ranged)
    return wl, part


def chunk_paths(tensors: list[torch.Tensor], range_hi: float = math.inf,
                range_lo: float = 0.0) -> list[int]:
    """Which path finished each chunk (0 fast, 1 shifted, 2 exact, 3 masked), in input order:
    for tests and tuning (one sync)."""
    (_, n_items, _, _, _), part = _work_list(list(tensors), range_hi, range_lo)
    return [int(p) for p in part[:n_items, layout.PARTIAL["path"]].tolist()]


def multi_tensor_stats_triton(tensors: list[torch.Tensor], range_hi: float = math.inf,
                              range_lo: float = 0.0) -> torch.Tensor:
    """The table [N + 1, TABLE_WIDTH] (float64) of tensors on one device, computed on that
    device (not the current one) and its current stream."""
    device = tensors[0].device if tensors else None
    if device is not None and device.type == "cuda" and device != torch.device(
            "cuda", torch.cuda.current_device()):
        with torch.cuda.device(device):
            return _stats(tensors, range_hi, range_lo)
    return _stats(tensors, range_hi, range_lo)


def _stats(tensors: list[torch.Tensor], range_hi: float, range_lo: float) -> torch.Tensor:
    tensors = tensors if type(tensors) is list else list(tensors)
    n = len(tensors)
    wl, v = _plan(tensors, range_hi, range_lo)
    n_items, n_runs = wl[1], wl[2]
    device = tensors[0].device
    ranged = _ranged(range_hi, range_lo)
    # One scratch allocation: the tensors' records, _merge_finalize_kernel's counter (zeroed by
    # the chunk launch; two words, so that the chunk records after it stay 16-byte aligned),
    # then the chunk records and the runs' records.
    head = n * layout.PARTIAL_WIDTH
    scratch = torch.empty(head + 2 + (n_items + n_runs) * layout.PARTIAL_WIDTH,
                          dtype=torch.float64, device=device)
    done = scratch[head:head + 1].view(torch.int32)
    part = scratch[head + 2:]
    _launch_chunks(wl, v, part, done, ranged)
    records, records_first = part, v.chunk_first
    if n_runs:  # the two-level merge: runs of chunks first, then each tensor's runs
        records = part[n_items * layout.PARTIAL_WIDTH:]
        _merge_chunks_kernel[(n_runs,)](part, v.runs, records, VBLOCK=VBLOCK)
        records_first = v.run_first
    table = torch.empty((n + 1, layout.TABLE_WIDTH), dtype=torch.float64, device=device)
    _merge_finalize_kernel[(n,)](records, records_first, scratch, table, done, n,
                                 VBLOCK=VBLOCK, WIDTH=layout.TABLE_WIDTH)
    return table
