"""``on_spike="skip"``: the outlier rule that skips a step before its update lands, decided on the
device from numbers the step already computed (docs/spec.md section 6, spike skipping).

The rule scores the loss and the global gradient norm of each step with the spike score's
tensor form (``robust.spike_scores_t``, equal to the host's ``spike_scores``): against the
median of the last 32 accepted values, in noise units, on the linear and the log scale, a
value's score being the smaller of the two. The scores go into the step record, and the host
spike rule (``rules/spike.py``) judges by them: one score for the skip and the event. A step
is skipped when

- its loss scores above ``zscore`` (a bad batch harms the loss of the step that sees it), or
- its loss and its gradient norm both score above ``joint * zscore`` (a bad batch moves both),
  or
- its gradient norm alone scores above ``grad_factor * zscore`` (5 x 6 = 30 units).

The loss's two paths also need the loss to rise at least ``FLOOR_RISE`` (10%) of the loss the
run started from above its recent median, as the host rule needs for an alarm: a blip at a
floor (a hard batch of a converged classifier, many units of a tiny noise) is not skipped, nor
is it taken into the window. The run's first loss is the host spike rule's, handed to the
device once it is known (at a flush: no sync); until then, and without it, the loss's paths
judge by the score alone.

The gradient norm alone needs far more than the loss: it climbs several-fold while a healthy
run leaves its initial plateau or warms up its learning rate, the loss falling fast, whereas a
bad batch puts it hundreds of units out (the scores behind the factor: docs/performance.md,
"Acting early").

What it never does: multiply an update by 0 (0 x NaN is NaN; the step is gated, through the
optimizer's ``found_inf`` or an early return: ``gate.py``), take a skipped value into its
window (a NaN or an outlier in the history would make every later step look normal, or skip),
or skip more than ``max_run`` steps in a row: a level that stays is a change of regime (an LR
jump that already hit the weights, a new data source), which skipping cannot undo and would
stall the run; the windows then restart from the new level (nothing is skipped until they hold
``warmup`` values again) and the alarms of the host rules say what happened.

All state lives in device tensors of fixed shapes (a (2, window) ring, its write positions, the
run length): no host sync, nothing recompiled, the same decision on every rank given the same
inputs (the Monitor gives it the cross-rank mean loss and the global norm under a
``process_group``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .robust import (
    FLOOR_RISE,
    SPIKE_MAX_RUN,
    SPIKE_WINDOW,
    SPIKE_ZSCORE,
    WARMUP_STEPS,
    score_constants,
    spike_scores_t,
)

SERIES = ("loss", "grad_norm")
GRAD_FACTOR = 5.0  # SkipConfig.grad_factor's default, also read by the host spike rule


@dataclass(frozen=True)
class SkipConfig:
    zscore: float = SPIKE_ZSCORE
    """The loss's threshold in noise units (the Monitor's ``spike_zscore``, as the host rule)."""
    window: int = SPIKE_WINDOW
    """Accepted values each series' ring holds (``spike_window``)."""
    warmup: int = WARMUP_STEPS
    """Values a ring needs before it scores (``warmup_steps``; at least 3)."""
    grad_factor: float = GRAD_FACTOR
    """Times ``zscore`` the gradient norm alone must stand out: it climbs several-fold while a
    healthy run leaves its plateau or warms up, whereas a bad batch puts it hundreds of units
    out (docs/performance.md)."""
    joint: float = 0.85
    """The loss and the gradient norm both above this share of ``zscore``: a bad batch moves
    both. The host rule no longer has this path (the rules' ablation: no tuning
    fault needed it there); the device rule keeps it until the skip evaluation, which scores the
    skips, says otherwise."""
    max_run: int = SPIKE_MAX_RUN
    """Skips in a row at most: a level that stays is a regime change, which skipping cannot
    undo and would stall the run (``robust.SPIKE_MAX_RUN``, as the host rule's)."""

    @classmethod
    def of(cls, spike: Any) -> SkipConfig:
        """The device rule's config from the host spike rule's (``SpikeConfig``, after the
        Monitor's keywords and ``rules={"spike": {...}}``): one threshold, window, warm-up and
        run length for both halves of the spike policy."""
        return cls(zscore=spike.zscore, window=spike.window, warmup=spike.warmup,
                   max_run=spike.max_run)


