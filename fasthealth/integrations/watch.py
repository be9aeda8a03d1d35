"""``fh.watch(model, optimizer)``: the Monitor in a plain training loop, one line, no change to
the loop.

An optimizer step pre-hook runs ``Monitor.check`` each time ``optimizer.step()`` is called (so
once per step, after gradient accumulation), and makes that step skip when the loss or a
gradient is non-finite. The loss and the batch come from a forward hook on ``model``: the
loss when the model's output carries one (``output.loss``, as Hugging Face models given
labels), else it is not checked (logged as null) and only the gradients are. The hook runs
when ``step()`` is called: clip with ``max_grad_norm=`` (with the norm the check computed)
rather than with ``clip_grad_norm_`` before it, which would smear one NaN over every tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..monitor import Monitor, gate
from .capture import ForwardCapture


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
          sample_ids: Callable[[Any], Any] | None = None, **monitor_options: Any) -> Monitor:
    """Watches ``model``'s training by ``optimizer``; returns the Monitor (``.events``,
    ``.close()``). ``monitor_options`` are those of ``fh.Monitor`` (``log_dir``,
    ``max_grad_norm``, ...); ``sample_ids(batch)`` finds a batch's sample ids."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fasthealth: watch needs a torch.optim optimizer, got "
                        f"{type(optimizer).__name__}")
    mon = Monitor(model, optimizer, **monitor_options)
    capture = ForwardCapture(model, sample_ids)

    def before_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        loss, batch, ids = capture.take()
        mon.check(loss, batch=batch, sample_ids=ids)

    mon.hooks += [capture, gate.unwrap(optimizer).register_step_pre_hook(before_step)]
    return mon
