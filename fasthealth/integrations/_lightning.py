"""What the Lightning callbacks share (``lightning.py``, ``pytorch_lightning.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from ..monitor import Monitor
from ..monitor.option_groups import with_default
from .capture import Capture
from .log import log_dir_option, log_incident, logger

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
      through ``found_inf``, others lose that step's gradients (one host sync).

    ``log_dir`` defaults to ``<default_root_dir>/fasthealth`` (False: no logs); the other
    keywords are ``fh.Monitor``'s, its option groups among them (``log=fh.LogOptions(...)``).
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
        self.monitor = Monitor(pl_module, optimizer,
                               scaler=getattr(trainer.precision_plugin, "scaler", None),
                               **options)
        self.monitor.on_alarm(log_incident)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        divided = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self.capture.add(loss.detach() * divided, self._batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        loss, batch, ids = self.capture.take()
        assert self.monitor is not None  # made in on_fit_start
        if loss is None and not self._warned:
            self._warned = True
            logger.warning(NO_LOSS, trainer.global_step)
        self.monitor.check(loss, batch=batch, sample_ids=ids, step=trainer.global_step)

    def _finish(self, trainer) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._finish(trainer)
