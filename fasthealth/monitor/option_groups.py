"""The Monitor's options, grouped by concern: one frozen dataclass a concern, each field with its
own docstring (what it does, its default and why). Each option is given one way, as a keyword
of ``Monitor``:

    fh.Monitor(model, optimizer, log_dir="runs/a", dumps="alarm", max_grad_norm=1.0,
               spike_zscore=8.0)

The groups are where the options are documented and how a Monitor shows them, resolved
(``mon.options.log.flush_every``); five, each the answer to one question a user asks:

- ``MeasureOptions``: what is measured, where: the kernels, the ranks the totals span, the
  modules whose activations are measured as well;
- ``DetectOptions``: what counts as an event: the spike score, the thresholds of the other
  rules, per-rule overrides, or a rule set of one's own;
- ``PrecursorOptions``: the notices that come before a spike, and the modules they read;
- ``ActOptions``: what the Monitor does to the step: skip, raise, clip, scale, roll back;
- ``LogOptions``: what reaches the host and the disk, when: the flush, the logs, the dumps and
  the parameter snapshots behind them.

So someone who wants to know how often the Monitor writes reads one group and none of the spike
score. An option that serves two concerns sits with the one that defines it: the spike score's
``spike_zscore``, ``spike_window`` and ``warmup_steps`` are in ``DetectOptions`` though
``on_spike="skip"`` uses them too (they say what a spike is; ``on_spike`` says what to do with
one), and ``flush_every`` is in ``LogOptions`` though the rules also run at each flush (it is
when the numbers leave the device, for the logs and the rules alike).

A group passed to the Monitor (``log=fh.LogOptions(...)``, ``precursors=fh.PrecursorOptions(...)``)
still works in this release and warns (``DeprecationWarning``) with the keywords to write
instead; a keyword given both ways is a ValueError, an unknown keyword a TypeError, each naming
it. ``gather`` maps the keywords into the groups (``FLAT``); ``options.py`` checks the values.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .incidents import IncidentConfig
from .options import shown
from .robust import (
    MIN_LOSS_SCALE,
    SPIKE_WINDOW,
    SPIKE_ZSCORE,
    VANISHING_THRESHOLD,
    WARMUP_STEPS,
)
from .rules import Rule


@dataclass(frozen=True)
class MeasureOptions:
    """What the Monitor measures, and where (docs/spec.md sections 4, 7 and 8)."""

    backend: str | None = None
    """The kernels that compute the statistics: "torch", "cpu", "cuda" or "triton". None (or
    "auto"): the fastest one validated for the model's device (docs/spec.md section 4); all
    give the same numbers, so naming one is for comparing them."""
    process_group: Any = None
    """A ``torch.distributed`` ProcessGroup (``dist.group.WORLD``): the totals span every rank
    in it, each element counted once, and a NaN on any rank skips the step on every rank; one
    all-gather a step. None: this process's tensors only, no collective."""
    replica_group: Any = None
    """With ``process_group``: the ranks that hold copies of the same parameters (DDP, the
    replicas of an FSDP shard): counted once, and compared, so that replicas that disagree
    raise ``replica_divergence`` (``fasthealth.distributed``). None: ranks whose tensors have
    the same names, shapes and dtypes are replicas; False: no two ranks are."""
    activations: Any = None
    """Also measure the modules' activations with an ``fh.ActivationMonitor`` (docs/spec.md
    section 7): True for every leaf module, a regex over module names, or a list of names.
    None: off, because hooks on every leaf module add some 7% to the forward and backward
    (docs/performance.md)."""


