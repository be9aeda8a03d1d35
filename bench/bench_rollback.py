"""What rolling back in process (``rollback=``) costs: a snapshot, a restore, and their share
of a training step at the snapshot interval.

GPT-2 small written from its config (transformers' ``GPT2Config()``: 12 layers, 768 wide, 124M
parameters, nothing fetched), AdamW with its state made by one step. Timed, ``--repeats``
times each, the median: one training step (batch ``--batch`` x ``--seq`` tokens, forward,
backward, ``optimizer.step``); a snapshot as the Monitor takes it (``Rollback._take``: the
model's and the optimizer's state dicts copied to host memory); a restore
(``Rollback._restore``: both loaded back in place); the pass over the weights and the
optimizer's state for NaN/Inf that comes before each snapshot. Reported: the snapshot's bytes,
the times, and the pass and the snapshot's share of the training time between two snapshots
(``every`` steps), which is what the snapshots cost a run.

    python bench/bench_rollback.py                 # ~2 minutes on 2 CPU cores
    python bench/bench_rollback.py --record        # into bench/results/rollback.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import fasthealth as fh
from fasthealth.monitor.rollback import Rollback


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="write bench/results/rollback.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (args.batch, args.seq))

    def train_step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()  # the optimizer's state exists from here
    step_s = timed(train_step, args.repeats)
    rb = Rollback(fh.RollbackConfig(), model, opt)
    state = [t for st in opt.state.values() for t in st.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    # the pass over the weights and the optimizer's state for NaN/Inf before each snapshot
    check_s = timed(lambda: fh.multi_tensor_stats([p.detach() for p in model.parameters()]
                                                  + state).raw.sum().item(), args.repeats)
    snap_s = timed(lambda: rb._take(0), args.repeats)
    snap = rb.snapshots[-1]
    restore_s = timed(lambda: rb._restore(snap), args.repeats)
    params = sum(p.numel() for p in model.parameters())
    out = {
        "what": "GPT-2 small from GPT2Config() (124M parameters), AdamW; a training step of "
                f"batch {args.batch} x {args.seq} tokens against a snapshot and a restore of "
                "its model and optimizer state in host memory",
        "machine": f"{platform.machine()}, {args.threads} thread(s), torch {torch.__version__}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "repeats": args.repeats,
        "parameters": params,
        "snapshot_bytes": snap.nbytes,
        "step_s": step_s,
        "check_s": check_s,
        "snapshot_s": snap_s,
        "restore_s": restore_s,
        "share_of_training": {str(k): (check_s + snap_s) / (k * step_s) for k in args.every},
    }
    print(f"{params / 1e6:.0f}M parameters; a snapshot holds {snap.nbytes / 2**20:.0f} MiB")
    print(f"training step {step_s:.3f} s, NaN/Inf pass {check_s:.3f} s, snapshot {snap_s:.3f} s, "
          f"restore {restore_s:.3f} s")
    for k, v in out["share_of_training"].items():
        print(f"a snapshot every {k} steps: {100 * v:.2f}% of the training time")
    if args.record:
        path = Path(__file__).resolve().parent / "results" / "rollback.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"written: {path}")


if __name__ == "__main__":
    main()
