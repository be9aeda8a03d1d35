"""The training-loop monitor (docs/spec.md section 6), in parts:

- ``monitor.py``: ``Monitor``: ``step`` = record + gate, ``flush`` = detect + write;
- ``record.py``: the device record, one row of named columns per step;
- ``gate.py``: clipping and the step-or-skip, without a host sync where the optimizer allows;
- ``detectors.py``: every event rule behind one interface;
- ``events.py``: ``Event``, ``Observation``, ``NonFiniteError``;
- ``sinks.py``: the JSONL logs, TensorBoard, the dumps;
- ``replay.py``: ``replay``, which re-runs the step behind an event from its dump.
"""

from .events import Event, Incident, NonFiniteError, Observation
from .monitor import Monitor
from .replay import ReplayResult, replay

__all__ = ["Event", "Incident", "Monitor", "NonFiniteError", "Observation", "ReplayResult",
           "replay"]
