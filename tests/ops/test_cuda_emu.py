"""The CUDA backend's kernels, run on the host through tests/ops/cuda_emu/ (no GPU needed).

`csrc/cuda/stats_kernels.cuh` is compiled with g++ against a small CUDA emulation (one fiber
per CUDA thread, taking turns at the barriers of __syncthreads and warp shuffles) and a chunk
of 4096 elements instead of 65536, so small tensors cross many chunks. This checks the
kernels' logic against the reference with the tolerances of docs/spec.md section 2, and which
path (fast, shifted, slow) finished each chunk; nvcc's compilation is checked by
`make cuda-check`, speed and the GPU guarantees by the `gpu` tests on a device.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from cases import fast_path_counts, random_batch, student_t
from tolerances import check_multi

from fasthealth.ops.layout import (
    COL,
    DTYPE_CODES,
    PATH_EXACT,
    PATH_FAST,
    PATH_SHIFTED,
    TABLE_WIDTH,
)
from fasthealth.ops.reference import tensor_stats_row

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tests/ops/cuda_emu/emu.h", ROOT / "tests/ops/cuda_emu/run_kernels.cpp",
           ROOT / "csrc/cuda/stats_kernels.cuh", ROOT / "csrc/plan.h",
           ROOT / "csrc/stats.h"]
CHUNK = 4096
NAN, INF = float("nan"), float("inf")
FAST, SHIFTED, SLOW = PATH_FAST, PATH_SHIFTED, PATH_EXACT
MASKED = 3  # the CUDA kernel's masked pass (NaN/Inf chunks): its fourth path counter

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def build(chunk: int) -> Path:
    """run_kernels compiled with chunks of ``chunk`` elements (cached by source digest)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    out = ROOT / "build" / "cuda-emu" / f"run_kernels-{chunk}-{digest}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")  # pytest-xdist workers build it at once
        subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", f"-DFH_CUDA_CHUNK={chunk}",
                        "-Wall", "-Werror", "-Wno-unknown-pragmas",
                        f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'tests/cuda_emu'}", "-o", str(tmp),
                        str(ROOT / "tests/ops/cuda_emu/run_kernels.cpp")], check=True)
        tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def exe() -> Path:
    return build(CHUNK)


def test_sixteen_bit_four_wide_loads():
    """With 4096-element chunks each of the 256 threads reads two 16-byte vectors of a 16-bit
    type, so the main loop's four loads in flight never run; chunks of 32768 give each thread
    sixteen vectors: the four-wide loop runs, with fast-path counts and a misaligned view."""
    big = build(32768)
    t = fast_path_counts(23, 2 * 32768 + 101)
    h = (t * 1e-4).half()  # within float16's range (1e8 would be inf: the exact path)
    ts = [t.bfloat16(), h, t.bfloat16()[3:], h[1:]]
    skews = [0, 0, 6, 2]  # the views' bytes start 6 and 2 bytes past a 16-byte boundary
    for rng in ((math.inf, 0.0), (float(torch.finfo(torch.float8_e4m3fn).max),
                                  float(torch.finfo(torch.float8_e4m3fn).tiny))):
        table, paths = run(big, ts, skews, rng=rng)
        check_multi(table, ts, f"emulated cuda 16-bit, 32K chunks, range {rng}",
                    range_dtype=None if rng[0] == math.inf else torch.float8_e4m3fn)
        n_chunks = sum(max(1, math.ceil(x.numel() / 32768)) for x in ts)
        assert paths == (n_chunks, 0, 0, 0), paths


