"""Where a Monitor's log files are: its run's directory (``LOG_DIR/run-NNN/``), for the tests
that read them after the Monitor is gone (with the Monitor at hand, ``mon.run_dir``)."""

from pathlib import Path


def run_of(log_dir, n_runs: int = 1) -> Path:
    """The latest run directory of ``log_dir``, which holds ``n_runs`` runs."""
    runs = sorted(Path(log_dir).glob("run-[0-9][0-9][0-9]*"), key=lambda p: int(p.name[4:]))
    assert len(runs) == n_runs, f"{log_dir} holds runs {[p.name for p in runs]}"
    return runs[-1]
