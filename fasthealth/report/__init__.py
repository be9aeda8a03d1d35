"""`fasthealth report LOG_DIR`, in parts: ``read`` (the tolerant reader of a log directory),
``summary`` (the text summary and its incident table), ``heatmap`` (the per-tensor heatmap's
data), ``plots`` (the figure and its panels), ``html`` (report.html and report.png) and ``cli``
(the command). Each part imports only those before it."""

from .cli import main
from .heatmap import MAX_COLUMNS, Heatmap, heatmap_data, layer_of
from .html import write, write_report
from .plots import (
    EVENT_COLORS,
    LABEL_COLORS,
    LABELLED,
    MIN_DRAWN,
    SPAN_COLORS,
    figure,
    span_extents,
)
from .read import Log, LogError, Problems, incidents_of, is_step, load, read, read_log
from .summary import incident_table, replay_brief, summary

__all__ = ["EVENT_COLORS", "LABELLED", "LABEL_COLORS", "MAX_COLUMNS", "MIN_DRAWN", "SPAN_COLORS",
           "Heatmap", "Log", "LogError", "Problems", "figure", "heatmap_data", "incident_table",
           "incidents_of", "is_step", "layer_of", "load", "main", "read", "read_log",
           "replay_brief", "span_extents", "summary", "write", "write_report"]
