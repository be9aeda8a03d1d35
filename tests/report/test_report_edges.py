"""`fasthealth report` at the edges, as a user meets them: a real Monitor's log with one file
broken in each way (a record without "step" or "kind", a number where a record goes, binary
data, an empty meta.json, a FIFO or a folder where a file goes), the user's own report.html,
a read-only log_dir. Each case: no traceback, the problem named by file (and line), the
report written where it can be, the user's files untouched (fasthealth/report/read.py, cli.py).
"""

import json
import os
import random
import shutil
import subprocess
import sys

import matplotlib
import pytest
import torch

import fasthealth as fh
from fasthealth import report
from fasthealth.report import html

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def monitor_log(tmp_path_factory):
    """A real Monitor's log: 40 steps of a linear model, a NaN loss at step 20 (one incident,
    two events, a dump)."""
    d = tmp_path_factory.mktemp("log")
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    with fh.Monitor(m, opt, log_dir=d, flush_every=7, warmup_steps=5) as mon:
        for step in range(40):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean() * (float("nan") if step == 20 else 1.0)
            loss.backward()
            mon.step(loss, batch=(x, y))
    return getattr(mon, "run_dir", None) or d


@pytest.fixture
def log(monitor_log, tmp_path):
    d = tmp_path / "log"
    shutil.copytree(monitor_log, d)
    assert (d / "events.jsonl").read_text().count("\n") == 2
    return d


def _append(path, text):
    with open(path, "a") as f:
        f.write(text)


def _replace(path, data=None, kind="file"):
    path.unlink()
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(data)


# (what is broken, how, what stderr says of it)
CASES = {
    "event without step": (lambda d: _append(d / "events.jsonl", json.dumps(
        {"kind": "loss_spike", "message": "no step"}) + "\n"),
        "events.jsonl line 3: an event with no 'step': listed, not plotted"),
    "event without kind": (lambda d: _append(d / "events.jsonl", json.dumps(
        {"step": 3, "message": "no kind"}) + "\n"),
        "events.jsonl line 3: an event with no 'kind'"),
    "event with only a step": (lambda d: _append(d / "events.jsonl", '{"step": 4}\n'),
                               "events.jsonl line 3: an event with no 'message'"),
    "a number for an event": (lambda d: _append(d / "events.jsonl", "5\n"),
                              "events.jsonl line 3: a number in JSON, not a record"),
    "a number for a step": (lambda d: _append(d / "steps.jsonl", "5\n"),
                            "steps.jsonl line 41: a number in JSON, not a record"),
    "a number for an incident": (lambda d: _append(d / "incidents.jsonl", "5\n"),
                                 "incidents.jsonl line 3: a number in JSON, not a record"),
    "a number for meta.json": (lambda d: (d / "meta.json").write_text("5"),
                               "meta.json: a number in JSON, not an object: ignored"),
    "a number for the norms": (lambda d: _append(d / "steps.jsonl", json.dumps(
        {"step": 40, "loss": 1.0, "per_tensor_norms": 5}) + "\n"),
        "'per_tensor_norms' is 5, not an object of numbers"),
    "a number for replay's result": (
        lambda d: (d / "dumps" / "step_00000020.pt.replay.json").write_text("5"),
        "step_00000020.pt.replay.json: a number in JSON, not an object: ignored"),
    "binary events": (lambda d: _replace(d / "events.jsonl", random.Random(1).randbytes(2000)),
                      "events.jsonl line 1: not"),
    "binary incidents": (lambda d: _replace(d / "incidents.jsonl",
                                            random.Random(2).randbytes(2000)),
                         "incidents.jsonl line 1: not"),
    "binary meta.json": (lambda d: _replace(d / "meta.json", random.Random(3).randbytes(2000)),
                         "meta.json: cannot be read"),
    "empty meta.json": (lambda d: _replace(d / "meta.json", b""), "meta.json: empty: ignored"),
    "events.jsonl a folder": (lambda d: _replace(d / "events.jsonl", kind="dir"),
                              "events.jsonl: a directory, not a file: no events shown"),
    "events.jsonl a FIFO": (lambda d: _replace(d / "events.jsonl", kind="fifo"),
                            "events.jsonl: not a regular file (a FIFO, socket or device): no "
                            "events shown"),
    "meta.json a FIFO": (lambda d: _replace(d / "meta.json", kind="fifo"),
                         "meta.json: cannot be read (not a regular file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_file_is_named_and_the_report_written(log, case, capsys):
    """The CLI's main in this process: a traceback would fail the test; a FIFO read would
    hang it (the test's time limit)."""
    breaks, said = CASES[case]
    breaks(log)
    assert report.main([str(log)]) == 0
    out = capsys.readouterr()
    assert said in out.err, out.err
    assert "steps 0..39 (40 logged)" in out.out or "steps 0..40 (41 logged)" in out.out, out.out
    assert html._is_our_page(log / "report.html") and html._is_our_png(log / "report.png")
    if "event" not in case or case.startswith("binary"):  # the incident is still reported
        assert ("#0    20-20" in out.out) == ("incidents" not in case), out.out


@pytest.mark.slow
def test_the_users_report_files_are_left_as_they_are(log):
    """The user's report.html and report.png (real files of theirs) through the installed CLI
    in a process of its own: byte for byte untouched, the report beside them, stderr says so;
    the next report replaces its own, not theirs."""
    page = b"<!doctype html><p>my notes on this run</p>"
    fig = matplotlib.pyplot.figure()
    fig.savefig(log / "report.png")
    matplotlib.pyplot.close(fig)
    png = (log / "report.png").read_bytes()
    (log / "report.html").write_bytes(page)
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "fasthealth", "report", str(log)],
                             capture_output=True, text=True)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert (log / "report.html").read_bytes() == page
        assert (log / "report.png").read_bytes() == png
        assert f"wrote {log / 'report-1.html'} and {log / 'report-1.png'}" in out.stdout
        assert "did not write: left as it is" in out.stderr
    assert sorted(p.name for p in log.glob("report*")) == [
        "report-1.html", "report-1.png", "report.html", "report.png"]


