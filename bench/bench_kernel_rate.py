"""The CPU kernel's compute rate with its data in L2, per variant: the roofline's compute side.

    python bench/bench_kernel_rate.py     # about 30 s; writes bench/results/cpu_kernel_rate.json

One torch thread checks one 64K-element tensor (256 KB as float32: it stays in L2) 200 times
through the op, 15 times, and a 64-element tensor the same way; the median of each gives the
time per call, and the difference (the op's fixed cost per call taken off) gives G elements/s
per core. Each variant runs in its own process (FASTHEALTH_CPU_ISA is read once). The
measurement is bench/harness.py's kernel_rate, which `make bench` also runs for
the variant it uses: its roofline compares this rate, times the threads and the element size,
with the read limit.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALLS, ROUNDS = 200, 15

CHILD = f"""
import json, sys, torch
sys.path.insert(0, {str(HERE)!r})
import fasthealth as fh
from harness import kernel_rate

out, fixed = {{}}, {{}}
for name in ("float32", "bfloat16", "float16"):
    rate, us = kernel_rate(getattr(torch, name), calls={CALLS}, repeats={ROUNDS})
    out[name], fixed[name] = round(rate, 2), round(us, 2)
print(json.dumps({{"isa": fh.ops.compiled.C.cpu_isa(), "G_elements_per_s": out,
                  "us_per_call_64_elements": fixed}}))
"""


def main() -> int:
    import fasthealth as fh

    rows = []
    for isa in fh.ops.compiled.C.cpu_isas():
        env = dict(os.environ, FASTHEALTH_CPU_ISA=isa)
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]["G_elements_per_s"]
        print(f"{isa:7s} " + "  ".join(f"{k} {v:6.2f}" for k, v in r.items()) +
              "  G elements/s per core, data in L2")
    res = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S")},
           "method": __doc__.strip().splitlines()[0], "rows": rows}
    path = HERE / "results" / "cpu_kernel_rate.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
