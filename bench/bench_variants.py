"""The CPU kernel variants compared on the large cases: `fasthealth bench` once per variant.

    python bench/bench_variants.py     # about 4 minutes; writes bench/results/cpu_variants.json

Each variant runs `fasthealth bench --case gpt2-small --case 4000-small --rounds 11` in its own
process with FASTHEALTH_CPU_ISA forcing it, one after another (the shared machine's bandwidth
moves between runs: compare ratios to the read limit, which are paired within each run, not
milliseconds across runs). The portable baseline is left out: it is several times slower by
design.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    import fasthealth as fh

    variants: dict[str, dict] = {}
    machine = None
    for isa in [v for v in fh.ops.compiled.C.cpu_isas() if v != "base"]:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "fasthealth", "bench", "--case", "gpt2-small", "--case",
                   "4000-small", "--rounds", "11", "--out", out]
            print(f"{isa}: running {' '.join(cmd[3:])}", flush=True)
            subprocess.run(cmd, env=dict(os.environ, FASTHEALTH_CPU_ISA=isa), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            res = json.loads((Path(out) / "cpu.json").read_text())
        machine = res["machine"]
        variants[isa] = {f"{r['case']} {r['dtype']}": {
            "ms": r["ms"], "x_read_paired_median": r["x_read_paired_median"]}
            for r in res["rows"] if r["provider"] == "fasthealth"}
        print(isa, json.dumps(variants[isa]))
    note = (f"{__doc__.strip().splitlines()[0]} ({time.strftime('%Y-%m-%d')}); paired median "
            "of fasthealth's time over the read limit")
    path = HERE / "results" / "cpu_variants.json"
    path.write_text(json.dumps({"note": note, "variants": variants, "machine": machine},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
