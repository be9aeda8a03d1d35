"""``lr_jump``: the learning rate far above the highest it has been, read off at the step,
before the loss shows it (an LR jump that moves the loss 5% is otherwise seen late, or never).

A schedule stepped at the wrong rate, a resumed run with another configuration, a hand edit.
Warm-ups climb a few percent a step and restarts (SGDR, cycles) return to the old peak, never
``ratio`` above it. A climb is judged as a whole too (``climb``): once the rate has risen
``climb_steps`` steps in a row, more than ``climb_ratio`` times the highest it had been when it
last stopped rising (a step at or below the one before, after ``warmup`` steps), reported once
per climb: a schedule whose exponent changed sign grows 10% a step and never jumps 3x at once.
A warm-up from the first step has no such point, so it is judged step by step only. Where the
scheduler is known (``schedule.py``), a rise of ``unexplained`` times the step before's that it
did not make is a jump too, below the peak: no schedule explains it.

Who made the change decides its severity. A rise that the known scheduler made (it set the
rate) is the schedule's, however large: a warm-up stepped per epoch (timm's: 1e-5 for an
epoch, then the peak), a restart. No finding. A rise it did not make is an alarm. Without a
known scheduler (no ``scheduler=``), a jump is a notice at once, and an alarm when the loss
suffers from it: a non-finite loss, or a loss ``suffer_z`` noise units above its level before
the jump, within ``confirm_steps`` steps; a library's schedule that the Monitor was not told
of (a per-epoch warm-up, a hand-written one) raises no alarm on a healthy run. Within
``confirm_steps`` steps of a rollback (``rewound``) a jump is an alarm at once: the restore
put the rate back, so a rate still too high is the code's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..kinds import NOTICE
from ..record import StepRecord
from ..robust import RECENT, SPIKE_ZSCORE, WARMUP_STEPS, level_and_noise
from ..schedule import ScheduleConfig
from .base import Context, Finding, Rule


@dataclass(frozen=True)
class LRJumpConfig:
    ratio: float = 3.0
    """Times the highest rate so far: restarts return to the old peak (1x), no schedule of
    torch's or transformers' exceeds it."""
    warmup: int = WARMUP_STEPS
    """Steps before the rule judges (``warmup_steps``): a warm-up from near 0 climbs by orders
    of magnitude in its first steps."""
    climb: bool = True
    """Judge a climb as a whole against the peak it started from (a 10%-a-step ramp), not only
    single steps."""
    climb_ratio: float = ScheduleConfig.peak_slack
    """A climb past this many times that peak is no schedule's: a restart returns to its old
    peak, and 1.5x is what the schedule test itself grants a cycle whose peak grows
    (``ScheduleConfig.peak_slack``). At 3x (``ratio``), a rate growing 10% a step from a
    schedule decayed to 16% of its peak was found 31 steps after it began, at 2.9x the peak (a
    rate ramp planted late in the long runs); at 1.5x, 24 steps."""
    climb_steps: int = 3
    """Steps in a row the rate must have risen for ``climb_ratio``: a warm-up stepped per epoch
    doubles the rate in one step at its second epoch, a rise of one step that ``ratio``
    judges."""
    confirm_steps: int = 20
    """Steps after a jump no scheduler is known to have made in which the loss can confirm
    it (an alarm): a rate 25x too high shows in the loss within a few steps (the corpus's
    lr_jump_x25 faults, the trainers' rate x20); past these, the rate is the run's."""
    suffer_z: float = SPIKE_ZSCORE
    """Noise units above the loss's level before the jump that confirm it: what a visible
    fault moves the loss by (the spike rule's own threshold)."""
    unexplained: float = 2.0
    """A rise of more than this many times the step before's rate that the known scheduler
    did not make (``schedule.py``: the rate differs from the scheduler's) is a jump whatever
    the peak: no schedule explains it. 2x as the restart test's ``rise``: the same step the
    rules would otherwise take as a restart."""


class LRJump(Rule[LRJumpConfig]):
    name = "lr_jump"
    kinds = ("lr_jump",)
    Config = LRJumpConfig
    STATE = ("last", "peak", "seen", "settled", "since", "losses", "pending", "strict")
    # added since the state's format (state.py): a state saved before starts them again
    STATE_ADDED: ClassVar[dict[str, Callable[[dict], Any]]] = {
        "losses": lambda f: [], "pending": lambda f: None, "strict": lambda f: 0}

    def __init__(self, config: LRJumpConfig | None = None, ctx: Context | None = None):
        super().__init__(config, ctx)
        self.peak = 0.0
        self.last: float | None = None
        self.settled: float | None = None  # the peak when the rate last stopped rising
        self.since = 0  # steps it has risen since
        self.seen = 0
        self.losses: list[float] = []  # the last RECENT finite losses, for the level
        # a jump no scheduler is known to have made, waiting for the loss: (its step, the
        # loss's level and noise before it, its message)
        self.pending: tuple[int, float, float, str] | None = None
        self.strict = 0  # steps left in which a jump is an alarm whoever made it (``rewound``)

    def rewound(self) -> None:
        """A rollback has put this rule's state back to a snapshot's (``snapshots.py``): for
        the next ``confirm_steps`` steps a jump is an alarm at once, scheduler known or not.
        The restore put the rate back with the optimizer's state; a rate still far above the
        peak before is set by the code (a factor applied by hand, a schedule stepped wrong),
        and waiting for the loss to suffer again only repeats the damage."""
        self.strict = self.config.confirm_steps

    def observe(self, s: StepRecord) -> list[Finding]:
        loss = s.values.get("loss", math.nan)
        found = self._confirm(s.step, loss)
        if math.isfinite(loss):
            self.losses = [*self.losses[-(RECENT - 1):], loss]
        return found + self._jump(s)

    def _confirm(self, step: int, loss: float) -> list[Finding]:
        """The alarm of a pending jump that the loss suffers from at this step."""
        if self.pending is None:
            return []
        start, level, noise, text = self.pending
        if step - start > self.config.confirm_steps:
            self.pending = None
            return []
        finite = math.isfinite(loss)
        if finite and (loss - level) / noise < self.config.suffer_z:
            return []
        self.pending = None
        how = ("the loss is non-finite" if not finite else
               f"the loss rose to {loss:.4g}, {(loss - level) / noise:.1f} noise units above its "
               f"level before it ({level:.4g})")
        return [Finding("lr_jump", f"{text}; {step - start} step(s) later {how}",
                        {"jump_step": start, "loss": loss, "level": level},
                        severity="alarm")]

    def _jump(self, s: StepRecord) -> list[Finding]:
        c = self.config
        lr = s.host.lr
        if lr is None or not math.isfinite(lr):
            return []
        self.seen += 1
        strict, self.strict = self.strict > 0, max(self.strict - 1, 0)
        peak, self.peak = self.peak, max(self.peak, lr)
        last = self.last
        rose = last is not None and lr > last
        self.last = lr
        if self.seen > c.warmup and not rose:
            self.settled, self.since = self.peak, 0
        elif rose:
            self.since += 1
        if self.seen <= c.warmup:
            return []
        scheduled = s.host.lr_scheduled is not None and not s.host.unexplained
        if s.host.unexplained and last and lr > c.unexplained * last:
            ref = last
            how = (f"the step before's ({last:.4g}), and the scheduler did not set it (it set "
                   f"{s.host.lr_scheduled:.4g})")
        elif scheduled:
            return []  # the known scheduler set it: the schedule's own change
        elif peak > 0 and lr > c.ratio * peak:
            ref, how = peak, f"the highest it had been ({peak:.4g})"
        elif c.climb and self.settled is not None and self.settled > 0 \
                and self.since >= c.climb_steps and lr > c.climb_ratio * self.settled:
            ref = self.settled
            how = (f"the highest it had been ({ref:.4g}) before it began climbing "
                   f"{self.since} steps ago")
        else:
            return []
        self.settled = None  # this climb is reported; the next starts where it stops
        text = (f"learning rate {lr:.4g} is {lr / ref:.3g}x {how}. Check first: the scheduler "
                "(stepped per batch instead of per epoch? a resumed scheduler state? a growth "
                "factor above 1?), then the run's configuration")
        details = {"lr": lr, "previous_peak": ref, "ratio": lr / ref, "climb_steps": self.since}
        if s.host.unexplained:
            return [Finding("lr_jump", text, details)]
        if strict:
            return [Finding("lr_jump", text + "; after a rollback, which restored the rate: the "
                            "code sets it, not the state", details)]
        # no scheduler known: a schedule's change or a bug, which the loss tells apart
        level, noise = (level_and_noise(self.losses) if len(self.losses) >= 3
                        else (math.nan, 0.0))
        if math.isfinite(level):  # a loss at a floor without noise: a thousandth of it
            self.pending = (s.step, level, max(noise, 1e-3 * abs(level)), text)
        return [Finding(
            "lr_jump", text + "; no scheduler is known (Monitor(scheduler=...)), so this is a "
            f"notice, an alarm if the loss suffers within {c.confirm_steps} steps",
            details, severity=NOTICE)]
