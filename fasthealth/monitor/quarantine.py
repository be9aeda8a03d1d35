"""The samples a rollback sets aside (``rollback.py``): the quarantine, what it is made from,
and how a loop or a trainer keeps them out.

For an incident whose cause is the data, with ``RollbackConfig.replay``: the culprits of the
incident's batches (``culprits.py``), searched on the state the rollback restored; then, for
``every`` steps, each step's batch before its update (the watch: bad samples the incident's
batches did not hold, which the restored model would otherwise learn by heart within an epoch).
Without a replay: every sample of the incident's steps. ``holds`` tells the step's gate whether
a batch holds a quarantined sample (the step is then skipped, on the device);
``skip_quarantined`` drops them from a plain loop's sampler.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import say
from .culprits import PullLine, search, threshold
from .events import Event, Incident
from .record import StepRecord
from .robust import SPIKE_ZSCORE

if TYPE_CHECKING:
    from .view import RunView

SEARCH_BATCHES = 64
"""Batches of an open incident kept (by reference, with ``replay=``) for the culprit search,
from its first step on: bad samples that come back every epoch are all seen once an epoch's
batches are (an epoch of 47 batches in the recovery evaluation; at 32, a first rollback found
36 of 60 planted and the rest stayed unseen)."""


def sample_ids(ids: Any) -> list[int]:
    """Sample ids as Python ints (a tensor, a list of ints); [] for anything else."""
    if isinstance(ids, torch.Tensor):
        return [int(i) for i in ids.detach().cpu().flatten().tolist()]
    if isinstance(ids, (list, tuple)) and all(isinstance(i, int) for i in ids):
        return list(ids)
    return []


class Quarantine:
    """The quarantined sample ids (``ids``, sorted, each once) and what finds them (the module
    docstring). ``replay``: the user's ``replay(model, batch)``, or None."""

    def __init__(self, model: torch.nn.Module, replay: Callable[[Any, Any], Any] | None,
                 every: int) -> None:
        self.model, self.replay, self.every = model, replay, every
        self.ids: list[int] = []
        self.steps: dict[int, list[int]] = {}  # step -> its sample ids, since a snapshot
        self._batches: dict[int, list[tuple[int, Any]]] = {}  # incident -> (step, batch)
        # after a data rollback: (until, the batch threshold, the pool's outlier bar and its
        # pull line)
        self._watch: tuple[int, float, float, PullLine | None] | None = None
        self._swept: list[int] = []  # set aside by the watch since the last flush
        self._held: tuple[int, torch.Tensor] | None = None  # ``ids`` on the device

    def add(self, ids: Iterable[int]) -> list[int]:
        """Adds ``ids``; returns those that were not in yet."""
        new = sorted(set(ids) - set(self.ids))
        if new:
            self.ids = sorted(set(self.ids) | set(new))
        return new

    def __contains__(self, i: int) -> bool:
        k = bisect_left(self.ids, i)
        return k < len(self.ids) and self.ids[k] == i

    # ---- at each step -----------------------------------------------------------------------

    def holds(self, ids: Any, device: torch.device, batch: Any = None,
              step: int | None = None) -> torch.Tensor | None:
        """Whether a batch of ``ids`` holds a quarantined sample, as a 0-dim bool on
        ``device`` for the step's gate (no host sync where the ids are on the device); None
        while nothing is quarantined or without ids (a tensor or a list of ints). While the
        watch is on, the batch is searched first (one sync)."""
        if self._watch is not None and batch is not None and step is not None \
                and ids is not None:
            self._sweep(batch, ids, step)
        if not self.ids or ids is None:
            return None
        if isinstance(ids, torch.Tensor):
            t = ids.detach().flatten()
        elif isinstance(ids, (list, tuple)) and ids and all(isinstance(i, int) for i in ids):
            t = torch.tensor(ids)
        else:
            return None
        if t.dtype == torch.bool or t.is_complex():
            return None  # not ids; whole-valued floats count, as the quarantine took them
        if self._held is None or self._held[0] != len(self.ids) \
                or self._held[1].device != t.device:
            # the quarantine only grows: its length says whether the copy is current
            self._held = (len(self.ids), torch.tensor(self.ids, dtype=torch.int64,
                                                      device=t.device))
        return torch.isin(t.to(torch.int64), self._held[1]).any().to(device, non_blocking=True)

    def _sweep(self, batch: Any, ids: Any, step: int) -> None:
        assert self._watch is not None and self.replay is not None
        until, limit, bar, line = self._watch
        if step > until:
            self._watch = None
            return
        found = search(self.model, self.replay, [(sample_ids(ids), batch)], limit, bar, line)
        if not found.whole:  # a batch bad as a whole is the source's: the ladder's to judge
            self._swept += self.add(found.ids)

    # ---- at each flush ------------------------------------------------------------------------

    def note(self, steps: list[StepRecord], most: int) -> None:
        """Keeps the steps' sample ids (the ``most`` latest steps')."""
        for s in steps:
            ids = sample_ids(s.host.sample_ids)
            if ids:
                self.steps[s.step] = ids
        while len(self.steps) > most:  # no snapshot for long: an incident older has none
            del self.steps[next(iter(self.steps))]

    def forget_before(self, step: int) -> None:
        """Drops the sample ids of the steps up to ``step`` (a snapshot's)."""
        self.steps = {k: v for k, v in self.steps.items() if k > step}

    def keep_batches(self, run: RunView, batches: dict[int, Any]) -> None:
        """Keeps (references to) the open incident's batches of these steps, and lets go of
        those of incidents closed since."""
        cur = run.tracker.current
        if cur is not None and cur.open:
            mine = self._batches.setdefault(cur.id, [])
            mine += [(t, b) for t, b in batches.items() if t >= cur.start][
                :max(SEARCH_BATCHES - len(mine), 0)]
        open_ids = {i.id for i in run.incidents if i.open}
        for key in [k for k in self._batches if k not in open_ids]:
            del self._batches[key]

    def culprits(self, run: RunView, incident: Incident, found: list[Event], level: float | None,
                 noise: float) -> tuple[list[int], bool]:
        """(the sample ids a data incident quarantines, found on the state just restored,
        whether its batches were mostly bad as a whole: the data's source; the module
        docstring); with a replay, the watch on the batches to come is armed."""
        kept = self._batches.pop(incident.id, [])
        self._batches.clear()
        if self.replay is not None and kept and level is not None:
            limit = threshold(level, noise, run.tracker.recover, SPIKE_ZSCORE)
            got = search(self.model, self.replay, [(self.steps.get(t, []), b) for t, b in kept],
                         limit)
            self._watch = (run.next_step() + self.every, limit, got.bar, got.line)
            if got.ran:
                return got.ids, got.source
        # no replay (or no batch it could split): the incident's steps, from its first to its
        # last event (a run of bad batches does not show an event at each of its steps)
        seen = [e.step for e in [*run.events, *found] if e.incident == incident.id]
        end = max(seen, default=incident.start)
        return sorted({i for t, ids in self.steps.items() if incident.start <= t <= end
                       for i in ids}), True

    def take_swept(self, run: RunView, last: int, since: int | None) -> list[int]:
        """The samples the watch set aside since the last flush, written to
        ``rollbacks.jsonl`` and logged."""
        ids, self._swept = self._swept, []
        if not ids:
            return ids
        jsonl = run.journal.jsonl
        if jsonl is not None:
            jsonl.queue_record("rollbacks.jsonl", {"record": "quarantine", "step": last,
                                                   "quarantined": ids})
        say.log.info("fasthealth: step %d: %d more samples quarantined after the rollback at "
                     "step %s (bad alone on the state it restored)", last, len(ids), since)
        return ids

    def logged(self, run_dir: Path | None) -> None:
        """Adds every sample the run's ``rollbacks.jsonl`` says was quarantined (a resumed
        run's, when it continues a run): a checkpoint older than a rollback holds a state
        without its quarantine, and the run's log keeps it. A line that cannot be read is
        passed over."""
        path = run_dir / "rollbacks.jsonl" if run_dir is not None else None
        if path is None or not path.is_file():
            return
        ids: set[int] = set()
        for line in path.read_text(errors="replace").splitlines():
            try:
                ids.update(int(i) for i in json.loads(line).get("quarantined") or [])
            except (ValueError, TypeError, AttributeError):
                continue
        self.add(ids)


def skip_quarantined(indices: Iterable[int], mon: Any) -> Iterator[int]:
    """The sample indices of ``indices`` (a sampler, a range) that ``mon`` has not
    quarantined: wrap a loop's sampler so that a resumed run skips the samples a rollback put
    aside (``sample_ids`` must be these indices)."""
    rollback = getattr(mon, "rollback", None)
    for i in indices:
        if rollback is None or int(i) not in rollback.samples:
            yield i
