"""docs/spec.md sections 4 and 5 on a CUDA device: the `cuda` and `triton` backends against
the reference, and the guarantees (no host sync, O(N) workspace, current stream, CUDA-graph
capture and replay, torch.compile without graph breaks, a number of launches independent of N).

Marked `gpu`; skipped with a reason where there is no CUDA device. On a machine with a CUDA
GPU, bench/gpu_check.sh runs them.
"""

import os

import pytest
import torch
from cases import fast_path_counts, random_batch, rounded_threshold_cases, student_t
from tolerances import check_multi

import fasthealth as fh
from fasthealth.ops import run
from fasthealth.ops.layout import COL
from fasthealth.ops.reference import tensor_stats_row

NAN, INF = float("nan"), float("inf")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# FASTHEALTH_GPU_BACKENDS=cuda (or triton) runs one backend's tests: bench/gpu_check.sh runs
# each in its own process, so that an illegal address in one cannot poison the other's
SELECTED = [b for b in os.environ.get("FASTHEALTH_GPU_BACKENDS", "cuda,triton").split(",") if b]


def gpu_backends():
    return [b for b in ("cuda", "triton") if b in fh.available_backends() and b in SELECTED]


@pytest.fixture(params=["cuda", "triton"])
def gbackend(request):
    if request.param not in SELECTED:
        pytest.skip(f"FASTHEALTH_GPU_BACKENDS={','.join(SELECTED)}")
    if request.param not in fh.available_backends():
        pytest.skip(f"backend {request.param!r} not available: {fh.ops.compiled.load_error or ''}")
    return request.param


# ---- the paths most likely to break on a device, first: bench/gpu_check.sh runs the tests in
# file order, so that these run even when the step's time runs out ---------------------------


def test_range_thresholds_as_the_reference(gbackend):
    """Range counts against the thresholds as the reference applies them: rounded to float32
    for inputs of 32 bits or fewer on every path (integers, and chunks that leave the fast
    path, included), and no negative underflow count where range_lo rounds to 0 in float32
    (range_dtype=torch.float64)."""
    for tensors, hi, lo in rounded_threshold_cases(65536):
        got = run(gbackend, [t.cuda() for t in tensors], hi, lo)[:-1, -2:].cpu()
        want = torch.stack([tensor_stats_row(t, hi, lo)[-2:] for t in tensors])
        assert got.tolist() == want.tolist(), (gbackend, hi, lo)
    t = torch.randn(3 * 65536 + 5)
    t[::7] = 0.0
    t[70_000] = NAN  # a chunk on the masked pass
    cpu = [t, t.bfloat16(), t.half(), t[1:]]
    raw = fh.multi_tensor_stats([x.cuda() for x in cpu], backend=gbackend,
                                range_dtype=torch.float64).raw.cpu()
    assert raw[:, COL["underflow_count"]].tolist() == [0.0] * 5
    check_multi(raw, cpu, f"{gbackend} range_dtype=float64", range_dtype=torch.float64)


def _nccl_worker(rank, world):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    m = torch.nn.Linear(64, 32).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
    ddp(torch.randn(8, 64, device="cuda")).sum().backward()
    fh.check_grads(ddp, process_group=dist.group.WORLD)  # the first call: the sets
    torch.cuda.set_sync_debug_mode("error")  # then two all-reduces and no host sync
    try:
        s = fh.check_grads(ddp, process_group=dist.group.WORLD)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    local = fh.check_grads(m)
    assert s.raw.device.type == "cuda"
    torch.testing.assert_close(s.total.norm, local.total.norm)
    assert s.total.numel.item() == local.total.numel.item() and s.ok
    m.weight.grad[0, 0] = float("nan")
    assert not fh.check_grads(ddp, process_group=dist.group.WORLD).ok
    _nccl_capture(ddp, m, dist.group.WORLD)
    _nccl_nan_origin(rank, world, dist.group.WORLD)


