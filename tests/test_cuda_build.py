"""The built CUDA kernels' machine code, read with cuobjdump (no GPU needed): `make cuda-check`
runs this in its CUDA build of the extension; elsewhere it skips (no CUDA kernels built).

Checks: machine code for sm_90 (and sm_80 when TORCH_CUDA_ARCH_LIST asks for it), both
instantiations of the chunk kernel (with and without range counts), and no kernel spilling
registers to local memory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import fasthealth as fh

C = fh.ops.compiled.C
pytestmark = pytest.mark.skipif(C is None or not getattr(C, "with_cuda", False),
                                reason="the extension was built without CUDA kernels")


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    try:  # torch's CUDA wheels bring Triton, which bundles cuobjdump
        import triton

        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                               "cuobjdump")
        if os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    pytest.skip("no cuobjdump found")


def resource_usage() -> dict[tuple[str, str], dict[str, int]]:
    """{(arch, kernel name): {"REG": .., "LOCAL": .., ...}} of fasthealth's kernels."""
    out = subprocess.run([_cuobjdump(), "--dump-resource-usage", C.__file__],
                         capture_output=True, text=True, check=True).stdout
    usage, arch, func = {}, None, None
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("arch = "):
            arch = line.split("=")[1].strip()
        elif line.startswith("Function "):
            func = line[len("Function "):].rstrip(":")
        elif line.startswith("REG:") and func and "fasthealth" in func:
            usage[(arch, func)] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    return usage


def test_kernels_are_built_for_the_asked_architectures():
    usage = resource_usage()
    archs = {a for a, _ in usage}
    want = {"sm_90"}
    if "8.0" in os.environ.get("TORCH_CUDA_ARCH_LIST", ""):
        want.add("sm_80")
    assert want <= archs, archs
    for arch in want:
        names = [f for a, f in usage if a == arch]
        assert sum("chunk_stats_cuda" in f for f in names) == 2, names  # with/without range
        assert any("merge_chunks_cuda" in f for f in names)
        assert any("finalize_cuda" in f for f in names)


def test_no_register_spills():
    spills = {k: v for k, v in resource_usage().items() if v.get("LOCAL", 0) or v.get("STACK", 0)}
    assert not spills, spills
