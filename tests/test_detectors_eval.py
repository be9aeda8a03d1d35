"""The detector evaluation of bench/detectors/ at the CI size: one seed of every healthy and
faulty run, real training under fh.Monitor. At the defaults no healthy step may raise an event,
and every fault must be caught within its allowed delay (bench/bench_detectors.py runs the
calibration and held-out seeds at full size; README, "How the rules were calibrated")."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_detectors  # noqa: E402


def test_quick_corpus_no_false_alarm_every_fault_caught():
    res = bench_detectors.evaluate(bench_detectors.QUICK, workers=2, progress=False)
    assert res["healthy_steps"] >= 6000
    assert len(res["healthy_kinds"]) >= 8 and len(res["faults"]) >= 10
    assert res["false_alarms"] == 0, res["false_alarm_list"]
    missed = {k: f["runs"] for k, f in res["faults"].items() if f["caught"] != len(f["runs"])}
    assert not missed, missed
