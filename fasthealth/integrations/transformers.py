"""``HealthCallback``: the Monitor inside a Hugging Face ``Trainer``, with its default arguments.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[HealthCallback()])

- the loss is the one the Trainer itself logs, however it computes it (the model's
  ``output.loss``, a ``compute_loss`` override, label smoothing, ``compute_loss_func``,
  ``num_items_in_batch`` scaling, gradient accumulation): the callback wraps the Trainer's
  ``training_step`` (on the instance, for the length of ``train()``) and takes the per-micro-
  batch loss it returns, which is what the Trainer sums into its logged ``loss`` (already
  divided for the accumulation); the step's loss is their sum. The batch is a shallow copy of
  the ``inputs`` given to ``training_step``, taken before it runs (``compute_loss`` pops
  ``labels`` from that dict); sample ids from a batch key (``sample_ids``, ``idx``, ...; keep
  the column with ``remove_unused_columns=False``) or ``sample_ids=fn(batch)``;
- the gradients are checked once per optimizer step, right after the ``training_step`` of the
  last micro-batch of the accumulation (accelerate's ``sync_gradients``), so before the
  Trainer clips them;
- the Trainer's own clipping (``args.max_grad_norm``) and everything it logs stay its own: the
  callback changes neither (its logged ``grad_norm`` stays the pre-clip norm). A
  ``max_grad_norm=`` given to the callback makes the Monitor clip too, before the Trainer;
- a non-finite step is skipped: fused torch optimizers (``optim="adamw_torch_fused"``) and the
  Trainer's GradScaler skip on the device through ``found_inf``, others lose that step's
  gradients (one host sync); ``steps.jsonl`` marks it skipped and the event says so. Under fp16
  the check unscales the gradients (the GradScaler's ``unscale_``), and the Trainer's own
  unscaling before its clipping is then left out for that step, as it is already done (a
  second ``unscale_`` would raise);
- where the Trainer is not known (the callback driven by something else than a ``Trainer``'s
  training, so that no Trainer holding it is on the call stack at ``on_train_begin``), the loss
  and the batch come from a forward hook on the model (its output's ``loss``) and the check
  runs at the end of the last backward pass; where no loss can be had at all, one warning at
  the first step says so and how to pass one, and the gradient rules go on.

- checkpoints (docs/spec.md section 11): while ``Monitor.safe_to_save()`` is False the
  Trainer writes none (``control.should_save`` turned off in ``on_step_end`` / ``on_epoch_end``,
  after ``DefaultFlowCallback`` set it; ``_save_checkpoint`` skipped as the backstop for
  ``save_strategy="best"``), one log line per incident; each checkpoint written gets the
  Monitor's state (``checkpoint-<step>/fasthealth_monitor.pt``, in ``on_save``, after the
  rotation), and ``train(resume_from_checkpoint=...)`` loads it before the first step.

Why wrap ``training_step``: callbacks are not given the Trainer, nor any loss before the
optimizer step (``on_pre_optimizer_step`` comes after the clipping), and the model's output
holds the Trainer's loss only when the model computes it. ``training_step``'s return value is
the one place every way of computing the loss goes through, and the one the Trainer's logged
loss is made of (a ``training_step`` of a subclass is wrapped as well). It returns after the
micro-batch's backward and before the Trainer's clipping, so the check still sees the raw
gradients. The Trainer always gets a scalar tensor from it (it adds it to its running loss), so
with the Trainer known no forward hook is needed. The Trainer is known because it is the one
calling ``on_train_begin`` (read off the call stack: nothing is installed on the ``Trainer``
class, and a Trainer without this callback is never touched); that, the wrapper of
``training_step`` (on that instance, for that ``train()``, removed at its end) and every other
place the callback goes past the callback API are in ``_hf_trainer.py``, listed at its top with
the versions they are tested with.

``log_dir`` defaults to ``<output_dir>/fasthealth`` (False: no logs), each training in a run of
its own there (``run-NNN/``, ``.monitor.run_dir``: steps.jsonl and the rest); the other keywords are
``fh.Monitor``'s (``dumps="alarm"``, ``on_spike="skip"``, ...). ``.monitor`` is the
Monitor once training has begun.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import Trainer, TrainerCallback

from ..monitor import Monitor
from ..monitor.option_groups import with_default
from . import _hf_trainer as adapter
from .capture import BackwardEnd, ForwardCapture
from .checkpoints import SaveGuard, load_state, save_state
from .log import log_dir_option, logger
from .replay import hf_replay, with_replay


def _resume_guess(args: Any, state: Any) -> str | None:
    """Without the Trainer: ``<output_dir>/checkpoint-<global_step>`` when the step is past 0
    at the start of training (a resume) and that folder exists."""
    folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    return folder if state.global_step > 0 and os.path.isdir(folder) else None


NO_LOSS = ("fasthealth: step %d: no loss to check (%s); the loss rules are off, the gradient "
           "rules go on. To have it checked, return the loss from the model's output "
           "(output.loss), or drive the callback from Trainer.train().")


class HealthCallback(TrainerCallback):
    def __init__(self, log_dir: str | os.PathLike | Literal[False] | None = None, *,
                 sample_ids: Callable[[Any], Any] | None = None, **monitor_options: Any):
        self.log_dir, self.sample_ids, self.options = log_dir, sample_ids, monitor_options
        self.monitor: Monitor | None = None
        self.trainer: Trainer | None = None  # the Trainer found, while training
        self._open = False
        self._warned = False
        self.guard: SaveGuard | None = None  # the checkpoint guard, while training


    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._end_of_run(args)  # a train() that raised never reached on_train_end
        options = log_dir_option(dict(self.options), self.log_dir, args.output_dir)
        # the Trainer's scheduler: the rules take its warm restarts as a new start
        options = with_default(options, "scheduler", kwargs.get("lr_scheduler"))
        bound = adapter.training_trainer(self)  # (trainer, resume), or None without one
        trainer = self.trainer = bound[0] if bound is not None else None
        # after a rollback, the incident's batch run again the Trainer's way (replay.py)
        options = with_replay(options, hf_replay(args.gradient_accumulation_steps, trainer))
        scaler = getattr(optimizer, "scaler", None)
        monitor = Monitor(model, optimizer, scaler=scaler, **options)
        self.monitor, self._open, self._warned = monitor, True, False
        self.guard = SaveGuard(monitor)
        folder = (adapter.checkpoint_folder(*bound) if bound is not None
                  else _resume_guess(args, state))
        if folder is not None:  # before the first step: the rules go on where they were
            load_state(monitor, folder)
        if trainer is not None:
            monitor.hooks.append(adapter.guard_saves(trainer, self.guard, state))
            monitor.hooks.append(adapter.wrap_training_step(
                trainer, monitor, lambda: state.global_step, self.sample_ids,
                lambda loss, t: self._no_loss(loss, t, "the Trainer's training_step "
                                              "returned no scalar tensor")))
            if monitor.scaler is not None:  # (a disabled scaler is none)
                monitor.hooks.append(adapter.unscale_once(trainer, monitor.scaler))
            return
        capture = ForwardCapture(model, self.sample_ids)
        sync = adapter.sync_step()

        def after_backward() -> None:
            if sync():
                loss, batch, ids = capture.take()
                self._no_loss(loss, state.global_step, "no Trainer calls this callback and "
                              "the model's output carries no loss")
                monitor.check(loss, batch=batch, sample_ids=ids, step=state.global_step)

        monitor.hooks += [capture, BackwardEnd(model, after_backward)]

    def _no_loss(self, loss: torch.Tensor | None, step: int, why: str) -> None:
        if loss is None and not self._warned:
            self._warned = True
            logger.warning(NO_LOSS, step, why)

    def on_step_end(self, args, state, control, **kwargs):
        self._hold_save(state, control)  # DefaultFlowCallback, first, has set should_save

    def on_epoch_end(self, args, state, control, **kwargs):
        self._hold_save(state, control)

    def _hold_save(self, state, control) -> None:
        if control.should_save and self._open and self.guard is not None \
                and not self.guard.allow(state.global_step):
            control.should_save = False

    def on_save(self, args, state, control, **kwargs):
        """The Monitor's state into the checkpoint folder just written (after the Trainer's
        rotation, which never removes the newest); nothing when the save was refused."""
        if not (self._open and self.monitor is not None and args.should_save):
            return
        if self.guard is not None and self.guard.refused[-1:] == [state.global_step]:
            return
        root = adapter.output_dir(self.trainer, args)
        save_state(self.monitor, os.path.join(root, f"checkpoint-{state.global_step}"))

    def on_train_end(self, args, state, control, **kwargs):
        self._end_of_run(args)

    def _end_of_run(self, args) -> None:
        """Closes the monitor (a final flush; its hooks off the model, the Trainer's
        ``training_step`` its own again): at the end of training, or at the next train() when
        the last one raised (a crash in a notebook, then train() again, must not check every
        gradient twice)."""
        if self.monitor is not None and self._open:
            self.monitor.close()  # kept: callback.monitor.events stays readable after training
        self._open = False
        self.trainer = None


HealthCallback.__doc__ = __doc__
