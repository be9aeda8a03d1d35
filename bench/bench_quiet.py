"""check_grads against the read limit, interleaved in one process, with the host's quiet rounds
set apart: how this shared machine's neighbours move the ratios of `make bench`.

    python bench/bench_quiet.py               # about a minute; bench/results/cpu_quiet.json
    python bench/bench_quiet.py --rounds 60 --repeat 5

Per case (the four of `make bench`), each round times `torch.sum` over one flat buffer of the
gradients' bytes (the read limit) and `check_grads(model).ok`, in turn, with a 64 MB write
before each call so that both start from memory (`make bench` interleaves other providers,
which leaves some data in the caches). A round's ratio is its check over its read limit. The
"quiet" rounds are those whose read limit is in the fastest third of the case's rounds: the
host's bandwidth was then at its best, which is when a memory-bound kernel's own overheads
show. Both medians are reported; `make bench` stays the reference for the CPU goals.
`--repeat K` runs it all K times, one after the other: a shared host moves between a quiet
state and a contended one (where the read limit takes far longer) over minutes, and the ratios
differ between the two, so one run says little.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import _GradModel, cases  # noqa: E402

import fasthealth as fh  # noqa: E402


def run_case(case: dict, rounds: int, flush: torch.Tensor, bar) -> dict:
    model = _GradModel(case["shapes"], case["dtype"])
    flat = torch.cat([g.flatten() for g in model.grads()])
    provs = {"read_limit": lambda: flat.sum(), "fasthealth": lambda: fh.check_grads(model).ok}
    for f in provs.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in provs}
    names = list(provs)
    for r in range(rounds):
        for k in names[r % 2:] + names[: r % 2]:
            flush.fill_(1.0)
            t0 = time.perf_counter()
            provs[k]()
            times[k].append(time.perf_counter() - t0)
        bar.update()
    read, ours = times["read_limit"], times["fasthealth"]
    cut = sorted(read)[max(0, len(read) // 3 - 1)]
    quiet = [i for i in range(rounds) if read[i] <= cut]
    return {
        "case": case["name"], "dtype": str(case["dtype"]).replace("torch.", ""),
        "rounds": rounds, "quiet_rounds": len(quiet),
        "read_limit_ms_median": round(statistics.median(read) * 1e3, 3),
        "read_limit_ms_quiet_median": round(statistics.median(read[i] for i in quiet) * 1e3, 3),
        "fasthealth_ms_median": round(statistics.median(ours) * 1e3, 3),
        "x_read_paired_median": round(statistics.median(a / b for a, b in zip(ours, read)), 3),
        "x_read_paired_median_quiet": round(statistics.median(ours[i] / read[i] for i in quiet), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_quiet.json"))
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error(f"--rounds must be at least 3 (a third of them are the quiet ones), "
                 f"got {args.rounds}")
    from tqdm import tqdm

    flush = torch.empty(16 * 1024 * 1024)  # 64 MB: more than this machine's L2 and L3
    todo = cases(quick=False)
    rows = []
    with tqdm(total=args.rounds * len(todo) * args.repeat, unit="round", file=sys.stderr) as bar:
        for rep in range(args.repeat):
            for case in todo:
                bar.set_description(f"run {rep + 1}: {case['name']} {str(case['dtype'])[6:]}")
                rows.append({"run": rep + 1, **run_case(case, args.rounds, flush, bar)})
    for r in rows:
        print(f"run {r['run']} {r['case']:11s} {r['dtype']:9s} read "
              f"{r['read_limit_ms_median']:7.3f} ms "
              f"(quiet {r['read_limit_ms_quiet_median']:7.3f})  x read paired "
              f"{r['x_read_paired_median']:.3f}, quiet rounds "
              f"{r['x_read_paired_median_quiet']:.3f}")
    res = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                       "cpus": os.cpu_count(), "kernel": fh.ops.compiled.C.cpu_isa(),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S")},
           "method": __doc__.strip().splitlines()[0] + " (see bench/bench_quiet.py)",
           "rows": rows}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
