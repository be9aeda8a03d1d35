"""What the Lightning callbacks share (``lightning.py``, ``pytorch_lightning.py``).

Lightning hands its callbacks the Trainer and the module at every hook, and the loss
(``on_before_backward``) and the optimizer (``on_before_optimizer_step``) where the check needs
them; the callback's state rides in Lightning's checkpoint through ``state_dict`` /
``load_state_dict``. What it takes beyond the callback API, each item with its test in
tests/integrations/test_trainer_adapters.py (tested with lightning 2.6.6, the Makefile's
``TRAINERS``):

1. ``trainer.save_checkpoint(filepath, ...)`` (public) is wrapped on the instance for the
   length of ``fit``: no write while the checkpoint guard refuses (``ModelCheckpoint`` calls it
   through the instance).
2. ``trainer.strategy.remove_checkpoint(filepath)`` (public) is wrapped the same way: no file
   removed while a refused save is pending, so that ``ModelCheckpoint``'s rotation never
   deletes the last healthy one.
3. ``trainer.precision_plugin.scaler`` (an attribute of the AMP plugin): the GradScaler whose
   ``found_inf`` the check joins.
4. ``trainer.lr_scheduler_configs[0].scheduler`` (public): the scheduler whose restarts the
   rules take as a new start.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from typing import Any, Literal

from ..monitor import Monitor
from ..monitor.option_groups import with_default
from .capture import UNREAD, Capture, without_quarantined
from .checkpoints import Patch, SaveGuard
from .log import log_dir_option, logger
from .replay import lightning_replay, with_replay

NO_LOSS = ("fasthealth: step %d: no loss to check (on_before_backward saw none before this "
           "optimizer step); the loss rules are off, the gradient rules go on. To have it "
           "checked, return the loss from training_step, or call self.manual_backward(loss) "
           "in manual optimization.")


class HealthCallbackMixin:
    """The Monitor inside a Lightning ``Trainer``, with its defaults.

    - the batch comes from ``on_train_batch_start``, the loss from ``on_before_backward``, which
      Lightning calls with the tensor it backpropagates: in automatic optimization the
      ``training_step``'s loss divided by ``accumulate_grad_batches`` (multiplied back here:
      the step's loss is the mean of its micro-batches'), in manual optimization the loss given
      to ``self.manual_backward`` (several calls in one step: their mean); sample ids from a
      batch key (``sample_ids``, ``idx``, ...) or ``sample_ids=fn(batch)``. Where none comes
      (a ``training_step`` returning None, ``loss.backward()`` instead of ``manual_backward``),
      one warning at the first such step; the gradient rules go on;
    - the gradients are checked in ``on_before_optimizer_step`` (which Lightning calls for the
      automatic and for the manual ``opt.step()``): after accumulation and AMP's unscaling,
      before Lightning's own clipping, which stays Lightning's (``gradient_clip_val`` is left
      alone; a ``max_grad_norm=`` given to the callback makes the Monitor clip too, first);
      nothing Lightning or the module logs is changed;
    - a non-finite step is skipped: fused torch optimizers and AMP's GradScaler on the device
      through ``found_inf``, others lose that step's gradients (one host sync);
    - checkpoints (docs/spec.md section 11): for the length of ``fit``, ``trainer.save_checkpoint``
      (what ``ModelCheckpoint`` calls, and any other caller within the fit) writes nothing
      while ``Monitor.safe_to_save()`` is False, and ``trainer.strategy.remove_checkpoint``
      removes nothing from a refused save until the next one goes through, so that
      ``ModelCheckpoint``'s rotation (``save_top_k``), which counts the refused file as saved,
      never deletes the last healthy one for it (that file stays on disk, no longer tracked).
      A fit that raises keeps the guard's last verdict for the saves made on the way out
      (``ModelCheckpoint``'s ``on_exception``) until the next fit. The Monitor's state rides in
      the checkpoint through this callback's ``state_dict`` / ``load_state_dict`` (Lightning
      loads it before ``on_fit_start`` makes the Monitor: it is held until then), so that
      ``fit(ckpt_path=...)`` goes on where the rules were; a checkpoint without it resumes
      cold, with one log line.

    ``log_dir`` defaults to ``<default_root_dir>/fasthealth`` (False: no logs); the other
    keywords are ``fh.Monitor``'s (``dumps="alarm"``, ``on_spike="skip"``, ...).
    ``.monitor`` is the Monitor once fitting has begun.
    """

    def __init__(self, log_dir: str | os.PathLike | Literal[False] | None = None, *,
                 sample_ids: Callable[[Any], Any] | None = None, **monitor_options: Any):
        super().__init__()
        self.log_dir, self.options = log_dir, monitor_options
        self.capture = Capture(sample_ids)
        self.monitor: Monitor | None = None
        self._warned = False
        self._batch: Any = None
        self._ids: Any = UNREAD  # the batch's sample ids, where read at its start
        self.guard: SaveGuard | None = None
        self._patches: list[Patch] = []
        self._pending: dict[str, Any] | None = None  # state loaded before the Monitor existed
        self._loaded = False
        self._live = False  # the Monitor of the fit under way, not closed yet

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) > 1:
            raise ValueError("fasthealth: HealthCallback watches one optimizer; this module "
                             f"configures {len(trainer.optimizers)}")
        options = log_dir_option(dict(self.options), self.log_dir, trainer.default_root_dir)
        self._warned = False
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        # the module's scheduler: the rules take its warm restarts as a new start
        options = with_default(options, "scheduler", configs[0].scheduler if configs else None)
        # after a rollback, the incident's batch run again through training_step (replay.py)
        options = with_replay(options, lightning_replay(pl_module,
                                                        trainer.accumulate_grad_batches))
        self.monitor = Monitor(pl_module, optimizer,
                               scaler=getattr(trainer.precision_plugin, "scaler", None),
                               **options)
        self._guard(trainer)
        self._loaded, self._live = False, True
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def _guard(self, trainer) -> None:
        """``trainer.save_checkpoint`` and ``trainer.strategy.remove_checkpoint`` wrapped on
        the instances for the length of the fit (the class docstring)."""
        self._unguard()
        assert self.monitor is not None
        guard = self.guard = SaveGuard(self.monitor)
        save, strategy = trainer.save_checkpoint, trainer.strategy
        remove = strategy.remove_checkpoint

        def save_checkpoint(filepath, *args: Any, **kwargs: Any) -> None:
            if guard.allow(trainer.global_step):
                save(filepath, *args, **kwargs)

        def remove_checkpoint(filepath) -> None:
            if not guard.holding:  # else it may be the last healthy file
                remove(filepath)

        self._patches = [Patch(trainer, "save_checkpoint", save_checkpoint),
                         Patch(strategy, "remove_checkpoint", remove_checkpoint)]

    def _unguard(self) -> None:
        for p in self._patches:
            p.remove()
        self._patches = []

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.ckpt_path is not None and not self._loaded:
            logger.warning("fasthealth: %s holds no state of this callback (saved without "
                           "fasthealth?): the Monitor resumes cold (a new warm-up, empty "
                           "windows)", trainer.ckpt_path)

    def state_dict(self) -> dict[str, Any]:
        """The Monitor's state, for Lightning's checkpoint (empty outside a fit)."""
        mon = self.monitor if self._live else None
        return {"fasthealth_monitor": mon.state_dict()} if mon is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore, usually before ``on_fit_start``: held until the Monitor is
        made, then loaded into it."""
        if "fasthealth_monitor" not in state_dict:
            return
        if not (self._live and self.monitor is not None):
            self._pending = state_dict
            return
        self.monitor.load_state_dict(state_dict["fasthealth_monitor"])
        self._pending, self._loaded = None, True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        mon, self._ids = self.monitor, UNREAD
        if mon is not None and mon.rollback is not None and mon.rollback.quarantine \
                and isinstance(batch, MutableMapping):
            # the loader still serves quarantined samples: their rows leave the batch object
            # that training_step is given next (capture.without_quarantined)
            cut, self._ids = without_quarantined(batch, self.capture.sample_ids(batch),
                                                 mon.rollback.quarantine)
            if cut is not batch:
                batch.clear()
                batch.update(cut)
        self._batch = batch

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        divided = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self.capture.add(loss.detach() * divided, self._batch, ids=self._ids)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        loss, batch, ids = self.capture.take()
        assert self.monitor is not None  # made in on_fit_start
        if loss is None and not self._warned:
            self._warned = True
            logger.warning(NO_LOSS, trainer.global_step)
        self.monitor.check(loss, batch=batch, sample_ids=ids, step=trainer.global_step)

    def _finish(self, trainer) -> None:
        self._live = False
        if self.monitor is not None:
            self.monitor.close()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish(trainer)
        self._unguard()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.guard is not None:
            self.guard.freeze(trainer.global_step)  # ModelCheckpoint may save after this
        self._finish(trainer)