def _read_only(d):
    """Makes ``d`` read-only for this process: chmod, and for root (whom chmod does not stop)
    the immutable flag where the file system has it; returns how to undo it, or None where
    ``d`` stays writable."""
    d.chmod(0o555)
    undo = [lambda: d.chmod(0o755)]
    if os.geteuid() == 0 and shutil.which("chattr"):
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
            undo.insert(0, lambda: subprocess.run(["chattr", "-i", str(d)], check=True))
    try:
        (d / "probe").touch()
    except OSError:
        return lambda: [u() for u in undo]
    (d / "probe").unlink()
    for u in undo:
        u()
    return None


@pytest.mark.slow
def test_a_read_only_log_dir_prints_the_summary_and_names_out(log, tmp_path):
    undo = _read_only(log)
    if undo is None:
        pytest.skip("cannot make a folder read-only here (root without chattr)")
    try:
        out = subprocess.run([sys.executable, "-m", "fasthealth", "report", str(log)],
                             capture_output=True, text=True)
    finally:
        undo()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "steps 0..39 (40 logged)" in out.stdout and "#0    20-20" in out.stdout
    assert out.stderr.startswith(f"fasthealth report: cannot write the report to {log}: ")
    assert "give a folder you can write to with --out DIR" in out.stderr
    assert not list(log.glob("report*"))
    out = subprocess.run([sys.executable, "-m", "fasthealth", "report", str(log),
                          "--out", str(tmp_path / "elsewhere")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert html._is_our_page(tmp_path / "elsewhere" / "report.html")


def test_a_tensor_without_a_gradient_is_gray_in_the_heatmap_not_red(tmp_path):
    """A real Monitor's log with a forgotten backward at steps 10 and 11 (every .grad None,
    logged as null norms) and a NaN gradient at step 20: only the NaN is red (bad); the steps
    without gradients are drawn as missing."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(32, 4)
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5, per_tensor_every=5) as mon:
        for step in range(30):
            opt.zero_grad(set_to_none=True)
            loss = ((m(x) - x.sum(1, keepdim=True)) ** 2).mean()
            if step not in (10, 11):
                loss.backward()
            if step == 20:
                m.weight.grad[0, 1] = float("nan")
            mon.step(loss)
    assert [(e.step, e.kind) for e in mon.events][:2] == [(11, "no_grad"), (20, "nonfinite_grad")]
    log = report.read_log(getattr(mon, "run_dir", None) or tmp_path)
    h = report.heatmap_data(log.meta, log.steps, log.events)
    col = {s: k for k, s in enumerate(h.steps)}
    assert not h.bad[:, col[10]].any() and not h.bad[:, col[11]].any()
    assert h.bad[:, col[20]].any()


def _legend_texts(log_dir, monkeypatch):
    """The texts of every legend of the figure ``fasthealth report LOG_DIR`` draws."""
    figs = []

    def mark(fig, meta):
        real(fig, meta)
        figs.append(fig)
    real = html.mark_figure
    monkeypatch.setattr(html, "mark_figure", mark)
    html.write(log_dir)
    (fig,) = figs
    return [t.get_text() for ax in fig.axes if ax.get_legend() is not None
            for t in ax.get_legend().get_texts()]


def test_a_resumes_line_is_in_the_legend_only_when_the_run_was_resumed(tmp_path, monkeypatch):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)

    def train(mon, steps, nan_at=-1):
        for step in steps:
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean() * (float("nan") if step == nan_at else 1.0)
            loss.backward()
            mon.step(loss, batch=(x, y))

    with fh.Monitor(m, opt, log_dir=tmp_path / "plain", flush_every=7) as mon:
        train(mon, range(40), nan_at=20)
    texts = _legend_texts(tmp_path / "plain", monkeypatch)
    assert "loss" in texts and "resumed after this step" not in texts
    with fh.Monitor(m, opt, log_dir=tmp_path / "resumed", flush_every=7) as mon:
        train(mon, range(25), nan_at=20)
        sd = mon.state_dict()
    with fh.Monitor(m, opt, log_dir=tmp_path / "resumed", flush_every=7) as mon:
        mon.load_state_dict(sd)
        train(mon, range(25, 40))
    texts = _legend_texts(tmp_path / "resumed", monkeypatch)
    assert "loss" in texts and texts.count("resumed after this step") == 1, texts
    assert "nonfinite_loss" in texts  # the panel's own entries are still there
