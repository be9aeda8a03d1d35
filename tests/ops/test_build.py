"""setup.py's handling of CUDA toolkits that cannot build: the install never fails for them, it
builds the CPU kernels alone with a warning (unless FASTHEALTH_FORCE_CUDA=1)."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def setup_module_functions() -> dict:
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")


def fake_toolkit(root: Path, runtime: bool) -> Path:
    """An nvcc that reports CUDA 13.0 and compiles nothing; with ``runtime``, the header and
    library a real toolkit has (empty files)."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    major = (torch.version.cuda or "13.0").split(".")[0]
    nvcc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then\n"
                    f"  echo 'Cuda compilation tools, release {major}.0, V{major}.0.0'\n"
                    "  exit 0\nfi\necho 'nvcc: fatal: this toolkit is broken' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    if runtime:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
        (root / "lib64").mkdir()
        (root / "lib64" / "libcudart.so").write_text("")
    return root


def test_partial_toolkit_is_named(tmp_path):
    problems = setup_module_functions()["cuda_toolkit_problems"]
    bare = fake_toolkit(tmp_path / "bare", runtime=False)
    found = problems(str(bare))
    assert any("cuda_runtime.h" in p for p in found) and any("libcudart" in p for p in found)
    assert problems(str(fake_toolkit(tmp_path / "full", runtime=True))) == []


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (make "
                    "cuda-check's environment) for setup.py to try the CUDA kernels")
def test_broken_cuda_toolkit_builds_the_cpu_kernels(tmp_path):
    tree = tmp_path / "tree"  # the sources, without builds or environments
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        "build", ".venv*", ".git", "__pycache__", "*.so", "*.egg-info", ".hypothesis",
        ".pytest_cache", "results"))
    toolkit = fake_toolkit(tmp_path / "cuda", runtime=True)
    env = {k: v for k, v in os.environ.items() if k != "FASTHEALTH_FORCE_CUDA"}
    env.update(CUDA_HOME=str(toolkit), PATH=f"{toolkit / 'bin'}:{env['PATH']}",
               TORCH_CUDA_ARCH_LIST="9.0", MAX_JOBS="2")
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation",
                          "--no-deps", "--target", str(target), str(tree)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "nvcc cannot build a small CUDA program" in out.stdout + out.stderr
    check = subprocess.run([sys.executable, "-c", "import fasthealth as fh; "
                            "print(fh.ops.compiled.C.with_cuda, fh.ops.compiled.C.cpu_isa())"],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={**env, "PYTHONPATH": str(target)})
    assert check.stdout.split()[0] == "False", check.stdout + check.stderr


def test_the_build_says_what_it_compiles_and_that_it_takes_minutes(capsys):
    """The few minutes of compiling start with a line naming the kernels and their sources."""
    f = setup_module_functions()
    ext = f["_cpu_extension"]()
    line = f["announce"](ext)
    assert line in capsys.readouterr().err
    assert "compiling the CPU kernels" in line and "a few minutes" in line
    assert all(Path(s).name in line for s in ext.sources) and f"{len(ext.sources)} sources" in line
