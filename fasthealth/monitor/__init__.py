"""The training-loop monitor (docs/spec.md section 6), in parts:

- ``monitor.py``: ``Monitor``: ``step`` = record + gate, ``flush`` = analyse + write
  (``journal.py``); ``analyser_for`` builds the analyser a Monitor has, for recorded steps;
- ``analyser.py``: ``Analyser``: the rules, events and incidents over step records, on its own;
- ``option_groups.py``: its options, grouped by concern (``LogOptions``, ``ActOptions``, ...);
  ``options.py`` checks them;
- ``record.py``: the device record, one row of named columns per step, and the typed
  ``StepRecord`` each step becomes on the host;
- ``gate.py``: clipping and the step-or-skip, without a host sync where the optimizer allows;
- ``rules/``: one file per event rule, and their registry; ``kinds.py``: every fact about
  each kind of event; ``robust.py``: the statistics the rules judge with;
- ``schema.py``: the step record's fields; ``incidents.py``: events grouped by fault;
- ``events.py``: ``Event``, ``Incident``, ``Observation``, ``NonFiniteError``;
- ``sinks.py``: the JSONL logs, TensorBoard, the dumps;
- ``replay.py``: ``replay``, which re-runs the step behind an event from its dump;
- ``rollback.py``: the known-good snapshots a damaged run is rolled back to, the budget, the
  quarantined samples.
"""

from .analyser import Analyser, Filing
from .causes import CauseConfig
from .events import Event, Incident, NonFiniteError, Observation
from .incidents import IncidentConfig
from .monitor import Monitor, analyser_for
from .option_groups import ActOptions, DetectOptions, LogOptions, MeasureOptions, PrecursorOptions
from .quarantine import skip_quarantined
from .replay import ReplayResult, replay
from .rollback import RollbackBudgetError, RollbackConfig
from .sinks import steps_from_log

__all__ = ["ActOptions", "Analyser", "CauseConfig", "DetectOptions", "Event", "Filing", "Incident",
           "IncidentConfig", "LogOptions", "MeasureOptions", "Monitor", "NonFiniteError",
           "Observation", "PrecursorOptions", "ReplayResult", "RollbackBudgetError",
           "RollbackConfig", "analyser_for", "replay", "skip_quarantined", "steps_from_log"]
