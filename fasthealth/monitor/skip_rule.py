"""``on_spike="skip"``: the outlier rule that skips a step before its update lands, decided on the
device from numbers the step already computed (docs/spec.md section 6, spike skipping).

The rule scores the loss and the global gradient norm of each step the way ``SpikeDetector``
does on the host (``detectors.py``): against the median of the last 32 accepted values, in
*noise units* (the 90th percentile of the step-to-step differences over 1.645 * sqrt(2), over
the window or its last 32 values, whichever is larger; on the log scale at least
``MIN_LOG_NOISE``), on the linear and the log scale, a value's score being the smaller of the
two. A step is skipped when

- its loss scores above ``zscore`` (a bad batch harms the loss of the step that sees it), or
- its loss and its gradient norm both score above ``joint * zscore`` (a bad batch moves both),
  or
- its gradient norm alone scores above ``grad_factor * zscore`` (5 x 6 = 30 units).

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

import torch
import torch.nn.functional as F

from .detectors import MIN_LOG_NOISE, NOISE_PER_SIGMA, NOISE_QUANTILE, Detector, Found
from .record import HostStep

SERIES = ("loss", "grad_norm")
_TINY = 1e-300  # keeps log() finite on positive values; non-positive ones turn the log off


def _noise_z(win: torch.Tensor, v: torch.Tensor, recent: int, floor: torch.Tensor,
             qs: torch.Tensor) -> torch.Tensor:
    """Per row of ``win`` (oldest first, NaN where empty): how many noise units ``v`` stands
    above the median of the last ``recent`` values; the noise unit is the larger of the whole
    window's and the last ``recent`` values', and at least the row's ``floor``. ``qs`` holds
    (NOISE_QUANTILE, 0.5): the three statistics come from one sort."""
    rows = win.shape[0]
    diffs = (win[:, 1:] - win[:, :-1]).abs()
    width = diffs.shape[1]
    recent_diffs = F.pad(diffs[:, -(recent - 1):], (0, width - recent + 1), value=math.nan)
    recent_values = F.pad(win[:, -recent:], (0, width - recent), value=math.nan)
    q = torch.nanquantile(torch.cat([diffs, recent_diffs, recent_values]), qs, dim=1)
    # the median as statistics.median takes it (the mean of the middle two of an even count;
    # nanmedian would take the lower one)
    level = q[1, 2 * rows:]
    # a recent stretch without two values (NaN) leaves the whole window's noise
    noise = torch.fmax(q[0, :rows], q[0, rows:2 * rows]) / (NOISE_PER_SIGMA * math.sqrt(2))
    noise = torch.fmax(noise, floor)
    z = (v - level) / noise
    flat = torch.where(v > level, math.inf, 0.0)  # a window without noise: any rise is out
    return torch.where(noise > 0, z, flat)


class SkipRule:
    """The device state and the per-step decision of ``on_spike="skip"``; see the module
    docstring. ``update`` returns (skip: 0-dim bool, scores: (2,) float64, NaN while a series'
    window holds fewer than ``warmup`` values)."""

    def __init__(self, device: torch.device, *, zscore: float = 6.0, window: int = 128,
                 warmup: int = 20, recent: int = 32, grad_factor: float = 5.0,
                 joint: float = 0.85, max_run: int = 5) -> None:
        self.window, self.warmup, self.recent = window, max(warmup, 3), recent
        self.zscore, self.joint, self.max_run = zscore, joint, max_run
        self.grad_factor = grad_factor
        self.buf = torch.full((2, window), math.nan, dtype=torch.float64, device=device)
        self.pos = torch.zeros(2, dtype=torch.int64, device=device)
        self.run = torch.zeros((), dtype=torch.int64, device=device)
        self.thresholds = torch.tensor([zscore, grad_factor * zscore], dtype=torch.float64,
                                       device=device)
        self._ring = torch.arange(window, device=device)
        # the noise floor of each row of ``scores``: none on the linear scale, MIN_LOG_NOISE on
        # the log one
        self._floor = torch.tensor([0.0, 0.0, MIN_LOG_NOISE, MIN_LOG_NOISE],
                                   dtype=torch.float64, device=device)
        self._qs = torch.tensor([NOISE_QUANTILE, 0.5], dtype=torch.float64, device=device)

    def scores(self, v: torch.Tensor) -> torch.Tensor:
        """(2,) scores of ``v`` = (loss, grad norm) against the windows, NaN where unarmed."""
        order = (self._ring[None, :] + self.pos[:, None]) % self.window
        win = self.buf.gather(1, order)  # oldest first; unfilled slots (NaN) come first
        both = torch.cat([win, win.clamp_min(_TINY).log()])  # rows: linear, then log scale
        lin, log = _noise_z(both, torch.cat([v, v.clamp_min(_TINY).log()]), self.recent,
                            self._floor, self._qs).chunk(2)
        positive = ((win > 0) | win.isnan()).all(1) & (v > 0)
        z = torch.where(positive, torch.minimum(lin, log), lin)
        armed = (~win.isnan()).sum(1) >= self.warmup
        return torch.where(armed & v.isfinite(), z, math.nan)

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor, step_ok: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decides this step (``step_ok``: its loss and gradients finite) and takes its values
        into the windows unless it is skipped."""
        v = torch.stack([loss.reshape(()), grad_norm.reshape(())]).to(self.buf.device,
                                                                      torch.float64)
        z = self.scores(v)
        alone = (z > self.thresholds).any()  # NaN compares False: an unarmed series never skips
        both = (z > self.joint * self.zscore).all()
        ok = step_ok.to(self.buf.device)
        outlier = (alone | both) & ok
        skip = outlier & (self.run < self.max_run)
        self.run = torch.where(outlier, self.run + 1, torch.zeros_like(self.run))
        # the step after max_run skips in a row, still out: a new regime; the windows restart
        # from it (else, while the median catches up, a value that dips under the threshold
        # resets the run and the next ones are skipped again)
        restart = outlier & ~skip
        self.buf.masked_fill_(restart, math.nan)
        take = ok & ~skip & v.isfinite()  # (2,): per series
        col = self.pos[:, None]
        old = self.buf.gather(1, col)[:, 0]
        self.buf.scatter_(1, col, torch.where(take, v, old)[:, None])
        self.pos = (self.pos + take.long()) % self.window
        return skip, z


