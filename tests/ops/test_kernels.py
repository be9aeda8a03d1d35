"""Every compiled CPU backend against fasthealth/ops/reference.py, on planted special values,
all dtypes, sizes around vector widths, block (4096) and chunk (65536) boundaries, odd layouts
and many tensors.

Run twice by `make test`: once with the CPU kernel chosen for this machine and once with
FASTHEALTH_CPU_ISA=base (the portable kernel).
"""

import math

import pytest
import torch
from cases import random_batch
from tolerances import check_multi, check_tensor

import fasthealth as fh
from fasthealth.ops.layout import COL
from fasthealth.ops.reference import tensor_stats_row

NAN, INF = float("nan"), float("inf")
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
SIZES = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257,
         2047, 2048, 2049, 4095, 4096, 4097, 8193, 65535, 65536, 65537, 150001]
PLANTS = {
    "none": [],
    "nan": [NAN],
    "posinf": [INF],
    "neginf": [-INF],
    "zero": [0.0],
    "nan+inf": [NAN, INF],
    "both_inf": [INF, -INF],
    "all_three": [NAN, INF, -INF],
}


def planted(n, dtype, plants, where, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
    pos = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    for k, v in enumerate(plants):
        t[(pos + k) % n] = v
    return t


def stats_row(t, backend):
    return fh.multi_tensor_stats([t], backend=backend).raw[0]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_planted_values_every_size(backend, dtype, n, where):
    for name, plants in PLANTS.items():
        if len(plants) > n:
            continue
        t = planted(n, dtype, plants, where, seed=n)
        check_tensor(stats_row(t, backend), t, f"{dtype} n={n} {name}@{where}")


@pytest.mark.parametrize("dtype", FLOATS)
def test_all_nonfinite_and_all_zero(backend, dtype):
    for n in (1, 5, 3000):
        for fill in (NAN, INF, -INF, 0.0, -0.0, 1.0):
            t = torch.full((n,), fill, dtype=dtype)
            check_tensor(stats_row(t, backend), t, f"{dtype} n={n} all {fill}")
        t = torch.full((n,), NAN, dtype=dtype)
        t[::2] = INF
        check_tensor(stats_row(t, backend), t, f"{dtype} n={n} nan/inf mix")


@pytest.mark.parametrize("dtype", INTS)
def test_integer_and_bool(backend, dtype):
    g = torch.Generator().manual_seed(1)
    for n in (1, 9, 4099, 70000):
        if dtype == torch.bool:
            t = torch.rand(n, generator=g) > 0.5
        else:
            info = torch.iinfo(dtype)
            lo, hi = max(info.min, -1000), min(info.max, 1000)
            t = torch.randint(lo, hi + 1, (n,), generator=g, dtype=dtype)
            t[0] = info.max
            t[-1] = info.min
        check_tensor(stats_row(t, backend), t, f"{dtype} n={n}")


def test_empty_and_zero_dim(backend):
    for dtype in FLOATS + INTS:
        for t in (torch.empty(0, dtype=dtype), torch.empty(3, 0, dtype=dtype)):
            row = stats_row(t, backend)
            check_tensor(row, t, f"empty {dtype}")
            s = fh.tensor_stats(t, backend=backend)
            assert s.numel.item() == 0 and s.norm.item() == 0 and math.isnan(s.min.item())
    for v in (1.5, NAN, -INF, 0.0):
        t = torch.tensor(v)
        check_tensor(stats_row(t, backend), t, f"0-dim {v}")


def test_non_contiguous_and_expanded(backend):
    base = planted(64 * 300, torch.float32, [NAN, INF], "middle").reshape(64, 300)
    views = {
        "transposed": base.t(),
        "sliced": base[:, ::3],
        "row_slice": base[5:40],
        "permuted3d": base.reshape(8, 8, 300).permute(2, 0, 1),
        "expanded": torch.randn(1, 700).expand(50, 700),
        "expanded_scalar": torch.tensor(2.5).expand(1000),
        "negative_step_flip": base.flip(0),
        "bf16_transposed": base.bfloat16().t(),
    }
    for name, v in views.items():
        check_tensor(stats_row(v, backend), v, name)


def test_many_tensors_mixed_dtypes(backend):
    g = torch.Generator().manual_seed(7)
    dtypes = FLOATS + [torch.int32, torch.int64, torch.bool]
    tensors = []
    for i in range(3000):
        n = int(torch.randint(0, 300, (1,), generator=g))
        dt = dtypes[i % len(dtypes)]
        t = (torch.randn(n, generator=g) * 10).to(dt)
        if n and i % 97 == 0:
            t[n // 2] = NAN if dt.is_floating_point else 0
        if n and i % 89 == 0 and dt.is_floating_point:
            t[0] = -INF
        tensors.append(t)
    check_multi(fh.multi_tensor_stats(tensors, backend=backend).raw, tensors, "3000 tensors")


def test_large_chunked_tensors_and_total(backend):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(300_001, generator=g) * 0.02, torch.randn(131_072, generator=g).double(),
               torch.randn(70_000, generator=g).bfloat16(), torch.randn(65_537, generator=g).half()]
    tensors[0][123_456] = INF
    check_multi(fh.multi_tensor_stats(tensors, backend=backend).raw, tensors, "large")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_does_not_overflow(backend, dtype):
    big = 1e30 if dtype != torch.float16 else 65504.0
    t = torch.full((1000,), big, dtype=dtype)
    s = fh.tensor_stats(t, backend=backend)
    want = float(t[0].double()) * math.sqrt(1000)
    assert math.isfinite(s.norm.item())
    assert s.norm.item() == pytest.approx(want, rel=1e-5)
    assert s.finite_norm.item() == pytest.approx(want, rel=1e-5)
    check_tensor(stats_row(t, backend), t, f"{dtype} {big}")


def test_float16_near_max_mixed(backend):
    t = torch.full((4096,), 65504.0, dtype=torch.float16)
    t[::2] = -65504.0
    check_tensor(stats_row(t, backend), t, "fp16 +-65504")
    assert math.isfinite(fh.tensor_stats(t, backend=backend).norm.item())


def test_float64_extreme_magnitudes_exact_norm(backend):
    # float64 subnormals square to 0 and magnitudes near float64's maximum square to inf: the
    # reference's norm and the kernel's both scale, and agree with the closed form
    for v in (1e200, 1e-200, 1e-310, 1.7e308):
        t = torch.full((4,), v, dtype=torch.float64)
        s = fh.tensor_stats(t, backend=backend)
        assert s.finite_norm.item() == pytest.approx(2 * v, rel=1e-12), v
        assert s.amax.item() == v and s.finite_mean.item() == pytest.approx(v, rel=1e-12)
        ref = tensor_stats_row(t)
        assert ref[COL["norm"]].item() == pytest.approx(2 * v, rel=1e-12), v
        if v < 1e300:  # the reference's float64 mean and std overflow at 1.7e308 (torch's sum)
            check_tensor(stats_row(t, backend), t, f"float64 {v}")
    # blocks of float64 subnormals, mixed signs and magnitudes
    t = torch.tensor([1e-310, -3e-311, 2e-312] * 1400, dtype=torch.float64)
    check_tensor(stats_row(t, backend), t, "float64 subnormal block")
    assert tensor_stats_row(t)[COL["norm"]].item() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("offset", [900.0, -900.0, 8.0])
def test_std_accuracy_when_mean_dominates(backend, dtype, offset):
    # Up to the limit of docs/spec.md section 2 (|mean|/std <= 1e3; the check skips rows past
    # it, so the offsets stay inside it whatever the sample's std): sums of x and x^2 alone
    # would cancel here (at 8, sum x^2 / M2 = 65, past the fast path's budget of 32), so the
    # kernel must notice and recompute those blocks.
    g = torch.Generator().manual_seed(11)
    if dtype == torch.bfloat16:
        offset /= 10  # its 8-bit mantissa cannot hold 900 +- 1
    t = (offset + torch.randn(1_000_003, generator=g, dtype=torch.float64)).to(dtype)
    ref = t.double()
    assert abs(ref.mean().item()) / ref.std().item() < 1e3  # inside what check_tensor checks
    check_tensor(stats_row(t, backend), t, f"{dtype} mean/std={offset}")


def test_std_with_outlier_at_block_start(backend):
    # The fast float32 path shifts by each block's first element; an outlier there must not
    # cost accuracy (the kernel detects the cancellation and recomputes the block).
    g = torch.Generator().manual_seed(5)
    t = torch.randn(65536 * 3, generator=g)
    t[::2048] = 1e4
    t[1::4096] = -3e5
    check_tensor(stats_row(t, backend), t, "outliers at block starts")
    tiny = torch.randn(10_000, generator=g) * 1e-30  # below the fast path's range
    check_tensor(stats_row(tiny, backend), tiny, "tiny values")
    huge = torch.randn(10_000, generator=g) * 1e30
    check_tensor(stats_row(huge, backend), huge, "huge values")


def test_float8_inputs(backend):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8 dtypes")
    x = torch.randn(5000) * 50
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = x.to(dt)
        check_tensor(stats_row(t, backend), t, str(dt))
    nan8 = torch.tensor([float("nan"), 1.0, -448.0]).to(torch.float8_e4m3fn)
    check_tensor(stats_row(nan8, backend), nan8, "e4m3fn nan")
    inf8 = torch.tensor([float("inf"), 2.0, -57344.0]).to(torch.float8_e5m2)
    check_tensor(stats_row(inf8, backend), inf8, "e5m2 inf")


def test_inputs_not_modified(backend):
    ts = [planted(5000, dt, [NAN, INF], "middle") for dt in FLOATS]
    before = [t.clone() for t in ts]
    fh.multi_tensor_stats(ts, backend=backend)
    for a, b in zip(ts, before):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    if "cpu" not in fh.available_backends():
        pytest.skip("needs the compiled CPU kernel (the torch reference would need 17 GB)")
    n = 2**31 + 100
    t = torch.zeros(n, dtype=torch.int8)
    t[2**31 + 7] = 3
    t[-1] = -5
    t[2**31 - 1] = 1
    s = fh.tensor_stats(t)
    assert s.numel.item() == n
    assert s.zero_count.item() == n - 3
    assert s.min.item() == -5 and s.max.item() == 3
    assert s.finite_norm.item() == pytest.approx(math.sqrt(35), rel=1e-6)
    assert s.mean.item() == pytest.approx(-1 / n, rel=1e-4)
    del t
    b = torch.zeros(n, dtype=torch.bfloat16)
    b[-1] = NAN
    b[2**31 + 3] = 2.0
    s = fh.tensor_stats(b)
    assert s.nan_count.item() == 1 and s.numel.item() == n and s.zero_count.item() == n - 2
    assert s.finite_max.item() == 2.0 and s.finite_norm.item() == 2.0


def test_random_batches(backend):
    """Seeded random batches of every dtype, size, magnitude and planted value (tests/cases.py),
    with misaligned views and range counts."""
    for seed in range(2):
        ts = random_batch(seed, 200, 300_000)
        ts += [t[1:] for t in ts[:40] if t.numel() > 1]
        check_multi(fh.multi_tensor_stats(ts, backend=backend).raw, ts, f"random {seed}")
    s = fh.multi_tensor_stats(ts, backend=backend, range_dtype=torch.float16)
    check_multi(s.raw, ts, "random, range", range_dtype=torch.float16)
