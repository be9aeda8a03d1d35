"""What the Monitor tells the user while training runs (docs/spec.md section 6, "Alarms as
they happen"): each incident, when it opens and when it closes or is rolled back, is one line
on Python's ``logging`` (logger ``fasthealth``: WARNING for alarms, INFO for notices), so a
hand-written loop sees an alarm at the flush that finds it, and the trainers' logs carry it
too. The usual logging configuration silences it (``logging.getLogger("fasthealth")
.setLevel(logging.ERROR)``). A warning points at the user's line, the first frame outside the
package, wherever in it the warning was raised.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from types import FrameType

from .events import ALARM, Incident

log = logging.getLogger("fasthealth")
_PACKAGE = str(Path(__file__).resolve().parent.parent)


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` (called by the caller of this function) that
    names the first frame outside fasthealth: the user's ``mon.step`` or ``mon.flush``."""
    frame: FrameType | None = sys._getframe(2)  # the frame that calls warnings.warn: level 1
    level = 1
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
            _PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` pointing at the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel() + 1)


def _level(inc: Incident) -> int:
    return logging.WARNING if inc.severity == ALARM else logging.INFO


def incident_opened(inc: Incident, step: int) -> None:
    """One line when an incident opens, or when one opened as a notice becomes an alarm."""
    first = next((e for e in inc.events if e.severity == inc.severity), None)
    what = first.message.split(". Check first")[0] if first is not None else inc.trigger
    log.log(_level(inc), "fasthealth: step %d: %s #%d %s (cause: %s): %s%s", step,
            inc.severity, inc.id, inc.trigger, inc.cause or "not known yet", what,
            f". Check first: {inc.check_first}" if inc.check_first else "")


def incident_closed(inc: Incident) -> None:
    """One line when an incident closes: whether the run came back from it."""
    if inc.rolled_back:
        how = "rolled back: the state from before it is restored"
    elif inc.recovered is None:
        how = "the run ended with it open"
    else:
        how = "the loss came back" if inc.recovered else "the loss did not come back"
    log.log(_level(inc), "fasthealth: steps %d-%d: %s #%d %s closed (cause: %s): %s", inc.start,
            inc.end, inc.severity, inc.id, inc.trigger, inc.cause, how)