def run(exe: Path, tensors, skews=None, rng=(math.inf, 0.0), resident=0, merge_run=256,
        plan=False):
    """(table [N + 1, TABLE_WIDTH], chunks finished by each path: fast, shifted, slow, masked),
    and with ``plan`` the plan (chunk, items, runs, [(tensor, slot, begin, count)] in launch
    order). ``resident`` and
    ``merge_run``: the planner's limits (csrc/plan.h); resident 0 keeps chunks of CHUNK."""
    skews = skews or [0] * len(tensors)
    buf = [struct.pack("<qddqq", len(tensors), *rng, resident, merge_run)]
    for t, skew in zip(tensors, skews):
        t = t.contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
        buf.append(struct.pack("<iqq", DTYPE_CODES[t.dtype], t.numel(), skew))
        buf.append(raw.numpy().tobytes())
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d, "in"), Path(d, "out")
        src.write_bytes(b"".join(buf))
        subprocess.run([str(exe), str(src), str(dst)], check=True, timeout=300)
        data = dst.read_bytes()
    n = len(tensors)
    table = torch.frombuffer(bytearray(data[: (n + 1) * TABLE_WIDTH * 8]), dtype=torch.float64)
    at = (n + 1) * TABLE_WIDTH * 8
    paths = struct.unpack("<4q", data[at:at + 32])
    table = table.view(n + 1, TABLE_WIDTH).clone()
    if not plan:
        return table, paths
    chunk, items, runs = struct.unpack("<3q", data[at + 32:at + 56])
    rows = list(struct.iter_unpack("<4q", data[at + 56:]))
    assert len(rows) == items
    return table, paths, (chunk, items, runs, rows)


