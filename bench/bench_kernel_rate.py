"""The CPU kernel's compute rate with its data in L2, per variant: the roofline's compute side.

    python bench/bench_kernel_rate.py     # about 30 s; writes bench/results/cpu_kernel_rate.json

One torch thread checks one 64K-element tensor (256 KB as float32: it stays in L2) 200 times
through the op, 15 times, and a 64-element tensor the same way; the median of each gives the
time per call, and the difference (the op's fixed cost per call, about 2 us here, taken off)
gives G elements/s per core. Each variant runs in its own process (FASTHEALTH_CPU_ISA is read
once). Compare twice this rate times the element size with the read limit of `make bench` to
see whether a case is compute- or memory-bound on 2 cores.
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
N, CALLS, ROUNDS = 65536, 200, 15

CHILD = f"""
import json, math, statistics, time, torch
import fasthealth as fh
torch.set_num_threads(1)
op = torch.ops.fasthealth.multi_tensor_stats

def per_call(t):
    for _ in range({CALLS}):
        op([t], math.inf, 0.0)
    ts = []
    for _ in range({ROUNDS}):
        t0 = time.perf_counter()
        for _ in range({CALLS}):
            op([t], math.inf, 0.0)
        ts.append((time.perf_counter() - t0) / {CALLS})
    return statistics.median(ts)

out = {{}}
fixed = {{}}
for name in ("float32", "bfloat16", "float16"):
    dt = getattr(torch, name)
    t = (torch.randn({N}, generator=torch.Generator().manual_seed(0)) * 0.02).to(dt)
    small = (torch.randn(64, generator=torch.Generator().manual_seed(1)) * 0.02).to(dt)
    call, call_small = per_call(t), per_call(small)
    out[name] = round(({N} - 64) / (call - call_small) / 1e9, 2)
    fixed[name] = round(call_small * 1e6, 2)
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
