"""The main loops of the Triton and CUDA chunk kernels read from their sm_90 machine code: no
GPU needed.

For each loop of 16-byte loads (``LDG.E.128``) in each compiled variant of
``_chunk_stats_kernel``: how many of an iteration's loads ptxas issues before the first use of
one, and how many instructions the loop spends per element. These are the two static figures
behind the GPU speed estimates of docs/gpu.md:

- loads in flight: a 4.8 TB/s memory over 132 SMs at ~700 ns latency needs ~25 KB in flight
  an SM; two programs of 256 threads with four 16-byte loads each hold 32 KB;
- instructions per element: an H200 issues ~3.3e13 thread instructions a second and streams
  ~2.4e12 bfloat16 elements (1.2e12 float32) a second, so a loop above ~14 instructions a
  bfloat16 element (~28 float32) is issue bound, not memory bound.

Loops are listed in code order: the fast pass, the masked pass (chunks holding NaN/Inf), then
the shifted passes (masked and plain) and any other loop of four 16-byte loads or more.

    python tests/sass_loops.py --out bench/results/triton_sass.json

With ``--cuda LIB`` it reads the two CUDA chunk kernels (with and without range counts) of a
CUDA build of the extension instead, each loop labelled with its element type and pass read
from the code (``make gpu-prebuilt`` leaves one in build/prebuilt/):

    python tests/sass_loops.py --cuda build/prebuilt/_C.cpython-312-x86_64-linux-gnu.so \
        --out bench/results/cuda_sass.json

``tests/ops/test_triton_compile.py`` and ``tests/ops/test_cuda_build.py`` check the fast and masked
loops with the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = re.compile(r"(?:@!?P\d+ )?LDG\.E\.128(?:\.[A-Z]+)* R(\d+), ")
LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b[^;]*?0x([0-9a-f]+)")


def instructions(sass: str) -> tuple[list[str], list[int]]:
    """(instruction texts, their addresses) of one function's SASS."""
    ins, addr = [], []
    for line in sass.splitlines():
        m = LINE.match(line)
        if m:
            addr.append(int(m.group(1), 16))
            ins.append(m.group(2))
    return ins, addr


def _written(line: str) -> set[str]:
    m = LOAD.match(line)
    assert m is not None
    return {f"R{int(m.group(1)) + k}" for k in range(4)}


def _inner_loops(sass: str) -> list[list[str]]:
    """The instructions of each innermost loop with four 16-byte loads or more, in code order
    (a backward branch closes a loop; a one-tile remainder loop has fewer loads)."""
    ins, addr = instructions(sass)
    where = {a: i for i, a in enumerate(addr)}
    spans = []
    for i, line in enumerate(ins):
        m = BRANCH.search(line)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in where:
            spans.append((where[int(m.group(1), 16)], i))
    return [ins[a:b + 1] for a, b in sorted(spans)
            if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)
            and sum(1 for line in ins[a:b + 1] if LOAD.match(line)) >= 4]


def _measure(body: list[str], elem_bytes: int) -> dict:
    loads = [j for j, line in enumerate(body) if LOAD.match(line)]
    live: set[str] = set()
    issued = 0
    for j in range(loads[0], loads[-1] + 1):
        if j in loads:
            issued += 1
            live |= _written(body[j])
        elif live & set(re.findall(r"\bR\d+\b", body[j])):
            break
    elements = len(loads) * 16 // elem_bytes
    return {"loads": len(loads), "in_flight": issued, "instructions": len(body),
            "per_element": round(len(body) / elements, 2)}


def loops(sass: str, elem_bytes: int) -> list[dict]:
    """Each innermost loop of four tiles or more of 16-byte loads, in code order: its loads,
    how many are issued before a register an earlier one wrote is read or written, and its
    instructions per element (the loop's length over the elements its loads bring)."""
    return [_measure(body, elem_bytes) for body in _inner_loops(sass)]


def _opcodes(body: list[str]) -> list[str]:
    return [re.sub(r"^@!?P\w+ ", "", line).split()[0] for line in body]


def cuda_loops(sass: str) -> list[dict]:
    """The main loops of one CUDA chunk kernel (``chunk_stats_cuda<kRange>``), in code order,
    each with its element type and pass read from the code: every element takes one FMNMX for
    the minimum and one for the maximum, which gives the elements an iteration (so 2 or 4
    bytes each); float16 converts with HADD2.F32; a masked pass (chunks holding NaN/Inf) tests
    each element for non-finite with FSETP.GEU."""
    out = []
    for body in _inner_loops(sass):
        ops = _opcodes(body)
        elements = ops.count("FMNMX") // 2
        loads = sum(1 for line in body if LOAD.match(line))
        if elements == 0 or (loads * 16) % elements:
            continue
        size = loads * 16 // elements
        dtype = {4: "float32", 2: "float16" if "HADD2.F32" in ops else "bfloat16"}.get(size)
        if dtype is None:
            continue
        row = {"dtype": dtype, "masked": any(o.startswith("FSETP.GEU") for o in ops)}
        out.append(dict(row, **_measure(body, size)))
    return out


