"""What every rule is: a ``Rule`` that observes each flushed step and returns ``Finding``s.

A rule is one file of ``rules/``: a ``Rule`` subclass with a ``name``, the ``kinds`` it raises
(each registered in ``kinds.py``, where its severity, colour and advice live) and a frozen
``Config`` dataclass holding every threshold it uses, each field with a docstring that gives
its reason. ``Context`` is what the Monitor knows when it builds its rules (the tensors'
names, the optimizer, the options); ``Rule.build`` makes a rule from it, or None where the rule
cannot apply (the loss-scale rule without a GradScaler).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from ..record import StepRecord
from ..robust import (
    MIN_LOSS_SCALE,
    SPIKE_WINDOW,
    SPIKE_ZSCORE,
    VANISHING_THRESHOLD,
    WARMUP_STEPS,
)


@dataclass
class Finding:
    """One rule's finding at one step: its ``kind`` (``kinds.KINDS``), a ``message`` that says
    what was seen and what to check first, the numbers behind it (``details``), and a
    ``severity`` when it is not the kind's default (a notice kind the loss confirmed)."""

    kind: str
    message: str
    details: dict = field(default_factory=dict)
    severity: str | None = None


@dataclass
class Context:
    """What the Monitor hands its rules: the watched tensors (``names``, their ``numels`` and
    the ``params`` themselves), the ``optimizer`` (or None), whether a GradScaler is used, the
    Monitor options that set rule thresholds, the precursor probe, and per-rule config
    overrides (``rules={"spike": {"zscore": 8}}``)."""

    names: list[str] = field(default_factory=list)
    buffer_names: list[str] = field(default_factory=list)
    """The buffers a forward writes (``buffers.py``), whose rows follow the parameters' in
    the weight scan's table."""
    numels: list[int] = field(default_factory=list)
    params: Sequence[tuple[str, Any]] = ()
    optimizer: Any = None
    scaler: bool = False
    spike_zscore: float = SPIKE_ZSCORE
    spike_window: int = SPIKE_WINDOW
    warmup_steps: int = WARMUP_STEPS
    vanishing_threshold: float = VANISHING_THRESHOLD
    min_loss_scale: float = MIN_LOSS_SCALE
    probe: Any = None  # precursors.PrecursorProbe, or None with precursors off
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class NoConfig:
    """No thresholds."""


C = TypeVar("C")


class Rule(Generic[C]):
    """One event rule. ``observe`` sees every flushed step once, in step order, and keeps the
    rule's state across flushes; it returns the step's findings (usually none). ``C`` is its
    config class (``Config``)."""

    name: ClassVar[str] = ""
    kinds: ClassVar[tuple[str, ...]] = ()
    precursor: ClassVar[bool] = False  # built only with the Monitor's precursors on
    Config: ClassVar[type[Any]] = NoConfig
    # the fields that are the rule's state, by name: its windows and counters, what
    # ``Monitor.state_dict`` saves and ``load_state_dict`` restores (``state.py``). What the
    # config or the context make (thresholds, names) is not state; a field left out of this
    # list starts from its initial value after a resume (tests/monitor/test_state.py checks
    # that every field a rule changes while it runs is listed)
    STATE: ClassVar[tuple[str, ...]] = ()
    # fields made from the state (a sorted copy of a window, a cached check), rebuilt when
    # the state is set: not saved
    DERIVED: ClassVar[tuple[str, ...]] = ()
    # config field -> the Context attribute (a Monitor option) it follows, where the config
    # has that field
    OPTIONS: ClassVar[dict[str, str]] = {"warmup": "warmup_steps"}
    # the rule's windows hold a level and a noise that a warm restart of the learning-rate
    # schedule makes stale: at a restart (``schedule.py``) it starts again as it was made
    REARM: ClassVar[bool] = False
    # when: after the restart's own step (its loss and gradients come from the weights the old
    # rate made), or before it for a rule that judges the step's update, which the new rate
    # made (``update_ratio``)
    REARM_BEFORE: ClassVar[bool] = False

    def __init__(self, config: C | None = None, ctx: Context | None = None) -> None:
        self.config: C = config if config is not None else type(self).Config()
        self.ctx = ctx if ctx is not None else Context()

    @classmethod
    def from_options(cls, ctx: Context) -> dict[str, Any]:
        """The config fields that follow the Monitor's own options (``OPTIONS``)."""
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        return {f: getattr(ctx, o) for f, o in cls.OPTIONS.items() if f in fields}

    @classmethod
    def configure(cls, ctx: Context) -> Any:
        """The rule's config under ``ctx``: the defaults, the Monitor's options, then the
        user's overrides for this rule (a field it does not have is an error naming it)."""
        cfg = cls.Config(**cls.from_options(ctx))
        over = ctx.overrides.get(cls.name, {})
        known = {f.name for f in dataclasses.fields(cfg)}
        unknown = sorted(set(over) - known)
        if unknown:
            raise ValueError(f"fasthealth: rules={{{cls.name!r}: ...}}: the {cls.name} rule has "
                             f"no setting {unknown[0]!r}; it has: {', '.join(sorted(known))}")
        return dataclasses.replace(cfg, **over)

    @classmethod
    def build(cls, ctx: Context) -> Rule[Any] | None:
        return cls(cls.configure(ctx), ctx)

    def observe(self, s: StepRecord) -> list[Finding]:
        raise NotImplementedError

    def rearm(self) -> None:
        """Called at a restart of the learning-rate schedule, after the restart's step is
        observed (before it with ``REARM_BEFORE``): a rule with ``REARM`` starts again as it
        was made (its config kept), so its level and noise are measured under the new rate,
        after a warm-up of its own. Rules whose state must outlive a restart (the peak rate of
        ``lr_jump``, a stall "from the start") keep ``REARM`` False; a rule may override this
        to keep part of its state."""
        if type(self).REARM:
            type(self).__init__(self, self.config, self.ctx)


def listed(names: Any) -> str:
    """The first five names, and "..." when there are more."""
    names = list(names)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def skipped(s: StepRecord) -> bool:
    return s.values["skipped"] > 0


def as_finding(x: Any) -> Finding:
    """A rule's result as a ``Finding``; a ``(kind, message, details)`` tuple (a user's rule
    written before ``Finding``) is taken too, its severity from ``details["severity"]``."""
    if isinstance(x, Finding):
        return x
    kind, message, details = x
    return Finding(kind, message, dict(details), details.get("severity"))
