"""``precursor_logit_growth`` (the LM head's largest |logit| grown ``ratio`` times, or its log Z
up by ``drift`` nats, against the run's early level: the output-logit divergence that precedes
loss spikes in LMs trained without z-loss) and ``precursor_attention_logits`` (the largest
attention logit grown ``ratio`` times and above ``attention_floor``: attention collapsing onto
single keys, Dehghani et al., 2023). Measured by ``precursors.PrecursorProbe``.

Each series is judged against its own level: the median of its values of steps
``EARLY_FROM`` to ``EARLY_FROM + EARLY_SPAN`` (after the early transient); growth lasting
``patience`` steps (counted in readings: the probe reads the LM head's logits every ``every``
steps, the attention logits every step) fires, once, re-armed when the series comes back below
``ratio`` times that level; a log Z above its level by ``drift`` nats fires at once.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..record import StepRecord
from .base import Context, Finding, Rule, skipped

EARLY_FROM: int = 20
"""Steps skipped before the early level is taken (the first steps' transient)."""

EARLY_SPAN: int = 30
"""Steps whose values the early level is the median of."""


@dataclass(frozen=True)
class LogitConfig:
    ratio: float = 4.0
    """Times the early level: beyond the sharpening a model's logits show as it learns; the
    value the precursor evaluation measured the precursors with
    (docs/performance.md)."""
    logit_floor: float = 30.0
    """The largest output logit must also pass it: below 30, softmax is far from saturated."""
    drift: float = 10.0
    """Nats log Z may drift above its early level: a z-loss keeps it near 0."""
    attention_floor: float = 100.0
    """The largest attention logit must also pass it: exp(100) saturates any softmax."""
    patience: int = 3
    """Steps the growth must last, counted in readings (at least one): one sharp batch between
    two readings is not a trend."""


class _Growth:
    """One series' growth against its early level."""

    STATE = ("seen", "ref", "high", "fired")  # the others: the config's

    def __init__(self, ratio: float, floor: float, c: LogitConfig, every: int = 1) -> None:
        self.ratio, self.floor, self.c = ratio, floor, c
        # read every ``every`` steps: the steps of the level and the patience in readings
        self.first = -(-EARLY_FROM // every)
        self.span = max(1, -(-EARLY_SPAN // every))
        self.patience = max(1, -(-c.patience // every))
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


class LogitGrowth(Rule[LogitConfig]):
    name = "logit_growth"
    kinds = ("precursor_logit_growth", "precursor_attention_logits")
    precursor = True
    Config = LogitConfig
    STATE = ("logit", "log_z", "attention", "z_fired")

    @classmethod
    def build(cls, ctx: Context) -> Rule | None:
        probe = ctx.probe
        return super().build(ctx) if probe is not None and (
            probe.head is not None or probe.attention) else None

    def __init__(self, config: LogitConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        c = self.config
        every = (ctx.probe.every if ctx is not None and ctx.probe is not None else 0) or 1
        self.logit = _Growth(c.ratio, c.logit_floor, c, every)
        self.log_z = _Growth(1.0, 0.0, c, every)  # judged by drift below
        self.attention = _Growth(c.ratio, c.attention_floor, c)  # read every step
        self.z_fired = False

    def observe(self, s: StepRecord) -> list[Finding]:
        if skipped(s):
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
            up = log_z - ref > self.config.drift
            if up and not self.z_fired:
                found.append(self._logits(f"log Z (the mean log-sum-exp of the output logits) "
                                          f"{log_z:.4g} has drifted {log_z - ref:.3g} nats above "
                                          f"its early level {ref:.4g}", log_z, ref))
            self.z_fired = up
        att = v.get("attention_logit_max", math.nan)
        if self.attention.update(att) and self.attention.ref is not None:
            found.append(Finding(
                "precursor_attention_logits",
                f"the largest attention logit {att:.4g} is {att / self.attention.ref:.3g}x its "
                f"early level {self.attention.ref:.4g}: attention is collapsing onto single "
                "keys. Check first: the learning rate, then qk-layernorm (normalising queries "
                "and keys bounds these logits)",
                {"value": att, "early_level": self.attention.ref}))
        return found

    @staticmethod
    def _logits(seen: str, value: float, ref: float) -> Finding:
        return Finding(
            "precursor_logit_growth",
            f"{seen}: the output logits are diverging. Check first: the learning rate, then a "
            "z-loss (1e-4 * log Z^2 keeps log Z near 0) or a final layernorm before the head",
            {"value": value, "early_level": ref})
