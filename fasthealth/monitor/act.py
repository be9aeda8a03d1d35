"""What the monitor does to a step, on the device: clip with the norm already computed, and
step the optimizer or skip it.

Skipping never reads the verdict on the host when it can avoid it: torch.optim's fused kernels
(Adam/AdamW/SGD/Adagrad with ``fused=True``, CPU or CUDA) take a ``found_inf`` tensor and skip
the update on the device; a ``GradScaler`` already skips through its own ``found_inf``, which
the verdict joins; any other optimizer costs one ``bool()`` per step.
"""

from __future__ import annotations

import torch


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """``clip_grad_norm_``'s rule with the global ``norm`` already computed: no second pass."""
    coef = (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """torch.optim's fused kernels read ``optimizer.found_inf`` and skip the update on device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def first_step_creates_garbage(optimizer: torch.optim.Optimizer) -> bool:
    """Fused SGD with momentum creates its buffers with empty_like on the first step, even when
    found_inf skips that step: a skipped first step would leave garbage momentum behind."""
    return isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0) != 0 and any(
            optimizer.state.get(p, {}).get("momentum_buffer") is None for p in g["params"])
        for g in optimizer.param_groups
    )


def step_with_scaler(optimizer: torch.optim.Optimizer, scaler, bad: torch.Tensor,
                     guard: bool) -> torch.Tensor:
    """``scaler.step`` and ``update``; with ``guard`` the verdict ``bad`` joins the scaler's
    own overflow check. Returns whether the step was skipped (0-dim bool, on bad's device)."""
    state = scaler._per_optimizer_states[id(optimizer)]
    found = state.get("found_inf_per_device", {})
    if guard:
        for f in found.values():
            f.copy_(torch.maximum(f, bad.to(f.device, f.dtype)))
    skipped = sum((f.to(bad.device) for f in found.values()),
                  torch.zeros((), device=bad.device)) > 0
    scaler.step(optimizer)
    scaler.update()
    return skipped


def step_or_skip(optimizer: torch.optim.Optimizer, bad: torch.Tensor, guard: bool
                 ) -> torch.Tensor:
    """Steps unless ``guard`` and ``bad``; returns whether it skipped (0-dim bool tensor)."""
    if not guard:
        optimizer.step()
        return torch.zeros_like(bad)
    if supports_found_inf(optimizer) and not first_step_creates_garbage(optimizer):
        optimizer.grad_scale = None
        optimizer.found_inf = bad.float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        return bad
    if not bool(bad):  # the one host sync per step for optimizers without found_inf
        optimizer.step()
    return bad
