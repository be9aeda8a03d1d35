"""`fasthealth report` and `fasthealth demo` end to end."""

import io
import json
import subprocess
import sys

import torch

import fasthealth as fh
from fasthealth import demo, report


def test_report_from_a_monitor_log(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=7, warmup_steps=5) as mon:
        for step in range(40):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean() * (float("nan") if step == 20 else 1.0)
            loss.backward()
            mon.step(loss, batch=(x, y))
    path, text = report.write(tmp_path)
    assert path.exists() and (tmp_path / "report.png").stat().st_size > 10_000
    page = path.read_text()
    assert "nonfinite_loss" in page and "data:image/png;base64," in page
    assert "steps 0..39 (40 logged)" in text
    assert "non-finite steps: 1 (first at 20); skipped steps: 1" in text
    assert "nonfinite_loss" in text
    out = subprocess.run([sys.executable, "-m", "fasthealth", "report", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "wrote" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "fasthealth", "report", str(tmp_path / "no")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not found" in bad.stdout


def test_demo_catches_every_planted_fault(tmp_path):
    out = io.StringIO()
    assert demo.run(tmp_path, progress=False, out=out), out.getvalue()
    text = out.getvalue()
    assert "MISSED" not in text and "does not reproduce on replay of step 120" in text
    assert "reproduces on replay of step 80" in text
    kinds = {json.loads(s)["kind"] for s in (tmp_path / "events.jsonl").read_text().splitlines()}
    assert set(report.EVENT_COLORS) <= kinds  # every detector fired


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "fasthealth", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "demo" in out.stdout and "report" in out.stdout