def _nccl_capture(ddp, m, group):
    """check_grads(process_group=) captured in a CUDA graph (its two all-reduces included) and
    replayed on new gradients: each replay's totals are those of an eager call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch's recipe has it
        for p in m.parameters():
            p.grad.normal_()
        fh.check_grads(ddp, process_group=group)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fh.check_grads(ddp, process_group=group)
    for k in range(3):
        for p in m.parameters():
            p.grad.normal_(std=k + 1.0)
        if k == 2:
            m.weight.grad[1, 1] = float("inf")
        graph.replay()
        torch.cuda.synchronize()
        want = fh.check_grads(m)
        torch.testing.assert_close(captured.total.norm, want.total.norm)
        assert captured.total.inf_count.item() == want.total.inf_count.item() == (k == 2)
        assert bool(captured.all_finite.item()) == (k != 2)


def _nccl_nan_origin(rank, world, group):
    """A Monitor given the DDP model on NCCL: a NaN made in the last rank's batch is named with
    its rank (the communication hook's flag rides in the step's all-reduces)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    mon = fh.Monitor(ddp, opt, process_group=group, flush_every=3)
    assert mon._origin is not None
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(8, 64, device="cuda")
        if step == 1 and rank == world - 1:
            x[0, 0] = float("nan")
        loss = ddp(x).pow(2).mean()
        loss.backward()
        mon.step(loss)
    mon.close()
    ev = [e for e in mon.events if e.kind == "nonfinite_grad"]
    assert [e.step for e in ev] == [1], [(e.step, e.kind) for e in mon.events]
    assert ev[0].details["origin_rank"] == world - 1, ev[0].details


def test_nccl_path():
    """The NCCL path on every GPU of the machine (one rank per GPU; world size 1 on a single
    GPU still runs the NCCL all-reduces on device tensors, and the all-gather of a group's first
    call): no host sync after the first call, the call captured in a CUDA graph and replayed,
    and a NaN named with the rank that made it."""
    import ranks
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    ranks.spawn(_nccl_worker, torch.cuda.device_count(), backend="nccl")


