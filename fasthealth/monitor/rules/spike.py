"""``loss_spike`` and ``grad_norm_spike``: a value far above its recent level (docs/spec.md
section 6, "Spike scoring"; the score is ``robust.spike_scores``).

A value is a spike when its score exceeds ``zscore`` on the linear and the log scale both (near
a loss floor of 0.01 healthy batches reach 50x the median: far on the log scale, near on the
linear one). Before the windows are armed, a loss above ``early_loss`` or a gradient norm above
``early_grad_norm`` times their first values (a learning rate far too high from the start).
``max_run`` spikes in a row are a new level, taken in. A loss spike that rises less than
``FLOOR_RISE`` of the loss the run started from is a notice, not an alarm: a blip at a floor.
Once a run has scored ``TAIL_STEPS`` losses, so is one within ``TAIL_MARGIN`` times the run's
own tail, on the smaller scale (the tail's), when it rose less than ``TAIL_RISE`` of the loss
the run started from; ``RESTART_RISE`` of it in a warm restart's high-rate phase
(``phase.py``). A spike that only the linear scale sees (the ``above_max`` path) is a notice
when it rose less than ``LINEAR_RISE`` of that loss (``RESTART_RISE`` in the phase), with or
without a tail.

Under ``on_spike="skip"`` the score is computed once, by the device rule (``skip_rule.py``),
where the skip needs it, and this rule judges by it (the record's ``skip_z_loss`` and
``skip_z_grad_norm``): an event and a skip never rest on two scores of one value. The host
scores a value itself only where the device has no score (its window not yet armed again after
a restart or a new level) and for the ``above_max`` path, which the device rule does not have. A
step the device rule skipped is always an event that says so: the host rule usually finds the
same spike (its finding then says ``skipped``); where it does not (the device rule also skips
on the loss and the gradient norm together, and on the norm alone at ``grad_factor`` times the
threshold), the device's scores make the finding.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..kinds import NOTICE
from ..record import StepRecord
from ..robust import (
    FLOOR_RISE,
    SPIKE_MAX_RUN,
    SPIKE_WINDOW,
    SPIKE_ZSCORE,
    TAIL_KEEP,
    TAIL_MARGIN,
    TAIL_RATE,
    TAIL_RISE,
    TAIL_STEPS,
    WARMUP_STEPS,
    SpikeWindow,
    WindowValues,
)
from ..skip_rule import GRAD_FACTOR, SERIES
from .base import Context, Finding, Rule
from .phase import RestartPhase

ADVICE = {
    "loss": "Check first: this step's batch (its dump: fh.replay) for corrupt, mislabelled or "
            "out-of-distribution samples",
    "grad_norm": "Check first: this step's batch, then the learning rate; clipping "
                 "(max_grad_norm) bounds the damage",
}
LABEL = {"loss": "loss", "grad_norm": "global grad norm"}
KIND = {"loss": "loss_spike", "grad_norm": "grad_norm_spike"}


EARLY_VALUES: int = 5
"""First values the early ratios are taken against (their largest): all a run has before its
window is armed."""

RESTART_LOSS: float = 10.0
"""At a warm restart of the schedule (``rearm``), until the new window is armed: a loss this
many times the largest of the window before the restart (which spans the cycle's higher losses,
not only its low end at a rate near 0: against the last few values, the climb after a restart
from a floor of 0.01 reached 10x and alarmed, the trainer evaluation). A loss x100 at the
restart's own step is still seen (a Llama through the HF Trainer, its loss x100 planted at a
restart). Nor less than this many
times the loss the run started from: a restart after a long cycle at a rate near 0 may undo
much of the run (a conv autoencoder 8,000 steps long, at its 5th and 6th restarts: 12x and
45x the window before, 3x and 7x its first loss; the long runs), while a bad
batch at a floor goes far past where the run began. The gradient norm keeps
``early_grad_norm``."""


RESTART_RISE: float = 4.0
"""In a restart's high-rate phase, a loss spike within the run's tail (``TAIL_MARGIN``) is a
notice when it rose less than this many times the loss the run started from (``TAIL_RISE``
elsewhere). A set memorised under dropout, thrown back to a rate of 0.05 under Nesterov
momentum, lost it for tens of steps 89-149 steps after its restarts: batches at 1.99 and 0.81
from a level of 5e-3 and 1e-4 (rises of 196% and 80% of its first loss), scoring 1.3x the
run's tail on the log scale (the long runs):
the schedule's doing, gone by itself. Twice the largest rise seen. The tail is the guard
still: a batch of garbage words planted in a restart's high-rate phase rose 221% and scored
6.8x the run's tail (a word-level transformer under warm restarts, in the detector corpus)."""


