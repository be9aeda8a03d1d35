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
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..checks import multi_tensor_stats
from ..distributed import local_view
from ..ops.layout import COL
from .detectors import Detector, Found, _listed, _skipped, level_and_noise
from .record import HostStep, not_measured

PRECURSOR_SCALARS = ("update_ratio_max", "update_ratio_arg", "logit_max", "log_z",
                     "attention_logit_max")
QKV_CHILDREN = ("qkv", "c_attn", "in_proj", "query_key_value")
HEAD_ATTRS = ("heads", "num_heads", "n_head", "num_attention_heads", "n_heads")
ROWS = 512  # logits rows (tokens) the hook reads: enough for the level, a fixed small cost
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
                 logits: Any = None, attention: str | None = None) -> None:
        self.device, self.every = device, every
        self.matrices = [(n, p) for n, p in params if p.dim() >= 2]
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
        if self.head is not None:
            self.hooks.append(self.head[1].register_forward_hook(self._on_logits))
        self.attention = find_attention(model, attention) if attention else []
        for _, proj, heads in self.attention:
            self.hooks.append(proj.register_forward_hook(self._attention_hook(heads)))

    # ---- the update-to-weight ratio ---------------------------------------------------------

    def _now(self) -> list[torch.Tensor]:
        """The matrices' data: a DTensor's local shard (FSDP2), where foreach ops run."""
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
        norms = multi_tensor_stats(self.copy + now).raw[:-1, COL["norm"]].to(self.device)
        n = len(now)
        ratio = norms[:n] / norms[n:].clamp_min(torch.finfo(torch.float64).tiny)
        ratio = torch.where(norms[n:] > 0, ratio, 0.0)
        self._ratio = ratio.max(), ratio.argmax().double()

    # ---- hooks ------------------------------------------------------------------------------

    def _on_logits(self, module: nn.Module, args: Any, out: Any) -> None:
        x = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
        if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return  # an evaluation pass, or not logits
        rows = x.detach().reshape(-1, x.shape[-1])[:ROWS].float()
        self._logits = rows.abs().amax().double(), rows.logsumexp(-1).mean().double()

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
        nan = not_measured(self.device)
        ratio = self._ratio or (nan, nan)
        return {"update_ratio_max": ratio[0], "update_ratio_arg": ratio[1]}

    def scalars(self) -> dict[str, torch.Tensor]:
        """This step's fields (the hooks' values since the last step), then reset."""
        nan = not_measured(self.device)
        logits = self._logits or (nan, nan)
        attention = self._attention if self._attention is not None else nan
        self._logits = self._attention = None
        return {**self.ratio_scalars(), "logit_max": logits[0].to(self.device),
                "log_z": logits[1].to(self.device),
                "attention_logit_max": attention.to(self.device)}

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


# ---- the host rules -------------------------------------------------------------------------