@dataclass(frozen=True)
class DetectOptions:
    """What counts as an event: the thresholds the built-in rules (``rules/``) take from the
    Monitor, the overrides of any rule's own config, or a rule set of one's own."""

    spike_zscore: float = SPIKE_ZSCORE
    """A loss or gradient norm more than this many noise units above its recent level is a
    spike (``rules/spike.py``, ``SpikeConfig.zscore``, where the measurement behind 6 is cited);
    ``on_spike="skip"`` skips by the same score."""
    spike_window: int = SPIKE_WINDOW
    """The recent finite values a level and its noise are taken from, for the spike, trend and
    vanishing rules and the skip rule: enough differences for a stable 0.9 quantile, short
    enough to follow the loss as it falls."""
    warmup_steps: int = WARMUP_STEPS
    """Finite values a window needs before it scores: the first steps of a run move too much
    to have a level. At most ``spike_window``, or no spike would ever be scored."""
    vanishing_threshold: float = VANISHING_THRESHOLD
    """A global gradient norm below it, for 3 steps in a row, is ``vanishing_grad``: updates
    that small vanish against float32 weights of order 1e-2 (``rules/vanishing.py``)."""
    min_loss_scale: float = MIN_LOSS_SCALE
    """A GradScaler scale below it, or NaN, is ``loss_scale_collapse``: a scale below 1
    shrinks the loss, the opposite of its purpose (``rules/loss_scale.py``)."""
    optimizer_check_every: int = 10
    """Steps between scans of the optimizer's state (Adam's moments) for NaN/Inf, one fused
    pass each: state that broke stays broken, so a scan every 10 steps finds it at a tenth of
    the cost of every step. 0: never."""
    scheduler: Any = None
    """The learning-rate scheduler that sets the optimizer's rate (a torch ``LRScheduler``,
    or anything with ``get_last_lr()``; timm's, with ``step()`` and a state, whose rate cannot
    be read back): evidence for the rules, which take a warm restart it makes as a new start
    and judge only a change of rate it did not make (``schedule.py``).
    The trainer callbacks pass the trainer's; in a plain loop pass yours. None: a rise of the
    rate back to at most its peak so far is taken as a restart, and a change of rate is told
    from the schedule by its size alone."""
    rules: dict[str, dict[str, Any]] | None = None
    """Overrides of any rule's own config, by rule name: ``{"spike": {"zscore": 8.0}}``
    (the names: ``fasthealth.monitor.rules.names()``; each field is documented in its rule's
    ``Config``). They take precedence over the options above. None: the configs as they are."""
    detectors: list[Rule] | None = None
    """A rule set of one's own, ``Rule`` instances in reporting order, in place of the
    built-in ones (which the options above configure, and which then are not made). None: the
    built-in rules."""
    incidents: IncidentConfig | None = None
    """How events are grouped into incidents and their causes named (``incidents.py``'s
    ``IncidentConfig``, its ``causes`` a ``CauseConfig``; each field gives its reason). None:
    the defaults, which the detector evaluation measured."""


@dataclass(frozen=True)
class PrecursorOptions:
    """The precursors: notices of what comes before a loss spike, read from statistics the
    Monitor has or one fused pass more (``precursors.py``)."""

    enabled: bool = field(default=True, metadata={"keyword": "precursors"})
    """Watch for precursors (the flat keyword is ``precursors``). On by default: they read
    statistics the Monitor has, or one fused pass more, and are notices: they never warn,
    raise or skip."""
    logits: Any = None
    """The LM head whose output logits ``precursor_logit_growth`` reads: None finds it (the
    model's ``get_output_embeddings()`` or a module named ``lm_head``), a module name names
    it, False: none."""
    attention: str | None = None
    """A regex over module names: the self-attention modules whose largest attention logit
    ``precursor_attention_logits`` watches, computed for one sequence from their packed q/k/v
    projection. None: none, since which modules those are differs from one model to the
    next."""