LINEAR_RISE: float = 2.0
"""A loss spike that only the linear scale sees (the ``above_max`` path: on the log scale, or on
the device's score, it stands under ``zscore``) is a notice when it rose less than this many
times the loss the run started from (``RESTART_RISE`` in a warm restart's high-rate phase,
whichever is larger), before the run's tail exists as after. On the long runs' tuning part
such spikes of healthy runs rose 0.94x the first loss at most outside a restart's phase (a
set memorised under Adam losing it for some steps, 885 steps in, log score 5.9) and 1.96x in
one (the long runs). No late fault of the long runs was found by that path;
the short corpus's faults it found rose 500x or more, and a batch of shuffled labels at a noisy
floor 10x (the trainer evaluation). Twice the largest healthy
rise."""


@dataclass(frozen=True)
class SpikeConfig:
    zscore: float = SPIKE_ZSCORE
    """Noise units above the recent median (``spike_zscore``). At 6 no healthy tuning family
    alarms and every garbage batch of the held-out part is caught; 11, which leave-one-out
    prefers on the tuning part, misses 5 of 6 held-out garbage-word batches
    (the detector evaluation)."""
    window: int = SPIKE_WINDOW
    """Finite, non-spike values the noise is measured over (``spike_window``): enough
    differences for a stable 0.9 quantile."""
    warmup: int = WARMUP_STEPS
    """Values a window needs before it scores (``warmup_steps``)."""
    max_run: int = SPIKE_MAX_RUN
    """Spikes in a row that make a new level, taken into the window (``robust.SPIKE_MAX_RUN``;
    the device skip rule reads this config)."""
    early_loss: float = 4.0
    """Before the window is armed: a loss this many times its first values is a learning rate
    far too high from the start. Without this path a rate too high from the start is caught in
    2 runs fewer of 6 (the rules' ablation)."""
    early_grad_norm: float = 100.0
    """The same for the gradient norm, set far higher: the first steps' gradient norms move
    much more than their losses."""
    above_max: float = 5.0
    """A value this many times the largest in its window, and past ``zscore`` on the linear
    scale, is a spike whatever the log scale says. At a noisy loss floor (a classifier of
    batch 16 whose healthy losses swing 30x from one batch to the next) the log-scale noise
    unit is so wide that a loss 28x the window's largest (shuffled labels, 0.85 -> 24.4)
    scored 1.7 there (the trainer evaluation). The largest of 128
    healthy values is the tail already: 5x beyond it is not noise. Only with the window at
    least half full (its largest is then a tail), or after a restart against the larger of
    the new window's and the old one's largest: the loss climbing after a restart outgrew a
    20-value window 5x and alarmed."""


