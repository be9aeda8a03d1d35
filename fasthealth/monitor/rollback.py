"""Rolling back in process (docs/spec.md section 6, "Rolling back"): a fault that a skip did not
contain, undone without stopping the run.

With ``rollback=fh.RollbackConfig(...)`` (or ``rollback=True``) the Monitor keeps a few
*known-good snapshots* of the training state in host memory: the model's parameters and
buffers, the optimizer's state (its learning rates with it), the GradScaler's and the
scheduler's, each a copy taken at a flush, only when ``safe_to_save()`` would say yes there (no
open incident says the state is damaged, no NaN/Inf in the parameters or the optimizer's
state), at most every ``every`` steps, ``keep`` of them.

At a flush that finds an open alarm incident saying the state may be damaged (``guard.py``,
case 1: a corrupted weight, a loss the run did not come back from, a broken run), the newest
snapshot from before the incident's first step is copied back into the model, the optimizer,
the scaler and the scheduler, in place, and training goes on with the next batch the loop
gives: the steps since the snapshot are lost (at most ``every`` plus a flush), and their
batches are not trained on again, as a person who restarts from an earlier checkpoint and skips
the bad stretch of data would do (PaLM, Chowdhery et al. 2022). The detectors' windows go back
with the state (``snapshots.py``) and the incident closes as rolled back: the same fault coming
back is a new incident, and a new rollback.

Quarantine, for an incident whose cause is the data (``batch``, or the replay's verdict): with
``replay=``, the culprits of the incident's batches, found on the restored state
(``culprits.py``: the fewest samples whose removal brings their batch back to a healthy
loss); without it, every sample of the incident's steps. With ``replay=`` the quarantine then
widens: for ``every`` steps after a data rollback, each step's batch is searched the same way
before its update (one forward without gradients, where the replay gives one loss per sample,
and a host sync), its culprits quarantined without a rollback and its step skipped: bad
samples the incident's batches did not hold, which come back too quietly to raise an alarm of
their own and which the model, restored to before them, would otherwise learn by heart. Under any
other cause (the weights, the learning rate, the numeric range, the optimizer's state) no
sample is put aside. The
sample ids (``sample_ids=`` of ``mon.step``) go into ``quarantine``, which the Monitor's state
keeps across a resume. ``fh.skip_quarantined`` drops them from a plain loop's
sampler; wherever the loop's own sampler still serves one (the Hugging Face Trainer's and
Lightning's data loading, whose callbacks pass each batch's sample ids), the step whose batch
holds it is skipped on the device, like a non-finite one, and recorded as ``quarantine_skip``
(not counted in ``max_skips``).

The *ladder* (``RollbackConfig.ladder``, by cause) and the *budget* stop a run that keeps going
wrong, with ``RollbackBudgetError`` at the flush, naming the cause and what to check. Rollbacks
are "in a row" until the run has gone ``every`` steps after the last one and a snapshot is
taken (no snapshot is taken sooner after a rollback). The default ladder: a rollback for
data that quarantined new culprits among good samples does not count (it made progress); one
whose batches were bad as a whole (the source is bad, not some samples) counts, once; any
other cause once: a rate still too high after a restore is the code's (``lr_jump`` says so at
once after a rollback), weights damaged again without new data are not a batch's doing. A
``learning_rate`` alarm whose rate is still far from the known scheduler's at a flush calls for
a rollback even where the loss is fine (``guard.rate_not_scheduled``): the rate the user's
schedule sets is not the one the run trains at, and a restore puts it back; if the code sets it
again, the run stops.
More than ``max_in_row`` rollbacks in a row or ``max_total`` in all stop it too, as do more
than ``max_skips`` skipped steps in all (NaN or spike skips), instead of skipping a real bug
forever.

Each rollback is written to the run's ``rollbacks.jsonl`` (with a ``log_dir``) and kept in
``Monitor.rollbacks``; a warning says what was done. Rolling back needs the optimizer, and is
not yet supported under a ``process_group`` (every rank would have to take the same decision).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from ..distributed import comm_device
from . import say
from .causes import CHECK_FIRST, DIRECT
from .events import Event, Incident, RollbackRecord
from .guard import incident_reason, nonfinite_state, rate_not_scheduled
from .quarantine import Quarantine
from .record import StepRecord
from .robust import noise_unit
from .snapshots import Snapshot, detector_state, nbytes, rewind, settle, to_host

if TYPE_CHECKING:
    from .view import RunView

LADDER: dict[str, int] = {"batch": 1, "weights": 1, "learning_rate": 1,
                          "optimizer_state": 1, "numeric_range": 1, "outside": 1}
"""Rollbacks in a row an incident of each cause may call for (``RollbackConfig.ladder``'s
default); the next one stops the run. A rollback for data that quarantined new samples is not
counted (it made progress; ``max_total`` bounds them): for data, the count is of rollbacks
whose batches were bad as a whole (the source is bad, not some samples) or found nothing.
One for every cause: a restore that did not hold says the cause is not in the state (the
recovery evaluation)."""

STOP_ON_RETURN = frozenset({"learning_rate"})
"""Causes whose alarm after their rollback stops the run at once (the ladder's count reached),
before it damages the state again: a rate still too high after a restore is set by the code,
and another restore cannot change it. In the recovery evaluation a rate bug (30x under a step
schedule) ran on after its rollback, the loss hurt but back within 20%, and ended 20 seed gaps
from its twin."""

STOP_ADVICE = {
    "batch": "bad data keeps coming: look at the quarantined samples (rollbacks.jsonl) and the "
             "data source (a corrupted shard, a broken transform)",
    "learning_rate": "the learning rate is still too high after a restore: the code sets it "
                     "(the scheduler, a factor applied by hand), not the state",
    "weights": "the weights were damaged again without new data: a numerical bug in the model "
               "or the update, not a batch",
}
"""What a stop by the ladder says to check, by cause (else the cause's own advice)."""


@dataclass(frozen=True)
class RollbackConfig:
    every: int = 100
    """Steps between snapshots at least (one is taken at the first flush this many steps after
    the last, when the run is safe to save there): the most steps a rollback loses, beside
    the flush's. 100: at flush_every 50, every other flush."""
    keep: int = 2
    """Snapshots kept: the newest from before an incident is restored; a second one covers an
    incident that began before the newest (its first step fell between a snapshot and the
    flush that took it)."""
    max_bytes: int = 8 * 2**30
    """Host memory the ``keep`` snapshots may take in all. A snapshot larger than
    ``max_bytes / keep`` is not taken (a warning says so, once): rolling back is then off."""
    max_in_row: int = 3
    """Rollbacks in a row (without a good snapshot taken between them) before the run is
    stopped: the same fault coming back after each is not a batch."""
    max_total: int = 20
    """Rollbacks in all before the run is stopped."""
    ladder: dict[str, int] | None = None
    """Rollbacks in a row allowed by cause (``kinds.CAUSES``), the next one stopping the run;
    a cause left out: ``max_in_row``. None: ``LADDER``."""
    max_skips: int | None = None
    """Skipped steps (non-finite, or spikes under ``on_spike="skip"``) in all before the run is
    stopped; None: no limit."""
    replay: Any = None
    """A loss function ``replay(model, batch) -> loss`` (as ``fh.replay`` takes): after a
    rollback, the batch of the incident's first alarm is run again without gradients on the
    restored, older state, to tell data from state (PaLM's ablation): its loss there
    non-finite or more than the tracker's ``recover`` share (20%) above the level before the
    incident says the batch alone is bad (``RollbackRecord.replay == "batch"``); a loss within
    it, that the batch was bad only with the state the run had reached (``"state"``). It needs
    the steps' batches (``mon.step(loss, batch=...)``), which the Monitor then keeps by
    reference until their flush, and an alarm's batch until its incident is rolled back or
    closed. It also finds the culprits a data incident quarantines (``culprits.py``; a
    function that returns one loss per sample runs each batch once). None: no replay, since
    the Monitor does not know the loss."""


class RollbackBudgetError(RuntimeError):
    """Raised at a flush when the rollback budget is spent (``RollbackConfig``): the run keeps
    going wrong, and skipping more would hide it. ``incidents``: the run's alarm incidents."""

    def __init__(self, message: str, incidents: list[Incident], cause: str | None = None
                 ) -> None:
        super().__init__(message)
        self.incidents = incidents
        self.cause = cause  # the cause the ladder stopped on; None: the budget's counts


class Rollback:
    """The snapshots, the budget and the quarantine of one Monitor (the module docstring).
    ``STATE``: what a resume keeps (the snapshots are copies of the model: never saved)."""

    STATE = ("history", "quarantine", "in_row", "skips", "done", "rolled_at", "row")
    STATE_ADDED: ClassVar[dict[str, Callable[[dict], Any]]] = {
        "rolled_at": lambda f: None, "row": lambda f: []}
    # what happened to the run, whatever the settings it resumes with (a larger budget, a
    # longer interval): its quarantine and its history are kept
    STATE_UNDER_ANY_CONFIG = True

    def __init__(self, config: RollbackConfig, model: torch.nn.Module, optimizer: Any,
                 scaler: Any = None, scheduler: Any = None,
                 averaged: list[torch.nn.Module] | None = None) -> None:
        self.config = config
        self.model, self.optimizer, self.scaler, self.scheduler = (model, optimizer, scaler,
                                                                   scheduler)
        self.averaged = list(averaged or [])  # EMA/SWA models, rolled back with the model
        self.snapshots: list[Snapshot] = []
        self.history: list[RollbackRecord] = []
        self.samples = Quarantine(model, config.replay, config.every)  # ``quarantine``'s
        self.in_row = 0  # rollbacks since the last good snapshot
        self.skips = 0
        self.done: list[int] = []  # incidents rolled back (once each)
        self.rolled_at: int | None = None  # the flush step of the last rollback
        self.row: list[str] = []  # the causes of the rollbacks in a row
        self.off_reason: str | None = None
        self._alarm_batches: dict[int, Any] = {}  # incident id -> its first alarm's batch

    @property
    def quarantine(self) -> list[int]:
        """The quarantined sample ids, sorted (``quarantine.py``)."""
        return self.samples.ids

    @quarantine.setter
    def quarantine(self, ids: Iterable[int]) -> None:  # a resumed state's
        self.samples.ids = sorted(set(ids))

    def holds(self, sample_ids: Any, device: torch.device, batch: Any = None,
              step: int | None = None) -> torch.Tensor | None:
        """``Quarantine.holds``: whether the step's batch holds a quarantined sample."""
        return self.samples.holds(sample_ids, device, batch, step)

    def quarantine_logged(self, run_dir: Path | None) -> None:
        """``Quarantine.logged``: the quarantine the run's ``rollbacks.jsonl`` holds."""
        self.samples.logged(run_dir)

    @classmethod
    def build(cls, option: Any, model: torch.nn.Module, optimizer: Any, scaler: Any = None,
              scheduler: Any = None, averaged: list[torch.nn.Module] | None = None
              ) -> Rollback | None:
        """The Monitor's ``rollback=`` (checked by ``options.py``): None or False is off, True
        the defaults."""
        if option is None or option is False:
            return None
        return cls(RollbackConfig() if option is True else option, model, optimizer, scaler,
                   scheduler, averaged)

    # ---- at each flush -----------------------------------------------------------------------

    def after_flush(self, run: RunView, steps: list[StepRecord], found: list[Event]) -> None:
        """Takes a snapshot, rolls back, or stops the run (the module docstring)."""
        if not steps:
            return
        c = self.config
        for s in steps:  # a quarantined sample's skip is the quarantine at work, not a fault's
            self.skips += s.values["skipped"] > 0 and not s.values["quarantine_skip"] > 0
        self.samples.note(steps, (c.keep + 2) * c.every + len(steps))
        if c.replay is not None:
            self._keep_alarm_batches(run, steps, found)
        last = steps[-1].step
        swept = self.samples.take_swept(run, last, self.rolled_at)
        if swept and self.history:
            self.history[-1].quarantined += swept
        if c.max_skips is not None and self.skips > c.max_skips:
            raise self._stop(run, f"{self.skips} steps skipped, more than max_skips="
                             f"{c.max_skips}")
        self._returned(run)
        damaged = incident_reason(run) or rate_not_scheduled(run, steps[-1])
        mine = damaged is not None and damaged[0].id not in self.done
        newest = self.snapshots[-1].step if self.snapshots else None
        due = self.off_reason is None and (newest is None or last - newest >= c.every) \
            and (self.rolled_at is None or last - self.rolled_at >= c.every)  # safe that long
        # a sync, every `every` steps: a snapshot only of a state without NaN/Inf
        bad_state = due and damaged is None and not bool(nonfinite_state(run).sum().cpu() == 0)
        # under a process group every rank decides alike: back when any rank's incident says
        # so (to before the earliest), a snapshot only when no rank objects
        (back, held, unsafe), (start,) = _agree(
            run, [float(mine), float(damaged is not None), float(bad_state)],
            [float(damaged[0].start) if mine and damaged is not None else math.inf])
        if back:
            incident, why = (damaged[0], damaged[1]) if mine and damaged is not None else \
                (None, "an incident on another rank")
            self._roll_back(run, incident, why, last, found, int(start))
        elif not held and due and not unsafe:
            self._take(last, run)

    def _returned(self, run: RunView) -> None:
        """Stops the run when an alarm of a cause in ``STOP_ON_RETURN`` opens again while its
        rollback is still in the row, damage or not: the restore did not remove its cause."""
        cur = run.tracker.current
        if cur is None or cur.severity != "alarm" or cur.id in self.done \
                or cur.cause not in STOP_ON_RETURN or cur.cause not in self.row:
            return
        allowed = (self.config.ladder or LADDER).get(cur.cause, self.config.max_in_row)
        if self.row.count(cur.cause) >= allowed:
            raise self._stop(run, f"incident #{cur.id} (cause {cur.cause}) opened after "
                             f"{self.row.count(cur.cause)} rollback(s) for {cur.cause} in a row: "
                             f"{STOP_ADVICE[cur.cause]}", cur.cause)

    def _take(self, step: int, run: RunView | None = None) -> None:
        c = self.config
        # the oldest snapshot's buffers are used again when it is the one to go
        old = self.snapshots[0] if len(self.snapshots) >= c.keep else None
        snap = Snapshot(step, to_host(self.model.state_dict(), old and old.model),
                        to_host(self.optimizer.state_dict(), old and old.optimizer),
                        to_host(self.scaler.state_dict()) if self.scaler is not None else None,
                        copy.deepcopy(self.scheduler.state_dict())
                        if self.scheduler is not None else None, 0,
                        [to_host(m.state_dict(), old and i < len(old.averaged)
                                  and old.averaged[i]) for i, m in enumerate(self.averaged)])
        snap.nbytes = nbytes(snap.model) + nbytes(snap.optimizer) + nbytes(snap.averaged)
        if snap.nbytes * c.keep > c.max_bytes:
            self.off_reason = (f"a snapshot takes {snap.nbytes / 2**20:.0f} MiB, and {c.keep} of "
                               f"them more than max_bytes={c.max_bytes}")
            say.warn(f"fasthealth: rollback is off: {self.off_reason}; raise "
                     "RollbackConfig.max_bytes or lower keep")
            return
        snap.detect = detector_state(run) if run is not None else {}
        self.snapshots = [*self.snapshots, snap][-c.keep:]
        self.in_row, self.row = 0, []
        self.samples.forget_before(self.snapshots[0].step)

    def _roll_back(self, run: RunView, incident: Incident | None, why: str, last: int,
                   found: list[Event], start: int) -> None:
        """Back to the newest snapshot from before ``start``: this rank's ``incident``'s, or
        under a process group the earliest of the ranks' (None: another rank's)."""
        c = self.config
        if incident is not None:
            self.done.append(incident.id)
        target = next((s for s in reversed(self.snapshots) if s.step < start), None)
        name = f"incident #{incident.id}" if incident is not None else "an incident"
        if target is None:
            say.warn(
                f"fasthealth: {name} (from step {start}) says the "
                f"training state may be damaged ({why}), and no snapshot from before it is "
                "kept" + (f" ({self.off_reason})" if self.off_reason else
                          f" (the first is taken once the run has been safe for {c.every} "
                          "steps)") + ": not rolled back")
            return
        if self.in_row + 1 > c.max_in_row:
            raise self._stop(run, f"{self.in_row + 1} rollbacks in a row, more than "
                             f"max_in_row={c.max_in_row}: the fault comes back after each")
        if len(self.history) + 1 > c.max_total:
            raise self._stop(run, f"{len(self.history) + 1} rollbacks, more than max_total="
                             f"{c.max_total}")
        tracker = run.tracker
        level = tracker.baseline[0]
        noise = noise_unit(list(target.detect.get("tracker", {}).get("losses", [])))
        rate_kept = self._restore(target)
        run.gate.skip_pending()  # a trainer's step still to come holds the old gradients
        verdict = self._replay(run, incident) if incident is not None else (None, None, None)
        if incident is not None and verdict[0] == "batch" and incident.basis != DIRECT:
            incident.cause, incident.basis = "batch", "replay"  # the replay re-ran it
            incident.why = "its first alarm's batch is bad on the restored state too"
        cause = incident.cause if incident is not None else "outside"
        allowed = (c.ladder if c.ladder is not None else LADDER).get(cause, c.max_in_row)
        if self.row.count(cause) + 1 > allowed:  # stopped on the restored, known-good state
            raise self._stop(run, f"{name} (cause {cause}) came after {self.row.count(cause)} "
                             f"rollback(s) for {cause} in a row, the most the ladder allows "
                             f"({allowed}): {STOP_ADVICE.get(cause, CHECK_FIRST[cause])}. The "
                             f"state is restored to the end of step {target.step}", cause)
        if target.detect:
            rewind(run, target.detect)  # the detectors as they were: a fault coming back shows
        ids: list[int] = []
        source = True
        if incident is not None:
            tracker.rolled_back(incident)
            if cause == "batch":
                ids, source = self.samples.culprits(run, incident, found, level, noise)
        new = self.samples.add(ids) and not source  # culprits among good samples: progress
        record = RollbackRecord(last, target.step, incident.id if incident is not None else -1,
                                why, ids, *verdict)
        self.history.append(record)
        self.rolled_at = last
        if not new:  # a rollback that set new samples aside made progress: not in the row
            self.in_row += 1
            self.row.append(cause)
        # the snapshots after the target hold the fault's start: never restored again
        self.snapshots = [s for s in self.snapshots if s.step <= target.step]
        jsonl = run.journal.jsonl
        if jsonl is not None:
            jsonl.queue_record("rollbacks.jsonl", record.to_json())
            jsonl.drain()
        message = (
            f"fasthealth: rolled back at step {last}: {name} (from step "
            f"{start}: {why}); the model, the optimizer"
            + (", the scaler" if target.scaler is not None else "")
            + (", the scheduler" if target.scheduler is not None else "")
            + (", the averaged model" if target.averaged else "")
            + f" are as they were at the end of step {target.step}"
            + (" (the learning rate is the scheduler's now: it sets the rate from the loop's "
               "own counter)" if rate_kept else "")
            + ", and training goes on with "
            f"the next batch ({last - target.step} steps' updates undone"
            + (f"; {len(ids)} samples quarantined" if ids else "") + ")"
            + ("" if verdict[0] is None else
               f"; its first alarm's batch replayed on the restored state: loss "
               f"{verdict[1]:.4g} against the level {verdict[2]:.4g} before, "
               + ("bad alone (the data)" if verdict[0] == "batch" else
                  "fine there (the batch with the state the run had reached)")))
        say.log.warning(message)
        say.warn(message)

    def _keep_alarm_batches(self, run: RunView, steps: list[StepRecord],
                            found: list[Event]) -> None:
        """Keeps (a reference to) the batch of each new incident's first alarm, and the open
        incident's batches for the culprit search (``Quarantine.keep_batches``), and lets go
        of those of incidents closed since."""
        batches = {s.step: s.host.batch for s in steps if s.host.batch is not None}
        self.samples.keep_batches(run, batches)
        for e in sorted(found, key=lambda e: e.step):
            if e.severity == "alarm" and e.incident is not None and e.step in batches \
                    and e.incident not in self._alarm_batches and e.incident not in self.done:
                self._alarm_batches[e.incident] = batches[e.step]
        open_ids = {i.id for i in run.incidents if i.open}
        for key in [k for k in self._alarm_batches if k not in open_ids]:
            del self._alarm_batches[key]

    def _replay(self, run: RunView, incident: Incident) -> tuple[str | None, float | None,
                                                           float | None]:
        """(verdict, loss, level): the incident's first alarm batch run again, without
        gradients and with the RNG put back after, on the state just restored
        (``RollbackConfig.replay``); (None, None, None) without it."""
        batch = self._alarm_batches.pop(incident.id, None)
        tracker = run.tracker
        level = tracker.baseline[0]
        if self.config.replay is None or batch is None or level is None:
            return None, None, None
        device = next(self.model.parameters()).device
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    torch.no_grad():
                loss = float(torch.as_tensor(self.config.replay(self.model, batch)).float()
                             .mean())
        except Exception as e:  # the user's function: the rollback stands without a verdict
            warnings.warn(f"fasthealth: the replay of incident #{incident.id}'s batch failed "
                          f"({type(e).__name__}: {e}); no data-or-state verdict",
                          RuntimeWarning, stacklevel=2)
            return None, None, level
        bad = not math.isfinite(loss) or loss > level + tracker.recover * abs(level)
        return ("batch" if bad else "state"), loss, level

    def _restore(self, snap: Snapshot) -> bool:
        """Copies ``snap`` back in place (the optimizer's learning rates with its state, unless
        the scheduler sets them from the loop's counter: ``_schedule_now``; returns whether it
        did); the snapshot itself is copied first: a loaded state may share the tensors it is
        given."""
        settle()
        self.model.load_state_dict(snap.model)
        for m, state in zip(self.averaged, snap.averaged):
            m.load_state_dict(state)
        kept = self._schedule_now()
        self.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
        for group, values in zip(self.optimizer.param_groups, kept):
            group.update(values)
        if self.scaler is not None and snap.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(snap.scaler))
        if self.scheduler is not None and snap.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
        return bool(kept)

    def _schedule_now(self) -> list[dict[str, Any]]:
        """The learning rates (and the field a scheduler drives) that a restore keeps: a
        scheduler that sets the rate from the loop's own counter and holds no position of its
        own (timm's ``Scheduler``: ``step(epoch)``, ``step_update(num_updates)``) would leave
        the snapshot's rate until its next call; its rate now is the schedule's. None for
        torch's schedulers (their position is restored with them) or without a scheduler."""
        sched = self.scheduler
        if sched is None or callable(getattr(sched, "get_last_lr", None)):
            return []
        keys = {"lr", getattr(sched, "param_group_field", "lr")}
        return [{k: g[k] for k in keys if k in g} for g in self.optimizer.param_groups]

    def _stop(self, run: RunView, why: str, cause: str | None = None) -> RollbackBudgetError:
        alarms = [i for i in run.incidents if i.severity == "alarm"]
        listed = "; ".join(f"#{i.id} steps {i.start}-{i.end} {i.trigger} (cause {i.cause})"
                           for i in alarms[-5:])
        return RollbackBudgetError(
            f"fasthealth: the run is stopped: {why}. Its alarm incidents: {listed or 'none'}. "
            "Look at them (fasthealth report LOG_DIR) before going on: a fault that keeps "
            "coming back is a bug or bad data, which skipping hides", alarms, cause)


def _agree(run: RunView, most: list[float], least: list[float]) -> tuple[list[float], list[float]]:
    """The largest of each of ``most`` and the smallest of each of ``least`` over the Monitor's
    process group, so that every rank takes the same decision: one all-reduce of a few
    numbers, at a flush; as they are without a process group."""
    pg = run.process_group
    if pg is None:
        return most, least
    t = torch.tensor([*most, *(-v for v in least)], dtype=torch.float64)
    t = t.to(comm_device(pg, run.device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    out = t.cpu().tolist()
    return out[:len(most)], [-v for v in out[len(most):]]
