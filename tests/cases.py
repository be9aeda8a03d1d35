"""Input generators shared by the kernel tests (seeded: the same cases every run)."""

from __future__ import annotations

import math

import torch

NAN, INF = float("nan"), float("inf")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def student_t(df: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Heavy-tailed float32 samples: normal / sqrt(chi2(df) / df)."""
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(n, df, generator=g, dtype=torch.float64).square().sum(1)
    return (z / (chi2 / df).sqrt()).float()


def random_batch(seed: int, count: int, max_numel: int) -> list[torch.Tensor]:
    """`count` tensors meant to reach every branch of a fused kernel: float and integer dtypes,
    sizes from 0 to max_numel (log-uniform), magnitudes from 1e-30 to 1e30, mean-dominated
    data, heavy tails, constant runs, and planted NaN, +-inf and zeros at random places."""
    g = torch.Generator().manual_seed(seed)

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * torch.rand((), generator=g, dtype=torch.float64).item()

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=g))]

    out = []
    for _ in range(count):
        n = 0 if uniform(0, 1) < 0.03 else int(math.exp(uniform(0, math.log(max_numel))))
        kind = pick(("normal", "offset", "heavy", "constant", "int"))
        if kind == "int":
            dtype = pick((torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool))
            t = torch.randint(-100, 100, (n,), generator=g)
            out.append(t > 0 if dtype == torch.bool else t.abs().to(dtype)
                       if dtype == torch.uint8 else t.to(dtype))
            continue
        dtype = pick(FLOAT_DTYPES)
        scale = 10 ** uniform(-30 if dtype != torch.float16 else -4, 30 if dtype not in (
            torch.float16,) else 4)
        if kind == "normal":
            t = torch.randn(n, generator=g, dtype=torch.float64) * scale
        elif kind == "offset":  # mean / std up to 1e3
            t = (10 ** uniform(0, 3) + torch.randn(n, generator=g, dtype=torch.float64)) * scale
        elif kind == "heavy":
            t = student_t(2, n, g).double() * scale
        else:
            t = torch.full((n,), scale * pick((1.0, -1.0, 0.0)), dtype=torch.float64)
        t = t.to(dtype)
        for _ in range(int(torch.randint(0, 4, (), generator=g)) if n else 0):
            t[int(torch.randint(n, (), generator=g))] = pick((NAN, INF, -INF, 0.0))
        out.append(t)
    return out


def fast_path_counts(seed: int, n: int) -> torch.Tensor:
    """float64 data for the fast paths' counts: magnitudes from 1e-8 to 1e8 (finite squares in
    float32, values below float16's and float8's tiny and above their max), exact zeros at
    every 7th place and -0.0 at every 11th from 5. Cast to float32/bfloat16 by the caller."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g, dtype=torch.float64)
    t = t * 10 ** (torch.rand(n, generator=g, dtype=torch.float64) * 16 - 8)
    t[::7] = 0.0
    t[5::11] = -0.0
    return t


class Overflowing(torch.nn.Module):
    """Linear -> Scale (overflows in float16 terms when x is large) -> ReLU -> Linear."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.amp = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 2)
        self.norm = torch.nn.LayerNorm(2)

    def forward(self, x):
        return self.norm(self.out(self.act(self.amp(self.inp(x)))))


def rounded_threshold_cases(chunk: int) -> list[tuple[list[torch.Tensor], float, float]]:
    """(tensors, range_hi, range_lo) whose counts depend on the thresholds being rounded to
    float32 for inputs of 32 bits or fewer and left alone for 64-bit ones (docs/spec.md
    section 2): int32 values on either side of 16777219.5 (float32: 16777220) and of
    16777218.9 (float32: 16777218), the same values as int64, int8 against 99.99999999
    (float32: 100), a float32 tensor whose second chunk of ``chunk`` elements leaves the fast
    path (tiny values), and a range_lo that float32 rounds to 0."""
    ints = torch.tensor([16777220, 16777219, 5, -16777220, 16777218], dtype=torch.int32)
    f = torch.full((2 * chunk,), 16777220.0)
    f[chunk:] *= torch.linspace(1.0, 1e-20, chunk)
    f[chunk] = 16777220.0
    small = torch.tensor([100, -100, 3, 0], dtype=torch.int8)
    tiny_lo = [torch.tensor([0.0, 1e-40, 3.0, 0.0]), torch.tensor([0, 2, 0], dtype=torch.int32)]
    return [([ints, ints.long(), f], 16777219.5, 0.0),
            ([ints, ints.long()], math.inf, 16777218.9),
            ([small, small.short()], 99.99999999, 0.0),
            (tiny_lo, math.inf, 5e-46)]
