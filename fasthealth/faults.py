"""Planted faults, to check a run's monitoring before a long run: what the evaluations plant,
as a public tool.

- ``flip_bit(t, index, bit)``: one bit of one element of a floating tensor flipped in place,
  as a GPU's silent data corruption flips one (float32: bits 0-22 the mantissa, 23-30 the
  exponent, 31 the sign; bfloat16 and float16 their own layouts, ``BITS``).
- ``BitFlip(module, at, bit, where=...)``: that flip in a module's matmul output at its
  ``at``-th call (counted from 0): the forward's output (``"forward"``), the gradient the
  module hands back to its input (``"grad_input"``), or its weight's gradient
  (``"grad_weight"``), in an element drawn at random (``seed``) unless ``element`` says which.
  A handle: ``remove()`` takes the hooks off; ``flipped`` holds (call, index, value before,
  value after) once it has fired.
- ``nan_sample(batch, sample=0)``: one sample's first value of a float tensor made NaN (a copy).
- ``scaled_lr(optimizer, factor)``: a context in which every group's rate is ``factor`` times
  what it was (an LR burst), put back after.
- ``corrupt_weight(param, factor=1e4)``: its largest element times ``factor``, in place.
- ``stuck(loader, at)``: a loader that serves its ``at``-th batch again and again from there on.

Nothing here runs unless called: the package never plants a fault by itself.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

BITS = {torch.float32: 32, torch.float64: 64, torch.bfloat16: 16, torch.float16: 16}
"""Bits per element of the floating types ``flip_bit`` flips."""
_INT = {32: torch.int32, 64: torch.int64, 16: torch.int16}


def flip_bit(t: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flips bit ``bit`` (0: the lowest) of element ``index`` of the flattened ``t``, in place;
    returns (the value before, the value after). ``t`` must be contiguous, of a type in
    ``BITS``."""
    if t.dtype not in BITS:
        raise TypeError(f"fasthealth.faults.flip_bit: a floating tensor of {sorted(map(str, BITS))}"
                        f" is needed, got {t.dtype}")
    width = BITS[t.dtype]
    if not 0 <= bit < width:
        raise ValueError(f"fasthealth.faults.flip_bit: bit must be in [0, {width}) for "
                         f"{t.dtype}, got {bit}")
    if not t.is_contiguous():
        raise ValueError("fasthealth.faults.flip_bit: t must be contiguous (a view of it is "
                         "changed in place)")
    flat = t.detach().view(-1)
    if not -flat.numel() <= index < flat.numel():
        raise IndexError(f"fasthealth.faults.flip_bit: index {index} is outside a tensor of "
                         f"{flat.numel()} elements")
    before = float(flat[index])
    ints = flat.view(_INT[width])
    mask = torch.tensor(1, dtype=_INT[width], device=t.device) << bit
    if bit == width - 1:  # the sign bit: 1 << (width-1) is the type's minimum
        mask = torch.tensor(torch.iinfo(_INT[width]).min, dtype=_INT[width], device=t.device)
    ints[index] ^= mask
    return before, float(flat[index])


class BitFlip:
    """One bit flipped in ``module``'s output (``where="forward"``), in the gradient it hands
    back to its input (``"grad_input"``: the backward's matmul output), or in its weight's
    gradient (``"grad_weight"``), at its ``at``-th call, element ``element`` of the flattened
    tensor, or one drawn uniformly with ``seed`` (a GPU's fault lands on any element; what it
    does depends on the value: the top exponent bit multiplies a value below 2 by 2^128 and
    divides one of 2 or more by as much). The module is typically an ``nn.Linear``; any module
    whose output (or input gradient) is one floating tensor works."""

    WHERE = ("forward", "grad_input", "grad_weight")

    def __init__(self, module: torch.nn.Module, at: int, bit: int, where: str = "forward",
                 element: int | None = None, seed: int = 0) -> None:
        if where not in self.WHERE:
            raise ValueError(f"fasthealth.faults.BitFlip: where must be one of {self.WHERE}, "
                             f"got {where!r}")
        if at < 0:
            raise ValueError(f"fasthealth.faults.BitFlip: at must be >= 0, got {at}")
        self.module, self.at, self.bit, self.where, self.element = module, at, bit, where, element
        self.seed = seed
        self.calls = 0
        self.flipped: tuple[int, int, float, float] | None = None
        self._handles = [module.register_forward_hook(self._forward)]
        if where == "grad_input":
            self._handles.append(module.register_full_backward_hook(self._grad_input))
        elif where == "grad_weight":
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter):
                raise ValueError("fasthealth.faults.BitFlip: where='grad_weight' needs a module "
                                 "with a .weight parameter")
            self._handles.append(weight.register_post_accumulate_grad_hook(self._grad_weight))

    def _due(self) -> bool:
        return self.flipped is None and self.calls - 1 == self.at

    def _flip(self, t: torch.Tensor) -> None:
        i = self.element if self.element is not None else int(torch.randint(
            t.numel(), (), generator=torch.Generator().manual_seed(self.seed)))
        before, after = flip_bit(t, i, self.bit)
        self.flipped = (self.at, i, before, after)

    def _forward(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        self.calls += 1
        if self.where == "forward" and self._due() and isinstance(out, torch.Tensor):
            out = out.clone()  # the output as autograd saw it stays; the flipped one goes on
            self._flip(out)
            return out
        return None

    def _grad_input(self, module: torch.nn.Module, grad_in: Any, grad_out: Any) -> Any:
        if self._due() and grad_in and isinstance(grad_in[0], torch.Tensor):
            g = grad_in[0].clone()
            self._flip(g)
            return (g, *grad_in[1:])
        return None

    def _grad_weight(self, p: torch.Tensor) -> None:
        if self._due() and p.grad is not None:
            self._flip(p.grad)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def nan_sample(batch: torch.Tensor, sample: int = 0) -> torch.Tensor:
    """A copy of ``batch`` (a float tensor, samples along dim 0) whose sample ``sample`` has
    its first value NaN."""
    if not batch.is_floating_point():
        raise TypeError(f"fasthealth.faults.nan_sample: a float tensor is needed, got "
                        f"{batch.dtype} (plant a NaN in an embedding row for token ids)")
    out = batch.clone()
    out[sample].view(-1)[0] = float("nan")
    return out


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every param group's learning rate times ``factor`` inside the block, put back after
    (unless something set it anew meanwhile: a scheduler's own rate is kept)."""
    old = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * factor
    set_to = [g["lr"] for g in optimizer.param_groups]
    try:
        yield
    finally:
        for g, lr, mine in zip(optimizer.param_groups, old, set_to):
            if g["lr"] == mine:
                g["lr"] = lr


def corrupt_weight(param: torch.Tensor, factor: float = 1e4) -> tuple[int, float]:
    """``param``'s largest element (in magnitude) times ``factor``, in place; returns (its
    flattened index, its value before)."""
    with torch.no_grad():
        flat = param.view(-1)
        i = int(flat.abs().argmax())
        before = float(flat[i])
        flat[i] *= factor
    return i, before


def stuck(loader: Iterable[Any], at: int) -> Iterator[Any]:
    """The batches of ``loader``, then, from its ``at``-th on (counted from 0), that batch
    again and again: a loader stuck on one batch."""
    it = iter(loader)
    for batch in itertools.islice(it, at):
        yield batch
    batch = next(it)
    while True:
        yield batch