class SkipRule:
    """The device state and the per-step decision of ``on_spike="skip"``; see the module
    docstring. ``update`` returns (skip: 0-dim bool, scores: (2,) float64, NaN while a series'
    window holds fewer than ``warmup`` values)."""

    STATE = ("buf", "pos", "run")  # the rings and the run of skips; the rest is the config's

    @classmethod
    def beside(cls, rules: Any, keywords: SkipConfig, device: torch.device) -> SkipRule:
        """The device half of the spike policy beside the host ``rules``: on the host spike
        rule's config (the Monitor's keywords and ``rules={"spike": ...}`` alike), or on
        ``keywords`` without that rule."""
        spike = next((r.config for r in rules if getattr(r, "name", None) == "spike"), None)
        return cls(device, SkipConfig.of(spike) if spike is not None else keywords)
    DERIVED = ("start", "_start")  # the host spike rule's, handed over at a flush

    def __init__(self, device: torch.device, config: SkipConfig | None = None) -> None:
        c = self.config = config if config is not None else SkipConfig()
        self.window, self.warmup = c.window, max(c.warmup, 3)
        self.zscore, self.joint, self.max_run = c.zscore, c.joint, c.max_run
        self.grad_factor = c.grad_factor
        self.buf = torch.full((2, c.window), math.nan, dtype=torch.float64, device=device)
        self.pos = torch.zeros(2, dtype=torch.int64, device=device)
        self.run = torch.zeros((), dtype=torch.int64, device=device)
        self.start = torch.full((), math.nan, dtype=torch.float64, device=device)
        self._start = math.nan  # its value on the host: set once, not at every flush
        self.thresholds = torch.tensor([c.zscore, c.grad_factor * c.zscore],
                                       dtype=torch.float64, device=device)
        self._ring = torch.arange(c.window, device=device)
        self._constants = score_constants(2, device)

    def rearm(self) -> None:
        """At a warm restart of the schedule (``schedule.py``): the rings start again, on the
        device, no sync; as the host rules do."""
        self.buf.fill_(math.nan)
        self.run.zero_()

    def set_start(self, start: float) -> None:
        """The loss the run started from (``Analyser.loss_start``), when it is new: one fill of
        a device scalar, no sync."""
        if start == start and start != self._start:
            self.start.fill_(start)
            self._start = start

    def scores(self, v: torch.Tensor) -> torch.Tensor:
        """(2,) scores of ``v`` = (loss, grad norm) against the windows, NaN where unarmed."""
        return self._scores(v)[0]

    def _scores(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``scores`` and the windows' recent medians."""
        order = (self._ring[None, :] + self.pos[:, None]) % self.window
        win = self.buf.gather(1, order)  # oldest first; unfilled slots (NaN) come first
        z, level = spike_scores_t(win, v, self._constants)
        armed = (~win.isnan()).sum(1) >= self.warmup
        return torch.where(armed & v.isfinite(), z, math.nan), level

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor, step_ok: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decides this step (``step_ok``: its loss and gradients finite) and takes its values
        into the windows unless it is skipped."""
        v = torch.stack([loss.reshape(()), grad_norm.reshape(())]).to(self.buf.device,
                                                                      torch.float64)
        z, level = self._scores(v)
        over = z > self.thresholds  # NaN compares False: an unarmed series never skips
        both = (z > self.joint * self.zscore).all()
        ok = step_ok.to(self.buf.device)
        outlier = (over.any() | both) & ok  # kept out of the windows, counted in the run
        # the loss's paths need a rise that matters to the run, not only to a floor's noise
        big = self._big(v[0], level[0])
        skip = (over[0] & big | over[1] | both & big) & ok & (self.run < self.max_run)
        within = self.run < self.max_run
        self.run = torch.where(outlier, self.run + 1, torch.zeros_like(self.run))
        # the step after max_run outliers in a row, still out: a new regime; the windows
        # restart from it (else, while the median catches up, a value that dips under the
        # threshold resets the run and the next ones are skipped again)
        restart = outlier & ~within
        self.buf.masked_fill_(restart, math.nan)
        take = ok & ~(outlier & within) & v.isfinite()  # (2,): per series
        col = self.pos[:, None]
        old = self.buf.gather(1, col)[:, 0]
        self.buf.scatter_(1, col, torch.where(take, v, old)[:, None])
        self.pos = (self.pos + take.long()) % self.window
        return skip, z

    def _big(self, loss: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        """Whether ``loss`` rises ``FLOOR_RISE`` of the run's first loss (of ``level``, its
        recent median, when higher) above ``level``; true while the first loss is unknown, or
        for a loss below 0 (as the host rule's ``small_rise``)."""
        small = (self.start > 0) & (level >= 0) & (
            loss - level < FLOOR_RISE * torch.fmax(level, self.start))
        return ~small
