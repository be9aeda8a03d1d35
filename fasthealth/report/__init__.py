"""`fasthealth report LOG_DIR`, in parts, each importing only those before it: ``read`` (the
tolerant reader of a run's files, ``read_log``), ``runs`` (the runs of a log directory, the one
reported and its abandoned branches left out, ``read_run``), ``summary`` (the text summary and its
incident table), ``heatmap`` (the per-tensor heatmap's data), ``plots`` (the figure and its
panels), ``html`` (report.html and report.png) and ``cli`` (the command, ``main``)."""

from .cli import main
from .heatmap import Heatmap, heatmap_data
from .html import report_paths, write, write_report
from .plots import LABELLED, MIN_DRAWN, SPAN_COLORS, figure, span_extents
from .read import Log, LogError, Problems, read_log
from .runs import read_run
from .summary import replay_brief, summary

__all__ = ["LABELLED", "MIN_DRAWN", "SPAN_COLORS", "Heatmap", "Log", "LogError", "Problems",
           "figure", "heatmap_data", "main", "read_log", "read_run", "replay_brief", "report_paths",
           "span_extents", "summary", "write", "write_report"]
