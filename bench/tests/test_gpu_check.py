"""The device script (bench/gpu_check.sh) dry-run here, without a GPU: whichever step fails,
hangs or finds no time left, a results file comes back with every case that ran and every
step's status; a prebuilt extension (make gpu-prebuilt) is used when its manifest matches and
refused, with the build run instead, when it does not. Also the per-test limit plugin
(tests/per_test_limit.py) and the results file's merges (bench/gpu_results.py).

The dry run (FASTHEALTH_GPU_DRY=1) builds nothing, assumes both GPU backends, benchmarks with
fake timings (bench_gpu.py --fake: the same case loop and writes), records a fake rollback
cost (bench_rollback.py --fake) and runs the GPU tests for real (they skip themselves without
CUDA). Each dry run is marked ``device_script``
(``make test-eval`` runs them, ``make test`` and ``make test-fast`` not): the matrix of forced
failures and hangs takes 6-8 minutes on 2 cores.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import gpu_results
import prebuilt
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ["env", "build-cuda", "backends", "bench-cuda", "bench-triton", "selftest", "tests",
         "rollback", "finish"]
FUSED_ROWS = 2 + 7  # cuda, triton and the baselines (bench_gpu.BASELINES)
N_CASES = 13  # bench_gpu.cases(False): 8 healthy, 5 holding NaN/Inf

QUICK_TESTS = """
def test_on_cuda_ok():
    pass


def test_on_triton_ok():
    pass
"""

HUNG_TESTS = """
import signal
import time


def test_1_ok():
    pass


def test_2_slow():
    time.sleep(30)


def test_3_stuck_in_c():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as a hung kernel would
    time.sleep(60)


def test_4_after_the_stuck_one():
    pass
"""


CARD = "dry-card"  # the results file's stem in the dry runs (FASTHEALTH_GPU_CARD)


def test_a_results_file_is_named_after_its_card():
    assert gpu_results.card_slug("NVIDIA H200") == "h200"
    assert gpu_results.card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_results.card_slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert gpu_results.card_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert gpu_results.card_slug("") == "gpu"


@pytest.mark.device_script
def test_without_a_card_name_given_the_file_is_named_by_nvidia_smi(tmp_path):
    p, out, doc = dry_run(tmp_path, FASTHEALTH_GPU_CARD="", FORCE_FAIL="bench-cuda")
    assert (out / f"{gpu_results.card()}.json").exists()


def dry_run(tmp_path, test_files=None, **env):
    out = tmp_path / "out"
    if test_files is None:
        test_files = tmp_path / "test_quick.py"
        test_files.write_text(QUICK_TESTS)
    # no prebuilt unless a test makes one, and never one copied into the tree's fasthealth/
    full = {**os.environ, "OUT": str(out), "FASTHEALTH_GPU_DRY": "1", "PYTHON": sys.executable,
            "FASTHEALTH_GPU_TEST_FILES": str(test_files), "FASTHEALTH_BENCH_FAKE_SLEEP": "0.05",
            "FASTHEALTH_PREBUILT": str(tmp_path / "no-prebuilt"),
            "FASTHEALTH_PREBUILT_PKG": str(tmp_path / "pkg"), "FASTHEALTH_GPU_CARD": CARD,
            **env}
    full.pop("FASTHEALTH_GPU_COPY", None)
    p = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True,
                       text=True, timeout=300)
    name = full["FASTHEALTH_GPU_CARD"] or gpu_results.card()
    assert (out / f"{name}.json").exists(), p.stdout + p.stderr
    doc = json.loads((out / f"{name}.json").read_text())
    return p, out, doc


def steps(doc, built_here=True):
    """name: status; the prebuilt step, absent in most dry runs, is checked and left out."""
    got = {s["name"]: s["status"] for s in doc["steps"]}
    if built_here and got.get("prebuilt") == "not run":
        del got["prebuilt"]
    return got


def written(out):
    """(case, dtype) the benchmark said it wrote, per bench step, from bench.txt."""
    got, step = {}, None
    for line in (out / "bench.txt").read_text().splitlines():
        if m := re.match(r"== (bench-\w+) ", line):
            step = m.group(1)
        elif m := re.match(r"wrote (\S+) (\S+) ", line):
            got.setdefault(step, set()).add((m.group(1), m.group(2)))
    return got


def assert_fake_rollback(doc, out):
    """The rollback step's record, in the card's results file and as its own file: the dry
    run's fake one, with the GPU fields."""
    own = json.loads((out / "rollback.json").read_text())
    assert doc["rollback"] == own and own["fake"] is True and own["device"] == "cuda"
    assert own["snapshot_overlap_s"] > 0 and set(own["share_of_training"]) == {"100", "500"}


