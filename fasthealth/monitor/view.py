"""What the Monitor's parts read of the run: ``RunView``, never the Monitor itself.

The parts that act on the run as a whole between steps (the rollback and its quarantine, the
save guard, the detectors' snapshots) each need a little of it: the incidents and events so
far, the detectors whose windows a rollback rewinds, the tensors a save or a rollback covers,
the log's writer, the step counter. The Monitor hands them this view, made once when it is
built; a part cannot reach anything the view does not name, and a reader of a part sees at
its signature what it depends on.

``RunView`` holds references to the Monitor's collaborators (made once, never replaced: a
resumed state is loaded into them) and three readings of what changes as the run goes on:
``next_step()``, ``closed()`` and ``flush()``. Those read the Monitor through a weak reference:
the view does not keep the Monitor alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .analyser import Analyser
from .events import Event, Incident
from .incidents import IncidentTracker


@dataclass(frozen=True)
class RunState:
    """The tensors a checkpoint or a rollback covers, as the save guard scans them: the
    parameters that train (by name), the buffers a forward writes, those of the averaged
    models, and the optimizer (its state's tensors named through ``names_by_id``)."""

    params: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]
    averaged: list[tuple[str, torch.Tensor]]
    optimizer: torch.optim.Optimizer | None
    names_by_id: dict[int, str]
    backend: str
    device: torch.device


@dataclass(frozen=True)
class RunView:
    """The run as the Monitor's parts see it (the module docstring)."""

    analyser: Analyser  # the host side's rules, events and incidents
    detectors: list[Any]  # the rules, in order (their windows are what a rollback rewinds)
    skip_rule: Any  # the device skip rule, or None
    restarts: Any  # the step's schedule view (the skip rule re-arms at a restart)
    journal: Any  # the flushes' writer: ``journal.jsonl`` is the log's, or None
    gate: Any  # the optimizer step's gate: ``skip_pending`` after a rollback
    state: RunState
    process_group: Any  # the Monitor's, or None
    next_step: Callable[[], int]  # the number the next step will have
    closed: Callable[[], bool]  # whether the Monitor has been closed
    flush: Callable[[], Any]  # the Monitor's flush (one sync)

    @property
    def tracker(self) -> IncidentTracker:
        return self.analyser.tracker

    @property
    def incidents(self) -> list[Incident]:
        return self.analyser.tracker.incidents

    @property
    def events(self) -> list[Event]:
        return self.analyser.events

    @property
    def device(self) -> torch.device:
        return self.state.device

    @classmethod
    def of(cls, mon: Any) -> RunView:
        """The Monitor ``mon``'s view, made at the end of its ``__init__``."""
        this = weakref.ref(mon)

        def live() -> Any:
            m = this()
            if m is None:
                raise ReferenceError("fasthealth: the Monitor of this run is gone")
            return m

        return cls(analyser=mon.analyser, detectors=mon.detectors, skip_rule=mon.skip_rule,
                   restarts=mon._restarts, journal=mon.journal, gate=mon.gate,
                   state=RunState(mon.params, mon.buffers, mon.averaged_state, mon.optimizer,
                                  mon.names_by_id, mon.backend, mon.device),
                   process_group=mon.process_group,
                   next_step=lambda: live()._next_step, closed=lambda: live()._closed,
                   flush=lambda: live().flush())
