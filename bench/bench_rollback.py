"""What rolling back in process (``rollback=``) costs: a snapshot, a restore, and their share
of the training time at the snapshot interval, on the CPU or on a GPU.

GPT-2 small written from its config (transformers' ``GPT2Config()``: 12 layers, 768 wide, 124M
parameters, nothing fetched; without transformers, the same shapes in plain torch), AdamW with
its state made by one step. Timed, ``--repeats`` times each, the median: one training step
(batch ``--batch`` x ``--seq`` tokens, forward, backward, ``optimizer.step``); a snapshot as
the Monitor takes it (``Rollback._take``: the model's and the optimizer's state dicts copied to
host memory); a restore (``Rollback._restore``: both loaded back in place); the pass over the
weights and the optimizer's state for NaN/Inf that comes before each snapshot. Reported: the
snapshot's bytes, the times, and the pass and the snapshot's share of the training time between
two snapshots (``every`` steps), which is what the snapshots cost a run.

On a GPU (``--device cuda``: the model and the batch there) each timing has a synchronize
before and after it, and the snapshot's copies go to pinned host memory without waiting, so
the host's time in ``_take`` is not what a run pays: the copies run on the GPU's stream while
the host already queues the next steps. What counts is measured apart: the wall time of
``--steps`` consecutive training steps (20) with a snapshot taken after the first of them,
against the same steps without one, each run synchronized at its start and end, the two
alternated, the median of ``--repeats`` each; their difference is ``snapshot_overlap_s``.
Before that, ``keep`` snapshots are taken, so that the one measured copies into the buffers
of the one it replaces, as in a run after its first two (``snapshot_first_s``: the very first,
which allocates its pinned buffers). There the share of the training time at each interval is
``(check_s + snapshot_overlap_s) / (every * step_s)``; ``snapshot_s`` is then the snapshot on
an otherwise idle GPU until its copies have landed, ``snapshot_host_s`` the host's part of it.

``--fake`` (bench/gpu_check.sh's dry run): no model, no GPU, no torch imported; the same
fields for ``--device``, holding fake numbers, with ``"fake": true``.

    python bench/bench_rollback.py                 # ~2 minutes on 2 CPU cores
    python bench/bench_rollback.py --record        # into bench/results/rollback.json
    python bench/bench_rollback.py --device cuda --out PATH   # on a GPU (--record: into
                                                              # bench/results/rollback_cuda.json)
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable[[], object], repeats: int,
          sync: Callable[[], None] = lambda: None) -> float:
    """The median over ``repeats`` of ``fn``'s wall time, with ``sync`` before and after."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def result(args: argparse.Namespace, machine: str, m: dict) -> dict:
    """The JSON record of the measurements ``m`` (the same fields, real or fake)."""
    cuda = args.device == "cuda"
    where = "pinned host memory, copied from the GPU" if cuda else "host memory"
    out = {
        "what": "GPT-2 small from GPT2Config() (124M parameters), AdamW; a training step of "
                f"batch {args.batch} x {args.seq} tokens against a snapshot and a restore of "
                f"its model and optimizer state in {where}",
        "machine": machine,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "repeats": args.repeats,
        "model": m.get("model", "transformers' GPT2LMHeadModel(GPT2Config())"),
        "parameters": m["parameters"],
        "snapshot_bytes": m["snapshot_bytes"],
        "step_s": m["step_s"],
        "check_s": m["check_s"],
        "snapshot_s": m["snapshot_s"],
        "restore_s": m["restore_s"],
    }
    if cuda:
        out.update({
            "device": "cuda",
            "method": "each timing between two torch.cuda.synchronize(); snapshot_overlap_s: "
                      f"the median wall time of {args.steps} training steps with a snapshot "
                      "taken after the first, minus the median of the same steps without, "
                      "each run synchronized at its start and end, the two alternated; the "
                      "snapshot measured copies into the buffers of the one it replaces",
            "snapshot_first_s": m["snapshot_first_s"],
            "snapshot_host_s": m["snapshot_host_s"],
            "steps": args.steps,
            "steps_plain_s": m["steps_plain_s"],
            "steps_with_snapshot_s": m["steps_with_snapshot_s"],
            "snapshot_overlap_s": m["steps_with_snapshot_s"] - m["steps_plain_s"],
        })
        cost = m["check_s"] + out["snapshot_overlap_s"]
    else:
        cost = m["check_s"] + m["snapshot_s"]
    out["share_of_training"] = {str(k): cost / (k * m["step_s"]) for k in args.every}
    return out