def test_triton_capture_with_a_tensor_count_never_seen():
    """Triton's kernels do not depend on the plan: after one eager call with a single float32
    tensor, a capture with 37 never-seen tensors (another item range, tensor count and scratch
    layout) needs no new kernel variant (tests/ops/test_triton_compile.py checks the keys); its
    replays are exact."""
    if "triton" not in fh.available_backends() or "triton" not in SELECTED:
        pytest.skip("triton is not available or not selected")
    fh.multi_tensor_stats([torch.randn(1000, device="cuda")], backend="triton")
    torch.cuda.synchronize()
    gpu = [torch.randn(1000 + 4099 * k, device="cuda") for k in range(37)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fh.multi_tensor_stats(gpu, backend="triton").raw
    for k in range(2):
        for t in gpu:
            t.mul_(-2.0)
        gpu[5][k] = INF
        graph.replay()
        torch.cuda.synchronize()
        check_multi(out.cpu(), [t.cpu() for t in gpu], f"triton, new tensor count, replay {k}")


def test_triton_staged_input_on_two_streams_at_once(monkeypatch):
    """Two calls at once on two streams with the same non-dense input: each stream stages into
    a buffer of its own. Stream A's kernels are held back after its staging copy (its launcher
    is Python: the test wraps it); stream B, waiting only for that copy, writes new values and
    makes its own call. With one buffer shared by both, B's copy could overwrite what A's
    kernels then read, and A report B's values."""
    if "triton" not in fh.available_backends() or "triton" not in SELECTED:
        pytest.skip("triton is not available or not selected")
    from fasthealth.triton_kernels import tensor_stats as ts

    base = torch.randn(400, 300, device="cuda")
    view = base[:, ::2]  # non-dense: staged
    fh.multi_tensor_stats([view], backend="triton")  # the kernels compiled, the buffer made
    before = view.cpu()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    a.wait_stream(torch.cuda.current_stream())
    b.wait_stream(torch.cuda.current_stream())
    copied = torch.cuda.Event()
    launch = ts._launch_chunks

    def held_back(*args):
        copied.record()  # after A's staging copy
        torch.cuda._sleep(300_000_000)  # ~0.2 s: B's whole call runs meanwhile
        launch(*args)

    monkeypatch.setattr(ts, "_launch_chunks", held_back)
    with torch.cuda.stream(a):
        out_a = fh.multi_tensor_stats([view], backend="triton").raw
    monkeypatch.setattr(ts, "_launch_chunks", launch)
    with torch.cuda.stream(b):
        b.wait_event(copied)
        base.mul_(-3.0)
        out_b = fh.multi_tensor_stats([view], backend="triton").raw
    torch.cuda.synchronize()
    check_multi(out_a.cpu(), [before], "triton, stream A (held back)")
    check_multi(out_b.cpu(), [view.cpu()], "triton, stream B")


def test_staged_inputs_on_two_streams_concurrently(gbackend):
    """Non-dense and float8 inputs on two streams at once, each stream with its own values
    for one shared view and its own tensors, many calls in flight: every result exact."""
    base = torch.randn(500, 300, device="cuda")
    shared = base[:, ::3]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    own = [[torch.randn(200, 90, device="cuda")[:, ::2],
            (torch.randn(3000, device="cuda") * (k + 1)).to(torch.float8_e4m3fn)]
           for k in range(2)]
    outs = []
    for _ in range(5):
        for k, s in enumerate(streams):
            with torch.cuda.stream(s):
                xs = [shared, *own[k]]
                outs.append((fh.multi_tensor_stats(xs, backend=gbackend).raw, k))
    torch.cuda.synchronize()
    for raw, k in outs:
        check_multi(raw.cpu(), [x.cpu() for x in [shared, *own[k]]], f"{gbackend} stream {k}")


# ---- the rest ------------------------------------------------------------------------------


def sample(seed=0, n=300):
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
    ts = []
    for i in range(n):
        size = int(torch.randint(0, 200_000 if i % 50 == 0 else 3000, (1,), generator=g))
        t = (torch.randn(size, generator=g) * 3).to(dtypes[i % len(dtypes)])
        if size and i % 17 == 0 and t.dtype.is_floating_point:
            t[size // 2] = NAN if i % 2 else INF
        ts.append(t)
    ts.append(torch.randn(300, 200).t())  # non-contiguous
    ts.append(torch.randn(1, 500).expand(40, 500))  # expanded
    return ts


def test_against_reference(gbackend):
    cpu = sample()
    gpu = [t.cuda() for t in cpu]
    s = fh.multi_tensor_stats(gpu, backend=gbackend)
    assert s.raw.device.type == "cuda"
    check_multi(s.raw.cpu(), cpu, f"{gbackend}")
    s = fh.multi_tensor_stats(gpu, backend=gbackend, range_dtype=torch.float16)
    check_multi(s.raw.cpu(), cpu, f"{gbackend} range", range_dtype=torch.float16)
    big = torch.full((1000,), 1e30, device="cuda")
    assert torch.isfinite(fh.tensor_stats(big, backend=gbackend).norm).item()


def fallback_cases():
    """Chunks for each path of the fast kernels (CHUNK = 65536 elements on the GPU)."""
    g = torch.Generator().manual_seed(3)
    c = 65536
    one_nan = torch.randn(3 * c, generator=g)
    one_nan[c + 5] = NAN
    far = torch.full((c,), -1.5e19)
    far[7] = 1.5e19
    return {
        "normal": torch.randn(4 * c + 77, generator=g),
        "bf16, unaligned": torch.randn(2 * c + 9, generator=g).bfloat16(),
        "offset (shifted pass)": 1000 + torch.randn(2 * c, generator=g),
        "one NaN (one masked chunk)": one_nan,
        "tiny (exact)": torch.randn(c, generator=g) * 1e-20,
        "huge (exact)": torch.randn(c, generator=g) * 1e25,
        "far apart (exact)": far,
        "heavy tails": student_t(2, 3 * c, g),
        "fp16 near max": torch.full((3000,), 65504.0, dtype=torch.float16),
    }


def test_every_kernel_path_against_reference(gbackend):
    for what, t in fallback_cases().items():
        x = t.cuda()
        if "unaligned" in what:  # 6 bytes past the allocation's start
            t, x = t[3:], x[3:]
        s = fh.multi_tensor_stats([x], backend=gbackend)
        check_multi(s.raw.cpu(), [t], f"{gbackend} {what}")


def test_zero_and_range_counts_on_the_fast_path(gbackend):
    # finite float32/bfloat16 chunks with zeros, values under tiny and over max: the fast path
    # counts in float and takes the zeros out of |x| < lo
    t = fast_path_counts(21, 3 * 65536 + 37)
    base = [t.float().cuda(), t.bfloat16().cuda(), t.half().cuda()]
    gpu = [*base, base[0][1:], base[1][3:]]  # views 4 and 6 bytes past alignment
    assert gpu[3].data_ptr() % 16 and gpu[4].data_ptr() % 16
    cpu = [x.cpu() for x in gpu]
    for target in (torch.float16, torch.float8_e4m3fn):
        raw = fh.multi_tensor_stats(gpu, backend=gbackend, range_dtype=target).raw.cpu()
        check_multi(raw, cpu, f"{gbackend} fast-path counts {target}", range_dtype=target)
        assert raw[:-1, COL["zero_count"]].tolist() == [float((x == 0).sum()) for x in cpu]


def test_random_batches(gbackend):
    for seed in range(4):
        cpu = random_batch(seed, 300, 400_000)
        gpu = [t.cuda() for t in cpu]
        gpu += [t[1:] for t in gpu[:50] if t.numel() > 1]  # misaligned views
        cpu += [t[1:] for t in cpu[:50] if t.numel() > 1]
        check_multi(fh.multi_tensor_stats(gpu, backend=gbackend).raw.cpu(), cpu,
                    f"{gbackend} random batch {seed}")


def test_float64_extreme_magnitudes(gbackend):
    for v in (1e200, 1e-200, 1e-310, 1.7e308):
        s = fh.tensor_stats(torch.full((4,), v, dtype=torch.float64, device="cuda"),
                            backend=gbackend)
        assert s.finite_norm.item() == pytest.approx(2 * v, rel=1e-12), v
        assert s.amax.item() == v and s.finite_std.item() == 0.0
        assert s.finite_mean.item() == pytest.approx(v, rel=1e-12), v


def test_triton_paths_on_device():
    if "triton" not in fh.available_backends():
        pytest.skip("triton is not available")
    from fasthealth.triton_kernels import tensor_stats as ts

    # (the planner may cut these tensors into chunks smaller than 65536: csrc/plan.h)
    cases = fallback_cases()
    assert set(ts.chunk_paths([cases["normal"].cuda()])) == {0}
    assert set(ts.chunk_paths([cases["offset (shifted pass)"].cuda()])) == {1}
    paths = ts.chunk_paths([cases["one NaN (one masked chunk)"].cuda()])
    assert paths.count(3) == 1 and set(paths) == {0, 3}, paths  # masked, not exact
    assert paths.index(3) == (65536 + 5) // (3 * 65536 // len(paths))  # the NaN's chunk


def test_no_host_sync(gbackend):
    gpu = [t.cuda() for t in sample(1, 50)]
    fh.multi_tensor_stats(gpu, backend=gbackend)  # warm-up: builds and caches the work list
    m = torch.nn.Linear(64, 64).cuda()  # (a copy from pageable host memory syncs: not ours)
    x = torch.randn(8, 64, device="cuda")
    m(x).sum().backward()  # the first matmul's library set-up, before the check
    m.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = fh.multi_tensor_stats(gpu, backend=gbackend)
        _ = s.total.norm, s.all_finite, s.per_tensor.nan_count
        m(x).sum().backward()
        fh.check_grads(m, backend=gbackend)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_first_call_does_not_sync(gbackend):
    # a set of tensors never seen before: the work list is built and copied to the device
    # from pinned memory, without a sync
    gpu = [torch.randn(n, device="cuda") for n in (12_345, 70_001, 3)]
    gpu.append(torch.randn(64, 33, device="cuda").t())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = fh.multi_tensor_stats(gpu, backend=gbackend)
        s = fh.multi_tensor_stats(gpu, backend=gbackend, range_dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check_multi(s.raw.cpu(), [t.cpu() for t in gpu], f"{gbackend} first call",
                range_dtype=torch.bfloat16)


def test_capture_without_warm_up_works(gbackend):
    """Tensors never seen before, first seen inside capture: the work list's copy is a node
    of the graph; every replay is exact, and an eager call with them after the capture (and
    before any replay) is exact too (it does not read the graph's buffer)."""
    gpu = [torch.randn(n, device="cuda") for n in (4321, 98_765)]  # never seen before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    eager = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    torch.cuda.synchronize()
    check_multi(eager.cpu(), [t.cpu() for t in gpu], f"{gbackend} eager after a capture")
    for k in range(3):
        for t in gpu:
            t.mul_(-3)
        gpu[1][k] = NAN
        graph.replay()
        torch.cuda.synchronize()
        check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} replay {k}, no warm-up")


def test_whole_step_capture(gbackend):
    """PyTorch's whole-network recipe: warm-up on a side stream, zero_grad(set_to_none=True),
    then capture forward + backward + check_grads + optimizer step; the gradients are
    allocated inside the capture (new pointers). Each replay's statistics are those of that
    replay's gradients, and the step is taken (the weights move)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            fh.check_grads(model, backend=gbackend)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        stats = fh.check_grads(model, backend=gbackend)
        opt.step()
    for k in range(3):
        x.copy_(torch.randn_like(x) * (k + 1))
        before = [p.detach().clone() for p in model.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        grads = [p.grad.cpu() for p in model.parameters()]
        check_multi(stats.raw.cpu(), grads, f"{gbackend} whole-step replay {k}")
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_workspace_is_small(gbackend):
    gpu = [torch.randn(1 << 20, device="cuda") for _ in range(64)]  # 256 MB of inputs
    fh.multi_tensor_stats(gpu, backend=gbackend)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fh.multi_tensor_stats(gpu, backend=gbackend)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 4 << 20, f"{extra} bytes of workspace for 64 tensors"


def test_current_stream(gbackend):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gpu = [torch.full((100_000,), 2.0, device="cuda") for _ in range(8)]
        s = fh.multi_tensor_stats(gpu, backend=gbackend)
        norm = s.total.norm * 1
    side.synchronize()
    assert norm.item() == pytest.approx(2.0 * (800_000**0.5), rel=1e-6)


def test_cuda_graph_capture_and_replay(gbackend):
    gpu = [torch.randn(50_000, device="cuda") for _ in range(10)]
    s = fh.multi_tensor_stats(gpu, backend=gbackend)  # warm-up with the same tensors
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    for t in gpu:
        t.copy_(torch.randn_like(t) * 5)
    gpu[3][7] = NAN
    graph.replay()
    torch.cuda.synchronize()
    check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} graph replay")
    assert s is not None


def test_captured_work_lists_survive_eviction(gbackend):
    """A graph keeps reading its work list at every replay: 40 other tensor sets used after the
    capture (more than the cache holds) must not evict and free it."""
    gpu = [torch.randn(30_000, device="cuda") for _ in range(6)]
    fh.multi_tensor_stats(gpu, backend=gbackend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    for k in range(40):
        fh.multi_tensor_stats([torch.randn(1000 + k, device="cuda")], backend=gbackend)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for t in gpu:
        t.copy_(torch.randn_like(t) * 3)
    graph.replay()
    torch.cuda.synchronize()
    check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} replay after 40 new sets")


def test_capture_with_float8_and_non_dense_inputs(gbackend):
    """Inputs copied before the kernels read them (float8 widened, non-dense views) are copied
    into the same buffer every call on a stream; the capture's stream stages into its own,
    which the graph refills at every replay."""
    base = torch.randn(300, 200, device="cuda")
    gpu = [base[:, ::2], (torch.randn(5000, device="cuda") * 4).to(torch.float8_e4m3fn),
           torch.randn(4000, device="cuda")]
    fh.multi_tensor_stats(gpu, backend=gbackend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    base.mul_(-3.0)
    graph.replay()
    torch.cuda.synchronize()
    check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} staged inputs in a graph")


def test_side_stream(gbackend):
    """A work list built on one stream and used on another is freed only after both."""
    gpu = [torch.randn(70_000, device="cuda") for _ in range(3)]
    fh.multi_tensor_stats(gpu, backend=gbackend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    torch.cuda.current_stream().wait_stream(side)
    check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} side stream")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_another_device_than_the_current(gbackend):
    gpu = [torch.randn(20_000, device="cuda:1") for _ in range(3)]
    with torch.cuda.device(0):
        raw = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    assert raw.device == torch.device("cuda:1")
    check_multi(raw.cpu(), [t.cpu() for t in gpu], f"{gbackend} on cuda:1, cuda:0 current")


def test_launch_count_does_not_grow_with_tensors(gbackend):
    from torch.profiler import ProfilerActivity, profile

    def kernels(n):
        gpu = [torch.randn(1000, device="cuda") for _ in range(n)]
        fh.multi_tensor_stats(gpu, backend=gbackend)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fh.multi_tensor_stats(gpu, backend=gbackend)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")

    assert kernels(10) == kernels(2000)


def test_compile_fullgraph_and_opcheck(gbackend):
    torch._dynamo.reset()

    def f(a, b):
        s = fh.multi_tensor_stats([a, b], backend=gbackend)
        return s.total.norm, s.all_finite

    a, b = torch.randn(1000, device="cuda"), torch.randn(30, 30, device="cuda")
    got = torch.compile(f, fullgraph=True)(a, b)
    want = f(a, b)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    name = "multi_tensor_stats" if gbackend == "cuda" else "multi_tensor_stats_triton"
    op = getattr(torch.ops.fasthealth, name).default
    res = torch.library.opcheck(op, ([a, b.t(), b.bfloat16()], float("inf"), 0.0))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_monitor_fused_adamw_on_gpu_skips_without_sync():
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    mon = fh.Monitor(m, opt, flush_every=100)
    x = torch.randn(16, 32, device="cuda")
    for _ in range(3):  # warm-up: the work list is built and cached on the first call
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        mon.step(loss)
    opt.zero_grad()
    loss = m(x).pow(2).mean() * NAN
    loss.backward()
    before = [p.detach().clone() for p in m.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        obs = mon.step(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert obs.skip.item()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    mon.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_blocks_of_subnormal_values(gbackend, dtype):
    """Blocks whose every value is below float32's smallest normal (the exact path): norm, mean
    and std are not flushed to zero."""
    vals = [1e-39, -3e-40, 2.5e-41] if dtype != torch.float64 else [1e-310, -3e-311, 2e-312]
    ts = [torch.tensor(vals * 1400, dtype=dtype), torch.full((4096,), vals[0], dtype=dtype)]
    raw = fh.multi_tensor_stats([t.cuda() for t in ts], backend=gbackend).raw.cpu()
    check_multi(raw, ts, f"{gbackend} subnormal blocks {dtype}")
    assert (raw[:, COL["norm"]] > 0).all() and (raw[:, COL["finite_std"]][:1] > 0).all()


def test_staged_inputs_under_a_live_graph_past_the_cache_size(gbackend):
    """A graph's staging buffers (float8 widened, non-dense views copied) are written at every
    replay: 40 other staged inputs afterwards (more than the 32 the cache keeps) must neither
    evict nor free them, nor the graph's work list."""
    base = torch.randn(300, 200, device="cuda")
    gpu = [base[:, ::2], (torch.randn(5000, device="cuda") * 4).to(torch.float8_e4m3fn),
           base.t()[::3], torch.randn(4000, device="cuda")]
    fh.multi_tensor_stats(gpu, backend=gbackend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw
    others = []
    for k in range(40):
        x = torch.randn(64 + k, 33, device="cuda")
        others.append([x[:, ::2], x.to(torch.float8_e5m2)])
        fh.multi_tensor_stats(others[-1], backend=gbackend)
    del others
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # blocks of the staging buffers' sizes: memory a freed buffer left would be handed out here
    filler = [torch.full((30_000,), 7.0, device="cuda") for _ in range(64)]
    base.mul_(-3.0)
    gpu[1].copy_((torch.randn(5000, device="cuda") * 2).to(torch.float8_e4m3fn))
    graph.replay()
    torch.cuda.synchronize()
    check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} staged inputs, live graph")
    assert all(bool((f == 7.0).all()) for f in filler)  # the replay wrote nothing freed


def test_work_list_used_from_a_side_stream_before_its_copy_lands(gbackend):
    """A new work list is copied on the current stream; used at once from another stream (with
    no wait between the streams), its kernels must still read it after the copy: the side
    stream waits on the copy's event on the device (no host sync)."""
    gpu = [torch.randn(70_000 + k, device="cuda") for k in range(64)]  # never seen before
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    torch.cuda._sleep(200_000_000)  # the copy waits behind this on the main stream
    fh.multi_tensor_stats(gpu, backend=gbackend)  # builds the list; the copy is queued
    with torch.cuda.stream(side):
        out = fh.multi_tensor_stats(gpu, backend=gbackend).raw  # the cached list, on side
    side.synchronize()
    main.synchronize()
    check_multi(out.cpu(), [t.cpu() for t in gpu], f"{gbackend} side stream before the copy")


def test_eager_cuda_path_matches_the_op():
    """Eager calls of the cuda backend skip the dispatcher (C.cuda_table): the same table, bit
    for bit, as the op; lazily negated or conjugated views go through the op."""
    if "cuda" not in fh.available_backends():
        pytest.skip("the cuda backend is not available")
    C = fh.ops.compiled.C
    cpu = sample(4, 80)
    gpu = [t.cuda() for t in cpu]
    direct = C.cuda_table(gpu, INF, 0.0)
    op = torch.ops.fasthealth.multi_tensor_stats(gpu, INF, 0.0)
    assert torch.equal(direct.nan_to_num(7.0), op.nan_to_num(7.0))
    x = torch.randn(5000, device="cuda")
    neg = torch._neg_view(x)
    assert C.cuda_table([x, neg], INF, 0.0) is None
    raw = fh.multi_tensor_stats([x, neg], backend="cuda").raw.cpu()
    check_multi(raw, [x.cpu(), -x.cpu()], "cuda, a lazily negated view")
