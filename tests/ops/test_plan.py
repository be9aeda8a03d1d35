"""The GPU backends' work plan (csrc/plan.h) and their work-list and staging cache
(csrc/work_list.h), on CPU tensors: one implementation serves both backends, so each policy is
tested here once per backend's way of calling it (the CUDA launcher's one launch group and
limits, the Triton launcher's groups per dtype and alignment and its limits). What needs a
device (the stream order, a real graph) is in tests/ops/test_gpu.py, for both backends.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import fasthealth as fh

C = fh.ops.compiled.C
pytestmark = pytest.mark.skipif(C is None, reason="fasthealth._C is not built")

CUDA_LIMITS = list(C.cuda_plan_limits(396)) if C is not None else []
TRITON_LIMITS = [65536, 8192, 132 * 2, 65536 // 32, 256]  # the launcher's, on an H200
# (grouped, limits) as each backend calls the cache
BACKENDS = {"cuda": (False, CUDA_LIMITS), "triton": (True, TRITON_LIMITS)}


def items_of(numels, chunk):
    return sum(max(1, math.ceil(n / chunk)) for n in numels)


def expected_chunk(numels, limits):
    """plan.h's chunk policy restated: the power of two in [min, max] that minimises
    ceil(items / resident) * (chunk + item_cost); ties to the larger."""
    max_chunk, min_chunk, resident, cost, _ = limits
    if resident <= 0:
        return max_chunk
    best = None
    chunk = max_chunk
    while chunk >= min_chunk:
        t = math.ceil(items_of(numels, chunk) / resident) * (chunk + cost)
        if best is None or t < best[0]:
            best = (t, chunk)
        chunk //= 2
    return best[1]


def check_plan(numels, groups, limits):
    chunk, items, group_begin, first, runs, run_first = C.plan(numels, groups, limits)
    assert chunk == expected_chunk(numels, limits)
    n = len(numels)
    assert first == [0] + [sum(max(1, math.ceil(x / chunk)) for x in numels[:i + 1])
                           for i in range(n)]
    assert sorted(s for _, s, _, _ in items) == list(range(first[-1]))
    for t, s, begin, count in items:  # slot s is chunk (s - first[t]) of tensor t
        assert first[t] <= s < first[t + 1] and begin == (s - first[t]) * chunk
        assert count == max(0, min(chunk, numels[t] - begin))
    n_groups = max(groups) + 1
    assert len(group_begin) == n_groups + 1 and group_begin[-1] == len(items)
    for g in range(n_groups):  # each launch group: its tensors' items, largest first
        part = items[group_begin[g]:group_begin[g + 1]]
        assert all(groups[t] == g for t, _, _, _ in part)
        counts = [c for _, _, _, c in part]
        assert counts == sorted(counts, reverse=True)
        # equal sizes keep input order: the plan depends on the inputs only
        assert part == sorted(part, key=lambda it: (-it[3], it[1]))
    merge_run = limits[4]
    if max(first[i + 1] - first[i] for i in range(n)) <= merge_run:
        assert runs == [] and run_first == []
    else:
        assert runs[0] == 0 and runs[-1] == first[-1] and len(run_first) == n + 1
        for i in range(n):
            own = runs[run_first[i]:run_first[i + 1] + 1]
            assert own[0] == first[i] and own[-1] == first[i + 1]
            assert all(0 < b - a <= merge_run for a, b in zip(own, own[1:]))
    return chunk, items, runs


def test_plan_policy_on_random_inputs():
    rng = random.Random(5)
    for trial in range(60):
        n = rng.choice([1, 3, 40, 300])
        numels = [rng.choice([0, 1, 7, 4096, 65536, 65537, 300_000, 3_000_000])
                  for _ in range(n)]
        groups = [rng.randrange(3) for _ in range(n)] if trial % 2 else [0] * n
        if trial % 2:  # groups are numbered in first-seen order
            order = list(dict.fromkeys(groups))
            groups = [order.index(g) for g in groups]
        limits = list(rng.choice([CUDA_LIMITS, TRITON_LIMITS]))
        limits[2] = rng.choice([0, 1, 8, 396])
        limits[4] = rng.choice([2, 256])
        check_plan(numels, groups, limits)
        assert C.plan(numels, groups, limits) == C.plan(numels, groups, limits)


def gpt2_small():
    d, v, ctx, layers = 768, 50257, 1024, 12
    shapes = [v * d, ctx * d]
    for _ in range(layers):
        shapes += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return shapes + [d, d]


def test_gpt2_small_fills_the_last_wave():
    """GPT-2 small on an H200 (132 SMs, 3 blocks each): 64K chunks make 5.04 waves, so the last
    wave holds 4% of the work and the estimate pays 6 full waves; the planner picks smaller
    chunks with less idle time in the last wave."""
    numels = gpt2_small()
    items64k = items_of(numels, 65536)
    assert 5 < items64k / 396 < 5.1
    chunk, items, _ = check_plan(numels, [0] * len(numels), CUDA_LIMITS)
    assert chunk < 65536
    waves = math.ceil(len(items) / 396)
    work = sum(numels)
    # the slowest block's chunks against the average block's elements
    assert waves * chunk / (work / 396) < 6 * 65536 / (work / 396)


def test_a_huge_tensor_is_merged_in_two_levels():
    numels = [7_000_000_000, 1000, 5]
    chunk, items, runs = check_plan(numels, [0, 0, 0], CUDA_LIMITS)
    assert chunk == 65536 and len(items) > 100_000
    assert len(runs) - 1 == math.ceil(items_of([numels[0]], chunk) / CUDA_LIMITS[4]) + 2


def test_unknown_device_size_keeps_the_largest_chunk():
    limits = list(CUDA_LIMITS)
    limits[2] = 0
    assert C.plan([10, 100_000], [0, 0], limits)[0] == limits[0]


# ---- the cache, as each backend calls it ---------------------------------------------------

def call(tensors, backend, capturing=False, params=()):
    grouped, limits = BACKENDS[backend]
    return C.work_list(tensors, grouped, capturing, limits, list(params))


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return request.param


def test_same_tensors_same_list(backend):
    xs = [torch.randn(100), torch.randn(70_000), torch.randn(3, 5).t()]
    first = call(xs, backend)
    before = C.cache_counts()
    xs[0].add_(1.0)  # new values, same tensors
    again = call(xs, backend)
    assert again[0].data_ptr() == first[0].data_ptr() and C.cache_counts() == before
    assert call(xs[:2], backend)[0].data_ptr() != first[0].data_ptr()  # another set
    assert call(xs, backend, params=[1.0])[0].data_ptr() != first[0].data_ptr()


def test_groups(backend):
    xs = [torch.randn(64), torch.randn(64).double(), torch.randn(65)[1:], torch.randn(9)]
    groups = call(xs, backend)[4]
    if backend == "cuda":
        assert len(groups) == 1
    else:  # (dtype code, aligned): float32 aligned, float64, float32 misaligned
        codes = fh.ops.layout.DTYPE_CODES
        assert [(c, a) for c, a, _, _ in groups] == [
            (codes[torch.float32], True), (codes[torch.float64], True),
            (codes[torch.float32], False)]


def test_a_list_first_seen_inside_capture_is_built_pinned_and_kept_from_eager_calls(backend):
    """Whole-step capture allocates the gradients inside the capture: their work list is
    first seen there. It is built (its copy a node of the graph), pinned, and found by a
    later capture; an eager call with the same tensors builds its own (the captured one's
    device buffer holds the list only after a replay)."""
    xs = [torch.randn(1234), torch.randn(17)]
    before = C.cache_counts()
    captured = call(xs, backend, capturing=True)
    after = C.cache_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)  # one more, pinned
    assert call(xs, backend, capturing=True)[0].data_ptr() == captured[0].data_ptr()
    eager = call(xs, backend)
    assert eager[0].data_ptr() != captured[0].data_ptr()
    assert torch.equal(eager[0], captured[0])  # the same plan
    assert C.cache_counts()[0] == after[0] + 1


def other_sets(k, staged=False):
    """k sets of tensors never seen before (with float8 and non-dense ones: new staging)."""
    out = []
    for i in range(k):
        x = torch.randn(50 + i, 4)
        out.append([x[:, ::2], x.to(torch.float8_e5m2)] if staged else [x])
    return out


def test_lists_found_under_capture_outlive_eviction(backend):
    xs = [torch.randn(3000), torch.randn(40)]
    built = call(xs, backend)
    pinned = C.cache_counts()[1]
    call(xs, backend, capturing=True)  # a graph now reads it at every replay
    assert C.cache_counts()[1] == pinned + 1
    keep = other_sets(40)  # (kept alive: freed pointers could come back as the same key)
    for s in keep:
        call(s, backend)
    counts = C.cache_counts()
    assert counts[0] - counts[1] <= 32  # unpinned ones were evicted
    assert call(xs, backend)[0].data_ptr() == built[0].data_ptr()  # the pinned one was not


def test_staged_inputs_under_capture_outlive_eviction(backend):
    """float8 and non-dense inputs are copied into the same staging buffer every call; one
    used under capture stays (the graph writes it at every replay) past 40 other staged
    inputs, so its work list still hits; unpinned staging buffers are bounded."""
    base = torch.randn(300, 20)
    xs = [base[:, ::2], (torch.randn(500) * 4).to(torch.float8_e4m3fn), torch.randn(77)]
    built = call(xs, backend)
    call(xs, backend, capturing=True)
    staged_pinned = C.cache_counts()[3]
    keep = other_sets(40, staged=True)
    for s in keep:
        call(s, backend)
    counts = C.cache_counts()
    assert counts[3] == staged_pinned and counts[2] - counts[3] <= 32
    assert call(xs, backend)[0].data_ptr() == built[0].data_ptr()


def test_unpinned_lists_are_bounded(backend):
    keep = other_sets(40)
    for s in keep:
        call(s, backend)
    counts = C.cache_counts()
    assert counts[0] - counts[1] <= 32 and counts[2] - counts[3] <= 32


def test_bad_inputs_are_named(backend):
    with pytest.raises(TypeError, match="input 1"):
        call([torch.randn(3), torch.randn(3) + 1j], backend)
    with pytest.raises(TypeError, match="input 1 is a str"):
        call([torch.randn(3), "x"], backend)
    with pytest.raises(ValueError):
        call([], backend)


def test_device_buffer_layout(backend):
    """The buffer both launchers read (work_list.h): the plan's items (32 bytes each: pointer,
    begin, count, slot, dtype, tensor), then first, runs and run_first, then the parameters."""
    grouped, limits = BACKENDS[backend]
    limits = list(limits)
    limits[4] = 2  # runs of two records: the two-level layout
    xs = [torch.randn(5), torch.randn(3 * 65536 + 1), torch.randn(7).double(), torch.empty(0)]
    buf, n_items, n_runs, chunk, groups = C.work_list(xs, grouped, False, limits, [2.5, 0.5])
    want = C.plan([x.numel() for x in xs], [0, 0, 1, 0] if grouped else [0] * 4, limits)
    assert chunk == want[0] and n_items == len(want[1]) and n_runs == len(want[4]) - 1
    b64, b32, n = buf.view(torch.int64), buf.view(torch.int32), len(xs)
    rows = b64[:4 * n_items].view(n_items, 4)
    rows32 = b32[:8 * n_items].view(n_items, 8)
    got = [(int(r32[7]), int(r32[5]), int(r[1]), int(r32[4])) for r, r32 in zip(rows, rows32)]
    assert got == list(want[1])  # (tensor, slot, begin, count), in launch order
    for r, r32 in zip(rows, rows32):
        t = xs[int(r32[7])]
        assert int(r[0]) == t.data_ptr()
        assert int(r32[6]) == fh.ops.layout.DTYPE_CODES[t.dtype]
    at = 4 * n_items
    assert b64[at:at + n + 1].tolist() == want[3]
    at += n + 1
    assert b64[at:at + n_runs + 1].tolist() == want[4]
    at += n_runs + 1
    assert b64[at:at + n + 1].tolist() == want[5]
    at += n + 1
    assert buf.view(torch.float64)[at:].tolist() == [2.5, 0.5]


@pytest.mark.skipif(C is None or not hasattr(C, "cuda_table"), reason="no CUDA kernels built")
def test_eager_cuda_table_refuses_what_is_not_plain_cuda():
    """The eager CUDA path reads plain CUDA tensors straight from the list; anything else (here
    CPU tensors) returns None, and ops.run then calls the op through the dispatcher."""
    assert C.cuda_table([torch.randn(3)], math.inf, 0.0) is None
    assert C.cuda_table([torch.randn(3), "x"], math.inf, 0.0) is None
