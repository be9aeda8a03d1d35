"""The Triton kernels compiled for real GPUs, ahead of time, on a machine without one.

Triton's interpreter (tests/ops/test_triton.py) checks the kernels' results but accepts code that
the compiler rejects (a non-constexpr global, a type mismatch between branches), and says
nothing of the machine code. Here each kernel is compiled for sm_90 (H100/H200) and sm_80
(A100) with the installed Triton and ptxas, under the launch's register cap; the checks: it
compiles, it spills no registers to local memory, two programs fit on an SM, and the float
kernels on aligned tensors use 16-byte vector loads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("compiles kernels: run without TRITON_INTERPRET", allow_module_level=True)

import triton.language as tl  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - other Triton layouts
    pytest.skip("this Triton has no ahead-of-time compile API", allow_module_level=True)

from fasthealth.triton_kernels import tensor_stats as ts  # noqa: E402

CHUNK_SIG = {"items64": "*i64", "items32": "*i32", "item_lo": "i32", "item_hi": "i32",
             "part": "*fp64", "thresholds": "*fp64", "done": "*i32"}
CONSTS = ("BLOCK", "DTYPE", "ACC", "FAST", "ALIGNED", "RANGE")
VARIANTS = [  # (DTYPE, ACC, FAST, ALIGNED, RANGE)
    (tl.bfloat16, tl.float32, True, True, False),
    (tl.bfloat16, tl.float32, True, True, True),
    (tl.float32, tl.float32, True, True, False),
    (tl.float16, tl.float32, True, True, True),
    (tl.float32, tl.float32, True, False, False),
    (tl.float64, tl.float64, False, True, False),
    (tl.int32, tl.float64, False, True, True),
    (tl.int8, tl.float32, False, False, False),
]


def _compile(fn, signature, constexprs, arch, num_warps, maxnreg=None):
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    options = {"num_warps": num_warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _resources(cubin: bytes) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    found = re.findall(r"(REG|LOCAL):(\d+)", out)
    assert found, out
    usage: dict[str, int] = {}
    for key, value in found:
        usage[key] = max(usage.get(key, 0), int(value))
    return usage


def _local_bytes(cubin: bytes) -> int:
    return _resources(cubin)["LOCAL"]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_chunk_kernel_compiles(arch, variant):
    dtype, acc, fast, aligned, ranged = variant
    consts = dict(zip(CONSTS, (2048, dtype, acc, fast, aligned, ranged)))
    k = _compile(ts._chunk_stats_kernel, CHUNK_SIG, consts, arch, ts.NUM_WARPS,
                 ts.MAX_REGISTERS)
    usage = _resources(k.asm["cubin"])
    assert usage["LOCAL"] == 0, "register spills"
    # two programs of NUM_WARPS warps fit in an SM's 65536 registers
    assert usage["REG"] <= ts.MAX_REGISTERS, usage
    assert 2 * ts.MAX_REGISTERS * 32 * ts.NUM_WARPS <= 65536
    # the exact path's power-of-two scale comes from exponent bits, in float64: no float32
    # exp2/floor, which the GPU flushes to zero below 2^-126 (ex2.approx.ftz.f32)
    assert not re.search(r"(ex2\.approx|cvt\.rmi)\.ftz\.f32", k.asm["ptx"])
    if fast and ranged:
        # the chunk's counts cross the lanes packed, three to one reduction:
        # range counts add no barrier (docs/gpu.md has the counts)
        plain = _compile(ts._chunk_stats_kernel, CHUNK_SIG, dict(consts, RANGE=False), arch,
                         ts.NUM_WARPS, ts.MAX_REGISTERS)
        assert k.asm["ptx"].count("bar.sync") == plain.asm["ptx"].count("bar.sync")
    vector_loads = len(re.findall(r"ld\.global[^\n]*\.v4", k.asm["ptx"]))
    if fast and aligned:  # the unrolled main loop: four 16-byte loads (or more) a thread
        assert vector_loads >= 4, "too few 16-byte loads: the alignment hint was lost"
    elif not aligned:
        assert vector_loads == 0  # an unaligned tensor must not get 16-byte loads


@pytest.mark.parametrize("arch", [90, 80])
def test_merge_and_finalize_kernels_compile(arch):
    k = _compile(ts._merge_chunks_kernel,
                 {"part": "*fp64", "chunk_first": "*i64", "tensor_part": "*fp64"},
                 {"VBLOCK": ts.VBLOCK}, arch, 4)
    assert _local_bytes(k.asm["cubin"]) == 0
    k = _compile(ts._merge_finalize_kernel,
                 {"src": "*fp64", "src_first": "*i64", "tensor_part": "*fp64",
                  "table": "*fp64", "done": "*i32", "n_tensors": "i32"},
                 {"VBLOCK": ts.VBLOCK, "WIDTH": ts.layout.TABLE_WIDTH}, arch, 4)
    assert _local_bytes(k.asm["cubin"]) == 0
    # the last-program pattern: a CTA barrier, then one acquire-release count at GPU scope,
    # then the total's reads past L1; no other atomic (none in the results)
    ptx = k.asm["ptx"]
    atomics = re.findall(r"atom\.[^\s]+", ptx)
    assert atomics and all(a.startswith("atom.global.gpu.acq_rel.add") or
                           a.startswith("atom.acq_rel.gpu.global.add") for a in atomics), atomics
    assert ptx.index("bar.sync") < ptx.index(atomics[0].split(" ")[0])
    assert "ld.global.cg" in ptx


@pytest.mark.slow
def test_main_loops_keep_their_loads_in_flight():
    """The fast pass's main loop issues an iteration's 16-byte loads before it uses any (four of
    four for 16-bit types, at least four of eight for float32: 64 bytes a thread, 32 KB an SM
    at two programs, above the ~25 KB that 4.8 TB/s at ~700 ns needs), and the masked pass for
    chunks holding NaN/Inf costs at most 2.5x its instructions per 16-bit element (it cost
    2.7x to 2.9x with a compare and an add per class and flags converted from booleans). Read
    from the sm_90 machine code of the installed Triton (tests/sass_loops.py).
    Without _in_flight's dependency, Triton 3.6's ptxas issued one of four."""
    import sass_loops

    for name, dtype, size in sass_loops.variants():
        for ranged in (False, True):
            k = sass_loops.compile_chunk_kernel(dtype, ranged)
            found = sass_loops.loops(sass_loops.sass_of(k.asm["cubin"]), size)
            assert len(found) >= 4, (name, ranged, found)  # fast, masked, shifted (two)
            fast, masked = found[0], found[1]
            assert fast["in_flight"] >= 4, (name, ranged, found)
            if size == 2:
                assert fast["in_flight"] == fast["loads"], (name, ranged, found)
                assert masked["per_element"] <= 2.5 * fast["per_element"], (name, ranged, found)


def test_waiting_for_all_loads_compiles_without_spills():
    """FASTHEALTH_TRITON_WAIT_ALL=1 (the default before Triton 3.7, which this test's Triton may
    not be): every tile waits for all four loads; the kernels still fit the register cap."""
    code = (
        "import triton.language as tl, sass_loops, test_triton_compile as t\n"
        "from fasthealth.triton_kernels import tensor_stats as ts\n"
        "assert ts.WAIT_ALL.value\n"
        "for dtype in (tl.bfloat16, tl.float32):\n"
        "    for ranged in (False, True):\n"
        "        u = t._resources(sass_loops.compile_chunk_kernel(dtype, ranged).asm['cubin'])\n"
        "        assert u['LOCAL'] == 0 and u['REG'] <= ts.MAX_REGISTERS, u\n")
    here = os.path.dirname(__file__)  # this module, and tests/ for sass_loops
    path = os.pathsep.join([here, os.path.join(here, os.pardir), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, FASTHEALTH_TRITON_WAIT_ALL="1", PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


def _import_with(**knobs) -> subprocess.CompletedProcess:
    env = dict(os.environ, **knobs)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", "import fasthealth.triton_kernels.tensor_stats"],
                          env=env, capture_output=True, text=True)


@pytest.mark.parametrize("chunk, block", [("131072", "2048"), ("65536", "1000")])
def test_chunk_and_block_knobs_are_checked_at_import(chunk, block):
    """More than 32 elements a lane (CHUNK > 32 BLOCK) would overflow the masked pass's six-bit
    count fields and the fast path's error bound; sizes not powers of two break the plan."""
    out = _import_with(FASTHEALTH_TRITON_CHUNK=chunk, FASTHEALTH_TRITON_BLOCK=block)
    assert out.returncode != 0
    assert f"FASTHEALTH_TRITON_CHUNK={chunk}" in out.stderr
    assert f"FASTHEALTH_TRITON_BLOCK={block}" in out.stderr