def chunks_of(tensors):
    return sum(max(1, math.ceil(t.numel() / CHUNK)) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_path_all_sizes_and_alignments(exe, dtype):
    g = torch.Generator().manual_seed(1)
    sizes = [1, 3, 7, 8, 9, 31, 255, 1024, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 20011]
    ts = [(torch.randn(n, generator=g, dtype=torch.float64) * 0.02 + 1e-3).to(dtype)
          for n in sizes]
    esize = ts[0].element_size()
    skews = [(i * esize) % 16 for i in range(len(ts))]  # heads of 0..7 elements
    table, paths = run(exe, ts, skews)
    check_multi(table, ts, f"emulated cuda {dtype}")
    # (a tensor of 1 or 3 elements may well take the shifted pass: its M2 is ~0)
    assert paths[FAST] >= chunks_of(ts) - 2 and paths[SLOW] == 0, paths


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_planted_values(exe, dtype):
    g = torch.Generator().manual_seed(2)
    ts = []
    for n in (1, 9, CHUNK + 3, 2 * CHUNK + 17):
        for plants in ([NAN], [INF], [-INF], [0.0, -0.0], [NAN, INF, -INF], [INF, -INF]):
            if len(plants) > n:
                continue
            for pos in sorted({0, n // 2, n - 1}):
                t = (torch.randn(n, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
                for k, v in enumerate(plants):
                    t[(pos + k) % n] = v
                ts.append(t)
    table, paths = run(exe, ts, [4 * (i % 4) for i in range(len(ts))])
    check_multi(table, ts, f"emulated cuda planted {dtype}")
    assert sum(paths) == chunks_of(ts)


def test_special_tensors_and_integer_dtypes(exe):
    ts = [torch.empty(0), torch.tensor([3.5]), torch.full((300,), NAN),
          torch.full((2 * CHUNK,), -INF), torch.zeros(CHUNK + 1), torch.arange(-50.0, 50.0),
          torch.empty(0, dtype=torch.bfloat16),
          torch.randint(-3, 4, (999,), dtype=torch.int8), torch.rand(777) > 0.5,
          torch.randint(0, 255, (5000,), dtype=torch.uint8),
          torch.randint(-2**15, 2**15 - 1, (300,), dtype=torch.int16),
          torch.randint(0, 2**31 - 1, (500,), dtype=torch.int32),
          torch.randint(-2**40, 2**40, (500,), dtype=torch.int64)]
    table, _ = run(exe, ts)
    check_multi(table, ts, "emulated cuda special")


def test_paths_taken(exe):
    """Each fallback is taken exactly where it should be, and only there."""
    g = torch.Generator().manual_seed(3)
    normal = torch.randn(4 * CHUNK, generator=g)
    _, paths = run(exe, [normal])
    assert paths == (4, 0, 0, 0)
    offset = 1000 + torch.randn(2 * CHUNK, generator=g)  # mean/std = 1e3: the variance cancels
    table, paths = run(exe, [offset])
    check_multi(table, [offset], "offset")
    assert paths == (0, 2, 0, 0)
    one_nan = torch.randn(3 * CHUNK, generator=g)
    one_nan[CHUNK + 5] = NAN
    table, paths = run(exe, [one_nan])
    check_multi(table, [one_nan], "one NaN")
    assert paths == (2, 0, 0, 1)  # the NaN's chunk: masked, not the slow path
    tiny = torch.randn(CHUNK, generator=g) * 1e-20  # squares below float32's normal range
    table, paths = run(exe, [tiny])
    check_multi(table, [tiny], "tiny")
    assert paths == (0, 0, 1, 0)
    huge = torch.randn(CHUNK, generator=g) * 1e25  # squares above float32's range
    table, paths = run(exe, [huge])
    check_multi(table, [huge], "huge")
    assert paths == (0, 0, 1, 0)
    wide = torch.randn(CHUNK + 1, generator=g, dtype=torch.float64)
    _, paths = run(exe, [wide])
    assert paths == (0, 0, 2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_pass_for_nonfinite_chunks(exe, dtype):
    """Chunks holding NaN/Inf take the masked pass, not the slow path: exact
    with NaN, +inf and -inf at every lane of a 16-byte vector, at the four-wide loop's edges
    and in the scalar head and tail (misaligned views), all non-finite, a 3% mix, and a mean
    that dominates (the masked shifted pass); finite values the fast path cannot serve go to
    the slow path as before."""
    g = torch.Generator().manual_seed(17)
    n = 2 * CHUNK + 37
    spots = list(range(0, 24)) + [255 * 8, 256 * 8 - 1, 4 * 256 * 8, CHUNK - 1, CHUNK, n - 1]
    ts = []
    for value in (NAN, INF, -INF):
        t = torch.randn(n, generator=g)
        t[spots] = value
        ts.append(t.to(dtype))
    mix = torch.randn(n, generator=g)
    u = torch.rand(n, generator=g)
    mix[u < 0.01] = NAN
    mix[(u >= 0.01) & (u < 0.02)] = INF
    mix[(u >= 0.02) & (u < 0.03)] = -INF
    ts += [mix.to(dtype), torch.full((n,), NAN, dtype=dtype), torch.full((n,), -INF, dtype=dtype)]
    table, paths = run(exe, ts, [2 * (i % 8) for i in range(len(ts))])
    check_multi(table, ts, f"emulated cuda masked {dtype}")
    assert paths[SLOW] == 0 and paths[MASKED] == chunks_of(ts), paths
    offset = 100 + torch.randn(2 * CHUNK, generator=g)  # mean-dominated: the masked shift
    offset[5] = NAN
    offset[CHUNK + 9] = INF
    offset = offset.to(dtype)
    table, paths = run(exe, [offset])
    check_multi(table, [offset], f"emulated cuda masked shifted {dtype}")
    assert paths == (0, 0, 0, 2), paths
    if dtype == torch.float32:
        for scale in (1e-20, 1e25):  # squares outside float32: the slow path, NaN or not
            t = torch.randn(CHUNK, generator=g) * scale
            t[3] = NAN
            table, paths = run(exe, [t])
            check_multi(table, [t], f"emulated cuda masked {scale}")
            assert paths == (0, 0, 1, 0), paths


F16, E4M3 = torch.finfo(torch.float16), torch.finfo(torch.float8_e4m3fn)


@pytest.mark.parametrize("rng", [(F16.max, F16.tiny), (E4M3.max, E4M3.tiny), (math.inf, F16.tiny),
                                 (F16.max, 0.0)], ids=["f16", "e4m3", "lo_only", "hi_only"])
def test_range_counts_on_the_masked_pass(exe, rng):
    """Chunks holding NaN/Inf count over and under among their finite elements only. The
    masked loop compares |x| itself: the infinities land in its over count and are taken out
    with the +inf/-inf counts, unless range_hi is inf (range_lo alone: then they never
    counted); zeros land in under and are taken out. Values beyond both thresholds, zeros and
    misaligned views; a count off by the non-finite elements fails here."""
    g = torch.Generator().manual_seed(29)
    n = 2 * CHUNK + 37
    t = torch.randn(n, generator=g)
    u = torch.rand(n, generator=g)
    t[u < 0.05] *= 1e6  # above float16's and float8's max
    t[(u >= 0.05) & (u < 0.1)] *= 1e-7  # below their smallest normal
    t[(u >= 0.1) & (u < 0.12)] = 0.0
    t[(u >= 0.12) & (u < 0.14)] = NAN
    t[(u >= 0.14) & (u < 0.15)] = INF
    t[(u >= 0.15) & (u < 0.16)] = -INF
    ts = [t, t.bfloat16(), t[1:], t.bfloat16()[3:]]
    hi, lo = float(rng[0]), float(rng[1])
    table, paths = run(exe, ts, [0, 0, 4, 6], rng=(hi, lo))
    assert paths[SLOW] == 0 and paths[MASKED] == chunks_of(ts), paths
    ref = torch.stack([tensor_stats_row(x, hi, lo)[-2:] for x in ts])
    assert table[:-1, -2:].tolist() == ref.tolist()
    assert table[-1, -2:].tolist() == ref.sum(0).tolist()
    assert (ref[:, 0] > 0).all() == (hi < math.inf) and (ref[:, 1] > 0).all() == (lo > 0)
    for dtype in (torch.float16, torch.float8_e4m3fn):
        if (hi, lo) == (float(torch.finfo(dtype).max), float(torch.finfo(dtype).tiny)):
            check_multi(table, ts, f"emulated cuda masked range {dtype}", range_dtype=dtype)


@pytest.mark.parametrize("lo", [float(torch.finfo(torch.float64).tiny), 5e-46],
                         ids=["range_float64", "below_half_the_smallest_subnormal"])
def test_underflow_count_when_range_lo_rounds_to_zero(exe, lo):
    """A range_lo that float32 rounds to 0 (range_dtype=torch.float64, or anything below
    about 7e-46) counts no underflow in float32, bfloat16 and float16 inputs: the fast and
    masked passes count |x| < lo with the zeros and take the zeros out afterwards, which must
    not happen when nothing was counted (it gave minus the number of zeros)."""
    g = torch.Generator().manual_seed(31)
    n = 2 * CHUNK + 37
    t = torch.randn(n, generator=g)
    t[::7] = 0.0
    t[5] = 1e-40  # a float32 subnormal: above lo once rounded (0), so not under
    nan = t.clone()
    nan[CHUNK + 3] = NAN  # that chunk takes the masked pass
    ts = [t, nan, t.bfloat16(), t.half(), t[1:]]
    hi = float(torch.finfo(torch.float64).max)
    table, paths = run(exe, ts, [0, 0, 0, 0, 4], rng=(hi, lo))
    assert paths[FAST] > 0 and paths[MASKED] >= 1 and paths[SLOW] == 0, paths
    ref = torch.stack([tensor_stats_row(x, hi, lo)[-2:] for x in ts])
    assert ref.abs().sum() == 0
    assert table[:, -2:].tolist() == [[0.0, 0.0]] * (len(ts) + 1)
    check_multi(table, ts, "emulated cuda, range_lo rounding to 0",
                range_dtype=torch.float64 if lo > 1e-300 else None)


def test_slow_path_thresholds_are_rounded_as_the_reference(exe):
    """Inputs of 32 bits or fewer compare against the thresholds rounded to float32 (the
    reference, docs/spec.md section 2), on the slow path too (integers, and float chunks that
    leave the fast path): otherwise an int32 tensor, or two chunks of one float32 tensor, would
    count one value on either side of the unrounded threshold."""
    hi = 16777219.5  # float32: 16777220
    ints = torch.tensor([16777220, 16777219, 5, -16777220, 16777218], dtype=torch.int32)
    i8 = torch.tensor([100, -100, 3], dtype=torch.int8)  # 99.99999999 rounds to 100.0
    f = torch.full((2 * CHUNK,), 16777220.0)
    f[CHUNK:] *= torch.linspace(1.0, 1e-20, CHUNK)  # the second chunk: tiny values, slow path
    f[CHUNK] = 16777220.0
    wide = torch.tensor([16777220, 16777219, 5, 16777218], dtype=torch.int64)  # unrounded
    for ts, (h, lo) in (([ints, f, wide], (hi, 0.0)), ([i8], (99.99999999, 0.0)),
                        ([ints, wide], (math.inf, 16777218.9))):
        table, paths = run(exe, ts, rng=(h, lo))
        ref = torch.stack([tensor_stats_row(x, h, lo)[-2:] for x in ts])
        assert table[:-1, -2:].tolist() == ref.tolist(), (h, lo)
    assert ref.tolist() == [[0.0, 1.0], [0.0, 2.0]]  # lo: 16777218 for int32, not for int64


def test_chunk_after_a_nan_chunk_is_read_masked_first(exe):
    """A block whose chunk held a NaN reads its next chunk masked first: the same result (bits
    included) as when the chunk comes first, one pass."""
    g = torch.Generator().manual_seed(19)
    t = torch.randn(6 * CHUNK, generator=g)
    t[7] = NAN
    table, paths = run(exe, [t])
    check_multi(table, [t], "emulated cuda masked first")
    assert paths[SLOW] == 0 and paths[MASKED] >= 2 and sum(paths) == 6, paths
    # four one-chunk tensors on a grid of three blocks: block 0 reads the NaN chunk, then the
    # last A masked first; every A row must be the same bits
    a = torch.randn(CHUNK, generator=g)
    ts = [torch.full((CHUNK,), NAN), a, a.clone(), a.clone()]
    table, paths = run(exe, ts)
    assert paths == (2, 0, 0, 2), paths
    alone, _ = run(exe, [a])
    for row in (1, 2, 3):
        assert torch.equal(table[row], alone[0]), row


def test_far_apart_extremes_leave_the_shifted_pass(exe):
    # mean-dominated (shifted pass), but (x - mean)^2 overflows float32: the slow path
    t = torch.full((CHUNK,), -1.5e19)
    t[7] = 1.5e19
    table, paths = run(exe, [t])
    check_multi(table, [t], "far apart")
    assert paths == (0, 0, 1, 0)


def test_accuracy_limits(exe):
    g = torch.Generator().manual_seed(5)
    ts = [torch.full((1000,), 1e30), torch.full((1000,), 1e30, dtype=torch.bfloat16),
          torch.full((3000,), 65504.0, dtype=torch.float16),
          (torch.randn(3 * CHUNK, generator=g) * 1e-3 + 1.0),  # mean/std = 1e3
          student_t(2, 5 * CHUNK, g),  # heavy tails
          (torch.rand(2 * CHUNK, generator=g) * 2**-30),  # small but above 2^-40
          torch.randn(CHUNK, generator=g).to(torch.bfloat16) * 3e38]
    table, _ = run(exe, ts)
    check_multi(table, ts, "emulated cuda accuracy")


def test_float64_extreme_magnitudes(exe):
    # torch's own float64 norm under/overflows here, so known answers are the oracle
    vals = (1e200, 1e-200, 1e-310, 1.7e308)
    ts = [torch.full((4,), v, dtype=torch.float64) for v in vals]
    ts.append(torch.tensor([1e200, 3.0, -1e-300, 1e160], dtype=torch.float64))
    ts.append(torch.full((CHUNK + 3,), 1e160, dtype=torch.float64))
    table, _ = run(exe, ts)
    for i, v in enumerate(vals):
        assert table[i, COL["finite_norm"]].item() == pytest.approx(2 * v, rel=1e-12), v
        assert table[i, COL["amax"]].item() == v
        assert table[i, COL["finite_mean"]].item() == pytest.approx(v, rel=1e-12)
        assert table[i, COL["finite_std"]].item() == 0.0
    assert table[4, COL["finite_norm"]].item() == pytest.approx(1e200, rel=1e-12)
    assert table[5, COL["finite_std"]].item() == 0.0  # no overflow in the spread either
    assert table[5, COL["norm"]].item() == pytest.approx(1e160 * math.sqrt(CHUNK + 3),
                                                         rel=1e-12)


@pytest.mark.parametrize("range_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_range_counts(exe, range_dtype):
    g = torch.Generator().manual_seed(6)
    t = torch.randn(3 * CHUNK + 11, generator=g, dtype=torch.float64)
    t = (t * 10 ** (torch.rand(t.numel(), generator=g, dtype=torch.float64) * 88 - 44))
    ts = [t.float(), t.bfloat16(), t, t[:100].half(), (t * 1e-40).float()]
    fi = torch.finfo(range_dtype)
    table, _ = run(exe, ts, rng=(float(fi.max), float(fi.tiny)))
    check_multi(table, ts, f"emulated cuda range {range_dtype}", range_dtype=range_dtype)
    assert table[2, -2] > 0 and table[2, -1] > 0  # both counts are exercised


@pytest.mark.parametrize("range_dtype", [torch.float16, torch.float8_e4m3fn])
def test_range_and_zero_counts_on_the_fast_path(exe, range_dtype):
    # finite float32/bfloat16 data with exact zeros, values below tiny and above max: every
    # chunk stays on the fast path, where the counts are float sums (under = |x| < lo minus
    # the zeros)
    t = fast_path_counts(16, 2 * CHUNK + 37)
    ts = [t.float(), t.bfloat16(), t.float()[1:], t.bfloat16()[3:]]
    fi = torch.finfo(range_dtype)
    # the views start 4 and 6 bytes past a 16-byte boundary, as on the device
    table, paths = run(exe, ts, [0, 0, 4, 6], rng=(float(fi.max), float(fi.tiny)))
    check_multi(table, ts, f"emulated cuda fast-path counts {range_dtype}",
                range_dtype=range_dtype)
    assert paths == (chunks_of(ts), 0, 0, 0), paths
    assert (table[:-1, -2] > 0).all() and (table[:-1, -1] > 0).all()
    zeros = table[:-1, COL["zero_count"]]
    assert zeros.tolist() == [float((x == 0).sum()) for x in ts]


@pytest.mark.slow
def test_many_mixed_tensors_and_determinism(exe):
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int32]
    ts = []
    for i in range(120):
        n = int(torch.randint(0, 3 * CHUNK, (1,), generator=g))
        t = (torch.randn(n, generator=g) * 5).to(dtypes[i % len(dtypes)])
        if n and i % 13 == 0 and t.dtype.is_floating_point:
            t[-1] = NAN
        ts.append(t)
    table, paths = run(exe, ts)
    check_multi(table, ts, "emulated cuda 120 tensors")
    again, _ = run(exe, ts)
    assert torch.equal(table.nan_to_num(7.0), again.nan_to_num(7.0))  # bitwise, NaNs aside
    assert paths[FAST] > 0 and paths[SLOW] > 0


def test_emulation_catches_a_planted_bug(exe, tmp_path):
    """Sanity of the harness itself: a kernel with a wrong tail loop must fail the checks."""
    bad = (ROOT / "csrc/cuda/stats_kernels.cuh").read_text().replace(
        "const int64_t rest = head + (end - tail);", "const int64_t rest = head;")
    assert "rest = head;" in bad
    tree = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", tree)
    (tree / "cuda/stats_kernels.cuh").write_text(bad)
    out = tmp_path / "bad"
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", f"-DFH_CUDA_CHUNK={CHUNK}",
                    f"-I{tree}", f"-I{ROOT / 'tests/cuda_emu'}", "-o", str(out),
                    str(ROOT / "tests/ops/cuda_emu/run_kernels.cpp")], check=True)
    t = torch.randn(CHUNK + 3)
    table, _ = run(out, [t])
    with pytest.raises(AssertionError):
        check_multi(table, [t], "planted bug")


@pytest.mark.slow
def test_random_batches(exe):
    """Seeded random batches of every dtype, size, magnitude and planted value, with and
    without range counts, at random misalignments."""
    for seed in range(3):
        ts = random_batch(seed, 150, 5 * CHUNK)
        skews = [(7 * i % 16) // t.element_size() * t.element_size() for i, t in enumerate(ts)]
        table, paths = run(exe, ts, skews)
        check_multi(table, ts, f"emulated cuda random batch {seed}")
        assert all(paths), paths  # every path was taken
    fi = torch.finfo(torch.bfloat16)
    table, _ = run(exe, ts, skews, rng=(float(fi.max), float(fi.tiny)))
    check_multi(table, ts, "emulated cuda random batch, range", range_dtype=torch.bfloat16)


def check_plan(plan, tensors):
    """The plan covers every element once, records land in input order, largest items first."""
    chunk, items, _, rows = plan
    assert chunk & (chunk - 1) == 0 and chunk <= CHUNK
    assert sorted(slot for _, slot, _, _ in rows) == list(range(items))
    counts = [count for _, _, _, count in rows]
    assert counts == sorted(counts, reverse=True)  # one launch group: largest first
    by_slot = sorted(rows, key=lambda r: r[1])
    covered = {}
    for tensor, _, begin, count in by_slot:  # a tensor's slots are consecutive, in order
        assert begin == covered.get(tensor, 0) and begin % chunk == 0
        covered[tensor] = begin + count
    assert [covered[i] for i in range(len(tensors))] == [t.numel() for t in tensors]
    assert [r[0] for r in by_slot] == sorted(r[0] for r in by_slot)


def test_chunk_size_from_total_work(exe):
    """With few items per block the planner halves the chunk (down to CHUNK / 8), and the
    kernels give the same statistics on the smaller, reordered items."""
    g = torch.Generator().manual_seed(11)
    ts = [torch.randn(n, generator=g) * 0.1 for n in (2 * CHUNK + 5, 700, CHUNK, 0, 3)]
    ts.append(torch.randn(CHUNK + 9, generator=g).bfloat16())
    whole, _, plan = run(exe, ts, plan=True)
    assert plan[0] == CHUNK and plan[1] == chunks_of(ts)
    check_plan(plan, ts)
    table, paths, plan = run(exe, ts, resident=3, plan=True)
    assert plan[0] < CHUNK and plan[0] >= CHUNK // 8 and plan[1] > chunks_of(ts)
    check_plan(plan, ts)
    assert sum(paths) == plan[1] - 1  # (the empty tensor's item takes no path)
    check_multi(table, ts, "emulated cuda, planned chunks")
    # the same inputs, the same plan: bit for bit the same results
    again, _ = run(exe, ts, resident=3)
    assert torch.equal(table.nan_to_num(7.0), again.nan_to_num(7.0))
    assert torch.equal(table[:, COL["numel"]], whole[:, COL["numel"]])


def test_many_blocks_keep_the_largest_chunk(exe):
    ts = [torch.randn(39 * CHUNK)]
    _, _, plan = run(exe, ts, resident=3, plan=True)
    assert plan[0] == CHUNK  # 13 full waves of 3 blocks: halving would only add item costs


@pytest.mark.slow
def test_two_level_merge(exe):
    """A tensor of many chunks is merged in runs, then per tensor: same statistics, and
    deterministic; tensors of few chunks in the same call keep their single run."""
    g = torch.Generator().manual_seed(12)
    big = torch.randn(37 * CHUNK + 11, generator=g) * 2 + 0.5
    big[5 * CHUNK + 1] = NAN
    ts = [torch.randn(100, generator=g), big, (torch.randn(9 * CHUNK, generator=g) + 3).half(),
          torch.randn(2 * CHUNK, generator=g, dtype=torch.float64)]
    one, _, p1 = run(exe, ts, plan=True)
    assert p1[2] == 0
    two, _, p2 = run(exe, ts, merge_run=4, plan=True)
    assert p2[2] == 1 + 10 + 3 + 1  # runs of at most 4 records
    check_multi(two, ts, "emulated cuda, two-level merge")
    check_multi(one, ts, "emulated cuda, one-level merge")
    again, _ = run(exe, ts, merge_run=4)
    assert torch.equal(two.nan_to_num(7.0), again.nan_to_num(7.0))
    counts = [COL[k] for k in ("numel", "nan_count", "zero_count", "min", "max")]
    assert torch.equal(one[:, counts].nan_to_num(7.0), two[:, counts].nan_to_num(7.0))
