"""Precursors: signals that tend to come before a loss spike, raised as notices (docs/spec.md
section 6). Each is measured on the device from numbers the step has, or with one fused pass
more, and judged on the host at the flush; each message says what was seen and what to check.

- ``precursor_update_ratio``: the update-to-weight ratio ||w_after - w_before|| / ||w_after|| of
  each weight matrix, every ``every`` steps: the update the optimizer really made (weight
  decay, clipping, any optimizer). Healthy training holds it near 1e-3; an update that is a
  large share of the weights is the step before the loss jumps. Measured from a copy of the
  matrices taken before the step and one fused pass over the differences and the weights; on
  when the matrices fit ``max_bytes`` (the copy is the cost).
- ``precursor_adam_eps``: tensors whose gradient RMS (from the step's per-tensor norms, free)
  has fallen below Adam's ``eps``: eps then dominates the update's denominator, and the update
  no longer follows the gradient's scale (Wortsman et al., 2023); a share of the model's
  parameters in that regime is worth a lower eps.
- ``precursor_logit_growth``: the output logits of the LM head (found by
  ``get_output_embeddings()`` or a module named ``lm_head``, or named by ``logits=``): their
  largest magnitude and log Z (the mean log-sum-exp over the vocabulary, what a z-loss keeps
  near 0) drifting far above their level of the run's first steps: the output-logit
  divergence that precedes loss spikes in LMs trained without z-loss.
- ``precursor_attention_logits``: opt in with ``attention=`` (a regex over module names): the
  largest pre-softmax attention logit q.k / sqrt(d_head) of the selected self-attention
  modules, computed for one sequence of the batch from their packed q/k/v projection (a child
  ``qkv``, ``c_attn``, ``in_proj`` or ``query_key_value``, or ``nn.MultiheadAttention``'s own);
  attention logits growing without bound collapse attention's entropy (Dehghani et al., 2023)
  and precede spikes in models without qk-layernorm.

The update ratio and the LM head's logits are read every ``every`` steps (10): they drift over
tens of steps, a hook's small operations cost several times more inside the forward than alone
(docs/performance.md), and the steps between readings pay nothing, so the default precursors
stay cheap. The attention logits, opted into, are read every step: collapsing attention can
come within ten steps of the damage. The rules count their levels and patience in steps.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..checks import multi_tensor_stats
from ..distributed import local_view
from ..ops.layout import COL

QKV_CHILDREN = ("qkv", "c_attn", "in_proj", "query_key_value")
HEAD_ATTRS = ("heads", "num_heads", "n_head", "num_attention_heads", "n_heads")
ROWS = 128  # logits rows (tokens) the hook reads: enough for the level, a fixed small cost
TOKENS = 256  # tokens of the one sequence whose attention logits are computed


def find_lm_head(model: nn.Module, logits: Any) -> tuple[str, nn.Module] | None:
    """The module whose output is the LM's logits: ``logits`` (a name), or, for None, the
    module ``get_output_embeddings()`` returns (Hugging Face) or one named ``lm_head``."""
    modules = dict(model.named_modules())
    if isinstance(logits, str):
        if logits not in modules:
            near = [n for n in modules if n.endswith(logits)][:3]
            raise ValueError(f"fasthealth: logits={logits!r} names no module of the model"
                             + (f" (did you mean {', '.join(map(repr, near))}?)" if near else ""))
        return logits, modules[logits]
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module):
        name = next((n for n, m in modules.items() if m is head), "lm_head")
        return name, head
    for name, m in modules.items():
        if name.split(".")[-1] == "lm_head":
            return name, m
    return None


def _heads(module: nn.Module) -> int | None:
    for attr in HEAD_ATTRS:
        h = getattr(module, attr, None)
        if isinstance(h, int) and h > 0:
            return h
    return None


def find_attention(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module, int]]:
    """(name, the packed q/k/v projection to hook, heads) of each self-attention module whose
    name matches ``pattern``; a matching module without a known projection is an error that
    names it."""
    rx = re.compile(pattern)
    found = []
    for name, m in model.named_modules():
        if not name or not rx.search(name):
            continue
        heads = _heads(m)
        proj = m if isinstance(m, nn.MultiheadAttention) else next(
            (getattr(m, c) for c in QKV_CHILDREN if isinstance(getattr(m, c, None), nn.Module)),
            None)
        if proj is None or heads is None:
            continue
        found.append((name, proj, heads))
    if not found:
        raise ValueError(f"fasthealth: attention={pattern!r} matches no self-attention module "
                         "with a packed q/k/v projection (a child named "
                         f"{', '.join(QKV_CHILDREN)}, or nn.MultiheadAttention) and a head count "
                         f"({', '.join(HEAD_ATTRS)})")
    return found


class PrecursorProbe:
    """The device side of the precursors: the update ratio's copy and fused pass, the hooks on
    the LM head and the attention projections. ``before_step``/``after_step`` bracket the
    optimizer's step; ``scalars()`` gives this step's record fields (NaN: not measured)."""

    def __init__(self, model: nn.Module, params: Sequence[tuple[str, torch.Tensor]],
                 device: torch.device, *, every: int = 10, max_bytes: int = 2**30,
                 logits: Any = None, attention: str | None = None,
                 stats: Callable[[list[torch.Tensor], list[str]], Any] | None = None,
                 next_step: Callable[[], int] | None = None) -> None:
        self.device, self.every = device, every
        # the step the next forward belongs to (the Monitor's counter): the LM head's hook
        # reads the steps the update ratio is measured on
        self.next_step = next_step if next_step is not None else (lambda: 0)
        # the fused pass (the Monitor's, its backend chosen once), else multi_tensor_stats
        self.stats = stats if stats is not None else (
            lambda tensors, names: multi_tensor_stats(tensors, names=names))
        self.matrices = [(n, p) for n, p in params if p.dim() >= 2]
        # no DTensor among them (a parameter keeps its type): no local view to take per step
        self._plain = all(local_view(p.detach())[1] is None for _, p in self.matrices)
        # the pass's rows: each matrix's change, then the matrix
        self._rows = [f"{n} (change)" for n, _ in self.matrices] + [n for n, _ in self.matrices]
        size = sum(p.numel() * p.element_size() for _, p in self.matrices)
        self.copy: list[torch.Tensor] | None = None
        if every and self.matrices and size <= max_bytes:
            self.copy = [torch.empty_like(t) for t in self._now()]
        self.matrix_names = [n for n, _ in self.matrices]
        self._due = False
        self._ratio: tuple[torch.Tensor, torch.Tensor] | None = None
        self._logits: tuple[torch.Tensor, torch.Tensor] | None = None
        self._attention: torch.Tensor | None = None
        self.hooks: list[Any] = []
        self.head = find_lm_head(model, logits) if logits is not False else None
        self._head_hook: Any = None  # on the LM head only for the forwards it reads
        self.arm(self.next_step())
        self.attention = find_attention(model, attention) if attention else []
        for _, proj, heads in self.attention:
            self.hooks.append(proj.register_forward_hook(self._attention_hook(heads)))

    # ---- the update-to-weight ratio ---------------------------------------------------------

    def _now(self) -> list[torch.Tensor]:
        """The matrices' data: a DTensor's local shard (FSDP2), where foreach ops run."""
        if self._plain:
            return [p.detach() for _, p in self.matrices]
        return [local_view(p.detach())[0] for _, p in self.matrices]

    def before_step(self, t: int) -> None:
        self._ratio = None
        self._due = self.copy is not None and t % self.every == 0
        if self._due:
            assert self.copy is not None
            torch._foreach_copy_(self.copy, self._now())

    def after_step(self) -> None:
        """||before - after|| and ||after|| of every matrix in one fused pass."""
        if not self._due:
            self._ratio = None
            return
        assert self.copy is not None
        now = self._now()
        torch._foreach_sub_(self.copy, now)
        norms = self.stats(self.copy + now, self._rows).raw[:-1, COL["norm"]].to(self.device)
        n = len(now)
        ratio = norms[:n] / norms[n:].clamp_min(torch.finfo(torch.float64).tiny)
        ratio = torch.where(norms[n:] > 0, ratio, 0.0)
        self._ratio = ratio.max(), ratio.argmax().double()

    # ---- hooks ------------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether the LM head's hook reads this forward: one of a step every ``every`` steps
        (every step for 0), in training (not an evaluation pass)."""
        return torch.is_grad_enabled() and (not self.every or self.next_step() % self.every == 0)

    def arm(self, step: int) -> None:
        """Hooks the LM head for the forwards of ``step`` when that step is read, and unhooks
        it otherwise: a module with a forward hook takes nn.Module's slower call path, which
        costs the nine steps in ten that are not read more than the reading costs the tenth."""
        if self.head is None:
            return
        due = not self.every or step % self.every == 0
        if due and self._head_hook is None:
            self._head_hook = self.head[1].register_forward_hook(self._on_logits)
        elif not due and self._head_hook is not None:
            self._head_hook.remove()
            self._head_hook = None

    def _on_logits(self, module: nn.Module, args: Any, out: Any) -> None:
        x = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
        if self._logits is not None or not isinstance(x, torch.Tensor) or x.dim() < 2 \
                or not self.due():
            # read once per step: the first forward of a step with gradient accumulation (its
            # other micro-batches' logits are drawn alike); not logits; not this step
            return
        rows = x.detach().reshape(-1, x.shape[-1])[:ROWS]
        low, high = torch.aminmax(rows)  # one pass, no copy of the rows
        self._logits = torch.maximum(high, low.neg()), rows.float().logsumexp(-1).mean()

    def _attention_hook(self, heads: int):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if isinstance(module, nn.MultiheadAttention):  # its input projection, redone
                x = args[0] if args else None
                if not isinstance(x, torch.Tensor):
                    return
                x = x.detach()
                seq = x[:TOKENS, 0] if not module.batch_first else x[0, :TOKENS]
                qkv = nn.functional.linear(seq, module.in_proj_weight, module.in_proj_bias)
            else:
                y = out[0] if isinstance(out, (tuple, list)) else out
                if not isinstance(y, torch.Tensor) or y.dim() < 2 or y.shape[-1] % 3:
                    return
                qkv = y.detach().reshape(-1, y.shape[-2], y.shape[-1])[0, :TOKENS]
            q, k, _ = qkv.float().chunk(3, dim=-1)
            d = q.shape[-1] // heads
            q = q.reshape(-1, heads, d).transpose(0, 1)
            k = k.reshape(-1, heads, d).transpose(0, 1)
            top = (q @ k.transpose(-1, -2)).abs().amax().double() / math.sqrt(d)
            self._attention = top if self._attention is None else torch.maximum(
                self._attention, top)
        return hook

    def ratio_scalars(self) -> dict[str, torch.Tensor]:
        """The update ratio's record fields, when this step measured it (else none)."""
        if self._ratio is None:
            return {}
        return {"update_ratio_max": self._ratio[0], "update_ratio_arg": self._ratio[1]}

    def scalars(self) -> dict[str, torch.Tensor]:
        """This step's fields that were measured (the hooks' values since the last step), then
        reset; a field left out is not measured."""
        out = self.ratio_scalars()
        self.arm(self.next_step())  # the next step's forwards
        if self._logits is not None:
            out["logit_max"], out["log_z"] = (x.to(self.device) for x in self._logits)
        if self._attention is not None:
            out["attention_logit_max"] = self._attention.to(self.device)
        self._logits = self._attention = None
        return out

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self._head_hook is not None:
            self._head_hook.remove()
            self._head_hook = None


# ---- the host rules -------------------------------------------------------------------------
