"""The Monitor's event rules, one file each (``base.py`` says what a rule is), and their
registry.

``RULES`` lists the built-in rules in reporting order; ``register`` adds one (a user's, or a
new built-in: one file and one entry). ``build`` makes a Monitor's set from its ``Context``.
Every kind a rule raises must be in the kinds registry (``kinds.py``), which gives it its
severity, what explains it in an incident, its colour and its advice.
"""

from __future__ import annotations

from .. import kinds
from .adam_eps import AdamEps
from .base import Context, Finding, Rule, as_finding
from .divergence import Divergence
from .grad_trend import GradNormTrend
from .level_shift import LevelShift
from .logit_growth import LogitGrowth
from .loss_scale import LossScale
from .lr_jump import LRJump
from .no_grad import NoGrad
from .nonfinite import NonFiniteGrad, NonFiniteLoss
from .optimizer_state import OptimizerState
from .oscillation import Oscillation
from .overflow_streak import OverflowStreak
from .own_grads import OwnGrads
from .repeated_batch import RepeatedBatch
from .replica import ReplicaDivergence
from .spike import Spike
from .stall import Stall
from .tensor_norm import TensorNorm
from .update_ratio import UpdateRatio
from .vanishing import Vanishing
from .weight_corruption import WeightCorruption

RULES: list[type[Rule]] = [
    NonFiniteLoss, NonFiniteGrad, Spike, Divergence, LevelShift, GradNormTrend, LRJump, Oscillation,
    Vanishing, TensorNorm, Stall, OptimizerState, ReplicaDivergence, OwnGrads, LossScale,
    AdamEps, UpdateRatio, LogitGrowth, NoGrad, WeightCorruption, RepeatedBatch, OverflowStreak,
]


def register(rule: type[Rule]) -> type[Rule]:
    """Adds ``rule`` (a ``Rule`` subclass) to ``RULES``, after checking that it has a name of
    its own and that every kind it raises is registered (``kinds.register``). Usable as a class
    decorator; registering the same class twice is a no-op."""
    if not (isinstance(rule, type) and issubclass(rule, Rule)):
        raise TypeError(f"fasthealth: register() takes a Rule subclass, got {rule!r}")
    if rule in RULES:
        return rule
    if not rule.name or any(r.name == rule.name for r in RULES):
        raise ValueError(f"fasthealth: rule {rule.__name__} needs a name of its own (name = "
                         f"{rule.name!r})")
    missing = [k for k in rule.kinds if kinds.get(k) is None] or ([] if rule.kinds else ["?"])
    if missing:
        raise ValueError(f"fasthealth: rule {rule.name!r} raises kind(s) not in the kinds "
                         f"registry: {', '.join(missing)} (kinds.register(Kind(...)) first)")
    RULES.append(rule)
    return rule


def names() -> list[str]:
    return [r.name for r in RULES]


def build(ctx: Context, precursors: bool = True) -> list[Rule]:
    """The Monitor's rules under ``ctx``, in ``RULES`` order; precursor rules only with
    ``precursors``. An override for a rule that does not exist is an error naming it."""
    unknown = sorted(set(ctx.overrides) - set(names()))
    if unknown:
        raise ValueError(f"fasthealth: rules={{{unknown[0]!r}: ...}} names no rule; the rules "
                         f"are: {', '.join(names())}")
    made = [r.build(ctx) for r in RULES if precursors or not r.precursor]
    return [r for r in made if r is not None]


__all__ = ["RULES", "Context", "Finding", "Rule", "as_finding", "build", "names", "register"]
