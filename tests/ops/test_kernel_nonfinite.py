"""The CPU kernel's masked paths: blocks holding NaN/Inf are split into their
finite lanes in the vector loop, never handed whole to a scalar path. Against
fasthealth/ops/reference.py: NaN, +inf and -inf at every lane of the widest vector and its
second load, at block (4096) and chunk (65536) edges and in the scalar tail; mixed with the
finite magnitudes that send a block to the shifted or the wide path; dense and sparse mixes;
a chunk whose later blocks go masked first after a NaN (finite ones, shifted ones, extremes).

Run once per CPU kernel variant by `make test` (FASTHEALTH_CPU_ISA=avx512, avx2, avx, base).
"""

import pytest
import torch
from tolerances import check_multi, check_tensor

import fasthealth as fh

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
BLOCK, CHUNK = 4096, 65536


def base(n, dtype, seed=0, offset=0.0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


def table(tensors, backend):
    return fh.multi_tensor_stats(tensors, backend=backend).raw


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_lane_and_edge(backend, dtype):
    # 3 blocks and a tail: positions 0..63 cover every lane of two iterations of the widest
    # loop (2 x 16 float32 lanes), then the block edges and the last elements (scalar tail)
    n = 3 * BLOCK + 77
    spots = list(range(64)) + [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK + 31,
                               3 * BLOCK - 1, 3 * BLOCK, n - 5, n - 1]
    tensors = []
    for value in (NAN, INF, -INF):
        for pos in spots:
            t = base(n, dtype, seed=pos)
            t[pos] = value
            tensors.append(t)
    check_multi(table(tensors, backend), tensors, f"{dtype} one non-finite value")
    # two kinds in one vector, and every kind in one block
    t = base(n, dtype, seed=1)
    t[[3, 5, 18, 4100, 4101, 9000]] = torch.tensor([NAN, INF, -INF, INF, -INF, NAN]).to(dtype)
    check_tensor(table([t], backend)[0], t, f"{dtype} kinds mixed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5, 0.99])
def test_dense_and_sparse_mixes(backend, dtype, density):
    n = CHUNK + 3 * BLOCK + 13  # two chunks, the second short
    g = torch.Generator().manual_seed(int(density * 1000))
    t = base(n, dtype, seed=7, scale=0.02)
    u = torch.rand(n, generator=g)
    t[u < density / 3] = NAN
    t[(u >= density / 3) & (u < 2 * density / 3)] = INF
    t[(u >= 2 * density / 3) & (u < density)] = -INF
    t[(u > 0.999)] = 0.0
    check_tensor(table([t], backend)[0], t, f"{dtype} density {density}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_all_nonfinite_blocks_and_chunks(backend, dtype, fill):
    sizes = [1, 17, 64, BLOCK, BLOCK + 1, CHUNK + 5]
    tensors = [torch.full((n,), fill, dtype=dtype) for n in sizes]
    # all non-finite but for one finite element, at a block's start, middle and end
    for pos in (0, 2049, BLOCK - 1):
        t = torch.full((BLOCK * 2,), fill, dtype=dtype)
        t[pos] = -3.5
        tensors.append(t)
    check_multi(table(tensors, backend), tensors, f"{dtype} all {fill}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_with_shifted_and_wide_blocks(backend, dtype):
    # NaN/Inf in blocks that the float lanes also refuse for their finite values: a mean that
    # dominates (the shifted path), magnitudes past 2^60 and below 2^-40 (the wide path), an
    # outlier at the block's start (the shift's first finite element), float32's extremes
    # whose squares overflow float32, and (float64) magnitudes for the exact scalar path.
    n = 2 * BLOCK + 99
    cases = {"mean 900": base(n, dtype, offset=900.0 if dtype != torch.bfloat16 else 90.0),
             "mean -8": base(n, dtype, offset=-8.0)}
    if dtype in (torch.float32, torch.float64):
        cases["huge"] = base(n, dtype, scale=1e30)
        cases["tiny"] = base(n, dtype, scale=1e-30)
        cases["near max"] = torch.full((n,), 3e38, dtype=dtype)
    if dtype == torch.float64:
        cases["1e150"] = base(n, dtype, scale=1e150)  # past 2^480: the scalar path
        cases["1e-150"] = base(n, dtype, scale=1e-150)
    if dtype == torch.float16:
        cases["near max"] = torch.full((n,), 65000.0, dtype=dtype)
    tensors, names = [], []
    for name, t in cases.items():
        for plant in ("first", "spread"):
            x = t.clone()
            if plant == "first":  # the shift would take element 0: it is NaN here
                x[0] = NAN
                x[BLOCK] = INF
            else:
                x[5::301] = NAN
                x[7::503] = -INF
            tensors.append(x)
            names.append(f"{name} {plant}")
    got = table(tensors, backend)
    for i, (x, name) in enumerate(zip(tensors, names)):
        check_tensor(got[i], x, f"{dtype} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_after_a_nan_in_the_chunk(backend, dtype):
    # After its first NaN block a chunk reads its later blocks masked first: finite blocks,
    # a block whose mean dominates, a block of extremes, an all-Inf block and a short last
    # block must come out as the unmasked paths would.
    parts = [base(BLOCK, dtype, seed=1), base(BLOCK, dtype, seed=2),
             base(BLOCK, dtype, seed=3, offset=8.0), base(BLOCK, dtype, seed=4),
             torch.full((BLOCK,), INF, dtype=dtype), base(1000, dtype, seed=5)]
    if dtype in (torch.float32, torch.float64):
        parts[3] = base(BLOCK, dtype, seed=4, scale=1e25)
    parts[0][100] = NAN
    t = torch.cat(parts)
    clean = torch.cat(parts[1:4] + parts[5:])
    got = table([t, clean], backend)
    check_tensor(got[0], t, f"{dtype} later blocks masked")
    check_tensor(got[1], clean, f"{dtype} the same blocks unmasked")


def test_masked_result_matches_unmasked_bitwise(backend):
    # The masked path sums the finite lanes in the unmasked path's order: a finite block read
    # masked (after a NaN block of its chunk) gives the same bits as read alone.
    blocks = base(BLOCK * 4, torch.float32, seed=9).view(4, BLOCK)
    nan_block = torch.full((BLOCK,), NAN)
    got = table([torch.cat([nan_block, blocks.flatten()]), blocks.flatten()], backend)
    from fasthealth.ops.layout import COL
    for name in ("finite_norm", "finite_mean", "finite_std", "finite_min", "finite_max"):
        assert got[0][COL[name]].item() == got[1][COL[name]].item(), name