class SkipEvents(Detector):
    """Wraps the host ``SpikeDetector`` under ``on_spike="skip"``: a step the device rule
    skipped is always an event that says so. The host rule usually sees the same spike (its
    event then gets ``skipped``); where it does not (the two rules differ in their windows'
    details), the device's own scores make the event."""

    KIND = {"loss": "loss_spike", "grad_norm": "grad_norm_spike"}

    def __init__(self, spikes: Detector, zscore: float, grad_factor: float) -> None:
        self.spikes = spikes
        self.limits = {"loss": zscore, "grad_norm": grad_factor * zscore}

    def observe(self, s: HostStep) -> list[Found]:
        found = self.spikes.observe(s)
        if not s.values.get("spike_skip", 0) > 0:
            return found
        found = [(k, m, dict(d, skipped=True)) if k in self.KIND.values() else (k, m, d)
                 for k, m, d in found]
        if any(k in self.KIND.values() for k, _, _ in found):
            return found
        z = {k: s.values.get(f"skip_z_{k}", math.nan) for k in SERIES}
        key = max(SERIES, key=lambda k: z[k] / self.limits[k] if z[k] == z[k] else -math.inf)
        value = s.values[key]
        return found + [(self.KIND[key],
                         f"step skipped (on_spike='skip'): the {key.replace('_', ' ')} "
                         f"{value:.4g} stood {z[key]:.1f} noise units above its recent level "
                         f"(loss {z['loss']:.1f}, gradient norm {z['grad_norm']:.1f} units). "
                         "Parameters and optimizer state were left as they were. Check first: "
                         "this step's batch (its dump: fh.replay)",
                         {"value": value, "zscore": z[key], "zscores": z, "skipped": True,
                          "rule": "device"})]
