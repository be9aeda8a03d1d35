"""The registry of event kinds: every fact about a kind in one place (docs/spec.md section 6).

A ``Kind`` says what a finding of that kind is (its one-line ``doc``), how grave it is by
default (``severity``), which open incidents can be its cause (``explained_by``), the colour the
report draws it in, and what to check first (``advice``). The rules (``rules/``) declare the
kinds they raise; events take their severity from here, the incident tracker what explains what,
the report its colours, an incident its default likely ``cause``, and the tables in
docs/guide/events.md and docs/spec.md are printed from here (``python -m
fasthealth.monitor.kinds``) and checked against it by a test.

A new rule adds its kinds with ``register``; nothing else has to know about it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

ALARM, NOTICE = "alarm", "notice"
SEVERITIES = (ALARM, NOTICE)

# The likely causes an incident names (``Incident.cause``, ``ReplayResult.cause``): the data,
# damaged model state, the learning rate or its schedule, the optimizer's state, the numeric
# range (overflow, fp16, loss scale), or something outside all of them (it does not reproduce:
# the loss code, a transient hardware fault).
CAUSES = ("batch", "weights", "learning_rate", "optimizer_state", "numeric_range", "outside")

# what groups of kinds are called in ``explained_by``
NONFINITE = frozenset({"nonfinite_loss", "nonfinite_grad"})
GRADIENT = frozenset({"grad_norm_spike", "exploding_grad"})


@dataclass(frozen=True)
class Kind:
    """One kind of event.

    ``explained_by``: the kinds of an open incident that can be this kind's cause. None (most
    kinds) means any open incident can: a spike or a NaN while the model recovers from a fault
    is that fault's aftermath. A set means this kind is a cause in its own right, explained
    only by an incident that already holds it or one of the set: a learning rate far above its
    peak is a change of configuration, never the aftermath of a bad batch. ``delayed``: a cause
    whose harm shows only some steps later (the incident keeps explaining until the harm has
    come and gone). ``cause``: the likely cause (``CAUSES``) of an incident this kind
    triggers when no other evidence names one (``causes.py``)."""

    name: str
    doc: str
    advice: str
    colour: str
    severity: str = ALARM
    explained_by: frozenset[str] | None = None
    delayed: bool = False
    fatal: bool = False  # a non-finite loss or gradient: what on_nonfinite acts on
    cause: str = "outside"

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"fasthealth: kind {self.name!r}: cause must be one of {CAUSES}, "
                             f"got {self.cause!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"fasthealth: kind {self.name!r}: severity must be 'alarm' or "
                             f"'notice', got {self.severity!r}")
        if not self.name.isidentifier():
            raise ValueError(f"fasthealth: kind name {self.name!r} must be an identifier")


KINDS: dict[str, Kind] = {}


def register(*kinds: Kind) -> None:
    """Adds ``kinds`` to the registry; registering the same kind again is a no-op, another
    kind under a name already taken is an error."""
    for k in kinds:
        old = KINDS.get(k.name)
        if old is not None and old != k:
            raise ValueError(f"fasthealth: event kind {k.name!r} is already registered "
                             "with other facts")
        KINDS[k.name] = k


def get(name: str) -> Kind | None:
    return KINDS.get(name)


def severity_of(name: str) -> str:
    """The default severity of ``name``; an unknown kind (a user's own rule that did not
    register it, a log from another version) is an alarm: better seen than missed."""
    k = KINDS.get(name)
    return k.severity if k is not None else ALARM


def colour_of(name: str) -> str:
    """The report's colour for ``name``; an unknown kind gets a stable colour of its own."""
    k = KINDS.get(name)
    if k is not None:
        return k.colour
    h = hashlib.sha256(name.encode()).digest()
    return "#" + "".join(f"{64 + b % 160:02x}" for b in h[:3])


def cause_of(name: str) -> str:
    """The default likely cause of an incident that ``name`` triggers; an unknown kind:
    "outside" (nothing known points inside the run)."""
    k = KINDS.get(name)
    return k.cause if k is not None else "outside"


