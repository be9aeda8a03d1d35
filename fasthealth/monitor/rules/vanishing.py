"""``vanishing_grad``, globally: the global gradient norm vanishingly small for ``patience``
steps, below ``abs_threshold`` or ``rel_drop`` times below its recent median (a constant or
masked-out loss, a learning-rate schedule at 0, a collapsed loss scale)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ..record import HostStep
from .base import Context, Finding, Rule


@dataclass(frozen=True)
class VanishingConfig:
    abs_threshold: float = 1e-8
    """A global norm below it has stopped training (``vanishing_threshold``): a gradient of
    that size moves no weight measurably."""
    rel_drop: float = 1e4
    """Times below the recent median: far beyond the fall of healthy norms within a window;
    no healthy run of the corpus alarms (bench/results/detectors.json, after_30_final)."""
    patience: int = 3
    """Steps in a row: one batch of all-masked tokens is not a fault."""
    window: int = 128
    """Norms in the recent median (``spike_window``)."""
    warmup: int = 20
    """Norms before the relative test (``warmup_steps``)."""


class Vanishing(Rule[VanishingConfig]):
    name = "vanishing"
    kinds = ("vanishing_grad",)
    Config = VanishingConfig

    OPTIONS = {"abs_threshold": "vanishing_threshold", "window": "spike_window",
               "warmup": "warmup_steps"}

    def __init__(self, config: VanishingConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        self.norms: deque[float] = deque(maxlen=self.config.window)
        self.low = 0
        self.active = False

    def observe(self, s: HostStep) -> list[Finding]:
        if s.info.get("grads_present", 1) == 0:  # no .grad at all: ``no_grad``'s finding
            return []
        return self.update(s.values["grad_norm"]) if s.values["grads_finite"] else []

    def update(self, norm: float) -> list[Finding]:
        c = self.config
        if not math.isfinite(norm):
            return []
        ref = statistics.median(self.norms) if len(self.norms) >= c.warmup else None
        low = norm < c.abs_threshold or (ref is not None and norm * c.rel_drop < ref)
        self.low = self.low + 1 if low else 0
        if not low:
            self.norms.append(norm)
            self.active = False
            return []
        if self.low >= c.patience and not self.active:
            self.active = True
            return [Finding(
                "vanishing_grad",
                f"global gradient norm {norm:.3g} has been vanishingly small for {self.low} "
                "steps" + (f" (recent median {ref:.3g})" if ref else "") + ". Check first: the "
                "loss (constant? masked out?), then the learning rate schedule and the loss "
                "scale", {"grad_norm": norm, "recent_median": ref, "steps": self.low})]
        return []