@dataclass(frozen=True)
class ActOptions:
    """What the Monitor does to a step: skip it, raise, clip it, or step through a GradScaler
    (``gate.py``)."""

    on_nonfinite: str = "skip"
    """A step whose loss or gradients hold NaN/Inf: "skip" leaves the parameters and the
    optimizer state as they were, without a host sync for fused torch optimizers; "raise"
    skips it and raises ``fh.NonFiniteError`` at the flush that sees it; "warn" only records
    it. "skip" by default: the update of such a step can only poison the weights."""
    on_spike: str = "warn"
    """A step whose loss or gradient norm is a spike (``DetectOptions.spike_zscore``): "warn"
    records it; "skip" also skips the step, decided on the device (``skip_rule.py``) and needs
    the optimizer. "warn" by default: a spike may be a hard batch worth learning from, and
    skipping it is the user's call."""
    max_grad_norm: float | None = None
    """Clip the gradients to this global norm, with the norm the check computed (no second
    pass, unlike ``clip_grad_norm_``). None: no clipping; the Monitor changes an update only
    where asked."""
    scaler: Any = None
    """A ``torch.amp.GradScaler``: ``mon.step`` unscales, steps and updates through it, and
    the loss-scale rule watches its scale. None: no loss scaling."""
    averaged: Any = None
    """An averaged copy of the model kept beside it (timm's ``ModelEmaV3``, torch's
    ``swa_utils.AveragedModel``), or a list of them: rolled back with the model, and its
    parameters and buffers read by ``safe_to_save()`` with the model's. None: none."""
    rollback: Any = None
    """Roll back in process (``rollback.py``): a ``fh.RollbackConfig`` (True: its defaults)
    keeps known-good snapshots of the training state in host memory and restores the newest
    from before an incident that says the state is damaged, then goes on. None: off, since
    the snapshots cost host memory the user should agree to."""


@dataclass(frozen=True)
class LogOptions:
    """What reaches the host and the disk, and when (``journal.py``, ``sinks.py``)."""

    log_dir: str | os.PathLike | None = None
    """The folder of the runs (made when missing): each Monitor writes its run's JSONL step
    log, incidents, ``meta.json`` and dumps into a new ``LOG_DIR/run-NNN/``, or continues the
    run whose state it loaded (``runs.py``), and never appends to another run's files. None:
    nothing is written and the events stay in ``mon.events``, since where to write is the
    user's to say."""
    flush_every: int = 50
    """Steps between flushes: the device buffer comes to the host in one copy, the rules run,
    the logs are written. Events carry their own step but surface up to this many steps
    late, and dumps keep this many parameter snapshots (``snapshot_max_bytes``). 50: events
    within 50 steps, and copies rarer than at 5, where the Monitor's cost is already below
    noise (docs/performance.md)."""
    per_tensor_every: int = 50
    """Steps between the per-tensor norms in the JSONL log (each record has the totals, and
    a step with an event has its per-tensor norms as well): once a flush keeps the log small."""
    tensorboard: bool = False
    """Also write the scalars to TensorBoard, under the run's ``tensorboard/``; needs ``log_dir``
    and the tensorboard package. Off: the JSONL log needs no other package."""
    dumps: str = "incident"
    """The steps saved for ``fh.replay``: "incident", the first alarm step of each incident;
    "alarm", every step with an alarm; "event", every step with an event; "none". One dump per
    fault by default: what its replay needs, and no more disk."""
    snapshot_max_bytes: int = 256 * 2**20
    """The budget for the parameters as they were before each pending step, ``flush_every``
    copies in all, which let a dump replay its step on the weights it had. Over budget, no
    copies are kept and replay runs on the weights it is given. 256 MiB, small beside a
    training run's memory, holds the 50 copies of a model of up to 1.3M float32 parameters."""
    all_ranks: bool = False
    """Under torch.distributed (a ``process_group``, or a default group of more than one
    process), whether every rank writes logs. False: rank 0 alone writes the run (records and
    dumps), since the ranks' verdicts agree (the statistics are reduced over the group) and N
    copies of one run would only multiply the files; the other ranks keep ``mon.events``.
    True: rank 0 writes ``LOG_DIR/run-NNN/`` and rank k its own runs under
    ``LOG_DIR/rank-k/run-NNN/`` (its own numbering: no rank waits on another)."""


GROUPS: dict[str, type[Any]] = {"measure": MeasureOptions, "detect": DetectOptions,
                                "precursors": PrecursorOptions, "act": ActOptions,
                                "log": LogOptions}


def _keyword(f: dataclasses.Field) -> str:
    return f.metadata.get("keyword", f.name)


# each flat keyword of Monitor: (its group's keyword, the field)
FLAT: dict[str, tuple[str, str]] = {_keyword(f): (g, f.name) for g, cls in GROUPS.items()
                                    for f in dataclasses.fields(cls)}