def cuda_functions(lib: str, arch: int = 90, cuobjdump: str | None = None) -> dict[str, str]:
    """{"range" or "plain": SASS} of the two chunk kernels in a CUDA build of the extension."""
    sass = subprocess.run([cuobjdump or _cuobjdump(), "-sass", "-arch", f"sm_{arch}", lib],
                          capture_output=True, text=True, check=True).stdout
    out = {}
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n", 1)[0].strip()
        if "chunk_stats_cuda" in name:
            out["range" if "ILb1E" in name else "plain"] = func
    return out


def _cuobjdump() -> str:
    """The CUDA toolkit's cuobjdump, else the one Triton bundles."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    import triton
    return os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def compile_chunk_kernel(dtype, ranged: bool, arch: int = 90):
    """The chunk kernel for one fast dtype (aligned), as the launcher builds it."""
    import triton
    import triton.language as tl
    from fasthealth.triton_kernels import tensor_stats as ts
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"items64": "*i64", "items32": "*i32", "item_lo": "i32", "item_hi": "i32",
           "part": "*fp64", "thresholds": "*fp64", "done": "*i32"}
    consts = {"BLOCK": ts.BLOCK, "DTYPE": dtype, "ACC": tl.float32, "FAST": True,
              "ALIGNED": True, "RANGE": ranged}
    src = ASTSource(fn=ts._chunk_stats_kernel, signature=dict(sig, **dict.fromkeys(consts,
                    "constexpr")), constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": ts.NUM_WARPS, "maxnreg": ts.MAX_REGISTERS})


def variants():
    import triton.language as tl
    return [("bfloat16", tl.bfloat16, 2), ("float16", tl.float16, 2),
            ("float32", tl.float32, 4)]


def _nvcc_version() -> str:
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "nvcc unknown"
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return f"nvcc {m.group(1)} ({m.group(2)})" if m else "nvcc unknown"


def cuda_main(lib: str, out: str | None) -> None:
    rows = []
    for kind, sass in sorted(cuda_functions(lib).items()):
        for r in cuda_loops(sass):
            rows.append(dict(r, kernel=kind))
            print(f"{kind:5} {r['dtype']:9} {'masked' if r['masked'] else 'fast':6} "
                  f"{r['per_element']:5.2f}/el {r['in_flight']}/{r['loads']}")
    if out:
        path = Path(out)
        table = json.loads(path.read_text()) if path.exists() else {
            "what": "main loops of the CUDA chunk kernel (sm_90): per loop in code order, the "
                    "instantiation (range: with range counts), element type, pass (masked: "
                    "chunks holding NaN/Inf; plain and shifted passes both appear), 16-byte "
                    "loads an iteration, how many issued before the first use, instructions "
                    "per element", "entries": {}}
        table["entries"][_nvcc_version()] = {"rows": rows}
        path.write_text(json.dumps(table, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="add this Triton's (or this nvcc's, with --cuda) table to this "
                                  "JSON file (one entry per Triton version and WAIT_ALL "
                                  "setting, or per nvcc version)")
    ap.add_argument("--cuda", metavar="LIB",
                    help="read the CUDA chunk kernels of this CUDA build of the extension "
                         "(fasthealth/_C*.so, e.g. from `make cuda-check` or "
                         "`make gpu-prebuilt`) instead of compiling the Triton one")
    args = ap.parse_args()
    if args.cuda:
        if not os.path.exists(args.cuda):
            ap.error(f"--cuda {args.cuda}: no such file")
        cuda_main(args.cuda, args.out)
        return
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import triton
    from fasthealth.triton_kernels import tensor_stats as ts

    rows = []
    for name, dtype, size in variants():
        for ranged in (False, True):
            k = compile_chunk_kernel(dtype, ranged)
            found = loops(sass_of(k.asm["cubin"]), size)
            rows.append({"dtype": name, "range_counts": ranged, "loops": found})
            print(f"{name:9} range={ranged!s:5} " + "  ".join(
                f"{r['per_element']:5.2f}/el {r['in_flight']}/{r['loads']}" for r in found))
    if args.out:
        path = Path(args.out)
        table = json.loads(path.read_text()) if path.exists() else {
            "what": "main loops of the Triton chunk kernel (sm_90, aligned fast dtypes): "
                    "per loop in code order (fast, masked, shifted masked, shifted, others), "
                    "16-byte loads an iteration, how many issued before the first use, "
                    "instructions per element", "entries": {}}
        key = f"triton {triton.__version__}, WAIT_ALL={int(ts.WAIT_ALL.value)}"
        table["entries"][key] = {"BLOCK": ts.BLOCK, "num_warps": ts.NUM_WARPS,
                                 "max_registers": ts.MAX_REGISTERS, "rows": rows}
        path.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
