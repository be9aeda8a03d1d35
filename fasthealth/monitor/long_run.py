"""The Monitor's long-run members (docs/spec.md section 11), a base class of ``Monitor``: its
state to resume from (``state.py``), the run it writes in its log directory (``runs.py``),
whether a checkpoint may be written now (``guard.py``), and the rollbacks (``rollback.py``).
Kept apart so that ``monitor.py`` stays the step and the flush."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from . import guard, state
from .rollback import RollbackRecord
from .view import RunView


class LongRun:
    """What ``Monitor`` adds for runs that stop, resume and checkpoint (its ``journal`` is the
    one ``Monitor.__init__`` makes)."""

    journal: Any
    rollback: Any
    _view: RunView

    def state_dict(self) -> dict[str, Any]:
        """Everything the rules and incidents need to go on as if the run had never stopped
        (docs/spec.md section 11): flushes first (one sync), then returns CPU tensors and
        Python values, small (never the model, and of the events and incidents only the
        latest and the open incident's: the logs hold them all; ``state.py``), loadable with
        ``torch.load(..., weights_only=True)``. Save it beside the model and the optimizer."""
        return state.state_dict(cast(state.Monitor, self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what ``state_dict()`` returned, before the first step: the run goes on with
        its windows, open incidents, step count and run (with a ``log_dir``, its records go on
        in that run). ``events`` then holds the state's latest events and those raised after,
        ``incidents`` every incident by id, the older ones as ``state.Forgotten`` placeholders.
        A state of another model's parameters, or one naming a class outside fasthealth, is a
        ValueError that changes nothing (no run continued). With ``rollback=``, the quarantine
        is also every sample the continued run's ``rollbacks.jsonl`` quarantined: a checkpoint
        older than a rollback still skips its samples."""
        state.load_state_dict(cast(state.Monitor, self), state_dict)
        if self.rollback is not None:
            self.rollback.quarantine_logged(self.run_dir)

    @property
    def run_id(self) -> str | None:
        """The run written (``run-NNN``, ``runs.py``); None before the first step, else too."""
        return self.journal.run.id if self.journal.run is not None else None

    @property
    def run_dir(self) -> Path | None:
        """That run's folder (``LOG_DIR/run-NNN``); None as ``run_id``."""
        return self.journal.log_dir

    def _continue_run(self, run_id: str | None, step: int | None) -> None:
        """``load_state_dict``'s: write on into run ``run_id`` after ``step`` (``runs.py``)."""
        self.journal.continue_run(run_id, step)

    @property
    def rollbacks(self) -> list[RollbackRecord]:
        """Every rollback so far (``rollback=``: ``rollback.py``), in order; [] without it."""
        return list(self.rollback.history) if self.rollback is not None else []

    def safe_to_save(self) -> bool:
        """Whether a checkpoint may be written now (docs/spec.md section 11; ``guard.py`` says
        which incidents forbid it): flushes, then one fused pass over the parameters and the
        optimizer's state for NaN/Inf. Its sync happens only here, when it is called. With
        ``on_nonfinite="raise"`` its flush raises NonFiniteError as any flush would."""
        return guard.verdict(self._view).safe

    def save_verdict(self) -> guard.Verdict:
        """``safe_to_save()`` with its reasons: ``safe``, and when not, ``reason`` (why, and
        what to do: for a run damaged but finite, resume from a checkpoint before the incident
        or wait for the loss to come back) and ``incident`` (the open incident that forbids
        it, None when only the pass over the values found NaN/Inf). The same flush and sync."""
        return guard.verdict(self._view)
