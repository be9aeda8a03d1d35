"""What the monitor does to a step, on the device: clip with the norm already computed, and
step the optimizer or skip it. ``step_*`` take the step themselves (``Monitor.step``);
``arm_skip`` only prepares the optimizer's next step, for a trainer that takes it
(``Monitor.check``, the framework callbacks, ``fh.watch``).

Skipping never reads the verdict on the host when it can avoid it: torch.optim's fused kernels
(Adam/AdamW/SGD/Adagrad with ``fused=True``, CPU or CUDA) take a ``found_inf`` tensor and skip
the update on the device; a ``GradScaler`` already skips through its own ``found_inf``, which
the verdict joins; any other optimizer costs one ``bool()`` per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..ops.layout import COL
from .precursors import PrecursorProbe
from .record import DeviceRecord, not_measured
from .skip_rule import SkipRule


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """``clip_grad_norm_``'s rule with the global ``norm`` already computed: no second pass."""
    coef = (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)
    dense = [g for g in grads if not g.is_sparse]
    if dense:
        torch._foreach_mul_(dense, coef)
    for g in grads:
        if g.is_sparse:
            g.mul_(coef)


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


def unwrap(optimizer):
    """The torch.optim optimizer inside a trainer's wrapper (accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer), which is the one whose step reads ``found_inf``."""
    for attr in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return unwrap(inner)
    return optimizer


def unscaled(optimizer: torch.optim.Optimizer, scaler) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` was called since its last ``update``."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def unscale(optimizer: torch.optim.Optimizer, scaler) -> None:
    """``scaler.unscale_`` unless this step's gradients were unscaled already."""
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def join_scaler(optimizer: torch.optim.Optimizer, scaler, bad: torch.Tensor) -> torch.Tensor:
    """The verdict ``bad`` joins the scaler's own overflow check, so that ``scaler.step`` skips;
    returns whether it will (0-dim bool, on bad's device)."""
    found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
    for f in found.values():
        f.copy_(torch.maximum(f, bad.to(f.device, f.dtype)))
    return sum((f.to(bad.device) for f in found.values()),
               torch.zeros((), device=bad.device)) > 0


def step_with_scaler(optimizer: torch.optim.Optimizer, scaler, bad: torch.Tensor,
                     guard: bool) -> torch.Tensor:
    """``scaler.step`` and ``update``; with ``guard`` the verdict ``bad`` joins the scaler's
    own overflow check. Returns whether the step was skipped (0-dim bool, on bad's device).
    A step without a single gradient (a forgotten backward: the ``no_grad`` rule's case) has
    nothing to step, and ``scaler.step`` would raise on it ("No inf checks were recorded"):
    neither is called, and the scaler's record of the step is dropped, as ``update`` drops it."""
    if not scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device"):
        scaler._per_optimizer_states.pop(id(optimizer), None)
        return bad if guard else torch.zeros_like(bad)
    skipped = join_scaler(optimizer, scaler, bad if guard else torch.zeros_like(bad))
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
        # what torch's fused step()s read (as GradScaler sets them), absent from its stubs
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]  # set above, as found_inf
            del optimizer.found_inf  # type: ignore[attr-defined]
        return bad
    if not bool(bad):  # the one host sync per step for optimizers without found_inf
        optimizer.step()
    return bad


def arm_skip(optimizer: torch.optim.Optimizer, bad: torch.Tensor, scaler=None
             ) -> torch.Tensor:
    """Makes the optimizer's next step a no-op when ``bad``, without taking it: through the
    scaler's overflow check, or ``found_inf`` (kept until ``disarm``), or, for optimizers
    without it, by dropping the gradients (torch.optim leaves parameters without a gradient,
    and their state, untouched; one host sync). Returns whether the step will be skipped."""
    if scaler is not None:
        return join_scaler(optimizer, scaler, bad)
    if supports_found_inf(optimizer) and not first_step_creates_garbage(optimizer):
        # what torch's fused step()s read (as GradScaler sets them), absent from its stubs
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
        return bad
    if bool(bad):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    return bad


def disarm(optimizer: torch.optim.Optimizer, *args) -> None:
    """Takes ``arm_skip``'s ``found_inf`` away after the step (an optimizer step post-hook)."""
    for attr in ("grad_scale", "found_inf"):
        if attr in optimizer.__dict__:
            delattr(optimizer, attr)


class Gate:
    """The Monitor's hand on the optimizer: the spike verdict (``on_spike="skip"``), the step
    or its skip, and the precursors' measurement around it. ``guard``: whether anything may be
    skipped (``on_nonfinite`` "skip"/"raise", or spike skipping); without it the step is plain
    (no ``found_inf``, no sync)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, scaler: Any,
                 record: DeviceRecord, device: torch.device, *, guard: bool,
                 skip_rule: SkipRule | None, precursors: PrecursorProbe | None) -> None:
        self.optimizer, self.scaler, self.record, self.device = optimizer, scaler, record, device
        self.guard, self.skip_rule, self.precursors = guard, skip_rule, precursors
        self._post_hook: Any = None  # the optimizer step post-hook of check()
        self._pending: tuple[int, int] | None = None  # (slot, step) of check()'s last row

    def spike(self, loss: Any, total: torch.Tensor, bad: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(whether ``on_spike="skip"`` skips this step, the rule's two scores), on the device;
        None without the rule. ``bad``: the step is non-finite."""
        if self.skip_rule is None:
            return None
        loss = not_measured(self.device) if loss is None else loss.to(self.device,
                                                                       torch.float64)
        return self.skip_rule.update(loss, total[COL["norm"]], ~bad)

    def act(self, t: int, bad: torch.Tensor, take_step: bool) -> torch.Tensor:
        """Steps, or skips when ``bad``; without ``take_step`` arms the skip of the trainer's
        own step instead. Returns whether the step is skipped (0-dim bool)."""
        opt = self.optimizer
        if opt is None:
            return torch.zeros_like(bad)
        if self.precursors is not None:
            self.precursors.before_step(t)
        if take_step:
            if self.scaler is not None:
                skipped = step_with_scaler(opt, self.scaler, bad, self.guard)
            else:
                skipped = step_or_skip(opt, bad, self.guard)
            if self.precursors is not None:
                self.precursors.after_step()
            return skipped
        if self._post_hook is None:
            self._post_hook = opt.register_step_post_hook(self._after_trainer_step)
        self._pending = (self.record.fill, t)
        return arm_skip(opt, bad, self.scaler)

    def skip_pending(self) -> None:
        """Makes the trainer's step that ``check`` armed (not taken yet) a skip: its gradients
        were computed on weights a rollback has just replaced."""
        if self.optimizer is not None and self._pending is not None:
            arm_skip(self.optimizer, torch.ones((), dtype=torch.bool, device=self.device),
                     self.scaler)

    def _after_trainer_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        """After a trainer's own step (``Monitor.check``): the skip disarmed, the update
        measured into that step's row."""
        disarm(optimizer)
        if self.precursors is not None and self._pending is not None:
            self.precursors.after_step()
            self.record.put(*self._pending, self.precursors.ratio_scalars())
        self._pending = None

    def precursor_scalars(self) -> dict[str, torch.Tensor]:
        """The precursors' fields this step measured (none without precursors)."""
        return {} if self.precursors is None else self.precursors.scalars()

    def remove(self) -> None:
        if self._post_hook is not None:
            self._post_hook.remove()
            self._post_hook = None
