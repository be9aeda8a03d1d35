"""A model's buffers are model state (docs/spec.md section 6, "Buffers"): BatchNorm's running
statistics, an EMA kept as a buffer, a counter. The forward pass updates them, before any check
can run, so a step whose batch held a NaN writes that NaN into ``running_mean`` and
``running_var`` even when the optimizer step is skipped: the weights stay finite and the model
is broken in eval mode.

``BufferGuard`` makes a skipped step skip its buffers' updates too. A forward pre-hook on the
model copies the buffers into one flat shadow per dtype before the first forward after each
step (micro-batches of an accumulated step share it); the Monitor's step then puts the shadow
back where the step is skipped: ``torch.where`` on the step's device verdict, so no sync and
the same three launches whether the step is skipped or not (one ``cat``, one ``where``, one
``_foreach_copy_``). Which buffers: the floating ones and BatchNorm's ``num_batches_tracked``
(the cumulative average's count), not the constant integer tables (position ids, masks) that
no forward writes.
"""

from __future__ import annotations

from typing import Any

import torch


def guarded_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers a forward may write: floating buffers and BatchNorm's
    ``num_batches_tracked``; each tensor once (a buffer shared by two modules)."""
    seen: set[int] = set()
    out = []
    for name, b in model.named_buffers():
        if b is None or id(b) in seen or b.is_sparse:
            continue
        if b.is_floating_point() or name.rsplit(".", 1)[-1] == "num_batches_tracked":
            seen.add(id(b))
            out.append((name, b))
    return out


def scanned_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers the weight scan and ``safe_to_save()`` read with the weights: the floating
    ones a forward may write, but those that hold NaN/Inf from the start, by design (a float
    attention mask of -inf). One sync, when the Monitor is made."""
    return [(n, b) for n, b in guarded_buffers(model)
            if b.is_floating_point() and bool(b.isfinite().all())]


def averaged_models(option: Any) -> list[torch.nn.Module]:
    """The Monitor's ``averaged=`` (checked by ``options.py``) as a list."""
    if option is None:
        return []
    return [option] if isinstance(option, torch.nn.Module) else list(option)


def averaged_state(models: list[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The parameters and scanned buffers of the averaged models, named apart from the model's
    (``averaged[0].module.fc.weight``): what ``safe_to_save()`` reads of them. Their updates
    (an EMA's ``lerp_``, a rollback's ``load_state_dict``) are in place, so the tensors listed
    once stay theirs."""
    return [(f"averaged[{i}].{n}", t) for i, m in enumerate(models)
            for n, t in [*m.named_parameters(), *scanned_buffers(m)]]


class BufferGuard:
    """The shadow of ``model``'s buffers taken before each step's first forward, and its
    restore where the step is skipped (module docstring). ``None``-free: a model without
    buffers gets no guard (``BufferGuard.for_model`` returns None)."""

    def __init__(self, model: torch.nn.Module, buffers: list[tuple[str, torch.Tensor]]) -> None:
        self.names = [n for n, _ in buffers]
        self.buffers = [b for _, b in buffers]
        # one flat shadow per (dtype, device): a single copy and a single where for each
        self._groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, b in enumerate(self.buffers):
            self._groups.setdefault((b.dtype, b.device), []).append(i)
        self._shadow = {k: torch.empty(sum(self.buffers[i].numel() for i in idx),
                                       dtype=k[0], device=k[1])
                        for k, idx in self._groups.items()}
        self._views = {k: list(torch.split(self._shadow[k],
                                           [self.buffers[i].numel() for i in idx]))
                       for k, idx in self._groups.items()}
        self.armed = True  # the next forward takes the shadow
        self.taken = False  # a shadow was taken since the last step
        self._hook = model.register_forward_pre_hook(self._before_forward)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> BufferGuard | None:
        buffers = guarded_buffers(model)
        return cls(model, buffers) if buffers else None

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self.armed:
            return
        self.armed, self.taken = False, True
        with torch.no_grad():
            for k, idx in self._groups.items():
                torch._foreach_copy_(self._views[k],
                                     [self.buffers[i].detach().reshape(-1) for i in idx])

    def settle(self, skipped: torch.Tensor) -> None:
        """After the step: where ``skipped`` (a 0-dim bool on any device), the buffers go back
        to the shadow. No sync. Nothing to do when no forward ran since the last step."""
        if self.taken:
            with torch.no_grad():
                for k, idx in self._groups.items():
                    bufs = [self.buffers[i] for i in idx]
                    now = torch.cat([b.detach().reshape(-1) for b in bufs])
                    kept = torch.where(skipped.to(k[1]), self._shadow[k], now)
                    torch._foreach_copy_(
                        bufs, [v.view_as(b) for v, b in
                               zip(torch.split(kept, [b.numel() for b in bufs]), bufs)])
        self.armed, self.taken = True, False

    def remove(self) -> None:
        self._hook.remove()
