"""The prebuilt extension's manifest and check (bench/prebuilt.py), without building anything:
a fake library in a small tree. bench/gpu_check.sh loads a prebuilt only when `check` passes,
so each reason to refuse one is tested here; the dry runs of the script with a prebuilt are in
bench/tests/test_gpu_check.py."""

import glob
import json
import sysconfig
from pathlib import Path

import prebuilt
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = {"version": torch.__version__, "cuda": torch.version.cuda}


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "tree"
    (root / "csrc" / "cuda").mkdir(parents=True)
    (root / "setup.py").write_text("setup()\n")
    (root / "csrc" / "stats.h").write_text("struct Partial {};\n")
    (root / "csrc" / "cuda" / "k.cu").write_text("__global__ void k() {}\n")
    (root / "csrc" / "cuda" / "k.o").write_bytes(b"an object file, not a source")
    return root


@pytest.fixture
def built(tmp_path, tree):
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    (folder / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"not a library")
    prebuilt.write_manifest(folder, tree, "9.0")
    return folder


def edit(folder, change):
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def test_the_sources_are_what_setup_py_compiles_and_nothing_built():
    files = prebuilt.source_files(ROOT)
    compiled = (glob.glob("csrc/**/*.cpp", root_dir=ROOT, recursive=True)
                + glob.glob("csrc/**/*.cu", root_dir=ROOT, recursive=True)
                + glob.glob("csrc/**/*.h", root_dir=ROOT, recursive=True)
                + glob.glob("csrc/**/*.cuh", root_dir=ROOT, recursive=True))
    assert compiled and set(compiled) <= set(files) and "setup.py" in files
    assert not [f for f in files if f.endswith((".o", ".so", ".pyc"))]


def test_a_fresh_manifest_passes_and_says_what_it_was_built_for(built, tree):
    m = json.loads((built / "manifest.json").read_text())
    assert m["python"]["ext_suffix"] == sysconfig.get_config_var("EXT_SUFFIX")
    assert (m["torch"], m["cuda"], m["arch_list"]) == (HERE["version"], HERE["cuda"], "9.0")
    assert sorted(m["sources"]["files"]) == ["csrc/cuda/k.cu", "csrc/stats.h", "setup.py"]
    assert prebuilt.problems(built, tree, "9.0") == []
    assert prebuilt.main(["check", str(built), "--root", str(tree), "--arch", "9.0"]) == 0


@pytest.mark.parametrize("how, reason", [
    (lambda t: (t / "csrc" / "stats.h").write_text("struct Partial { int n; };\n"),
     "the sources changed since the build: csrc/stats.h (changed)"),
    (lambda t: (t / "csrc" / "cuda" / "more.cuh").write_text("// new\n"),
     "the sources changed since the build: csrc/cuda/more.cuh (new)"),
    (lambda t: (t / "csrc" / "cuda" / "k.cu").unlink(),
     "the sources changed since the build: csrc/cuda/k.cu (gone)"),
    (lambda t: (t / "setup.py").write_text("setup(ext_modules=[])\n"),
     "the sources changed since the build: setup.py (changed)"),
])
def test_changed_sources_refuse_it_naming_the_file(built, tree, how, reason):
    how(tree)
    assert prebuilt.problems(built, tree, "9.0", HERE) == [reason]


def test_build_outputs_in_the_tree_do_not_make_it_stale(built, tree):
    (tree / "csrc" / "cpu.o").write_bytes(b"x")
    (tree / "csrc" / "_C.so").write_bytes(b"x")
    assert prebuilt.problems(built, tree, "9.0", HERE) == []


@pytest.mark.parametrize("torch_here, reason", [
    ({"version": "2.99.0+cu130", "cuda": "13.0"}, "built against torch "),
    ({"version": HERE["version"], "cuda": "99.9"}, "(CUDA 99.9)"),
    ({"error": "torch does not import (ImportError: x)"}, "torch does not import"),
])
def test_another_torch_refuses_it(built, tree, torch_here, reason):
    why = prebuilt.problems(built, tree, "9.0", torch_here)
    assert len(why) == 1 and reason in why[0], why


def test_the_same_torch_release_and_cuda_with_another_local_tag_pass(built, tree):
    release = HERE["version"].split("+")[0]
    assert prebuilt.problems(built, tree, "9.0", {"version": release + "+other",
                                                  "cuda": HERE["cuda"]}) == []


def test_another_python_refuses_it(built, tree):
    edit(built, lambda m: m["python"].update(version="3.99.0",
                                             ext_suffix=".cpython-399-x86_64-linux-gnu.so"))
    why = prebuilt.problems(built, tree, "9.0", HERE)
    assert len(why) == 1 and why[0].startswith("built for Python 3.99.0"), why


def test_an_architecture_it_lacks_refuses_it(built, tree):
    assert prebuilt.problems(built, tree, "8.0;9.0", HERE) == [
        "built for TORCH_CUDA_ARCH_LIST=9.0, not for 8.0"]
    assert prebuilt.problems(built, tree, "", HERE) == []


def test_a_library_other_than_the_manifests_refuses_it(built, tree):
    lib = next(built.glob("_C.*.so"))
    lib.write_bytes(b"another library")
    assert prebuilt.problems(built, tree, "9.0", HERE) == [
        f"{lib.name} is not the library the manifest describes (sha256 differs)"]
    lib.unlink()
    assert "is not in" in prebuilt.problems(built, tree, "9.0", HERE)[0]


def test_a_second_library_or_no_manifest_refuses_it(built, tree, capsys):
    (built / "_C.cpython-399-x86_64-linux-gnu.so").write_bytes(b"x")
    assert prebuilt.problems(built, tree, "9.0", HERE)[0].startswith("more than one library")
    (built / "manifest.json").unlink()
    assert prebuilt.problems(built, tree, "9.0", HERE)[0].startswith("no readable manifest")
    assert prebuilt.main(["check", str(built), "--root", str(tree)]) == 1
    assert "prebuilt refused: no readable manifest" in capsys.readouterr().out


def test_write_manifest_wants_exactly_one_library(tmp_path, tree):
    with pytest.raises(SystemExit, match="expected one _C"):
        prebuilt.write_manifest(tmp_path, tree, "9.0")
