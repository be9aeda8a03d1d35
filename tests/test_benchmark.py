"""`fasthealth bench --quick`: it runs, and its JSON holds the roofline the goals are read
against (the split of fasthealth's time adds up, every goal says what bounds it)."""

import json

import harness as benchmark
import pytest

import fasthealth as fh


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
