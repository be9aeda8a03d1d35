"""Optimizer state: the tensors behind a torch.optim optimizer, named after their parameters."""

from __future__ import annotations

import torch


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, param_names: dict[int, str] | None = None
) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of every floating state tensor, e.g. ``"fc.weight.exp_avg_sq"``."""
    names, tensors = [], []
    k = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            pname = (param_names or {}).get(id(p), f"param{k}")
            k += 1
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    names.append(f"{pname}.{key}")
                    tensors.append(value)
    return names, tensors
