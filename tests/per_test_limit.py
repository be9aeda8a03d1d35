"""A per-test time limit that fails the test, not the run: the pytest plugin bench/gpu_check.sh
loads for the GPU tests (`-p per_test_limit`, with tests/ on PYTHONPATH). Inert unless
FASTHEALTH_TEST_TIMEOUT is set.

FASTHEALTH_TEST_TIMEOUT=S: a test body still running after S seconds is interrupted (SIGALRM
raises in the main thread, where pytest runs the test): that test fails, the rest go on. One
that the alarm cannot reach, stuck in C code (a hung kernel, an NCCL wait), S +
FASTHEALTH_TEST_GRACE seconds after its start, has every thread's traceback written to
FASTHEALTH_HANG_LOG and the process ends. FASTHEALTH_TEST_LEDGER=FILE: each test's start and
end are appended there, and a run given the same ledger deselects every test already started,
so that the script reruns the rest after such an exit (the hung test is the one started and
never ended). With a limit set, a failure's report is printed when it happens too: such an exit
comes before pytest's summary.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path

import pytest

LIMIT = float(os.environ.get("FASTHEALTH_TEST_TIMEOUT", "0") or 0)
GRACE = float(os.environ.get("FASTHEALTH_TEST_GRACE", "15") or 15)
LEDGER = os.environ.get("FASTHEALTH_TEST_LEDGER")
_hang_log = None
_config = None


def pytest_configure(config):
    global _hang_log, _config
    if LIMIT > 0:
        _config = config
        # a shell starts background jobs with SIGINT ignored and Python keeps that; the step's
        # limit interrupts with SIGINT so that pytest still prints its summary
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _hang_log = open(os.environ.get("FASTHEALTH_HANG_LOG", "hang-tracebacks.txt"), "a")


def started(ledger: str | os.PathLike) -> set[str]:
    """The tests a ledger saw start."""
    try:
        lines = Path(ledger).read_text().splitlines()
    except OSError:
        return set()
    return {line[6:] for line in lines if line.startswith("start ")}


def pytest_collection_modifyitems(config, items):
    done = started(LEDGER) if LEDGER else set()
    dropped = [i for i in items if i.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i.nodeid not in done]


def _note(word: str, nodeid: str) -> None:
    if LEDGER:  # one unbuffered append: it is on disk before a hard exit
        fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{word} {nodeid}\n".encode())
        finally:
            os.close(fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _note("start", item.nodeid)
    if LIMIT > 0:
        faulthandler.dump_traceback_later(LIMIT + GRACE, exit=True, file=_hang_log)
    try:
        yield
    finally:
        if LIMIT > 0:
            faulthandler.cancel_dump_traceback_later()
        _note("end", item.nodeid)


def pytest_runtest_logreport(report):
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if report.failed and terminal is not None:
        terminal.write_line("")
        terminal.write_sep("-", f"{report.nodeid} failed ({report.when})")
        terminal.write_line(report.longreprtext)


def _alarm(signum, frame):
    pytest.fail(f"still running after the per-test limit of {LIMIT:g} s "
                "(FASTHEALTH_TEST_TIMEOUT)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if LIMIT <= 0:
        yield
        return
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