def cases_of(doc, provider):
    return {(r["case"], r["dtype"]) for r in doc["rows"] if r["provider"] == provider}


def assert_every_written_case_is_there(doc, wrote):
    """What each benchmark process said it wrote, and nothing else, is in the file."""
    assert {(r["case"], r["dtype"]) for r in doc["rows"]} == set().union(*wrote.values())
    for b in ("cuda", "triton"):
        if f"bench-{b}" in wrote and b in {r["provider"] for r in doc["rows"]}:
            assert cases_of(doc, b) == wrote[f"bench-{b}"]


@pytest.mark.device_script
def test_dry_run_every_step_ok(tmp_path):
    copy = ROOT / "bench" / "results" / f"{CARD}.json"
    before = copy.stat().st_mtime_ns if copy.exists() else None
    p, out, doc = dry_run(tmp_path, test_files="tests/ops/test_gpu.py")
    assert p.returncode == 0, p.stdout
    assert (copy.stat().st_mtime_ns if copy.exists() else None) == before  # no copy: dry
    assert steps(doc) == dict.fromkeys(STEPS, "ok")
    assert {"name": "prebuilt", "status": "not run", "seconds": 0, "limit": 0, "rc": 0,
            "note": f"(no prebuilt library in {tmp_path / 'no-prebuilt'}: building here)"} \
        in doc["steps"]
    assert "prebuilt" not in doc and "dry run: no build" in (out / "build.txt").read_text()
    assert len(doc["rows"]) == N_CASES * FUSED_ROWS and all(r["fake"] for r in doc["rows"])
    assert cases_of(doc, "cuda") == cases_of(doc, "read_sum") == written(out)["bench-cuda"]
    assert cases_of(doc, "triton") == written(out)["bench-triton"]
    assert doc["selftest"] == {"key": "dry run", "results": {}}
    assert_fake_rollback(doc, out)
    assert "bench_rollback.py --device cuda --repeats 3" in (out / "rollback.txt").read_text()
    assert doc["run"]["dry_run"] and doc["goals"] and (out / f"{CARD}.png").exists()
    assert sorted(f.name for f in out.iterdir()) == sorted([
        "bench.txt", "build.txt", "env.txt", f"{CARD}.json", f"{CARD}.png", "rollback.json",
        "rollback.txt", "selftest.txt", "summary.txt", "tests.txt"])
    tests = (out / "tests.txt").read_text()
    # one process per backend; tests/ops/test_gpu.py skips itself here, with its reason
    assert "== tests, backend cuda, process 1" in tests
    assert "== tests, backend triton, process 1" in tests
    assert "needs a CUDA device" in tests and " deselected" in tests


@pytest.mark.device_script
@pytest.mark.parametrize("step", STEPS)
def test_dry_run_with_a_step_forced_to_fail(tmp_path, step):
    p, out, doc = dry_run(tmp_path, FORCE_FAIL=step)
    assert p.returncode == 1
    got = steps(doc)
    assert got[step] == "FAILED", got
    assert all(s == "ok" for n, s in got.items() if n != step), got
    wrote = written(out)
    assert_every_written_case_is_there(doc, wrote)
    if step == "build-cuda":
        assert got["build-cpu"] == "ok"
    if step == "rollback":  # no record of its own: the section says it is missing
        assert "missing" in doc["rollback"] and not (out / "rollback.json").exists()
    else:
        assert_fake_rollback(doc, out)
    if step == "backends":  # no GPU backend found: the baselines alone, the tests of neither
        assert {r["provider"] for r in doc["rows"]} == {
            "foreach_norm", "total_norm_isfinite", "clip_grad_norm", "foreach_isfinite",
            "naive", "read_sum", "copy"}
        assert "selftest" not in got and "backend none" in (out / "tests.txt").read_text()
    elif step == "bench-cuda":  # the next benchmark process times the baselines instead
        assert cases_of(doc, "read_sum") == wrote["bench-triton"]
        assert len(wrote["bench-triton"]) == N_CASES and not cases_of(doc, "cuda")
    elif step == "bench-triton":
        assert not cases_of(doc, "triton") and len(doc["rows"]) == N_CASES * (FUSED_ROWS - 1)
    elif step == "selftest":
        assert "missing" in doc["selftest"]
    elif step == "finish":
        assert not (out / f"{CARD}.png").exists()
    else:
        assert len(doc["rows"]) == N_CASES * FUSED_ROWS


