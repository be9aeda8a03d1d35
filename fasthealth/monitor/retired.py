"""The config fields a release turned into named constants of their modules (details of a
rule's method that no run needs to move), by config class: (the field's place among the fields
then, its name, its value, the constant's). A Monitor state saved before spells its rules'
configs with them; ``state.py`` reads such a config as it was then, so that under the same
values the rules resume warm. A rule is saved under its place and name; a release that adds a
rule before it moves its place, and the state's rule is then found by its name (``saved_key``)."""

from __future__ import annotations

from typing import Any

from . import causes, incidents
from .rules import (
                    logit_growth,
                    oscillation,
                    repeated_batch,
                    spike,
                    stall,
                    tensor_norm,
                    vanishing,
                    weight_corruption,
)

RETIRED: dict[str, list[tuple[int, str, Any]]] = {
    "StallConfig": [(1, "first", stall.FIRST), (2, "recent", stall.RECENT),
                    (4, "half", stall.LEARNED), (5, "matrices_only", True)],
    "LogitConfig": [(4, "first", logit_growth.EARLY_FROM), (5, "span", logit_growth.EARLY_SPAN)],
    "OscillationConfig": [(3, "history", oscillation.HISTORY)],
    "SpikeConfig": [(6, "first", spike.EARLY_VALUES), (8, "restart_loss", spike.RESTART_LOSS)],
    "TensorNormConfig": [(4, "alpha", tensor_norm.ALPHA)],
    "VanishingConfig": [(5, "fitted", vanishing.FITTED)],
    "WeightCorruptionConfig": [(2, "floor", weight_corruption.FLOOR)],
    "RepeatedBatchConfig": [(1, "moving", repeated_batch.MOVING)],
    "IncidentConfig": [(5, "noise_floor", incidents.NOISE_FLOOR), (6, "recent", incidents.RECENT),
                       (7, "before", incidents.BEFORE), (9, "scale_drop", incidents.SCALE_DROP),
                       (12, "broken", incidents.BROKEN)],
    "CauseConfig": [(8, "back_within", causes.BACK_WITHIN),
                    (9, "astronomical", causes.ASTRONOMICAL)],
}

ADDED: dict[str, tuple[str, ...]] = {
    "CauseConfig": ("data_first",),
}
"""The config fields a release added, by config class: a state saved before them spells its
configs without them, and ``state.py`` compares such a config with them left out, so that a
run resumes warm across the release (its open incident among what it keeps)."""



def saved_key(saved: dict[str, Any], key: str) -> str:
    """The key (``"place:name"``) under which a state saved a rule that is at ``key`` now: the
    same, or the one rule of that name at another place (a release added a rule before it)."""
    if key in saved:
        return key
    name = key.split(":", 1)[1]
    same = [k for k in saved if k.split(":", 1)[1] == name]
    return same[0] if len(same) == 1 else key
