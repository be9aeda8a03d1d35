"""The Triton backend against the reference, on CPU tensors through Triton's interpreter.

Run in its own process with TRITON_INTERPRET=1 set before triton is imported (`make test` does
this); small sizes, since the interpreter runs the kernels in numpy. On a GPU (the `gpu`
tests) the same kernels run compiled.
"""

import math
import os

import pytest
import torch
from cases import fast_path_counts, random_batch, rounded_threshold_cases
from tolerances import check_multi, check_tensor

import fasthealth as fh
from fasthealth.ops.reference import tensor_stats_row

NAN, INF = float("nan"), float("inf")

pytestmark = [
    pytest.mark.skipif(
        "triton" not in fh.available_backends(),
        reason="triton is not installed, or TRITON_INTERPRET=1 is not set for CPU tensors"),
    # numpy's overflow warnings from inside the interpreter (inf and NaN inputs are planted)
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def row(t, **kw):
    return fh.multi_tensor_stats([t], backend="triton", **kw).raw[0]


def test_interpreter_really_runs_triton():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from fasthealth.triton_kernels import tensor_stats as ts

    assert ts.CHUNK == 1024 and ts.BLOCK == 256  # small chunks: the multi-chunk merge runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1023, 1024, 1025, 3001])
def test_planted_values(dtype, n):
    g = torch.Generator().manual_seed(n)
    for plants in ([], [NAN], [INF], [-INF], [0.0], [NAN, INF, -INF], [INF, -INF]):
        if len(plants) > n:
            continue
        for pos in {0, n // 2, n - 1}:
            t = (torch.randn(n, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
            for k, v in enumerate(plants):
                t[(pos + k) % n] = v
            check_tensor(row(t), t, f"triton {dtype} n={n} {plants}@{pos}")


def test_special_tensors_and_dtypes():
    cases = [torch.empty(0), torch.tensor(3.5), torch.full((300,), NAN),
             torch.full((2000,), -INF), torch.zeros(1500), torch.arange(-50, 50),
             torch.randint(-3, 4, (999,), dtype=torch.int8), torch.rand(777) > 0.5,
             torch.randint(0, 2**31 - 1, (500,), dtype=torch.int32),
             torch.randint(-2**40, 2**40, (500,), dtype=torch.int64),
             torch.randn(40, 60).t(), torch.randn(30, 50)[:, ::3],
             torch.randn(1, 90).expand(20, 90),
             (torch.randn(2000) * 100).to(torch.float8_e4m3fn)]
    for t in cases:
        check_tensor(row(t), t, f"triton {t.dtype} {tuple(t.shape)}")


def test_many_tensors_mixed_and_total():
    g = torch.Generator().manual_seed(4)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int32]
    ts = []
    for i in range(300):
        t = (torch.randn(int(torch.randint(0, 1500, (1,), generator=g)), generator=g) * 5)
        t = t.to(dtypes[i % len(dtypes)])
        if t.numel() and i % 31 == 0 and t.dtype.is_floating_point:
            t[-1] = NAN
        ts.append(t)
    check_multi(fh.multi_tensor_stats(ts, backend="triton").raw, ts, "triton 300 tensors")


def test_norm_overflow_and_std_accuracy():
    for dtype, v in [(torch.float32, 1e30), (torch.bfloat16, 1e30), (torch.float16, 65504.0)]:
        t = torch.full((1000,), v, dtype=dtype)
        s = fh.tensor_stats(t, backend="triton")
        assert s.norm.item() == pytest.approx(float(t[0].double()) * math.sqrt(1000), rel=1e-5)
    for off in (1e3, -1e3):
        t = off + torch.randn(5000, dtype=torch.float64)
        check_tensor(row(t.float()), t.float(), "triton mean/std=1e3 f32")
        check_tensor(row(t), t, "triton mean/std=1e3 f64")
    t = torch.randn(4000) * 1e-30
    check_tensor(row(t), t, "tiny")
    for v in (1e200, 1e-200, 1e-310, 1.7e308):  # known answers (torch's own norm overflows)
        s = fh.tensor_stats(torch.full((4,), v, dtype=torch.float64), backend="triton")
        assert s.finite_norm.item() == pytest.approx(2 * v, rel=1e-12), v
        assert s.amax.item() == v and s.finite_std.item() == 0.0
        assert s.finite_mean.item() == pytest.approx(v, rel=1e-12), v


@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_range_counts(target):
    g = torch.Generator().manual_seed(9)
    t = torch.randn(3000, generator=g) * torch.exp(torch.randn(3000, generator=g) * 15)
    t[::50] = 0.0
    t[3] = NAN
    check_multi(fh.multi_tensor_stats([t, t[:77]], backend="triton", range_dtype=target).raw,
                [t, t[:77]], f"triton range {target}", range_dtype=target)


@pytest.mark.parametrize("target", [torch.float16, torch.float8_e4m3fn])
def test_range_and_zero_counts_on_the_fast_path(target):
    # finite data with zeros, values below tiny and above max, all on the fast path (float
    # counts; under = |x| < lo minus the zeros), tails masked
    from fasthealth.triton_kernels import tensor_stats as ts

    t = fast_path_counts(19, 2 * ts.CHUNK + 37)
    ts_ = [t.float(), t.bfloat16(), t.float()[1:], t.bfloat16()[3:]]  # views: misaligned
    fi = torch.finfo(target)
    assert ts.chunk_paths(ts_, float(fi.max), float(fi.tiny)) == [0] * 12
    raw = fh.multi_tensor_stats(ts_, backend="triton", range_dtype=target).raw
    check_multi(raw, ts_, f"triton fast-path counts {target}", range_dtype=target)
    assert (raw[:-1, -2] > 0).all() and (raw[:-1, -1] > 0).all()
    assert raw[:-1, fh.stats.COL["zero_count"]].tolist() == [float((x == 0).sum()) for x in ts_]


def test_thresholds_rounded_as_the_reference():
    """Inputs of 32 bits or fewer count against the thresholds rounded to float32 (the
    reference), int32 too, whose kernel accumulates in float64; 64-bit ones against the
    doubles; a float32 chunk on the exact path against the same rounded values as the fast
    path's chunk before it."""
    from fasthealth.triton_kernels import tensor_stats as ts

    for tensors, hi, lo in rounded_threshold_cases(ts.CHUNK):
        got = ts.multi_tensor_stats_triton(tensors, hi, lo)[:-1, -2:]
        want = torch.stack([tensor_stats_row(t, hi, lo)[-2:] for t in tensors])
        assert got.tolist() == want.tolist(), (hi, lo)


def test_plan_cache_reuses_device_tables():
    # the work list cache is the CUDA backend's (csrc/work_list.h); its policy is tested for
    # both backends in tests/ops/test_plan.py
    counts = fh.ops.compiled.C.cache_counts
    xs = [torch.randn(100), torch.randn(2000)]
    fh.multi_tensor_stats(xs, backend="triton")
    before = counts()
    xs[0].add_(1.0)  # new values, same tensors: same plan
    s = fh.multi_tensor_stats(xs, backend="triton")
    assert counts() == before
    check_multi(s.raw, xs, "after in-place update")


def test_copies_of_float8_and_non_dense_inputs_are_stable():
    """Inputs the kernels cannot read as they lie get the same staging buffer every call, so the
    plan cache hits (inside a CUDA graph a fresh copy would be refused) and new values show."""
    counts = fh.ops.compiled.C.cache_counts
    base = torch.randn(64, 90)
    xs = [base[:, ::3], (torch.randn(500) * 4).to(torch.float8_e4m3fn), torch.randn(300)]
    fh.multi_tensor_stats(xs, backend="triton")
    before = counts()
    base.mul_(-2.0)
    s = fh.multi_tensor_stats(xs, backend="triton")
    assert counts() == before
    check_multi(s.raw, xs, "staged inputs after an in-place update")


def test_paths_taken():
    """The float32 fast path finishes ordinary chunks; each fallback only where it must."""
    from fasthealth.triton_kernels import tensor_stats as ts

    g = torch.Generator().manual_seed(11)
    chunk = ts.CHUNK
    assert ts.chunk_paths([torch.randn(3 * chunk, generator=g)]) == [0, 0, 0]
    assert ts.chunk_paths([torch.randn(2 * chunk, generator=g).bfloat16()]) == [0, 0]
    assert ts.chunk_paths([torch.randn(chunk + 5, generator=g).half()[1:]]) == [0, 0]  # unaligned
    offset = 1000 + torch.randn(2 * chunk, generator=g)
    assert ts.chunk_paths([offset]) == [1, 1]
    check_tensor(row(offset), offset, "offset (shifted pass)")
    one_nan = torch.randn(3 * chunk, generator=g)
    one_nan[chunk + 5] = NAN
    assert ts.chunk_paths([one_nan]) == [0, 3, 0]  # the NaN's chunk: the masked pass
    check_tensor(row(one_nan), one_nan, "one NaN (masked pass)")
    assert ts.chunk_paths([torch.randn(chunk, generator=g) * 1e-20]) == [2]  # tiny squares
    assert ts.chunk_paths([torch.randn(chunk, generator=g) * 1e25]) == [2]  # huge squares
    far = torch.full((chunk,), -1.5e19)
    far[7] = 1.5e19  # the shifted pass overflows: exact
    assert ts.chunk_paths([far]) == [2]
    check_tensor(row(far), far, "far apart extremes")
    assert ts.chunk_paths([torch.randn(chunk, dtype=torch.float64)]) == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_pass_for_nonfinite_chunks(dtype):
    """Chunks holding NaN/Inf take the masked pass (path 3), not the exact path: exact
    counts and statistics of the finite elements, with range counts; a mean that
    dominates takes the masked shifted pass; a chunk of nothing finite, and finite squares the
    fast path cannot hold, still come out right (the latter by the exact path)."""
    from fasthealth.triton_kernels import tensor_stats as ts

    g = torch.Generator().manual_seed(5)
    chunk = ts.CHUNK
    laden = torch.randn(3 * chunk, generator=g)
    laden[::7] = NAN
    laden[3::11] = INF
    laden[5::13] = -INF
    laden[chunk:2 * chunk] = NAN  # nothing finite
    laden = laden.to(dtype)
    assert ts.chunk_paths([laden]) == [3, 3, 3]
    check_tensor(row(laden), laden, f"NaN/Inf-laden {dtype}")
    wide = (laden.float() * 3e4).to(dtype)  # beyond float16's range: overflow counts too
    for t in (laden, wide):
        table = fh.multi_tensor_stats([t], backend="triton", range_dtype=torch.float16).raw
        check_multi(table, [t], f"NaN/Inf-laden {dtype} with range counts",
                    range_dtype=torch.float16)
    if dtype != torch.float16:  # (float16's own values never lie beyond its range)
        assert table[0, fh.ops.layout.COL["overflow_count"]] > 0
    # zeros, values below and above float16's range and NaN/Inf together, the last ones in
    # the masked last tile: each is counted once (under = 0 < |x| < lo, finite only)
    mixed = torch.randn(2 * chunk + 77, generator=g)
    mixed[::5] = 0.0
    mixed[1::9] = 1e-6
    mixed[2::17] = -7e4
    mixed[3::7] = NAN
    mixed[4::11] = INF
    mixed[6::13] = -INF
    mixed[-4:] = torch.tensor([NAN, 0.0, -1e-6, -INF])
    mixed = mixed.to(dtype)
    assert ts.chunk_paths([mixed]) == [3, 3, 3]
    table = fh.multi_tensor_stats([mixed], backend="triton", range_dtype=torch.float16).raw
    check_multi(table, [mixed], f"NaN/Inf, zeros and range counts {dtype}",
                range_dtype=torch.float16)
    col = fh.ops.layout.COL
    assert table[0, col["zero_count"]] == float((mixed == 0).sum())
    assert table[0, col["underflow_count"]] > 0
    offset = (100 + torch.randn(2 * chunk, generator=g)).to(dtype)
    offset[17] = NAN
    offset[chunk + 17] = -INF
    assert ts.chunk_paths([offset]) == [3, 3]
    check_tensor(row(offset), offset, f"masked shifted {dtype}")
    if dtype == torch.float32:
        huge = torch.randn(chunk, generator=g) * 1e25
        huge[3] = NAN
        assert ts.chunk_paths([huge]) == [2]
        check_tensor(row(huge), huge, "huge squares and a NaN")


def test_torch_compile_fullgraph():
    """Under torch.compile the Triton launcher is one opaque op (a fake gives its shape)."""
    torch._dynamo.reset()

    def f(a, b):
        s = fh.multi_tensor_stats([a, b], backend="triton")
        return s.total.norm, s.all_finite, s.per_tensor.nan_count

    a, b = torch.randn(3000), torch.randn(40, 30)
    b[3, 3] = NAN
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, b)
    want = f(a, b)
    assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(got, want))
    assert got[1].item() is False and got[2].tolist() == [0, 1]
    op = torch.ops.fasthealth.multi_tensor_stats_triton.default
    res = torch.library.opcheck(op, ([a, b.t(), b.bfloat16()], float("inf"), 0.0),
                                test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_random_batch():
    """A seeded random batch of every dtype, size, magnitude and planted value."""
    from fasthealth.triton_kernels import tensor_stats as ts

    batch = random_batch(1, 60, 4 * ts.CHUNK)
    batch += [t[1:] for t in batch[:20] if t.numel() > 1]  # misaligned views
    check_multi(fh.multi_tensor_stats(batch, backend="triton").raw, batch, "triton random")
    assert set(ts.chunk_paths(batch)) == {0, 1, 2, 3}  # every path was taken


def test_planned_chunks_and_two_level_merge(monkeypatch):
    """The planner's smaller chunks (a device of a few programs) and the two-level merge (runs
    of two records) give the same statistics, bit for bit the same on a second call."""
    from fasthealth.triton_kernels import tensor_stats as ts

    g = torch.Generator().manual_seed(31)
    big = torch.randn(9 * ts.CHUNK + 7, generator=g)
    big[3 * ts.CHUNK + 1] = float("nan")
    xs = [torch.randn(50, generator=g), big, torch.randn(3 * ts.CHUNK, generator=g).bfloat16(),
          torch.randn(2 * ts.CHUNK + 3, generator=g, dtype=torch.float64)[1:]]
    one = fh.multi_tensor_stats(xs, backend="triton").raw
    monkeypatch.setattr(ts, "RESIDENT_CPU", 3)
    monkeypatch.setattr(ts, "MERGE_RUN", 2)
    paths = ts.chunk_paths(xs)
    assert len(paths) > sum(max(1, -(-x.numel() // ts.CHUNK)) for x in xs)  # smaller chunks
    two = fh.multi_tensor_stats(xs, backend="triton").raw
    check_multi(two, xs, "triton, planned chunks, two-level merge")
    again = fh.multi_tensor_stats(xs, backend="triton").raw
    assert torch.equal(two.nan_to_num(7.0), again.nan_to_num(7.0))
    counts = [fh.stats.COL[k] for k in ("numel", "nan_count", "zero_count", "min", "max")]
    assert torch.equal(one[:, counts].nan_to_num(7.0), two[:, counts].nan_to_num(7.0))


def test_last_program_counter_is_zeroed_and_reset():
    """_merge_finalize_kernel's counter: the chunk launch zeroes whatever the scratch memory
    held (a count left at garbage would leave the total row unwritten), and the program that
    writes the total resets it, ready for a graph replay."""
    from fasthealth.triton_kernels import tensor_stats as ts

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(700, generator=g), torch.randn(40, generator=g).bfloat16()]
    done = torch.full((1,), 12345, dtype=torch.int32)
    ts._work_list(xs, math.inf, 0.0, done)
    assert int(done) == 0
    # the whole call through the kernels directly: the count ends at 0, the total is right
    n = len(xs)
    tensor_part = torch.full((n * ts.layout.PARTIAL_WIDTH + 1,), 3.0, dtype=torch.float64)
    done = tensor_part[n * ts.layout.PARTIAL_WIDTH:].view(torch.int32)
    (buf, n_items, _, _, _), part = ts._work_list(xs, math.inf, 0.0, done)
    table = torch.full((n + 1, ts.layout.TABLE_WIDTH), 7.0, dtype=torch.float64)
    first = buf.view(torch.int64)[4 * n_items:]
    ts._merge_finalize_kernel[(n,)](part, first, tensor_part, table, done, n,
                                    VBLOCK=ts.VBLOCK, WIDTH=ts.layout.TABLE_WIDTH)
    assert done.tolist() == [0, int(done[1])]
    check_multi(table, xs, "triton, merge and finalize in one launch")


def test_views_of_a_work_list_are_made_once_and_bounded(monkeypatch):
    """The launcher's typed views of a work list's buffer are made on its first call and
    reused while the cache returns that buffer; alternating plans stay right, and the cache of
    views keeps at most VIEWS_KEPT buffers."""
    from fasthealth.triton_kernels import tensor_stats as ts

    monkeypatch.setattr(ts, "_VIEWS", {})
    monkeypatch.setattr(ts, "VIEWS_KEPT", 2)
    g = torch.Generator().manual_seed(9)
    sets = [[torch.randn(300 + 50 * k, generator=g), torch.randn(9, generator=g).half()]
            for k in range(3)]
    _, first = ts._plan(sets[0], math.inf, 0.0)
    _, again = ts._plan(sets[0], math.inf, 0.0)
    assert again is first and again.buf.data_ptr() == first.buf.data_ptr()
    for xs in sets + sets[:1]:  # the first plan's views were dropped, then made again
        check_multi(ts.multi_tensor_stats_triton(xs), xs, "triton, views cached")
    assert len(ts._VIEWS) == 2
    assert all(v.buf is not None and id(v.buf) == k for k, v in ts._VIEWS.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_first_after_a_nonfinite_chunk(monkeypatch, dtype):
    """A program whose chunk held NaN/Inf reads its next chunk masked first (as the CUDA kernel
    does): a NaN-laden tensor is read once per chunk, not twice. A finite chunk read that way
    gives the same record, and the program goes back to the fast pass after it."""
    from fasthealth.triton_kernels import tensor_stats as ts

    monkeypatch.setattr(ts, "RESIDENT_CPU", 1)  # one program takes the chunks in order
    g = torch.Generator().manual_seed(17)
    chunk = ts.CHUNK
    x = torch.randn(5 * chunk, generator=g)
    x[3] = NAN
    x[3 * chunk + 9] = -INF
    x[4 * chunk:] += 1000  # the masked shifted pass, read masked first
    x = x.to(dtype)
    # chunk 1 (finite) and chunk 4 (finite) follow a non-finite chunk: masked; 2 went back
    assert ts.chunk_paths([x]) == [3, 3, 0, 3, 3]
    check_tensor(row(x), x, f"masked first {dtype}")
    monkeypatch.setattr(ts, "RESIDENT_CPU", 0)  # four programs: chunk 4 follows chunk 0
    assert ts.chunk_paths([x]) == [3, 0, 0, 3, 3]
    check_tensor(row(x), x, f"masked first, four programs {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wait_all", [False, True])
def test_in_flight_dependency_changes_no_bit(dtype, wait_all):
    """_in_flight's or-ed dependency (opaque is 0) leaves every tile bit for bit as loaded,
    NaN payloads, signed zeros, infinities and subnormals included, in both of its forms."""
    from triton_probes import in_flight_kernel

    g = torch.Generator().manual_seed(3)
    block = 64
    t = (torch.randn(4 * block, generator=g) * 10).to(dtype)
    bits = t.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
    t[:8] = torch.tensor([NAN, -NAN, INF, -INF, 0.0, -0.0, 1e-40, -1e-40]).to(dtype)
    bits[8] = 0x7FC5 if dtype.itemsize == 2 else 0x7FC00123  # a NaN with a payload
    out = torch.empty(8 * block, dtype=torch.float32)
    in_flight_kernel[(1,)](t, out, 4 * block, BLOCK=block, WAIT_ALL=wait_all)
    got, plain = out.view(torch.int32).split(4 * block)
    assert torch.equal(got, plain)
    a = t.float().abs()
    kept = ~((a > 0) & (a < torch.finfo(dtype).tiny))  # (the interpreter flushes bfloat16's
    assert torch.equal(got[kept], t.float().view(torch.int32)[kept])  # subnormals to zero)