DEFAULTS: dict[str, Any] = {_keyword(f): f.default for cls in GROUPS.values()
                            for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class Options:
    """A Monitor's options, every group resolved (``Monitor.options``)."""

    measure: MeasureOptions = field(default_factory=MeasureOptions)
    detect: DetectOptions = field(default_factory=DetectOptions)
    precursors: PrecursorOptions = field(default_factory=PrecursorOptions)
    act: ActOptions = field(default_factory=ActOptions)
    log: LogOptions = field(default_factory=LogOptions)

    def flat(self) -> dict[str, Any]:
        """Every option by its flat keyword: what ``options.check_options`` checks."""
        return {kw: getattr(getattr(self, g), f) for kw, (g, f) in FLAT.items()}


def _given(value: Any, default: Any) -> bool:
    """Whether ``value`` says something its default does not (a 6 for 6.0 does: an int)."""
    return not (value is default or (type(value) is type(default) and value == default))


def _unknown(name: str) -> TypeError:
    known = [*FLAT, *GROUPS]
    renamed = {f: kw for kw, (_, f) in FLAT.items() if f != kw}
    close = [renamed[name]] if name in renamed else difflib.get_close_matches(name, known, 1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(f"fasthealth: Monitor got an unknown keyword argument {name!r}{hint}; its "
                     "options are the keywords documented in fh.MeasureOptions, "
                     "DetectOptions, PrecursorOptions, ActOptions and LogOptions")


def _as_keywords(name: str, group: Any) -> str:
    """What to write instead of passing ``group`` as ``name=``: its options given, as
    keywords."""
    given = [f"{_keyword(f)}={shown(getattr(group, f.name))}"
             for f in dataclasses.fields(group)
             if _given(getattr(group, f.name), DEFAULTS[_keyword(f)])]
    return (f"fasthealth: {name}=fh.{type(group).__name__}(...) is deprecated and will be "
            "removed: give its options as Monitor keywords"
            + (f" ({', '.join(given)})" if given else " (it sets none)")
            + "; mon.options still shows them by group")


def gather(flat: dict[str, Any], stacklevel: int = 3, **groups: Any) -> Options:
    """The options from ``flat`` (a Monitor's keywords) and ``groups`` (the deprecated group
    keywords, each a group or None, which warn): a keyword given takes its place in its group.
    An unknown keyword, or a group keyword given anything but its group, is a TypeError; an
    option given both as a keyword and in its group a ValueError; each names it.
    ``stacklevel``: the warning's, pointing at the caller's caller (the user's Monitor call)."""
    flat = dict(flat)
    if isinstance(flat.get("precursors"), PrecursorOptions):  # the one keyword of both kinds
        groups["precursors"] = flat.pop("precursors")
    for name in flat:
        if name not in FLAT:
            raise _unknown(name)
    for name, group in groups.items():
        if group is not None and not isinstance(group, GROUPS[name]):
            raise TypeError(f"fasthealth: {name} must be a fh.{GROUPS[name].__name__} or None, "
                            f"got {shown(group)}")
        if group is not None:
            warnings.warn(_as_keywords(name, group), DeprecationWarning, stacklevel=stacklevel)
    fields: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for kw, (g, f) in FLAT.items():
        group, default = groups.get(g), DEFAULTS[kw]
        value = getattr(group, f) if group is not None else default
        if kw in flat and _given(flat[kw], default):
            if _given(value, default):
                raise ValueError(
                    f"fasthealth: {kw} is given twice, as {kw}={shown(flat[kw])} and in "
                    f"{g}={GROUPS[g].__name__}({f}={shown(value)}); give it once")
            value = flat[kw]
        fields[g][f] = value
    return Options(**{g: GROUPS[g](**fields[g]) for g in GROUPS})


def with_default(options: dict[str, Any], keyword: str, value: Any) -> dict[str, Any]:
    """``options`` (a Monitor's keywords, groups among them) with the flat ``keyword`` set to
    ``value`` unless they give it already, flat or in its group: how a trainer callback hands
    the Monitor the trainer's own settings (its clipping) without overriding the user's."""
    g, f = FLAT[keyword]
    group = options.get(g)
    if keyword in options or (isinstance(group, GROUPS[g])
                              and _given(getattr(group, f), DEFAULTS[keyword])):
        return dict(options)
    return {**options, keyword: value}
