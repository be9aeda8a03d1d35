"""The main loops of the Triton chunk kernel read from its sm_90 machine code: no GPU needed.

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

    python bench/sass_loops.py --out bench/results/triton_sass.json

``tests/test_triton_compile.py`` checks the fast and masked loops with the same functions.
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


def loops(sass: str, elem_bytes: int) -> list[dict]:
    """Each innermost loop of four tiles or more of 16-byte loads, in code order: its loads,
    how many are issued before a register an earlier one wrote is read or written, and its
    instructions per element (the loop's length over the elements its loads bring)."""
    ins, addr = instructions(sass)
    where = {a: i for i, a in enumerate(addr)}
    spans = []
    for i, line in enumerate(ins):
        m = BRANCH.search(line)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in where:
            spans.append((where[int(m.group(1), 16)], i))
    out = []
    for a, b in sorted(spans):
        if any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans):
            continue  # not innermost
        loads = [j for j in range(a, b + 1) if LOAD.match(ins[j])]
        if len(loads) < 4:
            continue  # a one-tile remainder loop
        live: set[str] = set()
        issued = 0
        for j in range(loads[0], loads[-1] + 1):
            if j in loads:
                issued += 1
                live |= _written(ins[j])
            elif live & set(re.findall(r"\bR\d+\b", ins[j])):
                break
        elements = len(loads) * 16 // elem_bytes
        out.append({"loads": len(loads), "in_flight": issued,
                    "instructions": b - a + 1,
                    "per_element": round((b - a + 1) / elements, 2)})
    return out


def _cuobjdump() -> str:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="add this Triton's table to this JSON file (one entry per "
                                  "Triton version and WAIT_ALL setting)")
    args = ap.parse_args()
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
