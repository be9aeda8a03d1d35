"""The fused multi-tensor statistics pass in Triton: backend ``"triton"``.

Reference: ``fasthealth/reference.py`` (SPEC section 2); record and finalisation rules: the
same as ``csrc/stats.h``. Read top to bottom: the partial record, the three kernels, the
launcher.

1. ``_chunk_stats_kernel``: one persistent launch per dtype group over a flat work list of
   (tensor, chunk) items, the tensors reached through an int64 pointer table. Each program
   reduces whole chunks, BLOCK elements at a time, every statistic from the same load: counts,
   finite min/max, block moments by two passes over registers merged with Chan's formula, a
   power-of-two scaled sum of squares (no overflow, no underflow), range counts. It writes one
   partial record per chunk: partials are sized by the number of chunks.
2. ``_merge_chunks_kernel``: one program per tensor merges that tensor's chunk records in a
   fixed order (vector blocks in closed form, then Chan), so results are deterministic.
3. ``_finalize_kernel``: program i < N turns tensor i's record into its table row; program N
   merges all tensor records into the total row.

Three launches plus one per dtype group, whatever the number of tensors. The metadata tables
are cached per set of input pointers, so a second call with the same tensors launches kernels
only (CUDA-graph capturable after one warm-up call).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from fasthealth.stats import COL, TABLE_WIDTH

# partial record layout (float64): counts as exact integers
P_N, P_FIN, P_PINF, P_NINF, P_ZERO, P_OVER, P_UNDER = 0, 1, 2, 3, 4, 5, 6
P_FMIN, P_FMAX, P_MEAN, P_M2, P_SCALE, P_SSQ = 7, 8, 9, 10, 11, 12
P_WIDTH = 13


@triton.jit
def _empty_record():
    """The record of no elements, in P_* order (extremes at +-inf, scale 0)."""
    z = tl.zeros((), tl.float64)
    lo = tl.full((), float("inf"), tl.float64)
    hi = tl.full((), -float("inf"), tl.float64)
    return z, z, z, z, z, z, z, lo, hi, z, z, z, z


@triton.jit
def _store_record(row, n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq):
    tl.store(row + 0, n)
    tl.store(row + 1, fin)
    tl.store(row + 2, pinf)
    tl.store(row + 3, ninf)
    tl.store(row + 4, zero)
    tl.store(row + 5, over)
    tl.store(row + 6, under)
    tl.store(row + 7, fmin)
    tl.store(row + 8, fmax)
    tl.store(row + 9, mean)
    tl.store(row + 10, m2)
    tl.store(row + 11, scale)
    tl.store(row + 12, ssq)


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
def _chunk_stats_kernel(ptrs, numels, chunk_tensor, chunk_start, chunk_slot, part, n_chunks,
                        thresholds, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        DTYPE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    inf = float("inf")
    hi = tl.load(thresholds).to(ACC)
    lo = tl.load(thresholds + 1).to(ACC)
    for c in range(pid, n_chunks, nprog):
        t = tl.load(chunk_tensor + c)
        start = tl.load(chunk_start + c)
        end = tl.minimum(start + CHUNK, tl.load(numels + t))
        base = tl.load(ptrs + t).to(tl.pointer_type(DTYPE))
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
            # moments of the block by two passes over registers, then Chan into the chunk
            amax = tl.max(tl.abs(xf), axis=0)
            sb = tl.where(amax > 0, tl.exp2(tl.floor(tl.log2(tl.where(amax > 0, amax, 1.0)))),
                          0.0)
            y = xf / tl.where(sb > 0, sb, 1.0)
            mean_y = tl.sum(y, axis=0) / tl.maximum(nb.to(ACC), 1.0)
            d = tl.where(fin, y - mean_y, 0.0)
            m2_y = tl.sum(d * d, axis=0)
            q_b = tl.sum(y * y, axis=0).to(tl.float64)
            s_b = sb.to(tl.float64)
            fin_n, mean, m2 = _chan(fin_n, mean, m2, nb, mean_y.to(tl.float64) * s_b,
                                    m2_y.to(tl.float64) * s_b * s_b)
            scale, ssq = _scaled(scale, ssq, s_b, q_b)
        _store_record(part + tl.load(chunk_slot + c) * 13, (end - start).to(tl.float64), fin_n,
                      pinf_n, ninf_n, zero_n, over_n, under_n, fmin, fmax, mean, m2, scale, ssq)


@triton.jit
def _merge_records(src, first, count, VBLOCK: tl.constexpr):
    """Merge records src[first : first + count] in order: vector blocks in closed form."""
    inf = float("inf")
    n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = _empty_record()
    for off in range(0, count, VBLOCK):
        k = off + tl.arange(0, VBLOCK)
        m = k < count
        rows = src + (first + k) * 13
        f_i = tl.load(rows + 1, mask=m, other=0.0)
        mean_i = tl.where(f_i > 0, tl.load(rows + 9, mask=m, other=0.0), 0.0)
        s_i = tl.load(rows + 11, mask=m, other=0.0)
        n += tl.sum(tl.load(rows + 0, mask=m, other=0.0), axis=0)
        pinf += tl.sum(tl.load(rows + 2, mask=m, other=0.0), axis=0)
        ninf += tl.sum(tl.load(rows + 3, mask=m, other=0.0), axis=0)
        zero += tl.sum(tl.load(rows + 4, mask=m, other=0.0), axis=0)
        over += tl.sum(tl.load(rows + 5, mask=m, other=0.0), axis=0)
        under += tl.sum(tl.load(rows + 6, mask=m, other=0.0), axis=0)
        fmin = tl.minimum(fmin, tl.min(tl.load(rows + 7, mask=m, other=inf), axis=0))
        fmax = tl.maximum(fmax, tl.max(tl.load(rows + 8, mask=m, other=-inf), axis=0))
        fb = tl.sum(f_i, axis=0)
        mean_b = tl.sum(f_i * mean_i, axis=0) / tl.maximum(fb, 1.0)
        dev = tl.where(f_i > 0, mean_i - mean_b, 0.0)
        m2_b = tl.sum(tl.load(rows + 10, mask=m, other=0.0) + f_i * dev * dev, axis=0)
        sb = tl.max(s_i, axis=0)
        r = tl.where(sb > 0, s_i / tl.where(sb > 0, sb, 1.0), 0.0)
        qb = tl.sum(tl.load(rows + 12, mask=m, other=0.0) * r * r, axis=0)
        fin, mean, m2 = _chan(fin, mean, m2, fb, mean_b, m2_b)
        scale, ssq = _scaled(scale, ssq, sb, qb)
    return n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq


@triton.jit
def _merge_chunks_kernel(part, chunk_first, tensor_part, VBLOCK: tl.constexpr):
    i = tl.program_id(0)
    first = tl.load(chunk_first + i)
    count = tl.load(chunk_first + i + 1) - first
    n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = _merge_records(
        part, first, count, VBLOCK)
    _store_record(tensor_part + i * 13, n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean,
                  m2, scale, ssq)


@triton.jit
def _finalize_kernel(tensor_part, table, n_tensors, VBLOCK: tl.constexpr,
                     WIDTH: tl.constexpr):
    i = tl.program_id(0)
    first = tl.where(i < n_tensors, i, 0)
    count = tl.where(i < n_tensors, 1, n_tensors)
    n, fin, pinf, ninf, zero, over, under, fmin, fmax, mean, m2, scale, ssq = _merge_records(
        tensor_part, first, count, VBLOCK)
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
    row = table + i * WIDTH
    tl.store(row + 0, n)
    tl.store(row + 1, nan_n)
    tl.store(row + 2, pinf)
    tl.store(row + 3, ninf)
    tl.store(row + 4, inf_n)
    tl.store(row + 5, zero)
    tl.store(row + 6, tl.where(bad, nan, mn))
    tl.store(row + 7, tl.where(bad, nan, mx))
    tl.store(row + 8, tl.where(bad, nan, mean_all))
    tl.store(row + 9, tl.where((nan_n > 0) | (inf_n > 0), nan, f_std))
    tl.store(row + 10, tl.where(nan_n > 0, nan, tl.where(inf_n > 0, inf, f_norm)))
    tl.store(row + 11, f_min)
    tl.store(row + 12, f_max)
    tl.store(row + 13, f_mean)
    tl.store(row + 14, f_std)
    tl.store(row + 15, f_norm)
    tl.store(row + 16, tl.where(has, tl.maximum(-fmin, fmax), nan))
    tl.store(row + 17, tl.where((nan_n == 0) & (inf_n == 0), 1.0, 0.0))
    tl.store(row + 18, over)
    tl.store(row + 19, under)


# ---- the launcher --------------------------------------------------------------------------

_TL = {
    torch.float32: (tl.float32, tl.float32), torch.float16: (tl.float16, tl.float32),
    torch.bfloat16: (tl.bfloat16, tl.float32), torch.float64: (tl.float64, tl.float64),
    torch.int8: (tl.int8, tl.float32), torch.uint8: (tl.uint8, tl.float32),
    torch.bool: (tl.int8, tl.float32), torch.int16: (tl.int16, tl.float32),
    torch.int32: (tl.int32, tl.float64), torch.int64: (tl.int64, tl.float64),
}
# Interpreted on CPU tests run small shapes: small chunks exercise the multi-chunk merge.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CHUNK = int(os.environ.get("FASTHEALTH_TRITON_CHUNK", 1024 if _INTERPRET else 65536))
BLOCK = int(os.environ.get("FASTHEALTH_TRITON_BLOCK", 256 if _INTERPRET else 2048))
VBLOCK = 128
_cache: OrderedDict = OrderedDict()
assert TABLE_WIDTH == 20 and COL["underflow_count"] == 19


def _dense(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.float()  # widened on the device: float8 loads need sm_89+ in Triton
    if t.is_contiguous():
        return t
    # a permuted dense tensor (e.g. a transpose) covers its memory exactly: read it as it lies
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t if t.permute(order).is_contiguous() else t.contiguous()


def _plan(tensors: list[torch.Tensor], device: torch.device, rng: tuple[float, float]) -> dict:
    """Device-side work lists and pointer tables, cached per set of (pointer, size, dtype)
    and thresholds: a repeated call copies nothing to the device."""
    key = (device, rng, tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors))
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    first = [0]
    for t in tensors:
        first.append(first[-1] + max(1, math.ceil(t.numel() / CHUNK)))
    groups = []
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        tensor_ix, starts, slots = [], [], []
        for j, i in enumerate(members):
            for k in range(first[i + 1] - first[i]):
                tensor_ix.append(j)
                starts.append(k * CHUNK)
                slots.append(first[i] + k)

        def dev(xs, dt):
            return torch.tensor(xs, dtype=dt).to(device, non_blocking=True)

        groups.append(dict(
            dtype=dtype, members=members,
            ptrs=dev([tensors[i].data_ptr() for i in members], torch.int64),
            numels=dev([tensors[i].numel() for i in members], torch.int64),
            chunk_tensor=dev(tensor_ix, torch.int32), chunk_start=dev(starts, torch.int64),
            chunk_slot=dev(slots, torch.int64), n_chunks=len(slots)))
    plan = dict(groups=groups, n_chunks=first[-1],
                chunk_first=torch.tensor(first, dtype=torch.int64).to(device),
                thresholds=torch.tensor(rng, dtype=torch.float64).to(device))
    _cache[key] = plan
    if len(_cache) > 32:
        _cache.popitem(last=False)
    return plan


def multi_tensor_stats_triton(tensors: list[torch.Tensor], range_hi: float = math.inf,
                              range_lo: float = 0.0) -> torch.Tensor:
    """The table [N + 1, TABLE_WIDTH] (float64) of tensors on one device."""
    if not tensors:
        raise ValueError("fasthealth: the triton backend needs at least one tensor")
    device = tensors[0].device
    dense = []
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"fasthealth: input {i} is on {t.device}, input 0 on {device}")
        d = _dense(t.detach())
        if d.dtype not in _TL:
            raise TypeError(f"fasthealth: input {i} has unsupported dtype {t.dtype}")
        dense.append(d)
    plan = _plan(dense, device, (float(range_hi), float(range_lo)))
    part = torch.empty((plan["n_chunks"], P_WIDTH), dtype=torch.float64, device=device)
    for g in plan["groups"]:
        dtype, acc = _TL[g["dtype"]]
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            grid = (min(g["n_chunks"], sms * 4),)
        else:
            grid = (min(g["n_chunks"], 4),)
        _chunk_stats_kernel[grid](g["ptrs"], g["numels"], g["chunk_tensor"], g["chunk_start"],
                                  g["chunk_slot"], part, g["n_chunks"], plan["thresholds"],
                                  CHUNK=CHUNK, BLOCK=BLOCK, DTYPE=dtype, ACC=acc)
    n = len(dense)
    tensor_part = torch.empty((n, P_WIDTH), dtype=torch.float64, device=device)
    _merge_chunks_kernel[(n,)](part, plan["chunk_first"], tensor_part, VBLOCK=VBLOCK)
    table = torch.empty((n + 1, TABLE_WIDTH), dtype=torch.float64, device=device)
    _finalize_kernel[(n + 1,)](tensor_part, table, n, VBLOCK=VBLOCK, WIDTH=TABLE_WIDTH)
    return table
