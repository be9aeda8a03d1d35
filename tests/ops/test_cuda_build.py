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


LOAD = re.compile(r"(?:@!?P\d )?LDG\.E\.128\.CONSTANT R(\d+), desc\[\w+\]\[(R\d+)\.64"
                  r"(?:\+0x([0-9a-f]+))?\]$")


def _loaded(line: str) -> set[str]:
    """The four registers a 16-byte load writes."""
    m = LOAD.match(line)
    assert m is not None
    return {f"R{int(m.group(1)) + k}" for k in range(4)}


def loads_in_flight(sass: str) -> dict[str, list[int]]:
    """For each chunk kernel, for each four-load iteration of its main loops (16-byte loads at
    [R.64], +0x1000, +0x2000 and +0x3000 from the same address register, 256 threads x 16
    bytes apart, in whatever order ptxas issues them), how many are issued before the
    registers of one already issued are read or written."""
    out: dict[str, list[int]] = {}
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n", 1)[0].strip()
        if "chunk_stats_cuda" not in name:
            continue
        ins = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line.split(";")[0]).strip()
               for line in func.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
        pending: dict[str, dict[int, int]] = {}  # address register -> offset -> instruction
        groups = []
        for i, line in enumerate(ins):
            m = LOAD.match(line)
            off = int(m.group(3) or "0", 16) if m else -1
            if m is None or off not in (0, 0x1000, 0x2000, 0x3000):
                continue
            seen = pending.setdefault(m.group(2), {})
            if off in seen or (seen and i - min(seen.values()) > 600):
                seen.clear()  # a loop's single-load remainder, or another loop
            seen[off] = i
            if len(seen) < 4:
                continue
            first, *rest = sorted(seen.values())
            seen.clear()
            live, n = _loaded(ins[first]), 1
            for j in range(first + 1, rest[-1] + 1):
                if j in rest:
                    n += 1
                    live |= _loaded(ins[j])
                elif live & set(re.findall(r"R\d+", ins[j])):
                    break
            groups.append(n)
        out[name] = groups
    return out


def test_loads_of_an_iteration_are_in_flight_before_the_first_use():
    """Every main loop (float32, bfloat16, float16; plain, shifted and masked
    passes) issues all four of an iteration's 16-byte loads before using any of them, in both
    instantiations, on sm_90. Without thread_sums' opaque dependency ptxas (nvcc 13.0) sank the
    fourth load past the first one's use in about half of the loops (9 of 17 and 10 of 18 kept
    four): two memory latencies an iteration."""
    groups = loads_in_flight(_sass())
    assert len(groups) == 2, list(groups)
    for name, g in groups.items():
        assert len(g) >= 6, (name, g)  # three element types, plain and shifted, and masked
        assert all(n == 4 for n in g), (name, g)


def test_main_loops_stay_under_the_issue_limit():
    """Per element, the fast loops stay under what an H200 can issue while it
    streams at its memory limit (~3.3e13 thread instructions a second over ~2.4e12 bfloat16
    elements: 14 an element, 28 a float32 one), and each masked loop (chunks holding NaN/Inf)
    costs at most 2.5x the dearest fast loop of its instantiation, element type for element
    type. Read from the sm_90 machine code with tests/sass_loops.py, which records the table
    in bench/results/cuda_sass.json (nvcc 13.0: fast 8.0 to 12.0 instructions a bfloat16
    element, masked 14.4 to 18.4)."""
    import sass_loops

    funcs = sass_loops.cuda_functions(C.__file__, cuobjdump=_cuobjdump())
    assert set(funcs) == {"plain", "range"}, list(funcs)
    for kind, sass in funcs.items():
        rows = sass_loops.cuda_loops(sass)
        for dtype, size in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
            fast = [r["per_element"] for r in rows if r["dtype"] == dtype and not r["masked"]]
            masked = [r["per_element"] for r in rows if r["dtype"] == dtype and r["masked"]]
            assert len(fast) >= 2 and len(masked) >= 2, (kind, dtype, rows)  # plain, shifted
            assert max(fast) <= 14 * size / 2, (kind, dtype, fast)
            assert max(masked) <= 2.5 * max(fast), (kind, dtype, masked, fast)
