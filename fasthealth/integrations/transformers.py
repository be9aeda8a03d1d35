"""``HealthCallback``: the Monitor inside a Hugging Face ``Trainer``, with its default arguments.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[HealthCallback()])

- the loss and the batch of every micro-batch come from a forward hook on the model (the
  ``loss`` of its output, as models given labels return it; the batch as the Trainer passes it);
  sample ids from a batch key (``sample_ids``, ``idx``, ...; keep the column with
  ``remove_unused_columns=False``) or ``sample_ids=fn(batch)``;
- the gradients are checked once per optimizer step, at the end of the backward pass of the
  last micro-batch of the accumulation, before the Trainer clips them (its clipping, and its
  norm pass with ``max_grad_norm=0``, would smear one NaN over every tensor);
- the Trainer's clipping (``args.max_grad_norm``) is taken over: the Monitor clips with the
  norm it computed, and the Trainer's own pass then sees unclipped-at-most gradients;
- a non-finite step is skipped: fused torch optimizers (``optim="adamw_torch_fused"``) and the
  Trainer's GradScaler skip on the device through ``found_inf``, others lose that step's
  gradients (one host sync); ``steps.jsonl`` marks it skipped and the event says so.

``log_dir`` defaults to ``<output_dir>/fasthealth`` (False: no logs); the other keywords are
``fh.Monitor``'s, its option groups among them (``log=fh.LogOptions(...)``). ``.monitor`` is the
Monitor once training has begun.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from transformers import TrainerCallback

from ..monitor import Monitor
from ..monitor.option_groups import with_default
from .capture import BackwardEnd, ForwardCapture
from .log import log_dir_option, log_incident


def _sync_step() -> Callable[[], bool]:
    """Whether the backward that just ended is the last of its gradient accumulation: the
    flag accelerate keeps for the Trainer."""
    from accelerate.state import GradientState  # the Trainer brings accelerate; we do not

    state = GradientState()
    return lambda: bool(state.sync_gradients)


class HealthCallback(TrainerCallback):
    def __init__(self, log_dir: str | os.PathLike | Literal[False] | None = None, *,
                 sample_ids: Callable[[Any], Any] | None = None, **monitor_options: Any):
        self.log_dir, self.sample_ids, self.options = log_dir, sample_ids, monitor_options
        self.monitor: Monitor | None = None
        self._clip: float | None = None
        self._open = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._end_of_run(args)  # a train() that raised never reached on_train_end
        options = dict(self.options)
        if args.max_grad_norm and args.max_grad_norm > 0:
            options = with_default(options, "max_grad_norm", float(args.max_grad_norm))
            self._clip, args.max_grad_norm = args.max_grad_norm, 0.0
        options = log_dir_option(options, self.log_dir, args.output_dir)
        monitor = Monitor(model, optimizer, scaler=getattr(optimizer, "scaler", None),
                          **options)
        monitor.on_alarm(log_incident)
        self.monitor = monitor
        self._open = True
        capture = ForwardCapture(model, self.sample_ids)
        sync = _sync_step()

        def after_backward() -> None:
            if sync():
                loss, batch, ids = capture.take()
                monitor.check(loss, batch=batch, sample_ids=ids, step=state.global_step)

        monitor.hooks += [capture, BackwardEnd(model, after_backward)]

    def on_train_end(self, args, state, control, **kwargs):
        self._end_of_run(args)

    def _end_of_run(self, args) -> None:
        """Gives the Trainer its clipping back and closes the monitor (a final flush, its hooks
        off the model): at the end of training, or at the next train() when the last one
        raised (a crash in a notebook, then train() again, must neither run without clipping
        nor check every gradient twice)."""
        if self._clip is not None:
            if not args.max_grad_norm:  # still ours
                args.max_grad_norm = self._clip
            self._clip = None
        if self.monitor is not None and self._open:
            self.monitor.close()  # kept: callback.monitor.events stays readable after training
        self._open = False