@pytest.mark.device_script
@pytest.mark.parametrize("step", ["build-cuda", "bench-cuda", "tests", "finish"])
def test_dry_run_with_a_step_hanging_to_its_limit(tmp_path, step):
    p, out, doc = dry_run(tmp_path, FORCE_HANG=step, FASTHEALTH_GPU_LIMITS=f"{step}=4")
    got = steps(doc)
    assert p.returncode == 1 and got[step] == "TIMED OUT", got
    assert all(s == "ok" for n, s in got.items() if n != step), got
    assert_every_written_case_is_there(doc, written(out))


@pytest.mark.device_script
def test_dry_run_benchmark_cut_mid_way_keeps_the_cases_it_wrote(tmp_path):
    # 2 s a case, stopped after 15 s (a few of them starting Python): some cases written
    p, out, doc = dry_run(tmp_path, FASTHEALTH_BENCH_FAKE_SLEEP="2",
                          FASTHEALTH_GPU_LIMITS="bench-cuda=15")
    wrote = written(out)
    assert steps(doc)["bench-cuda"] == "TIMED OUT"
    assert 0 < len(wrote["bench-cuda"]) < 8
    assert cases_of(doc, "cuda") == wrote["bench-cuda"]
    assert cases_of(doc, "read_sum") == wrote["bench-triton"]  # baselines timed again there


@pytest.mark.device_script
def test_dry_run_with_no_time_left_still_writes_the_file(tmp_path):
    # a 35 s budget: less than the steps after each need, so all are skipped but the last
    p, out, doc = dry_run(tmp_path, DEADLINE="35")
    got = steps(doc)
    assert got.pop("finish") == "ok"
    assert set(got.values()) == {"SKIPPED"} and doc["rows"] == []
    assert "missing" in doc["rollback"] and not (out / "rollback.json").exists()
    assert "SKIPPED" in (out / "summary.txt").read_text()


@pytest.mark.device_script
def test_dry_run_a_hung_test_fails_alone_and_the_rest_run(tmp_path):
    f = tmp_path / "test_hang.py"
    f.write_text(HUNG_TESTS)
    p, out, doc = dry_run(tmp_path, test_files=f, FASTHEALTH_GPU_DRY_BACKENDS="cuda",
                          FASTHEALTH_TEST_TIMEOUT="1", FASTHEALTH_TEST_GRACE="1",
                          FORCE_FAIL="env,bench-cuda,finish")  # not needed here: quicker
    tests = (out / "tests.txt").read_text()
    assert "test_2_slow FAILED" in tests and "per-test limit of 1 s" in tests
    assert "test_3_stuck_in_c did not end" in tests and "in test_3_stuck_in_c" in tests
    assert "== tests, backend cuda, process 2" in tests
    assert "test_4_after_the_stuck_one PASSED" in tests and "3 deselected" in tests
    assert "did not end" in (out / "summary.txt").read_text()
    assert steps(doc)["tests"] == "FAILED"


# ---- the prebuilt extension (make gpu-prebuilt, bench/prebuilt.py) -------------------------

# what the prebuilt's folder holds while the tests step runs, i.e. after the build steps
LISTING_TEST = """
import os


def test_list_the_prebuilt_folder():
    pkg = os.environ["FASTHEALTH_PREBUILT_PKG"]
    names = sorted(os.listdir(pkg)) if os.path.isdir(pkg) else []
    with open(os.environ["LISTING"], "w") as f:
        f.write(" ".join(names))


def test_on_triton_ok():  # the triton process's own test
    pass
"""


