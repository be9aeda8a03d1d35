"""The training-loop monitor (docs/spec.md section 6), in parts:

- ``monitor.py``: ``Monitor``: ``step`` = record + gate, ``flush`` = detect + write;
- ``option_groups.py``: its options, grouped by concern (``LogOptions``, ``ActOptions``, ...);
  ``options.py`` checks them;
- ``record.py``: the device record, one row of named columns per step;
- ``gate.py``: clipping and the step-or-skip, without a host sync where the optimizer allows;
- ``rules/``: one file per event rule, and their registry; ``kinds.py``: every fact about
  each kind of event; ``robust.py``: the statistics the rules judge with;
- ``schema.py``: the step record's fields; ``incidents.py``: events grouped by fault;
- ``events.py``: ``Event``, ``Incident``, ``Observation``, ``NonFiniteError``;
- ``sinks.py``: the JSONL logs, TensorBoard, the dumps;
- ``replay.py``: ``replay``, which re-runs the step behind an event from its dump.
"""

from .events import Event, Incident, NonFiniteError, Observation
from .monitor import Monitor
from .option_groups import ActOptions, DetectOptions, LogOptions, MeasureOptions, PrecursorOptions
from .replay import ReplayResult, replay

__all__ = ["ActOptions", "DetectOptions", "Event", "Incident", "LogOptions", "MeasureOptions",
           "Monitor", "NonFiniteError", "Observation", "PrecursorOptions", "ReplayResult",
           "replay"]
