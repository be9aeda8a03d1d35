"""What the quarantine's watch costs: for ``every`` steps after a rollback for bad data (with
``RollbackConfig(replay=...)``), each step's batch is searched sample by sample before its
update (``culprits.search``: the samples' losses, one forward of the batch, and their pulls,
each sample alone, a forward and a backward of one). This prices that search against the
training step it comes with.

Three models a user trains, built from config, on random data of their shapes: an MLP on
64 features (the recovery evaluation's, batch 32), a small CNN with BatchNorm on 32x32 images
(batch 16), and a 4-layer GPT (256 wide, 64 tokens, batch 8). Timed, ``--repeats`` times
each, the median: one training step (forward, backward, ``optimizer.step``) and one search of
the same batch, its loss per sample (the replay as the README writes it). Reported: both
times, their ratio (what a step of the watch costs beside a step of training) and what one
data rollback's watch (``every`` steps, 100 by default) costs a run, in training steps.

    python bench/bench_watch.py              # ~1 minute on 2 CPU cores
    python bench/bench_watch.py --record     # into bench/results/watch.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fasthealth.monitor.culprits import search

RESULTS = Path(__file__).resolve().parent / "results"
EVERY = 100  # RollbackConfig.every's default: the watch's length, and the snapshots' interval


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, d=256, layers=4, heads=4, seq=64):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
        self.mask = nn.Transformer.generate_square_subsequent_mask(seq)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


def cases() -> dict[str, tuple[nn.Module, Callable, tuple]]:
    """name: (model, per-sample loss (model, batch) -> losses, batch)."""
    g = torch.Generator().manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    cnn = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def classify(m, b):
        return F.cross_entropy(m(b[0]), b[1], reduction="none")

    def lm(m, b):
        logits = m(b[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), b[:, 1:], reduction="none").mean(1)

    return {
        "mlp, batch 32": (mlp, classify, (torch.randn(32, 64, generator=g),
                                          torch.randint(0, 10, (32,), generator=g))),
        "cnn 32x32, batch 16": (cnn, classify, (torch.randn(16, 3, 32, 32, generator=g),
                                                torch.randint(0, 10, (16,), generator=g))),
        "gpt 4x256, 64 tokens, batch 8": (TinyGPT(), lm,
                                          torch.randint(0, 256, (8, 65), generator=g)),
    }


def commit() -> str | None:
    """The checkout's commit, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=RESULTS.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def one(model: nn.Module, loss_fn: Callable, batch, repeats: int) -> dict:
    """One case: a training step and the watch's search of the same batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = len(batch[0]) if isinstance(batch, tuple) else len(batch)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model, batch).mean().backward()
        opt.step()

    def watch() -> None:
        search(model, loss_fn, [(list(range(n)), batch)], math.inf)

    step_s, watch_s = median_time(step, repeats), median_time(watch, repeats)
    return {"samples": n, "step_s": step_s, "watch_s": watch_s,
            "watch_per_step": watch_s / step_s,
            "steps_per_data_rollback": round(watch_s / step_s * EVERY, 1)}


def measure(repeats: int) -> dict:
    out = {}
    for name, (model, loss_fn, batch) in cases().items():
        r = out[name] = one(model, loss_fn, batch, repeats)
        print(f"{name:32s} step {r['step_s'] * 1e3:8.2f} ms   watch {r['watch_s'] * 1e3:8.2f} ms"
              f"   {r['watch_per_step']:5.1f}x a step", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--record", action="store_true", help="into bench/results/watch.json")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    res = {"what": __doc__.split("\n\n")[0].replace("\n", " "),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), "
                      f"torch {torch.__version__}",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": commit(),
           "repeats": a.repeats, "every": EVERY, "cases": measure(a.repeats)}
    if a.record:
        (RESULTS / "watch.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
