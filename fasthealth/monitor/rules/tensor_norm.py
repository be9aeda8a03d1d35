"""Per tensor: a gradient norm that collapses below ``collapse`` of its own recent level for
``patience`` steps (``vanishing_grad``: dead ReLUs, saturated sigmoids), or jumps above
``explode`` times it (``exploding_grad``). The level is an exponential average (``ALPHA``) of
the log norm, armed after ``warmup`` steps; collapsed and exploded steps stay out of it. When
every tensor collapses at once the global rule (``vanishing.py``) speaks. A step whose loss is
exactly 0 at a fitted floor (``vanishing.FitFloor``) is passed over: its gradients are float32's
rounding noise. A rate that rose more than ``ScheduleConfig.rise`` times at one step, whoever
set it, starts the levels again, as a restart of a known schedule does: a tensor's usual
gradient under a rate thousands of times lower says nothing of its size under the new one (a
per-epoch warm-up from 1e-5 without ``scheduler=``: a ConvNeXt stem's bias gradient fell
below 0.001 of its level three steps after the warm-up's jump, the zoo)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..record import StepRecord
from ..robust import WARMUP_STEPS
from ..schedule import ScheduleConfig
from .base import Context, Finding, Rule, listed
from .vanishing import FitFloor

ALPHA: float = 0.05
"""Weight of a new log norm in the level: a memory of ~20 steps."""


@dataclass(frozen=True)
class TensorNormConfig:
    collapse: float = 1e-3
    """Share of its own level below which a tensor's gradient has collapsed: three orders
    below its usual size; no healthy run of the corpus alarms (the detector evaluation)."""
    explode: float = 100.0
    """Times its own level above which a tensor's gradient has exploded."""
    patience: int = 3
    """Steps in a row for a collapse."""
    warmup: int = WARMUP_STEPS
    """Steps of a tensor before its level is trusted (``warmup_steps``)."""


class TensorNorm(FitFloor, Rule[TensorNormConfig]):
    name = "tensor_norm"
    kinds = ("vanishing_grad", "exploding_grad")
    Config = TensorNormConfig
    STATE = ("level", "seen", "low", "reported_low", "reported_high", "first_losses",
             "last_fitted", "lr")
    # added since the state's format (state.py): a resumed rule gathers its first losses anew
    STATE_ADDED: dict[str, Callable[[dict], Any]] = {
        "first_losses": lambda f: [], "last_fitted": lambda f: None, "lr": lambda f: None}
    DERIVED = ("_settled", "_level", "_level_of")  # caches: _steady's check, the first level
    REARM = True

    def __init__(self, config: TensorNormConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        n = len(self.ctx.names)
        self.lo, self.hi = math.log(self.config.collapse), math.log(self.config.explode)
        self.level = torch.full((n,), math.nan, dtype=torch.float64)
        self.seen = torch.zeros(n, dtype=torch.int64)
        self.low = torch.zeros(n, dtype=torch.int64)
        self.reported_low = torch.zeros(n, dtype=torch.bool)
        self.reported_high = torch.zeros(n, dtype=torch.bool)
        self._settled: tuple[torch.Tensor, ...] = ()  # see _steady
        self.first_losses = []
        self.last_fitted = None
        self.lr: float | None = None  # the step before's rate

    def observe(self, s: StepRecord) -> list[Finding]:
        c = self.config
        lr = s.host.lr
        if lr is not None and math.isfinite(lr):
            if self.lr and lr > ScheduleConfig.rise * self.lr:  # a new regime: levels anew
                self.rearm()
            self.lr = lr
        loss = s.values["loss"]
        if self.note_loss(s.step, loss, c.warmup) and loss == 0:
            return []  # a fitted batch rounded to 0: its gradients are rounding noise
        if not s.values["grads_finite"] or not s.per_norm:
            return []
        norm = torch.tensor(s.per_norm, dtype=torch.float64)
        if self._steady(norm):
            return []
        present = ~norm.isnan()
        log = norm.clamp(min=0).log()  # 0 -> -inf: a collapse
        armed = present & (self.seen >= c.warmup) & self.level.isfinite()
        low = armed & (log < self.level + self.lo)
        high = armed & (log > self.level + self.hi)
        normal = present & ~low & ~high & log.isfinite()
        first = normal & self.level.isnan()
        self.level = torch.where(first, log, self.level)
        self.level = torch.where(normal & ~first,
                                 (1 - ALPHA) * self.level + ALPHA * log, self.level)
        self.seen += normal.long()
        self.low = torch.where(low, self.low + 1, torch.where(present, 0, self.low))
        found = []
        new_low = (self.low >= c.patience) & ~self.reported_low
        if new_low.any() and not bool((low | ~present).all()):  # all at once: the global rule
            found.append(self._event(
                "vanishing_grad", new_low, norm,
                f"collapsed to below {c.collapse:g} of their usual size for {c.patience} steps",
                "dead units (a ReLU layer whose pre-activations went negative: its bias, the "
                "learning rate), saturated activations (sigmoid/tanh inputs far from 0), then "
                "parameters frozen by mistake"))
        self.reported_low = (self.reported_low | new_low) & ~(normal & ~first)
        new_high = high & ~self.reported_high
        if new_high.any():
            found.append(self._event(
                "exploding_grad", new_high, norm, f"are over {c.explode:g}x their usual size",
                "those tensors' weights (growing without bound? check_params), their learning "
                "rate and weight decay, then clipping (max_grad_norm)"))
        self.reported_high = (self.reported_high | new_high) & ~normal
        return found

    def _steady(self, norm: torch.Tensor) -> bool:
        """The usual step, in a few operations: every tensor present, armed and within its
        bounds, none collapsing or reported. Then it only moves the levels and counts, by the
        same arithmetic as the general path in ``observe`` (which a step that is not usual
        takes, from the start)."""
        c = self.config
        parts = (self.seen, self.low, self.reported_low, self.reported_high)
        if len(self._settled) != len(parts) or any(
                a is not b for a, b in zip(parts, self._settled)):
            # checked once for these tensors: the general path and a restored state replace
            # them; here ``seen`` only grows and the others stay as they are
            if not bool((self.seen >= c.warmup).all()) or self.low.any() \
                    or self.reported_low.any() or self.reported_high.any():
                return False
            self._settled = parts
        log, level = norm.log(), self.level
        if not bool(((log >= level + self.lo) & (log <= level + self.hi)).all()):
            return False  # NaN compares False: a tensor absent, a level not yet made
        self.level = (1 - ALPHA) * level + ALPHA * log
        self.seen += 1
        return True

    def _event(self, kind: str, mask: torch.Tensor, norm: torch.Tensor, seen: str,
               check: str) -> Finding:
        idx = mask.nonzero().flatten().tolist()
        named = {self.ctx.names[i]: {"norm": float(norm[i]), "level": math.exp(self.level[i])}
                 for i in idx}
        return Finding(kind, f"the gradients of {len(named)} tensor(s) {seen}: {listed(named)}. "
                       f"Check first: {check}", {"tensors": named})
