"""Every place where the Hugging Face callback (``transformers.py``) goes past the callback API,
in one file. A ``TrainerCallback``'s events are given the model, the optimizer, the scheduler
and the data loaders, never the ``Trainer``, nor any loss before the optimizer step; what the
callback needs beyond that is here, each item with the test that fails when the library
changes it (tests/integrations/test_trainer_adapters.py).

Tested with transformers 5.24.0 and accelerate 1.15.0 (the Makefile's ``TRAINERS``).

1. The Trainer and the checkpoint it resumes from are read off the call stack at
   ``on_train_begin`` (``training_trainer``): the first caller frame whose ``self`` is a
   ``Trainer`` holding this callback (``_inner_training_loop``, whose
   ``resume_from_checkpoint`` argument ``train`` has already resolved to a folder). Nothing
   is installed for that: ``Trainer.train`` stays the library's, for every Trainer of the
   process. A callback called from elsewhere (no Trainer on the stack) is driven without the
   Trainer (``transformers.py`` says what then changes).
2. ``trainer.callback_handler.callbacks`` (an attribute, not documented): where the wrapper
   looks for the callbacks.
3. ``trainer.training_step(model, inputs, num_items_in_batch)`` (public, documented as the
   method to override) is wrapped on the instance for the length of ``train()``: the one place
   that every way of computing the loss goes through (``compute_loss``, label smoothing,
   ``compute_loss_func``, ``num_items_in_batch``), and the value the Trainer's logged loss is
   made of.
4. ``trainer._save_checkpoint(model, trial)`` (private) is skipped while the checkpoint guard
   refuses: the backstop for ``save_strategy="best"``, which turns ``should_save`` on after the
   evaluation, past the last callback event before the save.
5. ``trainer._get_output_dir(trial)`` (private): the folder the checkpoints go to (a trial's
   own under a hyperparameter search).
6. ``trainer.accelerator.unscale_gradients(optimizer=None)`` (public in accelerate) is wrapped,
   and ``accelerator._optimizers`` (private) read, for the length of ``train()`` under a
   GradScaler: the check unscales the gradients first, and the Trainer's own ``unscale_``
   before its clipping would then raise.
7. ``accelerate.state.GradientState().sync_gradients`` (public): whether a micro-batch is the
   last of its accumulation.

GradScaler's own state (which optimizers it unscaled this step) is read in ``monitor/gate.py``,
the one place that touches it.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from ..monitor import Monitor, gate
from .capture import UNREAD, Capture, without_quarantined
from .checkpoints import Patch, SaveGuard

STACK_DEPTH = 12
"""Caller frames searched for the Trainer (item 1): ``on_train_begin`` is called three frames
below ``_inner_training_loop`` (``CallbackHandler.on_train_begin``, ``call_event``)."""


def training_trainer(callback: Any) -> tuple[Trainer, Any] | None:
    """(the Trainer whose training calls ``callback`` now, the ``resume_from_checkpoint`` it
    trains with) from the call stack (item 1); None when no Trainer holding ``callback`` is
    on it."""
    frame: FrameType | None = sys._getframe(1)
    try:
        for _ in range(STACK_DEPTH):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and any(
                    c is callback for c in getattr(owner.callback_handler, "callbacks", ())):
                return owner, frame.f_locals.get("resume_from_checkpoint")
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept would keep every local of the stack alive


def checkpoint_folder(trainer: Trainer, resume: Any) -> str | None:
    """The folder ``train(resume_from_checkpoint=resume)`` resumes from: a path as given, True
    resolved as the Trainer resolves it (the newest ``checkpoint-*`` of ``output_dir``), None
    without a resume."""
    if resume is True:
        resume = get_last_checkpoint(trainer.args.output_dir)
    return os.fspath(resume) if isinstance(resume, (str, os.PathLike)) else None


def sync_step() -> Callable[[], bool]:
    """Whether the micro-batch that just ended is the last of its gradient accumulation
    (item 7)."""
    from accelerate.state import GradientState  # the Trainer brings accelerate; we do not

    state = GradientState()
    return lambda: bool(state.sync_gradients)


def _loss_tensor(loss: Any) -> torch.Tensor | None:
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def wrap_training_step(trainer: Trainer, monitor: Monitor, step: Callable[[], int],
                       sample_ids: Callable[[Any], Any] | None,
                       on_loss: Callable[[torch.Tensor | None, int], None]) -> Patch:
    """``trainer.training_step`` wrapped (item 3): a micro-batch's rows whose samples a
    rollback quarantined are left out of it (``capture.without_quarantined``: the Trainer's
    sampler still serves them); each micro-batch's returned loss and a shallow copy of its
    inputs are kept; after the last micro-batch of the accumulation, ``monitor.check`` with
    their sum (the loss the Trainer logs for the step). ``on_loss(loss, step)`` sees it first
    (the warning when it is None)."""
    original = trainer.training_step
    capture, sync = Capture(sample_ids), sync_step()

    @functools.wraps(original)
    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        ids: Any = UNREAD
        if monitor.rollback is not None and monitor.rollback.quarantine:
            # the Trainer's sampler still serves them: their rows leave the batch
            inputs, ids = without_quarantined(inputs, capture.sample_ids(inputs),
                                              monitor.rollback.quarantine)
        batch = dict(inputs) if isinstance(inputs, Mapping) else inputs  # before labels go
        loss = original(model, inputs, *args, **kwargs)
        capture.add(_loss_tensor(loss), batch, partial=True, ids=ids)
        if sync():
            total, batches, ids = capture.take()
            t = step()
            on_loss(total, t)
            monitor.check(total, batch=batches, sample_ids=ids, step=t)
        return loss

    return Patch(trainer, "training_step", training_step)


def guard_saves(trainer: Trainer, guard: SaveGuard, state: Any) -> Patch:
    """``trainer._save_checkpoint`` skipped while ``guard`` refuses (item 4)."""
    original = trainer._save_checkpoint

    @functools.wraps(original)
    def _save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        if guard.allow(state.global_step):
            return original(*args, **kwargs)
        return None

    return Patch(trainer, "_save_checkpoint", _save_checkpoint)


def output_dir(trainer: Trainer | None, args: Any) -> str:
    """Where the Trainer writes its checkpoints (item 5); ``args.output_dir`` without it."""
    return trainer._get_output_dir(trial=None) if trainer is not None else args.output_dir


def unscale_once(trainer: Trainer, scaler: Any) -> Patch:
    """``trainer.accelerator.unscale_gradients`` leaving out the optimizers whose gradients
    the check already unscaled this step, so that the Trainer's clipping and norm pass neither
    raise nor unscale twice (item 6)."""
    accelerator = trainer.accelerator
    original = accelerator.unscale_gradients

    def unscale_gradients(optimizer: Any = None) -> None:
        opts = accelerator._optimizers if optimizer is None else optimizer
        opts = list(opts) if isinstance(opts, (list, tuple)) else [opts]
        left = [o for o in opts if not gate.unscaled(gate.unwrap(o), scaler)]
        if left:
            original(optimizer=left)

    return Patch(accelerator, "unscale_gradients", unscale_gradients)
