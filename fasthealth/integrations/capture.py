"""The loss and the batch of each training micro-batch, as a trainer passes them to the model,
kept until the optimizer step takes them (``take``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

SAMPLE_ID_KEYS = ("sample_ids", "sample_id", "idx", "index")
UNREAD = object()  # a micro-batch's sample ids not read yet (``Capture.add``)


def sample_ids_of(batch: Any, keys: tuple[str, ...] = SAMPLE_ID_KEYS) -> Any:
    """The sample ids a batch carries under one of ``keys`` (a mapping), else None."""
    if isinstance(batch, Mapping):
        for k in keys:
            if k in batch:
                return batch[k]
    return None


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: ``output.loss`` / ``output["loss"]`` (Hugging Face models
    given labels); else None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def without_quarantined(batch: Any, ids: Any, quarantine: Sequence[int]) -> tuple[Any, Any]:
    """(``batch``, ``ids``) less the rows whose sample id a rollback quarantined, for a batch
    that is a mapping: every tensor whose first dimension is the batch's, and the ids, cut
    alike, so that a trainer whose loader still serves a quarantined sample trains on the rest
    of its batch instead of losing the step. Both as given where nothing is quarantined, where
    the batch cannot be cut (not a mapping, ids that are not integers) and where every row is
    (the step is then skipped on the device: a batch of nothing trains nothing). The ids are
    read on the host: a sync for ids on a GPU, only while the quarantine holds a sample. A loss
    normalised by a count of items taken over the whole batch before (``num_items_in_batch``)
    is then a little smaller."""
    if not quarantine or ids is None or not isinstance(batch, Mapping):
        return batch, ids
    t = torch.as_tensor(ids).reshape(-1)
    if t.dtype == torch.bool or t.is_complex() or t.is_floating_point():
        return batch, ids
    keep = ~torch.isin(t.cpu().to(torch.int64), torch.as_tensor(list(quarantine),
                                                                dtype=torch.int64))
    if bool(keep.all()) or not bool(keep.any()):
        return batch, ids
    rows, n = keep.nonzero().flatten(), len(t)
    cut = {k: v.index_select(0, rows.to(v.device))
           if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
           for k, v in batch.items()}
    return cut, t.index_select(0, rows.to(t.device))


class Capture:
    """Losses, batches and sample ids of the micro-batches since the last ``take``.

    ``add`` records one micro-batch; ``take`` returns (the step's loss or None when any was
    unknown, the batch or the list of micro-batches, the sample ids or None) and starts over.
    The step's loss is the mean of the micro-batches' losses, or their sum when they are
    ``partial`` (each already divided by the whole accumulation's size, as Hugging Face models
    given ``num_items_in_batch`` return them).
    ``sample_ids``: a function of the batch, or None for the keys of ``SAMPLE_ID_KEYS``.
    """

    def __init__(self, sample_ids: Callable[[Any], Any] | None = None) -> None:
        self.sample_ids = sample_ids or sample_ids_of
        self.losses: list[torch.Tensor | None] = []
        self.batches: list[Any] = []
        self.ids: list[Any] = []
        self.partial = False

    def add(self, loss: torch.Tensor | None, batch: Any, partial: bool = False,
            ids: Any = UNREAD) -> None:
        """One micro-batch; ``ids``: its sample ids where already read (else read at
        ``take``)."""
        self.losses.append(None if loss is None else loss.detach().float().reshape(()))
        self.batches.append(batch)
        self.ids.append(ids)
        self.partial |= partial

    def take(self) -> tuple[torch.Tensor | None, Any, Any]:
        losses, batches, partial, read = self.losses, self.batches, self.partial, self.ids
        self.losses, self.batches, self.partial, self.ids = [], [], False, []
        loss = None
        present = [x for x in losses if x is not None]
        if losses and len(present) == len(losses):
            stacked = torch.stack(present)
            loss = stacked.sum() if partial else stacked.mean()
        each = [self.sample_ids(b) if i is UNREAD else i for b, i in zip(batches, read)]
        ids: Any
        if not each or any(i is None for i in each):
            ids = None
        elif len(each) == 1:
            ids = each[0]
        else:
            ids = (torch.cat([torch.as_tensor(i).reshape(-1) for i in each])
                   if all(torch.is_tensor(i) for i in each) else [x for i in each for x in i])
        batch = batches[0] if len(batches) == 1 else batches
        return loss, batch, ids


class ForwardCapture(Capture):
    """A ``Capture`` fed by a forward hook on ``model``: every training forward pass (grad
    enabled, ``model.training``) adds its inputs (the kwargs, or the args) and its output's
    loss."""

    def __init__(self, model: torch.nn.Module,
                 sample_ids: Callable[[Any], Any] | None = None) -> None:
        super().__init__(sample_ids)
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        batch = dict(kwargs) if kwargs and not args else (args if not kwargs else
                                                          {"args": args, **kwargs})
        if isinstance(batch, tuple) and len(batch) == 1:
            batch = batch[0]
        self.add(loss_of(output), batch, partial=kwargs.get("num_items_in_batch") is not None)

    def remove(self) -> None:
        self.handle.remove()


class BackwardEnd:
    """Calls ``fn`` (under no_grad) once at the end of every backward pass that reaches the
    parameters of ``model``: after the last gradient is accumulated, before the caller's next
    line (a trainer's clipping)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[[], None]) -> None:
        self.fn, self.queued = fn, False
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated)
                        for p in model.parameters() if p.requires_grad]

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._done)

    def _done(self) -> None:
        self.queued = False
        with torch.no_grad():
            self.fn()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