def fatal_kinds() -> frozenset[str]:
    return frozenset(k.name for k in KINDS.values() if k.fatal)


def table() -> str:
    """The Markdown table of every registered kind (docs/guide/events.md, docs/spec.md)."""
    rows = ["| event | severity | what it means | what to check first |", "|---|---|---|---|"]
    for k in KINDS.values():
        rows.append(f"| `{k.name}` | {k.severity} | {k.doc} | {k.advice} |")
    return "\n".join(rows)


BEGIN, END = "<!-- kinds table: python -m fasthealth.monitor.kinds -->", "<!-- end of kinds -->"


def with_table(text: str) -> str:
    """``text`` with the table between its BEGIN and END markers printed anew."""
    head, sep, rest = text.partition(BEGIN)
    if not sep or END not in rest:
        raise ValueError("fasthealth: no kinds table markers in the text")
    return f"{head}{BEGIN}\n{table()}\n{END}{rest.partition(END)[2]}"


# The built-in kinds, in reporting order. Each rule module imports this one and names its
# kinds; the registry is complete once ``rules`` is imported (the Monitor imports it).
register(
    Kind("nonfinite_loss", "the loss holds NaN or Inf (the step was skipped under "
         "`on_nonfinite=\"skip\"`)",
         "replay the dump: the batch (`r.source == \"batch\"`, `r.culprit_ids`) or a module "
         "(`r.first_nonfinite`); then the loss's divisions, logs and masks",
         "#d62728", fatal=True, cause="batch"),
    Kind("nonfinite_grad", "NaN/Inf in gradients; the details name the tensors",
         "if the loss was finite, the backward of the first tensor named (replay names the "
         "module); then fp16 ranges", "#ff7f0e", fatal=True, cause="numeric_range"),
    Kind("loss_spike", "the loss jumped far above its recent level",
         "that step's batch (replay it): corrupt, mislabelled, out-of-distribution samples",
         "#9467bd", cause="batch"),
    Kind("grad_norm_spike", "the global gradient norm jumped; an alarm when the loss jumped "
         "with it", "that batch, then the learning rate; `max_grad_norm` bounds the damage",
         "#8c564b", severity=NOTICE, cause="batch"),
    Kind("divergence", "the loss has been rising steadily",
         "the learning rate (schedule, end of warm-up), then a shift in the data, then the "
         "optimizer state", "#e377c2", cause="learning_rate"),
    Kind("loss_shift", "the loss stepped up to a higher level and stayed there (the median of "
         "the last steps far above the level before)", "the data of those steps (shuffled or "
         "wrong labels, a shard or source that changed: replay the dump), then the learning "
         "rate", "#f7b6d2", cause="batch"),
    Kind("exploding_grad", "a tensor's gradient far above its own level, or the global norm "
         "climbing for many steps; an alarm once the loss confirms it",
         "those weights (`fh.check_params`), their learning rate and weight decay, clipping",
         "#393b79", severity=NOTICE, cause="learning_rate"),
    Kind("lr_jump", "the learning rate more than 3x the highest it has been at once, more "
         "than 1.5x it after climbing three steps in a row, or more than 2x the step before's "
         "where the known scheduler did not set it; never a change the known scheduler made, "
         "and without one a notice until the loss suffers from it",
         "the scheduler (stepped per batch instead of per epoch? resumed state? "
         "a growth factor above 1?), then the run's configuration", "#637939",
         explained_by=frozenset(), delayed=True, cause="learning_rate"),
    Kind("oscillation", "large alternating swings of the loss, no downward trend",
         "lower the learning rate or lengthen warm-up; then alternating, unshuffled data",
         "#17becf", cause="learning_rate"),
    Kind("vanishing_grad", "gradients collapsed to ~0, globally or in named tensors",
         "a constant or masked-out loss; dead ReLUs, saturated sigmoid/tanh; parameters "
         "frozen by mistake", "#7f7f7f", cause="weights"),
    Kind("stall", "a run that has not learned from the start, with tensors whose gradients "
         "never reach them (named)", "whether gradients reach every layer (saturating "
         "activations, depth without residuals or normalisation), then the learning rate",
         "#c49c94", cause="weights"),
    Kind("optimizer_state_nonfinite", "NaN/Inf in the optimizer's state (e.g. Adam's moments)",
         "a checkpoint loaded into the optimizer; a step let through with "
         "`on_nonfinite=\"warn\"`", "#bcbd22", explained_by=NONFINITE, cause="optimizer_state"),
    Kind("loss_scale_collapse", "a GradScaler's scale fell below `min_loss_scale` (1.0), "
         "became NaN, or dropped 8x in 10 steps", "activations beyond float16's range "
         "(`fh.ActivationMonitor(model, range_dtype=torch.float16)`), or train in bfloat16",
         "#1f77b4", explained_by=NONFINITE | GRADIENT, cause="numeric_range"),
    Kind("sdc_suspect", "a rank's own gradients far above the other ranks' before they were "
         "averaged (named; an alarm once the same rank is named again and again)",
         "that rank's GPU (silent data corruption: ECC and error logs), then its batch",
         "#9c9ede", severity=NOTICE, cause="outside"),
    Kind("replica_divergence", "ranks that should hold the same gradients do not (named)",
         "those ranks' hardware (ECC errors, a failing GPU), then whether every rank runs the "
         "same code and data order", "#e7ba52", cause="outside"),
    Kind("precursor_update_ratio", "an update that is a large share of the weights it "
         "changed (update-to-weight ratio far above its level)", "the learning rate and its "
         "warm-up, then that layer's gradients", "#aec7e8", severity=NOTICE,
         cause="learning_rate"),
    Kind("precursor_adam_eps", "tensors whose gradient RMS fell below Adam's eps: eps, not "
         "the gradient, sets their update", "a smaller `eps` (1e-15 to 1e-8)", "#98df8a",
         severity=NOTICE, cause="optimizer_state"),
    Kind("precursor_logit_growth", "the LM head's logits (largest, or log Z) far above their "
         "level early in the run", "a z-loss, or weight decay on the head", "#ff9896",
         severity=NOTICE, cause="weights"),
    Kind("precursor_attention_logits", "attention logits growing without bound (watched with "
         "`attention=`)", "qk-layernorm, or a lower learning rate for attention",
         "#c5b0d5", severity=NOTICE, cause="weights"),
    Kind("no_grad", "no parameter has a gradient (every `.grad` is None)",
         "whether `loss.backward()` is called before the step, and whether the optimizer's "
         "parameters are the model's; then a loss detached from the model", "#7b4173",
         explained_by=frozenset(), cause="outside"),
    Kind("weight_corruption", "a parameter turned non-finite, or its largest magnitude jumped "
         "by orders of magnitude, between two weight scans (named, with the old and new "
         "magnitude)",
         "a checkpoint or state_dict loaded into the model, code writing to the weights, then "
         "the hardware (ECC errors: silent data corruption)", "#843c39",
         # broken moments write NaN into the weights they update, and a weight that jumped
         # breaks the moments: either way one fault (causes.py tells which came first)
         explained_by=NONFINITE | GRADIENT | {"optimizer_state_nonfinite"}, cause="weights"),
    Kind("repeated_batch", "the same batch (by sample ids, else a fingerprint) several steps "
         "in a row after the run had shown different ones", "the data loader: an iterator "
         "re-created each step, a batch variable not reassigned, a stuck sampler", "#5254a3",
         explained_by=frozenset(), cause="batch"),
    Kind("overflow_streak", "under a GradScaler, every step skipped for a float16 overflow "
         "for many steps in a row: the run has stopped learning", "a loss scale forced high "
         "(init_scale, backoff_factor, growth_interval), activations beyond float16's range, "
         "or train in bfloat16", "#de9ed6",
         explained_by=NONFINITE | GRADIENT | {"loss_scale_collapse"}, cause="numeric_range"),
)


if __name__ == "__main__":
    print(table())
