"""``stall``: a run that does not learn from the start, judged once, after ``steps`` finite
losses, against the median of the first ``FIRST`` (medians of ``RECENT`` values, so that one
lucky batch does not count as learning).

Some tensors' gradients have stayed below ``vanish_ratio`` of the largest tensor's for every
one of the last ``RECENT`` steps while the loss has fallen by less than ``LEARNED``: the signal
does not get through to them (saturated sigmoids, depth without residuals or normalisation, a
bad initialisation), and what learning there is happens in the layers it reaches. A flat loss
alone is not enough: healthy SGD runs can sit on their initial plateau for well over a hundred
steps before they leave it. After its one judgement the rule is done for the run: a plateau
later on is not a stall from the start.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ..record import StepRecord
from .base import Finding, Rule, listed

FIRST: int = 10
"""Losses in the starting median."""

RECENT: int = 10
"""Losses in the best recent median, and steps the gradients must stay vanished."""

LEARNED: float = 0.5
"""The loss having fallen by this share is learning, whatever the gradients."""



@dataclass(frozen=True)
class StallConfig:
    steps: int = 100
    """Finite losses before the one judgement: past the plateaus healthy runs of the corpus
    start on."""
    vanish_ratio: float = 1e-5
    """Share of the largest tensor's gradient norm: in healthy networks the smallest trained
    tensor's stays within a few orders of it; in a 12-layer sigmoid stack the first layers' are
    10 orders below."""


class Stall(Rule[StallConfig]):
    name = "stall"
    kinds = ("stall",)
    Config = StallConfig
    STATE = ("seen", "firsts", "start", "losses", "best", "vanished", "done")

    def __init__(self, config: StallConfig | None = None, ctx=None):
        super().__init__(config, ctx)
        self.losses: deque[float] = deque(maxlen=RECENT)
        self.vanished: deque[frozenset[int]] = deque(maxlen=RECENT)  # per step: indices
        self.start: float | None = None
        self.firsts: list[float] = []
        self.best = math.inf
        self.seen = 0
        self.done = False

    def observe(self, s: StepRecord) -> list[Finding]:
        c = self.config
        loss = s.values["loss"]
        if self.done or not math.isfinite(loss):
            return []
        self.seen += 1
        self.losses.append(loss)
        if s.values["grads_finite"] and s.per_norm:
            self.vanished.append(self._vanishing(s.per_norm))
        if self.start is None:
            self.firsts.append(loss)
            if len(self.firsts) == FIRST:
                self.start = statistics.median(self.firsts)
            return []
        self.best = min(self.best, statistics.median(self.losses))
        if self.seen < c.steps:
            return []
        self.done = True
        fell = (self.start - self.best) / abs(self.start) if self.start else math.inf
        always = frozenset.intersection(*self.vanished) if self.vanished else frozenset()
        if always and fell < LEARNED:
            return [self._finding(fell, sorted(always))]
        return []

    def _vanishing(self, norms: list[float]) -> frozenset[int]:
        top = max((n for n in norms if n == n), default=0.0)
        return frozenset(i for i, n in enumerate(norms)
                         if n == n and top > 0 and n < self.config.vanish_ratio * top
                         and self._counts(i))

    def _counts(self, i: int) -> bool:
        """Whether tensor ``i`` counts as vanished: only tensors of two or more dimensions do.
        Some vectors get no gradient by construction in healthy models (an attention key's
        bias: softmax ignores what it adds to every score; a bias just before a normalisation,
        whose mean it removes). A BERT has both: its key biases' gradients sit below 1e-5 of
        the largest from the first step, and a BERT on its initial plateau (100 steps under
        AdamW, the trainer evaluation) raised a false stall when they counted."""
        if i >= len(self.ctx.params):
            return True  # no tensors known (a rule fed recorded steps): every one counts
        return getattr(self.ctx.params[i][1], "ndim", 2) >= 2

    def _finding(self, fell: float, vanished: list[int]) -> Finding:
        names = [self.ctx.names[i] for i in vanished]
        where = (f" The gradients of {len(names)} tensor(s) stay below "
                 f"{self.config.vanish_ratio:g} of the largest: {listed(names)} (vanishing "
                 "gradients: saturated activations, depth without residuals or "
                 "normalisation, the initialisation)." if names else "")
        return Finding(
            "stall",
            f"the loss has not learned in {self.seen} steps: its best level {self.best:.4g} is "
            f"{max(fell, 0.0):.1%} below its start {self.start:.4g}.{where} Check first: "
            "whether the gradients reach every layer, then the learning rate (0? far too "
            "small?), then the labels (shuffled apart from the inputs?)",
            {"best": self.best, "start": self.start, "fell": fell, "steps": self.seen,
             "vanished": names})
