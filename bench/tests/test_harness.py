"""`fasthealth bench --quick`: it runs, and its JSON holds the roofline the goals are read
against (the split of fasthealth's time adds up, every goal says what bounds it)."""

import json
from pathlib import Path

import bench_runs
import harness as benchmark
import pytest

import fasthealth as fh


@pytest.mark.slow
def test_quick_bench_writes_roofline_and_goals(tmp_path):
    if fh.ops.compiled.C is None:
        pytest.skip("the roofline's read floor is the compiled CPU kernel's")
    assert benchmark.main(["--quick", "--rounds", "3", "--slow-rounds", "1",
                           "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "cpu-quick.json").read_text())
    assert (tmp_path / "cpu-quick.png").stat().st_size > 0
    assert (tmp_path / "cpu-quick-roofline.png").stat().st_size > 0
    cases = {(r["case"], r["dtype"]) for r in res["rows"]}
    providers = {r["provider"] for r in res["rows"]}
    assert {"floor", "floor_flat", "read_limit", "fasthealth", "total_norm"} <= providers
    roof = {(r["case"], r["dtype"]): r for r in res["roofline"]}
    assert set(roof) == cases
    for r in roof.values():
        split = r["split_x_read"]
        assert sum(split.values()) == pytest.approx(r["x_read"], abs=2e-3)
        assert r["bound"] in split
        assert r["compute_roof_gbps"] > 0 and r["memory_roof_gbps"] > 0
        assert r["total_norm_ceiling"] >= r["total_norm_x_read"]
    for g in res["goals"]:
        if "get_total_norm" in g["goal"]:
            assert "bound" in g


def test_several_runs_give_the_median_and_range_of_each_runs_median():
    def run(fh_ms, total_ms, speedup, met):
        rows = [{"case": "c", "dtype": "float32", "provider": "fasthealth", "ms": fh_ms,
                 "x_read_paired_median": fh_ms / 2,
                 "x_faster_than_total_norm_paired_median": speedup},
                {"case": "c", "dtype": "float32", "provider": "total_norm", "ms": total_ms},
                {"case": "c", "dtype": "float32", "provider": "naive", "ms": 10 * fh_ms}]
        return {"rows": rows, "goals": [{"goal": "c float32: x read limit (paired)",
                                         "value": 1.0, "met": met}]}

    (s,) = bench_runs.summarize([run(3.0, 9.0, 2.5, True), run(1.0, 4.0, 1.1, False),
                                 run(2.0, 5.0, 1.5, False)])
    assert s["fasthealth_ms"] == {"median": 2.0, "range": [1.0, 3.0], "runs": 3}
    assert s["total_norm_ms"]["median"] == 5.0 and s["total_norm_ms"]["range"] == [4.0, 9.0]
    assert s["x_faster_than_total_norm"]["median"] == 1.5  # never the best run's 2.5
    assert s["x_faster_than_naive"] == {"median": 10.0, "range": [10.0, 10.0], "runs": 3}
    assert "read_limit_ms" not in s  # no such row: no figure
    assert s["goals_met"] == {"c float32: x read limit (paired)": "1/3"}


def test_make_bench_writes_where_git_ignores_it_unless_asked_to_record(tmp_path):
    """`make bench` and `fasthealth bench` leave the tracked bench/results/ alone: their results
    go to build/bench-results/ (git-ignored); `make bench RECORD=1` / `--record` write into
    bench/results/."""
    import shutil
    import subprocess
    import sys

    root = benchmark.ROOT
    assert benchmark.SCRATCH == root / "build" / "bench-results"
    assert benchmark.RECORDED == root / "bench" / "results"
    top = None if shutil.which("git") is None else subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    # A copy of the tree inside another checkout (make cuda-check's build/cuda-check) is read
    # with that checkout's ignore rules, under which all of build/ is ignored.
    if top is None or top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        pytest.skip("not the top level of a git checkout")

    def ignored(path):
        return subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(path)]
                              ).returncode == 0

    assert ignored(benchmark.SCRATCH / "cpu.json") and ignored(benchmark.SCRATCH / "cpu.png")
    assert not ignored(benchmark.RECORDED / "cpu.json")
    if shutil.which("make") is not None:  # the recipe as make would run it (-n: not run)
        def harness_line(*args):
            out = subprocess.run(["make", "-n", "-C", str(root), "bench", *args],
                                 capture_output=True, text=True)
            return next(s for s in out.stdout.splitlines() if "bench/harness.py" in s).split()

        assert harness_line()[-1] == "bench/harness.py"  # no --out: the harness's default
        assert harness_line("RECORD=1")[-2:] == ["bench/harness.py", "--record"]
    with pytest.raises(SystemExit):  # both: refused
        benchmark.main(["--record", "--out", str(tmp_path)])
    out = subprocess.run([sys.executable, "-m", "fasthealth", "bench", "--help"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and "build/bench-results" in " ".join(out.stdout.split())
    assert not list(tmp_path.iterdir())