def fake(args: argparse.Namespace) -> tuple[str, dict]:
    """The dry run's stand-in: no model, no GPU, no torch."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    m = {"parameters": 124439808, "snapshot_bytes": 1647667792, "step_s": 0.02,
         "check_s": 0.001, "snapshot_s": 0.03, "restore_s": 0.05, "snapshot_first_s": 0.5,
         "snapshot_host_s": 0.005, "steps_plain_s": 0.02 * args.steps,
         "steps_with_snapshot_s": 0.02 * args.steps + 0.03}
    return f"fake (dry run, no GPU), torch {torch_version}", m


def _gpt2_small_in_torch():
    """GPT-2 small's shapes in plain torch (124M parameters: 12 pre-LN blocks 768 wide, 12
    heads, a 3,072 MLP, 50,257 tokens, 1,024 positions, the head tied to the embedding), for a
    machine without transformers; called as GPT2LMHeadModel is (``input_ids``, ``labels``)."""
    import types

    import torch
    from torch import nn

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(50257, 768), nn.Embedding(1024, 768)
            block = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.1, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.h = nn.TransformerEncoder(block, 12, enable_nested_tensor=False)
            self.ln_f = nn.LayerNorm(768)

        def forward(self, input_ids, labels):
            n = input_ids.shape[1]
            x = self.wte(input_ids) + self.wpe(torch.arange(n, device=input_ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=input_ids.device)
            logits = self.ln_f(self.h(x, mask=mask, is_causal=True)) @ self.wte.weight.T
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                               labels[:, 1:].flatten())
            return types.SimpleNamespace(loss=loss)

    return Small()


def measure(args: argparse.Namespace) -> tuple[str, dict]:
    import torch

    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        def gpt2_small() -> torch.nn.Module:
            return GPT2LMHeadModel(GPT2Config())
        written = "transformers' GPT2LMHeadModel(GPT2Config())"
    except ImportError:  # a GPU machine without transformers: the same shapes in plain torch
        gpt2_small = _gpt2_small_in_torch
        written = "GPT-2 small's shapes in plain torch (transformers is not installed)"

    import fasthealth as fh
    from fasthealth.monitor.rollback import Rollback

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_rollback: --device cuda, and torch sees no CUDA device")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = gpt2_small().to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (args.batch, args.seq)).to(args.device)

    def train_step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()  # the optimizer's state exists from here
    if cuda:  # the GPU's libraries and the allocator warmed up
        for _ in range(3):
            train_step()
        sync()
    m: dict = {"step_s": timed(train_step, args.repeats, sync)}
    rb = Rollback(fh.RollbackConfig(), model, opt)
    state = [t for st in opt.state.values() for t in st.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    # the pass over the weights and the optimizer's state for NaN/Inf before each snapshot
    m["check_s"] = timed(lambda: fh.multi_tensor_stats([p.detach() for p in model.parameters()]
                                                       + state).raw.sum().item(),
                         args.repeats, sync)
    if cuda:
        # the first snapshots allocate their pinned buffers; from the keep-th on, each copies
        # into the buffers of the one it replaces, as in a run
        m["snapshot_first_s"] = timed(lambda: rb._take(0), 1, sync)
        for _ in range(rb.config.keep - 1):
            rb._take(0)
        sync()
        host = []

        def take() -> None:
            t = time.perf_counter()
            rb._take(0)
            host.append(time.perf_counter() - t)

        m["snapshot_s"] = timed(take, args.repeats, sync)
        m["snapshot_host_s"] = statistics.median(host)
    else:
        m["snapshot_s"] = timed(lambda: rb._take(0), args.repeats)
    snap = rb.snapshots[-1]
    m["restore_s"] = timed(lambda: rb._restore(snap), args.repeats, sync)
    if cuda:
        def steps(snapshot: bool) -> float:
            sync()
            t = time.perf_counter()
            train_step()
            if snapshot:
                rb._take(0)
            for _ in range(args.steps - 1):
                train_step()
            sync()
            return time.perf_counter() - t

        steps(False), steps(True)  # warm-up
        plain, with_snapshot = [], []
        for r in range(args.repeats):  # alternated, each first in turn
            for snapshot in ((False, True) if r % 2 == 0 else (True, False)):
                (with_snapshot if snapshot else plain).append(steps(snapshot))
        m["steps_plain_s"] = statistics.median(plain)
        m["steps_with_snapshot_s"] = statistics.median(with_snapshot)
        props = torch.cuda.get_device_properties(torch.device("cuda"))
        machine = f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        machine = f"{platform.machine()}, {args.threads} thread(s), torch {torch.__version__}"
    m["model"] = written
    m["parameters"] = sum(p.numel() for p in model.parameters())
    m["snapshot_bytes"] = snap.nbytes
    return machine, m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model and the batch are (cpu)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--steps", type=int, default=20,
                    help="cuda: the training steps timed with and without a snapshot (20)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the JSON record here")
    ap.add_argument("--record", action="store_true",
                    help="write bench/results/rollback.json (with --device cuda: "
                         "rollback_cuda.json)")
    ap.add_argument("--fake", action="store_true",
                    help="no model, no GPU: fake numbers (bench/gpu_check.sh's dry run)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats take 1 or more")
    # a shell starts background jobs with SIGINT ignored and Python keeps that; the device
    # script's step limit interrupts with SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    machine, m = fake(args) if args.fake else measure(args)
    out = result(args, machine, m)
    if args.fake:
        out["fake"] = True
    print(f"{out['parameters'] / 1e6:.0f}M parameters; a snapshot holds "
          f"{out['snapshot_bytes'] / 2**20:.0f} MiB")
    print(f"training step {out['step_s']:.3f} s, NaN/Inf pass {out['check_s']:.3f} s, "
          f"snapshot {out['snapshot_s']:.3f} s, restore {out['restore_s']:.3f} s")
    if "snapshot_overlap_s" in out:
        print(f"the first snapshot {out['snapshot_first_s']:.3f} s; a snapshot holds the host "
              f"{out['snapshot_host_s']:.3f} s")
        print(f"{out['steps']} training steps {out['steps_plain_s']:.3f} s, with a snapshot "
              f"{out['steps_with_snapshot_s']:.3f} s: the snapshot costs them "
              f"{out['snapshot_overlap_s']:.3f} s")
    for k, v in out["share_of_training"].items():
        print(f"a snapshot every {k} steps: {100 * v:.2f}% of the training time")
    paths = [args.out] if args.out else []
    if args.record:
        paths.append(RESULTS / ("rollback_cuda.json" if args.device == "cuda"
                                else "rollback.json"))
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