class _Growth:
    """A series judged against its own level in the run's first recorded values: ``ref`` is the
    median of values ``first``..``first + span`` (after the early transient); a value counts as
    grown when it exceeds ``ratio`` x ref and ``floor``; ``patience`` such values in a row fire,
    once, re-armed when the series comes back below ``ratio`` x ref."""

    def __init__(self, ratio: float, floor: float, first: int = 20, span: int = 30,
                 patience: int = 3) -> None:
        self.ratio, self.floor, self.first, self.span = ratio, floor, first, span
        self.patience = patience
        self.seen: list[float] = []
        self.ref: float | None = None
        self.high = 0
        self.fired = False

    def update(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.ref is None:
            self.seen.append(v)
            if len(self.seen) >= self.first + self.span:
                self.ref = statistics.median(self.seen[self.first:])
            return False
        grown = v > self.ratio * self.ref and v > self.floor
        self.high = self.high + 1 if grown else 0
        if not grown and v < self.ratio * self.ref:
            self.fired = False
        if self.high >= self.patience and not self.fired:
            self.fired = True
            return True
        return False


class UpdateRatioPrecursor(Detector):
    """``precursor_update_ratio``: the largest update-to-weight ratio of a matrix more than
    ``zscore`` noise units above its recent level, on the log scale (``spike_scores``' unit:
    the median of the last ``window`` measured values, the noise from their step-to-step
    differences), after ``warmup`` measurements, while the loss is not falling fast.

    Why the noise unit and not a ratio to the median: small-batch SGD makes healthy updates
    many times its median now and then, while an LR jump under clipping moves a steady series
    by less; measured against its own step-to-step noise the jump stands out and the noisy
    healthy series does not. Why per unit of gradient: with SGD the update follows the
    gradient, which grows several-fold while a run leaves a plateau; an LR jump changes the
    update for the same gradient. Why not while the loss falls fast (its median over the last
    10 steps 10% below the 10 before): a run leaving a plateau makes its largest updates then,
    and they are what it needs."""

    def __init__(self, names: list[str], zscore: float = 6.0, window: int = 30,
                 warmup: int = 8, floor: float = 1e-3) -> None:
        self.names, self.zscore, self.warmup, self.floor = names, zscore, warmup, floor
        self.history: deque[float] = deque(maxlen=window)
        self.losses: deque[float] = deque(maxlen=20)
        self.fired = False  # reported until the series comes back

    def _falling(self) -> bool:
        xs = list(self.losses)
        return len(xs) == 20 and statistics.median(xs[10:]) < 0.9 * statistics.median(xs[:10])

    def observe(self, s: HostStep) -> list[Found]:
        loss = s.values["loss"]
        if math.isfinite(loss):
            self.losses.append(loss)
        v = s.values.get("update_ratio_max", math.nan)
        g = s.values.get("grad_norm", math.nan)
        if not (math.isfinite(v) and v > 0 and math.isfinite(g) and g > 0) or _skipped(s):
            return []
        y = math.log(v / g)  # the update per unit of gradient: an effective learning rate
        logs = list(self.history)
        self.history.append(y)
        if len(logs) < self.warmup or v < self.floor:
            return []
        level, noise = level_and_noise(logs, recent=len(logs))
        z = (y - level) / noise if noise > 0 else math.inf
        high = z > self.zscore
        fire = high and not self.fired and not self._falling()
        self.fired = high
        if not fire:
            return []
        name = self.names[int(s.values["update_ratio_arg"])]
        median = math.exp(level)
        return [("precursor_update_ratio",
                 f"update-to-weight ratio {v:.3g} in {name}, {v / median:.3g}x its recent "
                 f"median {median:.3g} ({z:.1f} noise units): this step's update moved the "
                 "weights far more than usual. Check first: the learning rate (schedule, "
                 "warm-up too short, a changed config), then the gradient norm (clipping: "
                 "max_grad_norm) and Adam's second moments",
                 {"value": v, "tensor": name, "window_median": median, "zscore": z})]


class AdamEpsPrecursor(Detector):
    """``precursor_adam_eps``: tensors holding more than ``share`` of the parameters whose
    gradient RMS stayed below Adam's eps for ``patience`` steps (zero gradients, a tensor no
    gradient reached, left out). Reported once until the share comes back."""

    def __init__(self, names: list[str], numels: list[int], eps: list[float | None],
                 share: float = 0.05, patience: int = 20) -> None:
        self.names, self.numels, self.eps = names, numels, eps
        self.share, self.patience = share, patience
        self.total = sum(numels) or 1
        self.run = 0
        self.fired = False

    def observe(self, s: HostStep) -> list[Found]:
        low = [i for i, (norm, n, eps) in enumerate(zip(s.per_norm, self.numels, self.eps))
               if eps is not None and norm > 0 and norm / math.sqrt(max(n, 1)) < eps]
        share = sum(self.numels[i] for i in low) / self.total
        self.run = self.run + 1 if share > self.share else 0
        if self.run == 0:
            self.fired = False
        if self.run < self.patience or self.fired:
            return []
        self.fired = True
        names = [self.names[i] for i in low]
        return [("precursor_adam_eps",
                 f"the gradient RMS of {len(low)} tensor(s) ({share:.0%} of the parameters) has "
                 f"stayed below Adam's eps for {self.run} steps: {_listed(names)}. Their "
                 "updates are damped by eps, not scaled by the gradient. Check first: a smaller "
                 "eps (1e-12 or less for large models), then the loss scale",
                 {"tensors": names, "share": share, "steps": self.run})]


class LogitPrecursor(Detector):
    """``precursor_logit_growth`` (the LM head's largest |logit| grown ``ratio`` x, or its log Z
    up by ``drift`` nats, against the run's early level) and ``precursor_attention_logits``
    (the largest attention logit grown ``ratio`` x and above ``attention_floor``)."""

    def __init__(self, ratio: float = 4.0, logit_floor: float = 30.0, drift: float = 10.0,
                 attention_floor: float = 100.0) -> None:
        self.logit = _Growth(ratio, logit_floor)
        self.log_z = _Growth(1.0, 0.0)  # judged by drift below, the level taken the same way
        self.drift = drift
        self.attention = _Growth(ratio, attention_floor)
        self.z_fired = False

    def observe(self, s: HostStep) -> list[Found]:
        if _skipped(s):
            return []
        v = s.values
        found = []
        lmax, log_z = v.get("logit_max", math.nan), v.get("log_z", math.nan)
        if self.logit.update(lmax) and self.logit.ref is not None:
            found.append(self._logits(f"the largest output logit {lmax:.4g} is "
                                      f"{lmax / self.logit.ref:.3g}x its early level "
                                      f"{self.logit.ref:.4g}", lmax, self.logit.ref))
        self.log_z.update(log_z)
        ref = self.log_z.ref
        if ref is not None and math.isfinite(log_z):
            up = log_z - ref > self.drift
            if up and not self.z_fired:
                found.append(self._logits(f"log Z (the mean log-sum-exp of the output logits) "
                                          f"{log_z:.4g} has drifted {log_z - ref:.3g} nats above "
                                          f"its early level {ref:.4g}", log_z, ref))
            self.z_fired = up
        att = v.get("attention_logit_max", math.nan)
        if self.attention.update(att) and self.attention.ref is not None:
            found.append(("precursor_attention_logits",
                          f"the largest attention logit {att:.4g} is "
                          f"{att / self.attention.ref:.3g}x its early level "
                          f"{self.attention.ref:.4g}: attention is collapsing onto single "
                          "keys. Check first: the learning rate, then qk-layernorm (normalising "
                          "queries and keys bounds these logits)",
                          {"value": att, "early_level": self.attention.ref}))
        return found

    @staticmethod
    def _logits(seen: str, value: float, ref: float) -> Found:
        return ("precursor_logit_growth",
                f"{seen}: the output logits are diverging. Check first: the learning rate, "
                "then a z-loss (1e-4 * log Z^2 keeps log Z near 0) or a final layernorm "
                "before the head",
                {"value": value, "early_level": ref})


def adam_eps(optimizer: Any, params: Sequence[tuple[str, torch.Tensor]]) -> list[float | None]:
    """Per watched parameter, the eps of its Adam-family group (None: not Adam)."""
    eps: dict[int, float] = {}
    if optimizer is not None:
        for g in optimizer.param_groups:
            if "eps" in g and "betas" in g and isinstance(g["eps"], float):
                for p in g["params"]:
                    eps[id(p)] = g["eps"]
    return [eps.get(id(p)) for _, p in params]


def precursor_rules(probe: PrecursorProbe | None, optimizer: Any,
                    params: Sequence[tuple[str, torch.Tensor]]) -> list[Detector]:
    """The host rules of the precursors the probe measures (and the free Adam-eps one)."""
    if probe is None:
        return []
    rules: list[Detector] = [AdamEpsPrecursor([n for n, _ in params],
                                              [p.numel() for _, p in params],
                                              adam_eps(optimizer, params))]
    if probe.copy is not None:
        rules.append(UpdateRatioPrecursor(probe.matrix_names))
    if probe.head is not None or probe.attention:
        rules.append(LogitPrecursor())
    return rules
