"""What fasthealth costs in a CNN's training loop on the CPU: BatchNorm buffers included.

A ResNet of torchvision's BasicBlock shape, built here (3 stages of 2 blocks, 16-32-64 wide,
BatchNorm, in-place ReLU, in-place residual adds), on scikit-learn's digits upsampled to 32x32,
batch 32, SGD with momentum, clipping at 1.0. Copies of the same run take turns, one step each
per round, so that the machine's noise hits all of them alike:

- ``plain`` and ``plain_twin``: ``clip_grad_norm_`` and ``optimizer.step()``, twice: the
  costs are taken against the two together, and how far the twins stand apart is the noise
  floor;
- ``monitor``: ``fh.Monitor(model, opt, max_grad_norm=1.0)`` at its defaults, whose
  ``mon.step(loss)`` replaces the clip and the step; it copies the BatchNorm buffers before
  each step's forward and puts them back where a step is skipped (``monitor/buffers.py``);
- ``monitor_without_buffers``: the same with the buffer copy and restore taken out, so that
  their own cost is the difference of the two monitor copies.

Each step is timed whole (forward, backward, the step, ``zero_grad``), after ``--warmup``
steps. Reported per copy: the median and the mean step time and their cost against the plain
twins (the loop-cost goal: at most 1% median, 2% mean).

    python bench/bench_cnn_cost.py                  # 300 rounds, ~2 minutes on 2 cores
    python bench/bench_cnn_cost.py --record         # into bench/results/cnn_loop_cost.json
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
from torch import nn

import fasthealth as fh

ARMS = ("plain", "plain_twin", "monitor", "monitor_without_buffers")
BATCH = 32


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                               nn.ReLU(inplace=True)]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    x = nn.functional.interpolate(x.expand(-1, 3, 8, 8), size=32, mode="bilinear",
                                  align_corners=False)
    return x, torch.tensor(d.target)


class Run:
    def __init__(self, arm: str, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.manual_seed(0)
        self.arm, self.data = arm, data
        self.model = resnet()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.mon = None
        if arm.startswith("monitor"):
            self.mon = fh.Monitor(self.model, self.opt, max_grad_norm=1.0)
            if arm == "monitor_without_buffers" and self.mon.buffer_guard is not None:
                self.mon.buffer_guard.remove()
                self.mon.buffer_guard = None
        self.g = torch.Generator().manual_seed(0)
        self.times: list[float] = []

    def step(self) -> None:
        x, y = self.data
        i = torch.randint(0, len(x), (BATCH,), generator=self.g)
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(x[i]), y[i])
        loss.backward()
        if self.mon is None:
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        else:
            self.mon.step(loss)
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - t)


def summarize(runs: dict[str, Run], warmup: int) -> dict:
    pooled = runs["plain"].times[warmup:] + runs["plain_twin"].times[warmup:]
    base_median, base_mean = statistics.median(pooled), statistics.fmean(pooled)
    out = {}
    for arm, r in runs.items():
        t = r.times[warmup:]
        out[arm] = {"median_step_ms": round(1e3 * statistics.median(t), 3),
                    "mean_step_ms": round(1e3 * statistics.fmean(t), 3),
                    "median_cost": round(statistics.median(t) / base_median - 1, 5),
                    "mean_cost": round(statistics.fmean(t) / base_mean - 1, 5)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="steps of each copy")
    ap.add_argument("--warmup", type=int, default=30, help="first steps left out")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--record", action="store_true",
                    help="write bench/results/cnn_loop_cost.json")
    args = ap.parse_args(argv)
    if args.rounds <= args.warmup:
        ap.error(f"--rounds ({args.rounds}) must exceed --warmup ({args.warmup})")
    torch.set_num_threads(args.threads)
    data = digits()
    runs = {arm: Run(arm, data) for arm in ARMS}
    t0 = time.perf_counter()
    for i in range(args.rounds):
        for arm in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:  # who goes first rotates
            runs[arm].step()
    for r in runs.values():
        if r.mon is not None:
            r.mon.close()
    res = {"what": "ResNet of BasicBlocks (16-32-64, BatchNorm, in-place ReLU and adds) on "
                   "digits at 32x32, batch 32, SGD momentum, clip 1.0; copies taking turns "
                   "a step each",
           "rounds": args.rounds, "warmup": args.warmup, "threads": args.threads,
           "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                      f"{torch.get_num_threads()} thread(s), torch {torch.__version__}",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "seconds": round(time.perf_counter() - t0, 1),
           "arms": summarize(runs, args.warmup)}
    print(json.dumps(res, indent=1))
    if args.record:
        path = Path(__file__).parent / "results" / "cnn_loop_cost.json"
        path.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
