"""What the Lightning callbacks share (``lightning.py``, ``pytorch_lightning.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from ..monitor import Monitor
from ..monitor.option_groups import with_default
from .capture import Capture
from .log import log_dir_option, log_incident


class HealthCallbackMixin:
    """The Monitor inside a Lightning ``Trainer`` (automatic optimization), with its defaults.

    - the batch comes from ``on_train_batch_start``, the loss from ``on_before_backward`` (times
      ``accumulate_grad_batches``, which Lightning divided it by); sample ids from a batch key
      (``sample_ids``, ``idx``, ...) or ``sample_ids=fn(batch)``;
    - the gradients are checked in ``on_before_optimizer_step``: after accumulation and AMP's
      unscaling, before Lightning's clipping, which is taken over (``gradient_clip_val`` with
      the norm algorithm: the Monitor clips with the norm it computed);
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
        self._clip: float | None = None
        self._batch: Any = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) > 1:
            raise ValueError("fasthealth: HealthCallback watches one optimizer; this module "
                             f"configures {len(trainer.optimizers)}")
        options = dict(self.options)
        clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if clip and (algorithm is None or str(algorithm).lower().endswith("norm")):
            options = with_default(options, "max_grad_norm", float(clip))
            self._clip, trainer.gradient_clip_val = clip, None
        options = log_dir_option(options, self.log_dir, trainer.default_root_dir)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.monitor = Monitor(pl_module, optimizer,
                               scaler=getattr(trainer.precision_plugin, "scaler", None),
                               **options)
        self.monitor.on_alarm(log_incident)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.capture.add(loss.detach() * trainer.accumulate_grad_batches, self._batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        loss, batch, ids = self.capture.take()
        assert self.monitor is not None  # made in on_fit_start
        self.monitor.check(loss, batch=batch, sample_ids=ids, step=trainer.global_step)

    def _finish(self, trainer) -> None:
        if self._clip is not None:
            trainer.gradient_clip_val, self._clip = self._clip, None
        if self.monitor is not None:
            self.monitor.close()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._finish(trainer)