@pytest.mark.slow
def test_wait_all_knob_is_checked_at_import():
    out = _import_with(FASTHEALTH_TRITON_WAIT_ALL="yes")
    assert out.returncode != 0 and "FASTHEALTH_TRITON_WAIT_ALL='yes'" in out.stderr
    assert _import_with(FASTHEALTH_TRITON_WAIT_ALL="0").returncode == 0


class _Recorder:
    """Stands in for a @triton.jit kernel: records each launch's arguments, launches nothing."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, args, kwargs))


def _specializations(kernels, plans, monkeypatch):
    """Per plan, the specialization Triton's launcher would key each launch's compiled kernel
    on (its binder over the kernel's parameters), for launches recorded from ts._stats on CPU
    tensors (the plan is built on the host; nothing runs)."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import create_function_from_signature
    except ImportError:  # pragma: no cover - other Triton layouts
        pytest.skip("this Triton has no create_function_from_signature")
    binders = {name: create_function_from_signature(k.signature, k.params, BaseBackend)
               for name, k in kernels.items()}
    out = []
    for tensors in plans:
        calls: list = []
        for name in kernels:
            monkeypatch.setattr(ts, name, _Recorder(name, calls))
        ts._stats(tensors, float("inf"), 0.0)
        monkeypatch.undo()
        keys = {}
        for name, args, kwargs in calls:
            _, spec, _ = binders[name](*args, **kwargs)
            keys.setdefault(name, set()).add(tuple(map(tuple, spec)))
        out.append(keys)
    return out


def test_kernel_variants_do_not_depend_on_the_plan(monkeypatch):
    """A compiled kernel is keyed on its arguments' specialization: integers equal to 1 or
    divisible by 16, pointers 16-byte aligned. Every runtime argument of the three kernels
    depends on the plan (item ranges, the tensor count, offsets of views into the work list and
    the scratch), so specializing on them compiled and loaded a new variant for many a new set
    of tensors, eagerly or inside a CUDA-graph capture: plans of 1, 2, 5 and 37 float32
    tensors, with and without the two-level merge, must give one key per kernel."""
    kernels = {name: getattr(ts, name) for name in
               ("_chunk_stats_kernel", "_merge_chunks_kernel", "_merge_finalize_kernel")}
    for k in kernels.values():
        runtime = [p for p in k.params if not p.is_constexpr]
        assert all(p.do_not_specialize for p in runtime), [p.name for p in runtime]
    big = torch.empty(257 * ts.CHUNK)  # more than MERGE_RUN chunks: the two-level merge
    plans = [[torch.empty(1000)], [torch.empty(5000), torch.empty(16)],
             [torch.empty(16 * k + 1) for k in range(5)],
             [torch.empty(ts.CHUNK * (k % 3) + 7 * k + 1) for k in range(37)],
             [big], [big, torch.empty(3), torch.empty(ts.CHUNK + 16)]]
    keys = _specializations(kernels, plans, monkeypatch)
    assert all("_merge_chunks_kernel" in k for k in keys[4:])  # (the merge was planned)
    for name in kernels:
        seen = set().union(*(k.get(name, set()) for k in keys))
        assert len(seen) == 1, (name, seen)
