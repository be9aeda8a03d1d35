"""What the trainer callbacks do around the trainers' checkpoints (docs/spec.md section 11):
refuse a save while ``Monitor.safe_to_save`` says no (``SaveGuard``), and carry the Monitor's
state in the checkpoint and back (``save_state``, ``load_state``).

The guard logs one line per incident that holds the saves back (its id, its cause, that saving
resumes when it closes as recovered), one per stretch of non-finite values found directly,
and one when saving resumes. It judges at most once per trainer step (a trainer that asks
twice for the same step, the HF callback's flag and its backstop, costs one sync).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..monitor import Monitor
from ..monitor.guard import Verdict
from .log import logger

STATE_FILE = "fasthealth_monitor.pt"
"""The Monitor's state in an HF checkpoint folder (``checkpoint-<step>/``)."""


class Patch:
    """An attribute of an instance replaced until ``remove``, which puts back what was there
    (the class's method when the instance had none of its own)."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name = obj, name
        self.had, self.old = name in vars(obj), vars(obj).get(name)
        setattr(obj, name, value)

    def remove(self) -> None:
        if self.obj is None:
            return
        if self.had:
            setattr(self.obj, self.name, self.old)
        else:
            vars(self.obj).pop(self.name, None)
        self.obj = None


class SaveGuard:
    """Whether the trainer may write a checkpoint at a step; ``holding``: a save was refused
    since the last one allowed (a rotation must not delete files meanwhile)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.holding = False
        self.refused: list[int] = []  # the steps whose save was refused
        self._told: set[Any] = set()  # incident ids (or "state") already in the log
        self._last: tuple[int, bool] | None = None
        self.final: bool | None = None  # set when the Monitor closed: the last verdict

    def allow(self, step: int) -> bool:
        if self.final is not None:
            if not self.final and "final" not in self._told:
                self._told.add("final")
                logger.warning("fasthealth: step %d: checkpoint not saved: the run raised "
                               "while the Monitor said the model may be damaged (steps "
                               "refused: %s)", step, ", ".join(map(str, self.refused[-5:])))
            return self.final
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        v = self.monitor.save_verdict()
        self._last = (step, v.safe)
        if v.safe:
            if self.holding:
                logger.warning("fasthealth: step %d: checkpoints are saved again (refused at "
                               "steps %s)", step, ", ".join(map(str, self.refused[-5:])))
            self.holding = False
            self._told.discard("state")
            return True
        self.holding = True
        self.refused.append(step)
        self._tell(step, v)
        return False

    def freeze(self, step: int) -> None:
        """The Monitor is closing (a run that raised): later saves get its last verdict."""
        try:
            self.final = self.allow(step)
        except Exception:  # a Monitor that cannot flush cannot vouch for the weights
            self.final = False

    def _tell(self, step: int, v: Verdict) -> None:
        inc = v.incident
        key = inc.id if inc is not None else "state"
        if key in self._told:
            return
        self._told.add(key)
        if inc is not None:
            logger.warning("fasthealth: step %d: checkpoint not saved: incident %d (%s; cause "
                           "so far: %s) says the weights or the optimizer's state may be "
                           "damaged: %s. Checkpoints are saved again once the incident closes "
                           "as recovered.", step, inc.id, ", ".join(inc.kinds), inc.cause,
                           v.reason)
        else:
            logger.warning("fasthealth: step %d: checkpoint not saved: %s. Checkpoints are "
                           "saved again once they are finite.", step, v.reason)


def save_state(monitor: Monitor, folder: str | os.PathLike) -> bool:
    """``monitor.state_dict()`` into ``folder/fasthealth_monitor.pt`` (False: no folder)."""
    if not os.path.isdir(folder):
        return False
    torch.save(monitor.state_dict(), os.path.join(folder, STATE_FILE))
    return True


def load_state(monitor: Monitor, folder: str | os.PathLike) -> bool:
    """The state ``save_state`` wrote, loaded into ``monitor``; False (and one log line) when
    the checkpoint has none (written without fasthealth): the Monitor starts cold."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        logger.warning("fasthealth: %s holds no %s (saved without fasthealth?): the Monitor "
                       "resumes cold (a new warm-up, empty windows)", folder, STATE_FILE)
        return False
    monitor.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True
