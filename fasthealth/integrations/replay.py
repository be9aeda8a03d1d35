"""The replay a trainer callback gives ``rollback=`` when the user gives none: the step's loss
computed again the trainer's way, so that after a rollback the incident's batch is run again
on the older state and its verdict says data or state (``RollbackConfig.replay``).

- Hugging Face: the Trainer's own ``compute_loss(model, inputs)`` (public, documented for
  overriding: its label smoothing, its ``compute_loss_func``, a subclass's loss), on the
  inputs the Trainer handed ``training_step`` moved to the model's device; without a Trainer
  (the callback called by something else), the model's own loss (``model(**inputs).loss``,
  keys its ``forward`` does not take left out). With gradient accumulation the batch is the
  list of micro-batches: their mean.
- Lightning: the module's ``training_step`` (its loss, or the ``"loss"`` of the dict it
  returns) with ``self.log`` and ``self.log_dict`` silenced for the call, so that nothing the
  run logs changes; under manual optimization none (its ``training_step`` steps the optimizer).

Where a loss cannot be had, the replay raises; the rollback then goes on without a verdict and
says why (``rollback.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..monitor.option_groups import ActOptions
from ..monitor.rollback import RollbackConfig

Replay = Callable[[Any, Any], torch.Tensor]


def with_replay(options: dict[str, Any], replay: Replay | None) -> dict[str, Any]:
    """The Monitor's keywords ``options`` with ``replay`` as the rollback's replay, where
    rollback is on (flat or in ``act=``) and names none of its own."""
    def filled(rb: Any) -> Any:
        if rb is True:
            return RollbackConfig(replay=replay)
        if isinstance(rb, RollbackConfig) and rb.replay is None:
            return dataclasses.replace(rb, replay=replay)
        return rb

    if replay is None:
        return dict(options)
    out = dict(options)
    if "rollback" in out:
        out["rollback"] = filled(out["rollback"])
    act = out.get("act")
    if isinstance(act, ActOptions) and act.rollback is not None:
        out["act"] = dataclasses.replace(act, rollback=filled(act.rollback))
    return out


def _parts(batch: Any, micro: bool) -> list[Any]:
    return list(batch) if micro else [batch]


def _loss_of(out: Any, where: str) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else (
        out if torch.is_tensor(out) else getattr(out, "loss", None))
    if not torch.is_tensor(loss):
        raise ValueError(f"fasthealth: {where} returned no loss to replay the batch with")
    # not detached: the culprit search takes each sample's gradient through it (its pull),
    # and fh.replay a backward; the callers that only read it run it under no_grad
    return loss.float().reshape(-1).mean()


def hf_replay(accumulation: int, trainer: Any = None) -> Replay:
    """The step's loss again (the mean over ``accumulation`` micro-batches): the Trainer's
    ``compute_loss``, or without ``trainer`` the model's own loss."""
    def replay(model: Any, batch: Any) -> torch.Tensor:
        device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        losses = []
        for inputs in _parts(batch, accumulation > 1 and isinstance(batch, list)):
            if not isinstance(inputs, Mapping):
                raise ValueError("fasthealth: the Trainer's inputs are not a mapping: no "
                                 "replay (give RollbackConfig(replay=...))")
            kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()
                      if trainer is not None or takes_any or k in params}
            out = trainer.compute_loss(model, kwargs) if trainer is not None else model(**kwargs)
            losses.append(_loss_of(out, "the Trainer's compute_loss" if trainer is not None
                                   else "the model"))
        return torch.stack(losses).mean()
    return replay


def lightning_replay(module: Any, accumulation: int) -> Replay | None:
    """``module.training_step(batch, 0)``'s loss, logging silenced; None under manual
    optimization."""
    if not getattr(module, "automatic_optimization", True):
        return None

    def replay(model: Any, batch: Any) -> torch.Tensor:
        own = {k: model.__dict__[k] for k in ("log", "log_dict") if k in model.__dict__}
        model.log = model.log_dict = lambda *args, **kwargs: None
        try:
            losses = [_loss_of(model.training_step(b, 0), "training_step")
                      for b in _parts(batch, accumulation > 1)]
        finally:
            for k in ("log", "log_dict"):
                if k in own:
                    model.__dict__[k] = own[k]
                else:
                    model.__dict__.pop(k, None)
        return torch.stack(losses).mean()
    return replay
