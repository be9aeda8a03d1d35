"""Where the trainer callbacks log: the Monitor's ``log_dir``, by default in the trainer's own
folder, and one line per fault in the trainer's own log, when its incident becomes an alarm.
Notices stay in the Monitor's logs and the report."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..monitor import Incident
from ..monitor.option_groups import with_default

logger = logging.getLogger("fasthealth")


def log_dir_option(options: dict[str, Any], log_dir: Any, root: str | os.PathLike
                   ) -> dict[str, Any]:
    """The Monitor's keywords ``options`` with the callback's ``log_dir``: as given (False:
    none), or, for None, ``<root>/fasthealth`` unless ``options`` name one (in the
    deprecated ``log=fh.LogOptions(log_dir=...)``)."""
    if log_dir is None:
        return with_default(options, "log_dir", os.path.join(root, "fasthealth"))
    return {**options, "log_dir": log_dir or None}


def log_incident(incident: Incident) -> None:
    logger.warning("fasthealth: step %d: %s (incident %d: %s; the log_dir's report has the "
                   "rest)", incident.start, incident.message, incident.id,
                   ", ".join(incident.kinds))