def fake_prebuilt(tmp_path):
    """A prebuilt folder whose manifest matches this tree, Python and torch (its library is
    not one: the dry run fakes the import test), and a library already in the package folder,
    as an earlier build leaves it."""
    folder, pkg = tmp_path / "prebuilt", tmp_path / "pkg"
    folder.mkdir()
    pkg.mkdir()
    name = "_C" + sysconfig.get_config_var("EXT_SUFFIX")
    (folder / name).write_bytes(b"the prebuilt library")
    (pkg / name).write_bytes(b"an earlier build")
    prebuilt.write_manifest(folder, ROOT, "9.0")
    return folder, pkg, name


def prebuilt_dry_run(tmp_path, change=None, **env):
    """A dry run with fake_prebuilt (its manifest edited by ``change``), the tests step
    listing the package folder; checks that the tree is untouched and the folder as it was."""
    folder, pkg, name = fake_prebuilt(tmp_path)
    if change:
        m = json.loads((folder / "manifest.json").read_text())
        change(m)
        (folder / "manifest.json").write_text(json.dumps(m))
    tests = tmp_path / "test_listing.py"
    tests.write_text(LISTING_TEST)
    before = sorted(os.listdir(ROOT / "fasthealth"))
    p, out, doc = dry_run(tmp_path, test_files=tests, FASTHEALTH_PREBUILT=str(folder),
                          LISTING=str(tmp_path / "listing"), **env)
    assert sorted(os.listdir(ROOT / "fasthealth")) == before  # nothing copied into the tree
    # a dry run takes out what it copied and puts back the library it moved aside
    assert os.listdir(pkg) == [name] and (pkg / name).read_bytes() == b"an earlier build"
    during = (tmp_path / "listing").read_text().split()
    return p, out, doc, during, name


def notes(doc):
    return {s["name"]: s.get("note") for s in doc["steps"]}


@pytest.mark.device_script
def test_dry_run_a_prebuilt_that_loads_replaces_the_build(tmp_path):
    p, out, doc, during, name = prebuilt_dry_run(tmp_path)
    assert p.returncode == 0, p.stdout
    assert steps(doc, built_here=False) == {
        **dict.fromkeys(STEPS, "ok"), "prebuilt": "ok", "build-cuda": "not run"}
    assert notes(doc)["build-cuda"] == "(the prebuilt loaded)"
    assert during == [name, "triton_kernels"]  # copied, and linked as install() does
    assert doc["prebuilt"] == json.loads((tmp_path / "prebuilt" / "manifest.json").read_text())
    build = (out / "build.txt").read_text()
    assert "matches this tree, Python and torch" in build and "dry run: no build" not in build
    assert "build-cuda: not run (the prebuilt loaded)" in (out / "summary.txt").read_text()


@pytest.mark.device_script
def test_dry_run_a_stale_prebuilt_is_refused_and_the_build_runs(tmp_path):
    def stale(m):  # built from another csrc/stats.h
        m["sources"]["files"]["csrc/stats.h"] = "0" * 64
        m["sources"]["sha256"] = "0" * 64
    p, out, doc, during, name = prebuilt_dry_run(tmp_path, change=stale)
    assert p.returncode == 1  # the prebuilt failed; everything else ran
    assert steps(doc) == {**dict.fromkeys(STEPS, "ok"), "prebuilt": "FAILED"}
    assert notes(doc)["prebuilt"] == \
        "(the sources changed since the build: csrc/stats.h (changed))"
    assert during == [name]  # the earlier build's library, untouched (nothing was copied)
    assert "prebuilt" not in doc and "dry run: no build" in (out / "build.txt").read_text()
    assert "the prebuilt was not used: building here" in (out / "summary.txt").read_text()


