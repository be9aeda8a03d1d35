"""Cost on a CPU training step of what the alarms for faults that do not show in the loss
measure: the weight scan of the
``weight_corruption`` rule (one fused pass over every parameter, once per ``flush_every`` steps)
and the batch fingerprint of the ``repeated_batch`` rule (every step).

GPT-2-small-sized model (``fasthealth.demo.TinyGPT``, 124M parameters), AdamW, one sequence of
128 tokens; the median of a few plain steps (forward, backward, optimizer step), of the scan and
of the fingerprint; the scan's share per step is its time over ``flush_every`` (50). The same
for the fingerprint on a small model (``--small`` sizes), where a step is cheapest. Writes
bench/results/new_alarms_cost.json.

    OMP_NUM_THREADS=1 python bench/bench_new_alarms.py [--steps 3] [--scans 5]
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fasthealth.demo import TinyGPT, gpt2_config
from fasthealth.monitor.scans import fingerprint, weight_scan


def timed(fn, n: int) -> float:
    """The median of ``n`` runs of ``fn``, in ms."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def measure(small: bool, steps: int, scans: int, flush_every: int) -> dict:
    torch.manual_seed(0)
    cfg = gpt2_config(small)
    model = TinyGPT(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg["vocab"], (1, 129))
    params = list(model.named_parameters())
    cpu = torch.device("cpu")

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()

    step()  # warm-up (the optimizer's state)
    step_ms = timed(step, steps)
    scan_ms = timed(lambda: weight_scan(params, None, cpu)[0].item(), scans)
    batch = (ids[:, :-1], ids[:, 1:])
    fp_ms = timed(lambda: fingerprint(batch, cpu).item(), 50)
    return {
        "model": cfg, "params": sum(p.numel() for _, p in params),
        "step_ms": round(step_ms, 2), "weight_scan_ms": round(scan_ms, 2),
        "weight_scan_per_step_ms": round(scan_ms / flush_every, 3),
        "weight_scan_pct_of_step": round(scan_ms / flush_every / step_ms * 100, 3),
        "fingerprint_ms": round(fp_ms, 4),
        "fingerprint_pct_of_step": round(fp_ms / step_ms * 100, 4),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed plain steps")
    ap.add_argument("--scans", type=int, default=5, help="timed weight scans")
    ap.add_argument("--flush-every", type=int, default=50)
    ap.add_argument("--out", default="bench/results/new_alarms_cost.json")
    args = ap.parse_args(argv)
    result = {
        "gpt2_small": measure(False, args.steps, args.scans, args.flush_every),
        "small": measure(True, 20, 20, args.flush_every),
        "flush_every": args.flush_every, "batch": 1, "seq": 128,
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