class _Series:
    """One watched series: its window of finite, non-spike values, its first values, and its
    run of spikes."""

    STATE = ("values", "first", "start", "run", "restarted", "before", "scored",
             "top")  # the rest: config's
    DERIVED = ("window",)  # made from ``values`` (``values`` reads and sets it)
    # fields added since the state's format: from a state saved before them (state.py)
    STATE_ADDED: dict[str, Callable[[dict], Any]] = {
        "start": lambda f: (statistics.median(f["first"]) if f.get("first")
                            and not f.get("restarted") else math.nan),
        "scored": lambda f: 0, "top": lambda f: []}

    def __init__(self, key: str, window: int, early_ratio: float, first: int):
        self.key, self.label, self.early_ratio, self.n_first = key, LABEL[key], early_ratio, first
        self.window = SpikeWindow(window)
        self.first: list[float] = []
        self.start = math.nan  # the median of the first values, kept through restarts
        self.run = 0
        self.restarted = False  # the window started again at a warm restart (Spike.rearm)
        self.before = math.inf  # then: the largest value of the window before the restart
        self.scored = 0  # the loss's scores so far, and the largest of them, ascending
        self.top: list[float] = []

    values = WindowValues("window")  # the window's values, oldest first

    def armed(self, value: float, warmup: int) -> bool:
        """Whether the window judges ``value`` (finite, and the window holds ``warmup``
        values); notes it among the first values."""
        if not math.isfinite(value):
            return False
        if len(self.first) < self.n_first:
            self.first.append(value)
            if len(self.first) == self.n_first and self.start != self.start:
                self.start = statistics.median(self.first)
        return len(self.values) >= max(warmup, 3)

    def small_rise(self, value: float) -> float | None:
        """For the loss: the rise of ``value`` above the window's median as a share of the
        run's scale (its start, or its level when higher), when below ``FLOOR_RISE``; else
        None (an alarm, as for any series without a positive start)."""
        if self.key != "loss" or not self.start > 0 or not self.values:
            return None
        level = statistics.median(self.values)
        share = (value - level) / max(level, self.start)
        return share if level >= 0 and share < FLOOR_RISE else None

    def tail(self) -> float | None:
        """The run's tail (``TAIL_RATE``): the score its losses exceeded once per thousand
        scored steps so far; None before ``TAIL_STEPS`` of them."""
        if self.scored < TAIL_STEPS or not self.top:
            return None
        k = min(max(1, int(self.scored * TAIL_RATE)), len(self.top))
        return self.top[-k]

    def note_score(self, z: float) -> None:
        """Counts a scored loss among the run's, after it was judged."""
        if z != z:
            return
        self.scored += 1
        if len(self.top) < TAIL_KEEP:
            bisect.insort(self.top, z)
        elif z > self.top[0]:
            self.top.pop(0)
            bisect.insort(self.top, z)

    def early(self, value: float) -> float | None:
        """value / the largest of its first values, when that exceeds ``early_ratio``. The
        largest, not the median: at a batch of 8, healthy batches' losses spread several-fold,
        and the first few values are all there is to measure that spread on."""
        ref = max(self.first) if self.first else math.nan
        if math.isfinite(value) and ref > 0 and value > self.early_ratio * ref:
            return value / ref
        return None

    def settle(self, value: float, spike: bool, max_run: int) -> bool:
        """Takes ``value`` into the window unless it is a spike; a run of ``max_run`` spikes is a
        new level, taken in. Returns whether to report ``value`` as a spike."""
        if not math.isfinite(value):
            return False
        if not spike:
            self.run = 0
            self.window.append(value)
            return False
        if self.run >= max_run:
            self.window.append(value)
            return False
        self.run += 1
        return True


