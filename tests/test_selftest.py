"""`fasthealth selftest` without a GPU: it says so and exits 0; its record and the automatic
choice it feeds; its battery and tolerance check, run here on the compiled CPU kernel."""

import math
import subprocess
import sys

import pytest
import torch

import fasthealth as fh
from fasthealth import selftest
from fasthealth.ops import validation


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_says_so_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "fasthealth", "selftest"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "no CUDA device" in out.stdout


def test_record_keeps_the_passed_backends_fastest_first(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    t = {"gpt2-small bfloat16": {}}
    results = {
        "cuda": {"passed": True, "timings": {"gpt2-small bfloat16": {"cuda": 2.0}}},
        "triton": {"passed": True, "timings": {"gpt2-small bfloat16": {"triton": 1.5}}},
    }
    validation.write_record("H200|sm90|driver 1|torch x|triton y|fasthealth z", results)
    assert validation.validated("H200|sm90|driver 1|torch x|triton y|fasthealth z") == [
        "triton", "cuda"]
    assert validation.validated("H100|sm90|driver 1|torch x|triton y|fasthealth z") == []
    results["triton"] = {"passed": False, "timings": t, "failures": ["norm: 0 vs 1"]}
    validation.write_record("H200|sm90|driver 1|torch x|triton y|fasthealth z", results)
    assert validation.validated("H200|sm90|driver 1|torch x|triton y|fasthealth z") == ["cuda"]
    assert (tmp_path / "fasthealth" / "selftest.json").exists()


def test_battery_and_tolerances_on_the_cpu_kernel():
    if "cpu" not in fh.available_backends():
        pytest.skip(f"needs the compiled CPU kernel ({fh.ops.compiled.load_error})")
    ts = selftest.battery()
    for rng, target in (((math.inf, 0.0), None), ((65504.0, 6.103515625e-05), torch.float16)):
        raw = fh.multi_tensor_stats(ts, backend="cpu", range_dtype=target).raw
        bad = {i: selftest.compare(raw[i], t, rng) for i, t in enumerate(ts)}
        assert not any(bad.values()), {i: b for i, b in bad.items() if b}
    # a wrong answer is caught
    wrong = raw[5].clone()
    wrong[fh.ops.layout.COL["norm"]] *= 1.001
    assert any("norm" in b for b in selftest.compare(wrong, ts[5], rng))