@pytest.mark.device_script
@pytest.mark.parametrize("how", ["does not load", "FORCE_FAIL", "FORCE_HANG"])
def test_dry_run_a_prebuilt_that_fails_is_taken_out_and_the_build_runs(tmp_path, how):
    env = {"does not load": {"FASTHEALTH_GPU_DRY_PREBUILT": "fails"},
           "FORCE_FAIL": {"FORCE_FAIL": "prebuilt"},
           "FORCE_HANG": {"FORCE_HANG": "prebuilt", "FASTHEALTH_GPU_LIMITS": "prebuilt=4"}}[how]
    p, out, doc, during, name = prebuilt_dry_run(tmp_path, **env)
    status = "TIMED OUT" if how == "FORCE_HANG" else "FAILED"
    assert p.returncode == 1
    assert steps(doc) == {**dict.fromkeys(STEPS, "ok"), "prebuilt": status}
    # by the tests step its copy is gone and the earlier library is back, then rebuilt
    assert during == [name] and "dry run: no build" in (out / "build.txt").read_text()
    assert "prebuilt" not in doc
    if how == "does not load":
        assert notes(doc)["prebuilt"] == \
            "(does not load: AssertionError: dry run: faked load failure)"


# ---- the results file ----------------------------------------------------------------------

def row(case, dtype, provider, gpu, wall, **kw):
    return {"case": case, "dtype": dtype, "provider": provider, "gpu_ms": gpu, "wall_ms": wall,
            "host_sync": False, **kw}


def test_results_merge_atomically_and_goals_tolerate_partial_rows(tmp_path):
    path, copy = tmp_path / "h.json", tmp_path / "tree" / "h.json"
    gpu_results.update([path, copy], [row("gpt2-small", "bfloat16", "cuda", 1.0, 2.0)],
                       machine={"device": "x"})
    doc = gpu_results.load(path)
    assert doc == gpu_results.load(copy) and doc["machine"] == {"device": "x"}
    by = {g["goal"]: g for g in doc["goals"]}
    share = by["cuda: >= 85% of the read limit, gpt2-small bfloat16 (GPU time)"]
    assert share["met"] is None and share["missing"]  # no read limit yet: not decided
    gpu_results.update([path], [row("gpt2-small", "bfloat16", "read_sum", 0.9, 1.0),
                                row("gpt2-small", "bfloat16", "foreach_norm", 1.5, 1.5),
                                row("gpt2-small", "bfloat16", "naive", None, 150.0),
                                row("gpt2-small", "bfloat16", "cuda", 1.0, 2.0, host_sync=True),
                                {"case": "7b-like", "dtype": "bfloat16", "provider": "cuda",
                                 "error": "OutOfMemoryError"}])
    doc = gpu_results.load(path)
    assert len(doc["rows"]) == 5  # the second cuda row replaced the first
    by = {g["goal"]: g for g in doc["goals"]}
    assert by["cuda: >= 85% of the read limit, gpt2-small bfloat16 (GPU time)"]["value"] == 0.9
    assert by["cuda: faster than torch._foreach_norm in every case (GPU time)"]["met"] is True
    assert by["cuda: faster than torch._foreach_norm in every case (wall time)"]["slower_in"] \
        == ["gpt2-small bfloat16"]
    assert by["cuda: >= 50x faster than the naive loop, gpt2-small bfloat16 (wall time)"][
        "value"] == 75.0
    assert by["cuda: no host sync"]["met"] is False
    assert not list(tmp_path.glob(".*.tmp"))
    path.write_text("{not json")  # a damaged file is started afresh, not a crash
    gpu_results.update([path], [row("a", "b", "cuda", 1.0, 1.0)])
    assert len(gpu_results.load(path)["rows"]) == 1


def test_results_steps_from_the_script(tmp_path):
    tsv = tmp_path / "steps.tsv"
    tsv.write_text("env\tok\t3\t20\t0\nbuild-cuda\tTIMED OUT\t170\t170\t124\n")
    gpu_results.main(["--results", str(tmp_path / "h.json"), "steps", str(tsv),
                      "--deadline", "420", "--elapsed", "180"])
    doc = gpu_results.load(tmp_path / "h.json")
    assert doc["steps"][1] == {"name": "build-cuda", "status": "TIMED OUT", "seconds": 170,
                               "limit": 170, "rc": 124}
    assert doc["run"] == {"deadline_s": 420, "elapsed_s": 180, "dry_run": False}


