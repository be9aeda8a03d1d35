"""What the trainer callbacks put in the trainer's own log: one line per fault, when its
incident becomes an alarm. Notices stay in the Monitor's logs and the report."""

from __future__ import annotations

import logging

from ..monitor import Incident

logger = logging.getLogger("fasthealth")


def log_incident(incident: Incident) -> None:
    logger.warning("fasthealth: step %d: %s (incident %d: %s; the log_dir's report has the "
                   "rest)", incident.start, incident.message, incident.id,
                   ", ".join(incident.kinds))
