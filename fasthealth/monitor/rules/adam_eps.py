"""``precursor_adam_eps``: tensors holding more than ``share`` of the parameters whose gradient
RMS (from the step's per-tensor norms, free) stayed below their Adam group's eps for
``patience`` steps: eps then dominates the update's denominator, and the update no longer
follows the gradient's scale (Wortsman et al., 2023). Zero gradients (a tensor no gradient
reached) are left out. Reported once until the share comes back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..record import StepRecord
from .base import Context, Finding, Rule, listed


@dataclass(frozen=True)
class AdamEpsConfig:
    share: float = 0.05
    """Share of the parameters: a few small tensors (biases, norms) below eps do not matter."""
    patience: int = 20
    """Steps in a row: a quiet stretch of a few steps is not a regime."""


def adam_eps(optimizer: Any, params: Any) -> list[float | None]:
    """Per watched parameter, the eps of its Adam-family group (None: not Adam)."""
    eps: dict[int, float] = {}
    if optimizer is not None:
        for g in optimizer.param_groups:
            if "eps" in g and "betas" in g and isinstance(g["eps"], float):
                for p in g["params"]:
                    eps[id(p)] = g["eps"]
    return [eps.get(id(p)) for _, p in params]


class AdamEps(Rule[AdamEpsConfig]):
    name = "adam_eps"
    kinds = ("precursor_adam_eps",)
    precursor = True
    Config = AdamEpsConfig
    STATE = ("run", "fired")

    def __init__(self, config: AdamEpsConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        self.eps = adam_eps(self.ctx.optimizer, self.ctx.params)
        self.total = sum(self.ctx.numels) or 1
        self.run = 0
        self.fired = False

    def observe(self, s: StepRecord) -> list[Finding]:
        c, numels = self.config, self.ctx.numels
        low = [i for i, (norm, n, eps) in enumerate(zip(s.per_norm, numels, self.eps))
               if eps is not None and norm > 0 and norm / math.sqrt(max(n, 1)) < eps]
        share = sum(numels[i] for i in low) / self.total
        self.run = self.run + 1 if share > c.share else 0
        if self.run == 0:
            self.fired = False
        if self.run < c.patience or self.fired:
            return []
        self.fired = True
        names = [self.ctx.names[i] for i in low]
        return [Finding(
            "precursor_adam_eps",
            f"the gradient RMS of {len(low)} tensor(s) ({share:.0%} of the parameters) has "
            f"stayed below Adam's eps for {self.run} steps: {listed(names)}. Their updates are "
            "damped by eps, not scaled by the gradient. Check first: a smaller eps (1e-12 or "
            "less for large models), then the loss scale",
            {"tensors": names, "share": share, "steps": self.run})]