@pytest.mark.device_script
def test_dry_run_without_a_working_python_still_writes_the_file(tmp_path):
    # every Python step fails and bench/gpu_results.py cannot run: the script writes the
    # steps itself
    p, out, doc = dry_run(tmp_path, PYTHON="false")
    got = steps(doc)
    assert p.returncode == 1 and doc["rows"] == [] and "did not write" in doc["error"]
    assert got["env"] == got["bench-cuda"] == got["tests"] == got["rollback"] == "FAILED"
    assert len(got) == len(STEPS)
    assert doc["steps"][1]["note"].startswith("(no prebuilt library in ")  # the awk's JSON


def test_the_new_baselines_compute_what_they_say():
    import baselines
    import torch

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g).bfloat16() for s in [(50, 20), (20,), (3, 3, 3)]]
    want = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in ts]))
    norms = baselines.foreach_norm(ts)
    assert [n.item() for n in norms] == [torch.linalg.vector_norm(t).item() for t in ts]
    before = [t.clone() for t in ts]
    params = baselines.grad_holders(ts)
    assert [p.grad is t for p, t in zip(params, ts)] == [True] * 3
    assert all(p.shape == t.shape and p.untyped_storage().nbytes() == 2
               for p, t in zip(params, ts))  # one element each, expanded
    total = baselines.clip_grad_norm(params)
    assert total.item() == pytest.approx(want.item(), rel=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(before, ts))  # scaled by exactly 1
    flat = torch.cat([t.flatten() for t in ts])
    out = torch.empty_like(flat)
    assert torch.equal(baselines.copy_limit(flat, out), flat)


def _bench_gpu():
    import importlib
    return importlib.import_module("bench_gpu")  # bench/ is on sys.path (gpu_results above)


@pytest.mark.parametrize("fill", ["nan-one", "nan-all", "inf-mix"])
def test_the_benchmarks_reference_check_passes_exact_tables_and_fails_wrong_ones(fill):
    """bench_gpu's self-check, run on the CPU kernel's tables (the check is device-agnostic):
    the planted gradients hold what their name says, an exact table passes, a table off by
    one count or by 1e-4 in a norm fails."""
    import torch

    import fasthealth as fh
    from fasthealth.ops.layout import COL
    bg = _bench_gpu()
    assert len(bg.cases(False)) == N_CASES
    ts = [bg.plant(torch.randn(s, dtype=torch.bfloat16) * 0.02, fill, i)
          for i, s in enumerate([(300, 7), (4096,), (33,)])]
    bad = [int((~t.isfinite()).sum()) for t in ts]
    if fill == "nan-one":
        assert bad == [1, 1, 1]
    elif fill == "nan-all":
        assert bad == [t.numel() for t in ts]
    else:
        assert all(b == max(1, t.numel() // 100) for b, t in zip(bad, ts))
        assert any(bool(t.isinf().any()) for t in ts)
    table = fh.multi_tensor_stats(ts, backend="cpu").raw
    assert bg.reference_check(table, ts)["ref_ok"]
    off = table.clone()
    off[0, COL["nan_count"]] += 1
    assert bg.reference_check(off, ts)["ref_exact_mismatches"] == 1
    if fill != "nan-all":  # with nothing finite the norms are 0 or NaN: no relative error
        off = table.clone()
        off[-1, COL["finite_norm"]] *= 1 + 1e-4
        assert not bg.reference_check(off, ts)["ref_ok"]


def test_nonfinite_goal_reads_the_faulty_cases_against_the_healthy_ones():
    rows = [{"case": "gpt2-small", "dtype": "bfloat16", "provider": "cuda", "gpu_ms": 1.0,
             "ref_ok": True},
            {"case": "gpt2-small/nan-all", "dtype": "bfloat16", "provider": "cuda",
             "gpu_ms": 2.0, "ref_ok": False}]
    nonfinite = [x for x in gpu_results.goals(rows) if "NaN/Inf" in x["goal"]][0]
    assert nonfinite["met"] is False and nonfinite["value"] == {"gpt2-small/nan-all bfloat16": 0.5}
    ref = [x for x in gpu_results.goals(rows) if "reference" in x["goal"]][0]
    assert ref["met"] is False and ref["in"] == ["gpt2-small/nan-all bfloat16"]
