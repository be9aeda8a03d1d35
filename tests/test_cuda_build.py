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
        assert any("merge_finalize_cuda" in f for f in names)


def test_no_register_spills():
    spills = {k: v for k, v in resource_usage().items() if v.get("LOCAL", 0) or v.get("STACK", 0)}
    assert not spills, spills


def _sass() -> str:
    return subprocess.run([_cuobjdump(), "-sass", "-arch", "sm_90", C.__file__],
                          capture_output=True, text=True, check=True).stdout


def loads_in_flight(sass: str) -> dict[str, list[int]]:
    """For each chunk kernel, for each four-load iteration of its main loops (a 16-byte load
    at [R.64] followed by ones at +0x1000, +0x2000 and +0x3000 from the same address register:
    256 threads x 16 bytes apart), how many of the four are issued before the first one's
    registers are read or written again."""
    out: dict[str, list[int]] = {}
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n", 1)[0].strip()
        if "chunk_stats_cuda" not in name:
            continue
        ins = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line.split(";")[0]).strip()
               for line in func.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
        groups = []
        for i, line in enumerate(ins):
            m = re.match(r"(@!?P\d )?LDG\.E\.128\.CONSTANT R(\d+), desc\[\w+\]\[(R\d+)\.64\]$",
                         line)
            if not m:
                continue
            base, window = m.group(3), ins[i + 1:i + 600]
            if not any(f"[{base}.64+0x3000]" in w for w in window):
                continue  # a single load (a loop's remainder), not an iteration of four
            first = {f"R{int(m.group(2)) + k}" for k in range(4)}
            n = 1
            for w in window:
                if re.search(rf"LDG\.E\.128\.CONSTANT R\d+, desc\[\w+\]\[{base}\.64\+0x[123]000\]",
                             w):
                    n += 1
                    if n == 4:
                        break
                elif first & set(re.findall(r"R\d+", w)):
                    break
            groups.append(n)
        out[name] = groups
    return out


def test_loads_of_an_iteration_are_in_flight_before_the_first_use():
    """issue 33 item 1, as far as it holds: the main loops (float32, bfloat16, float16; plain,
    shifted and masked passes) issue at least three of an iteration's four 16-byte loads
    before using the first, in both instantiations, on sm_90. Before the masked (NaN/Inf)
    passes were added every iteration had all four in flight; with them ptxas (nvcc 13.0)
    keeps four in about half of the loops (9 of 17, 10 of 18) and three in the rest, with or
    without a register cap: item 1's "every load in flight" is not met yet. The bounds below
    keep it from getting worse."""
    groups = loads_in_flight(_sass())
    assert len(groups) == 2, list(groups)
    for name, g in groups.items():
        assert len(g) >= 6, (name, g)  # three element types, plain and shifted, and masked
        assert min(g) >= 3, (name, g)
        assert sum(n == 4 for n in g) >= len(g) // 2, (name, g)
