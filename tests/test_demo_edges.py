"""`fasthealth demo` at the edges, run as a user runs it (its own process, a fresh TMPDIR):
without matplotlib it says what to install before it trains; whatever way it ends, it leaves
nothing in the temp directory (fasthealth/demo.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from fasthealth import demo


def _env(tmp_path, hide_matplotlib=False):
    """The environment of the demo's process: TMPDIR a fresh folder; matplotlib hidden by a
    sitecustomize on PYTHONPATH (its import fails, as where it is not installed)."""
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), OMP_NUM_THREADS="1")
    (tmp_path / "tmp").mkdir()
    if hide_matplotlib:
        shim = tmp_path / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
        env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_without_matplotlib_it_says_what_to_install_before_training(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fasthealth", "demo"], cwd=cwd,
                         env=_env(tmp_path, hide_matplotlib=True), capture_output=True,
                         text=True, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines() == [demo.REPORT_NEEDS], out.stderr
    assert "pip install 'fasthealth[report]'" in out.stderr and "--no-report" in out.stderr
    assert out.stdout == ""  # no "trained 440 steps": it did not train first
    assert took < 30, took  # the training alone takes 40 s or more
    assert not list((tmp_path / "tmp").iterdir()) and not list(cwd.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_an_interrupted_demo_leaves_nothing_in_the_temp_directory(tmp_path, how):
    """Interrupted mid-training (its log under way in the temp dir): the logs, the dumps
    and torch's inductor cache folder are removed; it exits on the signal, without a hang."""
    tmp = tmp_path / "tmp"
    # Ctrl-C as at a terminal: a shell without job control starts its background jobs with
    # SIGINT ignored, which the child would inherit (and Python then never raises
    # KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-m", "fasthealth", "demo", "--no-report"],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list(tmp.glob("fasthealth-demo-*/logs/run-*/steps.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        assert list(tmp.iterdir())  # the run was writing into the temp directory
        proc.send_signal(how)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + how, err
    assert "Traceback" not in err, err
    if how == signal.SIGINT:
        assert err.rstrip().endswith("fasthealth demo: interrupted; its temp folder is removed")
    assert not list(tmp.iterdir()), list(tmp.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # nothing in the cwd either


@pytest.mark.slow
def test_a_whole_demo_keeps_its_report_and_leaves_the_temp_directory_empty(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fasthealth", "demo"], cwd=tmp_path,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo: every planted fault was caught" in out.stdout
    assert "report: fasthealth-demo/report.html (the logs and dumps, in a temp folder, are " \
           "removed: --log-dir DIR keeps them)" in out.stdout
    assert sorted(p.name for p in (tmp_path / "fasthealth-demo").iterdir()) == [
        "report.html", "report.png"]
    assert not list((tmp_path / "tmp").iterdir()), list((tmp_path / "tmp").rglob("*"))
