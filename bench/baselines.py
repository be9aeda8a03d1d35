"""What people run instead of fasthealth: the baselines the benchmarks time and the tests check.

Kept in the package so that `bench/`, `fasthealth bench` and `tests/` use the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def naive_loop(tensors: Sequence[torch.Tensor]) -> dict[str, float | bool]:
    """The usual hand-written check: per tensor isnan().any(), isinf().any(), norm(), .item().

    One host sync per tensor per check, as in the guides this project replaces.
    """
    any_nan = any_inf = False
    sq = 0.0
    for t in tensors:
        if torch.isnan(t).any().item():
            any_nan = True
        if torch.isinf(t).any().item():
            any_inf = True
        sq += t.norm().item() ** 2
    return {"any_nan": any_nan, "any_inf": any_inf, "total_norm": sq**0.5}


def naive_full_loop(tensors: Sequence[torch.Tensor]) -> list[dict[str, float]]:
    """The same loop computing fasthealth's full statistic set, one .item() per value."""
    out = []
    for t in tensors:
        d = t.double() if t.dtype != torch.float64 else t
        finite = torch.isfinite(d)
        out.append({
            "nan_count": torch.isnan(d).sum().item(),
            "posinf_count": (d == float("inf")).sum().item(),
            "neginf_count": (d == float("-inf")).sum().item(),
            "zero_count": (d == 0).sum().item(),
            "min": d.min().item(),
            "max": d.max().item(),
            "mean": d.mean().item(),
            "std": d.std().item(),
            "norm": torch.linalg.vector_norm(d).item(),
            "finite_count": finite.sum().item(),
            "amax": d.abs().max().item(),
        })
    return out


def foreach_norm(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Plain torch._foreach_norm: one norm per tensor, no flag. What any fused check must beat."""
    return torch._foreach_norm(list(tensors))


def foreach_norm_isfinite(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch._foreach_norm plus a count of non-finite elements: norms and one flag, no stats."""
    norms = torch._foreach_norm(list(tensors))
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    nonfinite = torch.stack([torch.isfinite(t).logical_not().sum() for t in tensors]).sum()
    return total, nonfinite


def total_norm_isfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What a user writes in one line instead: torch's own fused global norm
    (``torch.nn.utils.get_total_norm``) and whether it is finite. One statistic, one flag."""
    return torch.isfinite(torch.nn.utils.get_total_norm(list(tensors)))


def grad_holders(tensors: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose ``.grad`` are ``tensors``, for ``clip_grad_norm``. Each parameter is one
    element expanded to the gradient's shape, so that a 7B-sized set does not need a second
    14 GB for weights that clipping never reads."""
    out = []
    for t in tensors:
        p = torch.nn.Parameter(t.new_zeros(()).expand(t.shape))
        p.grad = t
        out.append(p)
    return out


def clip_grad_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, what training loops already run every step: the total
    norm, then every gradient scaled in place by min(1, max_norm / norm) without a host sync
    (reads the gradients twice and writes them once). max_norm is infinite: the scale is 1,
    the gradients keep their values."""
    return torch.nn.utils.clip_grad_norm_(params, float("inf"))


def read_limit(flat: torch.Tensor) -> torch.Tensor:
    """A plain reduction over one flat buffer of the same bytes: how fast memory can be read."""
    return flat.sum()


def copy_limit(flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A copy of that buffer: reads and writes, the other common bandwidth yardstick."""
    return out.copy_(flat)
