"""`fasthealth report` and `fasthealth demo` end to end."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from runlog import run_of

import fasthealth as fh
from fasthealth import demo, report
from fasthealth.monitor import kinds


@pytest.mark.slow
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
    assert path.exists() and (mon.run_dir / "report.png").stat().st_size > 10_000
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


NOT_PLANTED = {"replica_divergence", "sdc_suspect", "stall", "precursor_adam_eps",
               "precursor_logit_growth", "precursor_attention_logits"}


@pytest.mark.slow
def test_demo_catches_every_planted_fault(tmp_path):
    out = io.StringIO()
    assert demo.run(tmp_path, progress=False, out=out), out.getvalue()
    text = out.getvalue()
    assert "MISSED" not in text and "does not reproduce on replay of step 120" in text
    assert "reproduces on replay of step 80" in text
    assert "incidents: 12 for 12 planted faults, each fault in its own; 12 dumps" in text
    for kind, cause in (("no_grad", "outside"), ("repeated_batch", "batch"),
                        ("overflow_streak", "numeric_range"), ("weight_corruption", "weights")):
        line = text.split(f"-> {kind} at ")[1].split("\n")[0]
        assert line.endswith(f", cause {cause}"), (kind, line)
    dumps = [p for p in (run_of(tmp_path) / "dumps").iterdir() if p.suffix == ".pt"]
    assert len(dumps) == 12
    fired = {json.loads(s)["kind"]
             for s in (run_of(tmp_path) / "events.jsonl").read_text().splitlines()}
    # every detector fired but those the demo does not plant: replicas and a rank's own
    # gradients need a process group (tests/test_distributed.py), the stall and three
    # precursors models of their own
    # (evaluation/tests/test_eval_detectors.py, tests/monitor/test_act.py)
    assert set(kinds.KINDS) - NOT_PLANTED <= fired


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "fasthealth", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "demo" in out.stdout and "report" in out.stdout


def _synthetic_log(n_tensors=120, steps=60):
    """A log as the Monitor writes it: no optimizer (no learning rate, no loss scale), one
    gradient NaN at step 30 (skipped), per-tensor norms every 5 steps but none for 40-54 (the
    process was down), many tensors in 12 layers."""
    names = [f"model.layers.{i // 10}.w{i % 10}" for i in range(n_tensors)]
    rows = []
    for t in list(range(0, 40)) + list(range(55, steps)):
        bad = t == 30
        r = {"step": t, "loss": 1.0 / (1 + t), "grad_norm": None if bad else 1.0,
             "nan_count": 1 if bad else 0, "inf_count": 0, "grads_finite": not bad,
             "loss_finite": True, "skipped": bad, "lr": None, "loss_scale": None}
        if t % 5 == 0 or bad:
            r["per_tensor_norms"] = {n: (None if bad and i == 7 else 0.1 * (1 + i % 3))
                                     for i, n in enumerate(names)}
        rows.append(r)
    meta = {"names": names, "per_tensor_every": 5}
    events = [{"step": 30, "kind": "nonfinite_grad", "message": "1 NaN", "dump": None,
               "severity": "alarm", "incident": None}]
    return meta, rows, events


def test_report_marks_inside_axes_gaps_and_layers():
    import matplotlib

    matplotlib.use("Agg")
    meta, steps, events = _synthetic_log()
    fig = report.figure(meta, steps, events)
    titles = [ax.get_title() for ax in fig.axes]
    assert not any("learning rate" in t or "loss scale" in t for t in titles), titles
    fig.canvas.draw()
    marks = 0
    for ax in fig.axes:
        box = ax.get_window_extent()
        for coll in ax.collections:
            if not hasattr(coll, "get_offsets") or coll.__class__.__name__ != "PathCollection":
                continue
            pts = coll.get_offset_transform().transform(coll.get_offsets())
            for x, y in pts:
                assert box.x0 - 1 <= x <= box.x1 + 1 and box.y0 - 1 <= y <= box.y1 + 1, (
                    ax.get_title(), coll.get_label(), x, y, box)
                marks += 1
        # legends sit outside the axes, to the right: they hide no data
        leg = ax.get_legend()
        if leg is not None:
            assert leg.get_window_extent().x0 >= box.x1 - 1, ax.get_title()
    assert marks > 0
    nf = next(ax for ax in fig.axes if ax.get_title().startswith("non-finite gradient"))
    assert nf.get_ylim()[0] < 1  # a single NaN (a bar of height 1) shows on the log scale
    heat = next(ax for ax in fig.axes if "gradient norm at the recorded" in ax.get_title())
    assert heat.get_title().startswith("per-layer")  # 120 tensors: one row per layer
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert labels == [f"model.layers.{i}" for i in range(12)], labels
    h = report.heatmap_data(meta, steps, events)
    assert h.steps == [*range(0, 40, 5), 55] and h.cadence == 5
    at = {s: k for k, s in enumerate(h.steps)}
    assert h.ends[at[25]] == 30 and h.ends[at[35]] == 40  # a record: up to the next, at most 5
    assert h.ends[at[30]] == 31  # the NaN record at 30 stands for its own step only
    assert h.bad[0, at[30]] and not h.bad[1:, at[30]].any()  # the NaN layer
    # drawn: the record's columns, gray (masked) between 31 and 35 and for 40-54
    mesh = heat.collections[0]
    x = mesh.get_coordinates()[0, :, 0]
    grid = mesh.get_array()
    assert grid.shape == (12, len(x) - 1)

    def column(step):
        return int(np.searchsorted(x, step, side="right")) - 1

    assert grid.mask[:, column(45)].all() and not grid.mask[:, column(35)].any()
    assert grid.mask[:, column(32)].all() and column(32) == column(34)
    red = heat.collections[1].get_array()
    assert not red.mask[0, column(30)] and red.mask[0, column(29)]  # the NaN layer at 30: red


def test_report_without_matplotlib_says_what_to_install(tmp_path):
    meta, steps, events = _synthetic_log(n_tensors=4, steps=20)
    (tmp_path / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in steps) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from fasthealth import report\n"
            f"sys.exit(report.main([{str(tmp_path)!r}]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "pip install 'fasthealth[report]'" in out.stderr and "Traceback" not in out.stderr
    assert "fasthealth report: steps 0.." in out.stdout  # the text summary still comes
