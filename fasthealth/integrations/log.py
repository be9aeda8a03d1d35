"""Where the trainer callbacks log: the Monitor's ``log_dir``, by default in the trainer's own
folder. The lines of each incident in the trainer's own log are the Monitor's own
(``monitor/say.py``: logger ``fasthealth``)."""

from __future__ import annotations

import logging
import os
from typing import Any

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