class Spike(Rule[SpikeConfig], RestartPhase):
    """See the module docstring."""

    name = "spike"
    kinds = ("loss_spike", "grad_norm_spike")
    Config = SpikeConfig
    STATE = ("series", "lr", "lr_peak", "restart_lr")
    # added since the state's format (state.py): a state saved before is out of any restart
    STATE_ADDED: dict[str, Callable[[dict], Any]] = {"lr": lambda f: None,
                                                     "lr_peak": lambda f: 0.0,
                                                     "restart_lr": lambda f: None}

    OPTIONS = {"zscore": "spike_zscore", "window": "spike_window", "warmup": "warmup_steps"}

    def __init__(self, config: SpikeConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        c = self.config
        self.series = {"loss": _Series("loss", c.window, c.early_loss, EARLY_VALUES),
                       "grad_norm": _Series("grad_norm", c.window, c.early_grad_norm, EARLY_VALUES)}
        self.restart_lr: float | None = None  # the rate a warm restart set, in its high phase
        self.lr_peak = 0.0  # the highest rate before the step observed last
        self.lr: float | None = None  # the rate of the step observed last

    def observe(self, s: StepRecord) -> list[Finding]:
        self.track(s.host.lr)
        return self._device_skips(s, self._host(s))

    def rearm(self) -> None:
        """At a warm restart: the windows start again (the noise under the old rate is not the
        new rate's), and the early ratios stay off: they catch a rate far too high from the
        start, and this rate is the schedule's."""
        c = self.config
        for key, ser in self.series.items():
            ser.before = max(ser.values) if ser.values else math.inf
            ser.window.clear()
            ser.run = 0
            ref = max(ser.before, ser.start) if key == "loss" and ser.start > 0 else ser.before
            ser.first = [ref] * EARLY_VALUES
            ser.early_ratio = RESTART_LOSS if key == "loss" else c.early_grad_norm
            ser.restarted = True
        self.restarted()

    def _host(self, s: StepRecord) -> list[Finding]:
        c = self.config
        values = {"loss": s.values["loss"],
                  "grad_norm": s.values["grad_norm"] if s.values["grads_finite"] else math.nan}
        # the device rule's scores (on_spike="skip"), where it has one: the score it skipped
        # by is the score judged here; computed on the host only without one
        device = not math.isnan(s.values.get("spike_skip", math.nan))
        armed = {k: self.series[k].armed(v, c.warmup) for k, v in values.items()}
        found = []
        for key, ser in self.series.items():
            v = values[key]
            if not armed[key]:
                ratio = ser.early(v) if math.isfinite(v) else None
                if ratio is not None:
                    found.append(self._early(ser, v, ratio))
                elif math.isfinite(v) and len(ser.values) < max(c.warmup, 3):
                    ser.window.append(v)
                continue
            z = s.values.get(f"skip_z_{key}", math.nan) if device else math.nan
            lin, decided = math.nan, z == z and z > c.zscore  # by the device's score
            if z != z:
                lin, log = ser.window.scores(v)
                z = min(lin, log)
            top = max(ser.values)
            if len(ser.values) < c.window // 2:  # too few values for their largest to be a tail
                top = max(top, ser.before) if ser.restarted else math.inf
            big = top > 0 and v > c.above_max * top
            if big and lin != lin:
                lin = ser.window.scores(v)[0]
            beyond = big and lin > c.zscore
            if ser.settle(v, z > c.zscore or beyond, c.max_run):
                found.append(self._spike(ser, v, max(z, lin) if beyond and not decided else z,
                                         z))
            if key == "loss":
                ser.note_score(z)
        return found

    def _device_skips(self, s: StepRecord, found: list[Finding]) -> list[Finding]:
        """``found`` with the device rule's skip said (spike_skip is NaN with on_spike off)."""
        if not s.values.get("spike_skip", 0) > 0:
            return found
        for f in found:
            if f.kind in KIND.values():
                f.details = dict(f.details, skipped=True)
        if any(f.kind in KIND.values() for f in found):
            return found
        limits = {"loss": self.config.zscore, "grad_norm": GRAD_FACTOR * self.config.zscore}
        z = {k: s.values.get(f"skip_z_{k}", math.nan) for k in SERIES}
        key = max(SERIES, key=lambda k: z[k] / limits[k] if z[k] == z[k] else -math.inf)
        value = s.values[key]
        return found + [Finding(
            KIND[key], f"step skipped (on_spike='skip'): the {key.replace('_', ' ')} "
            f"{value:.4g} stood {z[key]:.1f} noise units above its recent level (loss "
            f"{z['loss']:.1f}, gradient norm {z['grad_norm']:.1f} units). Parameters and "
            "optimizer state were left as they were. Check first: this step's batch (its dump: "
            "fh.replay)",
            {"value": value, "zscore": z[key], "zscores": z, "skipped": True, "rule": "device"})]

    def _spike(self, ser: _Series, value: float, z: float, scored: float) -> Finding:
        """The finding for a spike of ``value`` at score ``z`` (the linear score where the
        ``above_max`` path found it); ``scored``: the score the run's tail is made of."""
        median = statistics.median(ser.values)
        ratio = f" ({value / median:.3g}x)" if median > 0 else ""
        details = {"value": value, "zscore": z, "window_median": median,
                   "window": len(ser.values), "threshold": self.config.zscore}
        share = ser.small_rise(value)
        if share is not None:  # a blip at a floor: many units of a tiny noise, little loss
            of = (f"the loss the run started from ({ser.start:.4g})" if ser.start >= median
                  else "that median")
            return Finding(
                KIND[ser.key],
                f"{ser.label} {value:.4g} is {z:.1f} noise units above its recent median "
                f"{median:.4g}{ratio}, a rise of {share:.1%} of {of}: a blip at the loss's "
                f"floor, a notice (an alarm from {FLOOR_RISE:.0%}). {ADVICE[ser.key]}",
                {**details, "rise_share": share, "start": ser.start}, severity=NOTICE)
        if ser.key == "loss" and not scored > self.config.zscore and ser.start > 0:
            rise = max(LINEAR_RISE, RESTART_RISE if self.in_restart else 0.0)
            if value - median < rise * ser.start:
                during = ", in a warm restart's high-rate phase" if self.in_restart else ""
                return Finding(
                    KIND[ser.key],
                    f"{ser.label} {value:.4g} is {z:.1f} noise units above its recent median "
                    f"{median:.4g}{ratio} on the linear scale, {scored:.1f} on the log scale, "
                    f"and it rose less than {rise:.0%} of the loss the run started from "
                    f"({ser.start:.4g}){during}: a miss at a floor spanning decades, a notice. "
                    f"{ADVICE[ser.key]}", {**details, "log_zscore": scored, "start": ser.start},
                    severity=NOTICE)
        tail = ser.tail() if ser.key == "loss" else None
        # as far as this run's batches go, on the scale its tail is measured on, and a rise
        # small beside the loss the run started from
        rise = RESTART_RISE if self.in_restart else TAIL_RISE
        if tail is not None and scored < TAIL_MARGIN * tail and \
                value - median < rise * ser.start:
            both = "" if scored == z else f" ({scored:.1f} on the log scale)"
            during = ", in a warm restart's high-rate phase" if self.in_restart else ""
            return Finding(
                KIND[ser.key],
                f"{ser.label} {value:.4g} is {z:.1f} noise units above its recent median "
                f"{median:.4g}{ratio}{both}, within {TAIL_MARGIN:g}x of what this run's own "
                f"losses reach once per {1 / TAIL_RATE:,.0f} steps ({tail:.1f} units over "
                f"{ser.scored:,} steps), and it rose less than {rise:.0%} of the loss "
                f"the run started from ({ser.start:.4g}){during}: its noise has heavy tails, "
                "a notice. "
                f"{ADVICE[ser.key]}", {**details, "tail": tail, "scored": ser.scored},
                severity=NOTICE)
        return Finding(
            KIND[ser.key],
            f"{ser.label} {value:.4g} is {z:.1f} noise units above its recent median "
            f"{median:.4g}{ratio}. {ADVICE[ser.key]}", details)

    def _early(self, ser: _Series, value: float, ratio: float) -> Finding:
        if ser.restarted:
            return Finding(
                KIND[ser.key],
                f"{ser.label} {value:.4g} is {ratio:.3g}x its level before the learning "
                f"rate's warm restart (or the run's first, when higher), beyond what a restart "
                f"causes. {ADVICE[ser.key]}",
                {"value": value, "ratio": ratio, "threshold": ser.early_ratio,
                 "restart": True})
        return Finding(
            KIND[ser.key],
            f"{ser.label} {value:.4g} is {ratio:.3g}x its first values early in training. "
            "Check first: the learning rate and its warm-up (far too high from the start?), "
            f"then the initialisation. {ADVICE[ser.key]}",
            {"value": value, "ratio": ratio, "threshold": ser.early_ratio, "early": True})
