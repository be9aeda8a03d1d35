"""The likely cause of an alarm incident and what to check first (docs/spec.md section 6).

An incident names one of ``kinds.CAUSES`` from the evidence it has, by the first rule of
``CauseConfig`` that applies (each field says why it holds):

1. the optimizer's state non-finite as its first alarm: ``optimizer_state`` (``weights`` when
   a weight also jumped by orders of magnitude and stayed finite);
2. a corrupted weight (``weight_corruption``) among its kinds: ``weights`` (not several
   tensors that jumped together: a diverging run, whatever made it diverge);
3. a learning-rate jump among its kinds: ``learning_rate``;
4. a collapsing loss scale or an overflow streak, or non-finite gradients with a finite loss
   under a GradScaler: ``numeric_range``; a repeated batch: ``batch``;
5. a loss spike, a non-finite loss or gradient (or an alarmed gradient spike) whose loss comes
   back within ``BACK_WITHIN`` steps: ``batch`` (replay it); one that persists: ``weights``
   (the model state was damaged), unless a loss spike on weights from ordinary steps opened it
   and the losses stayed finite (``data_first``: the data from that step on); until that is
   known, a loss ``ASTRONOMICAL`` times its level at the first alarm's step is ``weights``
   already;
6. otherwise the default cause of its first alarm's kind (``Kind.cause``).

The judgement is made again at every step while the incident is open: rule 5 needs the steps
after the spike, so an incident's cause can change from ``batch`` to ``weights`` once the loss
has stayed up. ``check_first`` says what to look at first for that cause; ``why`` says which
rule named it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .events import ALARM, SEVERAL_TENSORS, Event, Incident
from .kinds import cause_of

CHECK_FIRST = {
    "batch": "this step's batch: replay its dump (fh.replay(incident.dump, model, loss_fn); "
             "culprit_ids names the samples), then the data loader",
    "weights": "the weights before this step (fh.check_params(model): non-finite or huge "
               "tensors), then the learning rate and the updates of the steps before it",
    "learning_rate": "the learning rate and its schedule (a scheduler stepped per batch, a "
                     "resumed state, the end of warm-up), then the run's configuration",
    "optimizer_state": "the optimizer's state (a checkpoint loaded into it, a step that went "
                       "through with a non-finite gradient)",
    "numeric_range": "the numeric range: activations beyond float16's "
                     "(fh.ActivationMonitor(model, range_dtype=torch.float16)), the loss "
                     "scale; or train in bfloat16",
    "outside": "the loss code at this step (a scaling, a mask, a division computed "
               "differently), then the hardware (a fault that does not replay is transient)",
}


ASTRONOMICAL: float = 1e6
"""A first alarm's loss this many times its level names the weights before the run has shown
whether it comes back (so that the trainer's log line, written at that step, leads to them): a
1e30 weight makes a loss 7e28x its level in tests/monitor/test_causes.py, while its garbage
batch (inputs 300x, mislabelled) makes 210x; a batch would need inputs thousands of times off to
come near a million."""

BACK_WITHIN: int = 3
"""Steps after the first alarm within which the loss must come back for the cause to be the
batch: a bad batch harms its own step (a garbage batch, the Adam update it makes, is back within
one or two steps in the tests); a loss that stays up after the batch has passed is the model's
state."""


@dataclass(frozen=True)
class CauseConfig:
    optimizer_first: frozenset[str] = frozenset({"optimizer_state_nonfinite"})
    """First alarms that name the optimizer's state: broken moments found before any
    non-finite loss or gradient came from outside the step (a loaded checkpoint), not from
    this run's gradients; unless the incident also holds a finite weight jump (``jumped``)."""
    jumped: bool = True
    """A weight that jumped by orders of magnitude and stayed finite (``weight_corruption``'s
    ``jumps``) names the weights even after broken optimizer state: a 1e37 weight's gradient
    squared overflows the second moments (Adafactor's were non-finite 10 steps before the
    weight scan saw the weight, the trainer evaluation), while broken
    moments make the weights they update NaN or Inf, not finite and huge."""
    weight_kinds: frozenset[str] = frozenset({"weight_corruption"})
    """Kinds that name the weights wherever they stand in the incident: a parameter seen
    non-finite or orders of magnitude off between two scans is damaged model state, whatever
    alarm came first (the loss spike it makes is its effect)."""
    lr_kinds: frozenset[str] = frozenset({"lr_jump"})
    """Kinds that name the learning rate: a rate far above its peak is a change of
    configuration, and the spikes and the divergence that follow are its effect."""
    range_kinds: frozenset[str] = frozenset({"loss_scale_collapse", "overflow_streak"})
    """Kinds that name the numeric range: a loss scale that keeps backing off, or overflow at
    every step, is float16's range exceeded."""
    batch_kinds: frozenset[str] = frozenset({"repeated_batch"})
    """Kinds that name the data wherever they stand: a loader that serves the same batch again
    is the input pipeline, whatever the loss does."""
    scaled_grads: bool = True
    """Non-finite gradients with a finite loss under a GradScaler name the numeric range: the
    forward stayed in range, the scaled backward did not."""
    spikes: frozenset[str] = frozenset({"loss_spike", "nonfinite_loss", "nonfinite_grad",
                                        "grad_norm_spike"})
    """First alarms judged by whether the run comes back (rule 5): each is what one bad batch
    makes at its own step, and what damaged weights make at every step."""
    back_share: float = 0.2
    """Back: a finite loss at most this share above its level before the incident (the
    tracker's ``recover``)."""
    data_first: frozenset[str] = frozenset({"loss_spike"})
    """First alarms whose loss, staying up, names the data rather than the weights (rule 5),
    when the step before the alarm raised no event (its update was ordinary) and every loss
    since has been finite and short of ``ASTRONOMICAL``: the loss jumped on weights that
    ordinary steps made, so what changed at that step was the batch, and what holds it up is
    more such batches (a stretch of shuffled labels or random tokens) or the update the first
    one made. Weights damaged from outside the step show in the weight scans (a direct cause)
    or as non-finite losses. (20 steps of shuffled labels on the zoo's CNNs: the data.)"""


def back(loss: float, level: float | None, share: float) -> bool:
    """Whether ``loss`` is back at its ``level`` (None: no level yet, never back)."""
    return level is not None and math.isfinite(loss) and loss <= (1 + share) * level


DIRECT, RECOVERY, DEFAULT = "direct", "recovery", "default"
"""What named an incident's cause (``Incident.basis``): a kind or a fact that names it
directly (rules 1-4), whether the loss came back (rule 5), or its first alarm's default (rule
6). A replay of the incident's dump re-runs the step: its cause replaces one named by the
recovery or by default, not one named directly (the report shows one cause)."""


def _data_held(inc: Incident, first: Event | None, after: list[float], level: float,
               c: CauseConfig) -> bool:
    """Whether an incident whose loss stayed up is the data's (``CauseConfig.data_first``)."""
    if first is None or first.kind not in c.data_first:
        return False
    if any(first.step - 1 <= e.step < first.step for e in inc.events):
        return False  # the update before the spike raised an event itself
    jumped = first.details.get("step_loss", first.details.get("value"))
    losses = [*after, jumped] if isinstance(jumped, float) else after
    return all(math.isfinite(x) and x < ASTRONOMICAL * level for x in losses)


def judge(inc: Incident, after: list[float] | None, level: float | None, scaled: bool,
          c: CauseConfig) -> tuple[str, str, str]:
    """(cause, why, basis) of ``inc``; ``after``: the losses of the steps after its first alarm
    (None before it has one), ``level``: the loss before it, ``scaled``: a GradScaler's scale
    seen; ``basis``: ``DIRECT``, ``RECOVERY`` or ``DEFAULT``."""
    trigger = inc.trigger
    if trigger in c.optimizer_first:
        if c.jumped and any(e.kind in c.weight_kinds and e.details.get("jumps")
                            for e in inc.events):
            return "weights", (f"it holds a finite weight jump, which broke the optimizer's "
                               f"state ({trigger} first)"), DIRECT
        return "optimizer_state", f"its first alarm is {trigger}", DIRECT
    # several tensors that jumped together are a diverging run's symptom, not its cause
    kinds = [k for k in inc.kinds if k not in c.weight_kinds or any(
        e.kind == k and not e.details.get(SEVERAL_TENSORS) for e in inc.events)]
    for names, cause in ((c.weight_kinds, "weights"), (c.lr_kinds, "learning_rate"),
                         (c.range_kinds, "numeric_range"), (c.batch_kinds, "batch")):
        hit = next((k for k in kinds if k in names), None)
        if hit is not None:
            return cause, f"it holds {hit}", DIRECT
    first = next((e for e in inc.events if e.severity == ALARM and e.kind == trigger), None)
    if c.scaled_grads and scaled and trigger == "nonfinite_grad" and first is not None:
        loss = first.details.get("step_loss")
        if isinstance(loss, float) and math.isfinite(loss):
            return ("numeric_range", "non-finite gradients with a finite loss under a GradScaler",
                    DIRECT)
    if trigger in c.spikes and after is not None:
        if any(back(x, level, c.back_share) for x in after[:BACK_WITHIN]):
            return ("batch", f"the loss came back within {BACK_WITHIN} steps of {trigger}",
                    RECOVERY)
        if len(after) >= BACK_WITHIN and level is not None:
            if _data_held(inc, first, after, level, c):
                return "batch", (f"the loss jumped at {trigger} on weights from ordinary "
                                 "steps and stayed up, finite: the data from that step on (a "
                                 "stretch of bad batches, or the update the first one made)"), \
                    RECOVERY
            return "weights", (f"the loss stayed up (or non-finite) {BACK_WITHIN} steps "
                               f"after {trigger}: the model state was damaged"), RECOVERY
        loss = first.details.get("step_loss") if first is not None else None
        if isinstance(loss, float) and level and loss >= ASTRONOMICAL * level:
            return "weights", (f"the loss at {trigger} was {loss / level:.3g}x its level: "
                               "damaged weights, not data (judged again once the run has "
                               "shown whether it comes back)"), RECOVERY
    if not trigger and inc.kinds:
        trigger = inc.kinds[0]
    return cause_of(trigger), f"the default cause of {trigger}", DEFAULT
