"""`fasthealth demo`: a small GPT-like model trained on CPU with planted faults.

Every detector of the Monitor should fire at its planted step; the bad steps are skipped; the
replay tells the bad batch (reproduces) from the simulated bit flip (does not); a report is
written. Exit status 0 when every planted fault was caught where it was planted, each in an
incident of its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F

from .monitor import Monitor, replay
from .report import read_log
from .report import write as write_report

VOCAB, CTX = 64, 32


class _FaultKeys(TypedDict):
    at: int
    fault: str
    expect: list[tuple[str, int, int]]


class _Fault(_FaultKeys, total=False):
    replay: str  # "reproduces" or "transient": what replay says of the step's dump
    cause: str  # the likely cause its incident must name (kinds.CAUSES)


# step -> what is planted there; "expect" lists (kind, first step it may fire, last step)
SCHEDULE: list[_Fault] = [
    _Fault(at=80, fault="a corrupt record: one sample's loss weight is NaN",
           expect=[("nonfinite_loss", 80, 80), ("nonfinite_grad", 80, 80)], replay="reproduces"),
    _Fault(at=100, fault="a forgotten backward: the loss computed, backward not called, twice",
           expect=[("no_grad", 101, 101)], cause="outside"),
    _Fault(at=120, fault="a transient bit flip: one gradient value set to NaN after backward",
           expect=[("nonfinite_grad", 120, 120)], replay="transient"),
    _Fault(at=140, fault="a stuck loader: step 140's batch fed again at steps 141 to 143",
           expect=[("repeated_batch", 142, 143)], cause="batch"),
    _Fault(at=160, fault="a garbage batch: random labels, weight x25",
           expect=[("loss_spike", 160, 160), ("grad_norm_spike", 160, 160)], replay="reproduces"),
    _Fault(at=176, fault="a loss scale set back after every step while the gradients overflow "
           "float16 (Inf after backward, the loss finite) for 20 steps",
           expect=[("overflow_streak", 195, 195)], cause="numeric_range"),
    _Fault(at=200, fault="optimizer state corruption: Inf written into Adam's exp_avg_sq",
           expect=[("optimizer_state_nonfinite", 200, 200)]),
    _Fault(at=212, fault="a stray write into a weight: one element of block 0's attention key "
           "bias set to 2000x its tensor's largest (the loss cannot show it: softmax ignores a "
           "key bias)", expect=[("weight_corruption", 212, 217)], cause="weights"),
    _Fault(at=230, fault="alternating easy/hard batches (loss weight 4 and 0.25) for 40 steps",
           expect=[("oscillation", 230, 270)]),
    _Fault(at=290, fault="loss weight 0 for 15 steps: gradients vanish",
           expect=[("vanishing_grad", 290, 295)]),
    _Fault(at=330, fault="fp16-style overflow: Inf loss for 12 steps, the GradScaler backs off",
           expect=[("loss_scale_collapse", 330, 345)]),
    _Fault(at=380, fault="learning-rate jump x300",
           expect=[("lr_jump", 380, 380), ("divergence", 380, 420)]),
]
STEPS = 440
FOLLOW_ON = 25  # steps after a fault in which its consequences (recovery, re-spikes) may show


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def gpt2_config(small: bool = False) -> dict:
    """TinyGPT's arguments for GPT-2 small (124M parameters), or a small smoke-test size."""
    if small:
        return dict(vocab=512, ctx=128, d=64, layers=2, heads=2)
    return dict(vocab=50257, ctx=1024, d=768, layers=12, heads=12)


class TinyGPT(torch.nn.Module):
    """GPT-2's layout (pre-norm blocks, tied embedding); GPT-2 small is
    TinyGPT(vocab=50257, ctx=1024, d=768, layers=12, heads=12)."""

    def __init__(self, vocab: int = VOCAB, ctx: int = CTX, d: int = 96, layers: int = 3,
                 heads: int = 4):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    ids, targets, weight = batch
    logits = model(ids)
    per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
    return (per_sample * weight).mean()


def make_batch(g: torch.Generator, n: int = 32):
    """Sequences that count up modulo VOCAB from a random start, a quarter of the targets
    replaced by noise: learnable next-token data whose loss settles above zero, as real data's
    does."""
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    seq = (start + torch.arange(CTX + 1)) % VOCAB
    targets = seq[:, 1:].clone()
    noise = torch.rand(targets.shape, generator=g) < 0.25
    targets[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
    return seq[:, :-1], targets, torch.ones(n)


def _mlp_linear(model: TinyGPT, block: int, layer: int) -> torch.nn.Linear:
    """A Linear of a block's MLP (ModuleList and Sequential items are typed as any Module)."""
    b = model.blocks[block]
    assert isinstance(b, Block)
    linear = b.mlp[layer]
    assert isinstance(linear, torch.nn.Linear)
    return linear


def _attention(model: TinyGPT, block: int) -> torch.nn.MultiheadAttention:
    b = model.blocks[block]
    assert isinstance(b, Block)
    return b.attn


def _plant(step: int, batch: tuple, model: TinyGPT, opt: torch.optim.Optimizer,
           g: torch.Generator) -> tuple:
    """The faults of SCHEDULE that act before the forward pass; returns the (changed) batch."""
    ids, targets, weight = batch
    if step == 80:
        weight[5] = float("nan")
    if step == 160:
        targets = torch.randint(0, VOCAB, targets.shape, generator=g)
        weight = weight * 25
    if step == 212:  # q . b_k is the same for every key: the attention does not change
        bias = _attention(model, 0).in_proj_bias
        assert bias is not None
        with torch.no_grad():
            d = bias.numel() // 3
            scale = max(float(p.detach().abs().max()) for p in model.parameters())
            bias[d + 5] = 2e3 * max(float(bias.detach().abs().max()), 0.01 * scale)
    if step == 200:
        p = _mlp_linear(model, 1, 0).weight
        opt.state[p]["exp_avg_sq"][3, 7] = float("inf")
    if 230 <= step < 270:
        weight = weight * (4.0 if step % 2 else 0.25)
    if 290 <= step < 305:
        weight = weight * 0.0
    if 330 <= step < 342:
        weight = weight * float("inf")
    if step == 380:
        for group in opt.param_groups:
            group["lr"] *= 300
    return ids, targets, weight


def _progress(steps: int, show: bool):
    if not show:
        return None
    try:
        from tqdm import tqdm  # optional (the report extra): no progress bar without it
    except ImportError:
        return None
    return tqdm(total=steps, desc="demo training", unit="step", file=sys.stderr)


def train(log_dir: Path, steps: int = STEPS, progress: bool = True) -> tuple[TinyGPT, Monitor]:
    """The demo's training run with SCHEDULE's faults planted; returns the model and monitor."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10_000)
    # the weights scanned every 5 steps (by default once per flush): the stray write at 212
    # is found before the next fault; a constant schedule, known to the Monitor, so that the
    # rate set by hand at 380 is no schedule's
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    mon = Monitor(model, opt, log_dir=log_dir, flush_every=25, warmup_steps=30, scheduler=sched,
                  max_grad_norm=5.0, scaler=scaler, per_tensor_every=5, optimizer_check_every=10,
                  rules={"weight_corruption": {"every": 5}})
    bar = _progress(steps, progress)
    stuck: tuple = ()
    forced = 0.0  # the loss scale that code sets back at 176..195
    try:  # closed also on Ctrl-C: its last flush is written now, not at exit into a removed dir
        for step in range(steps):
            batch = _plant(step, make_batch(g), model, opt, g)
            ids = torch.arange(32) + 32 * step
            if step == 140:
                stuck = (batch, ids)
            if 141 <= step <= 143:  # the loader stuck on step 140's batch
                batch, ids = stuck
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if step not in (100, 101):  # backward forgotten at 100 and 101
                scaler.scale(loss).backward()
            if step == 120:  # a bit flip in one gradient, not in the data
                grad = _mlp_linear(model, 0, 2).weight.grad
                assert grad is not None  # after backward
                grad[1, 2] = float("nan")
            if step == 176:
                forced = scaler.get_scale()
            if 176 <= step < 196:  # float16's overflow, as the scaled gradient would make it
                grad = _mlp_linear(model, 1, 2).weight.grad
                assert grad is not None
                grad[0, 0] = float("inf")
            mon.step(loss, batch=batch, sample_ids=ids)
            if 176 <= step < 196:  # code that sets the scale back: it cannot back off
                scaler.update(forced)
            if bar is not None:
                bar.update()
    finally:
        mon.close()
        if bar is not None:
            bar.close()
    return model, mon


def _check_schedule(model: TinyGPT, mon: Monitor, out) -> bool:
    """Prints, per planted fault, what the monitor reported (and replay's verdict)."""
    all_ok = True
    incidents: list[int | None] = []  # the incident of each fault's first expected event
    for item in SCHEDULE:
        found = []
        for kind, lo, hi in item["expect"]:
            hits = [e for e in mon.events if e.kind == kind and lo <= e.step <= hi]
            found.append((kind, hits[0].step if hits else None))
        ok = all(s is not None for _, s in found)
        all_ok &= ok
        got = ", ".join(f"{k} at {s}" if s is not None else f"{k} MISSING" for k, s in found)
        first = next((e for e in mon.events if e.kind == found[0][0] and e.step == found[0][1]),
                     None)
        incident = None if first is None else first.incident
        shown = "" if incident is None else f"; incident #{incident}"
        if "cause" in item:  # the likely cause its incident names
            got_cause = None if incident is None else mon.incidents[incident].cause
            ok &= got_cause == item["cause"]
            all_ok &= ok
            shown += f", cause {got_cause}" + ("" if got_cause == item["cause"] else
                                                f" (NOT {item['cause']})")
        print(f"  [{'ok' if ok else 'MISSED'}] step {item['at']}: {item['fault']}\n"
              f"         -> {got}{shown}", file=out)
        incidents.append(incident)
        if "replay" in item:
            ev = next((e for e in mon.events if e.step == item["at"] and e.dump), None)
            if ev is None or not ev.dump:
                all_ok = False
                continue
            r = replay(ev.dump, model, loss_fn)
            all_ok &= r.reproduced == (item["replay"] == "reproduces")
            print(f"         replay: {r.verdict}", file=out)
    apart = None not in incidents and len(set(incidents)) == len(incidents)
    dumps = {inc.dump for inc in mon.incidents if inc.dump}
    size = sum(Path(d).stat().st_size for d in dumps if Path(d).exists())
    print(f"\nincidents: {len(mon.incidents)} for {len(SCHEDULE)} planted faults, "
          f"{'each fault in its own' if apart else 'SOME FAULTS SHARE ONE'}; "
          f"{len(dumps)} dumps ({size / 2**20:.0f} MiB)", file=out)
    return all_ok and apart


def run(log_dir: Path, steps: int = STEPS, progress: bool = True, out=sys.stdout) -> bool:
    """Trains, then prints what was planted against what was reported; True when every fault
    was caught, no event fell outside the faults and the parameters stayed finite."""
    t0 = time.time()
    model, mon = train(log_dir, steps, progress)
    print(f"trained {steps} steps in {time.time() - t0:.0f} s; {len(mon.events)} events; "
          f"logs in {log_dir}", file=out)
    print("\nplanted fault -> what the monitor reported", file=out)
    all_ok = _check_schedule(model, mon, out)
    # from the step records: an incident records one event of each kind, not every step's
    skipped = [r["step"] for r in read_log(mon.run_dir or log_dir).steps if r.get("skipped")]
    print(f"\nskipped (parameters and optimizer state untouched): {len(skipped)} steps "
          f"{skipped[:6]}{' ...' if len(skipped) > 6 else ''}", file=out)
    params_ok = all(torch.isfinite(p).all() for p in model.parameters())
    print(f"parameters all finite at the end: {params_ok}", file=out)
    windows = [(item["at"], max(hi for _, _, hi in item["expect"]) + FOLLOW_ON)
               for item in SCHEDULE]
    stray = [(e.step, e.kind) for e in mon.events
             if not any(lo <= e.step <= hi for lo, hi in windows)]
    print(f"events outside the planted faults and their aftermath: {stray or 'none'}", file=out)
    return all_ok and not stray and params_ok


REPORT_NEEDS = ("fasthealth demo: the report needs matplotlib: pip install 'fasthealth[report]' "
                "(or: pip install matplotlib); --no-report runs the demo with its text only")


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _interrupted(signum, frame):  # SIGTERM as an exception: the finally below still cleans
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fasthealth demo", description=__doc__)
    ap.add_argument("--log-dir", help="where the monitor writes, kept (default: a temp folder, "
                    "removed at the end)")
    ap.add_argument("--out", help="where report.html and report.png go (default: LOG_DIR, or "
                    "./fasthealth-demo without --log-dir)")
    ap.add_argument("--no-report", action="store_true", help="skip the HTML report")
    args = ap.parse_args(argv)
    if not args.no_report:
        try:  # an optional dependency: said before 40 s of training, not after
            import matplotlib  # noqa: F401
        except ImportError:
            print(REPORT_NEEDS, file=sys.stderr)
            return 2
    # the demo's own temp folder, removed at the end however the run ends (a failure, Ctrl-C,
    # SIGTERM): the logs and dumps without --log-dir, and the inductor cache folder that torch's
    # fused CPU optimizer would otherwise leave in the temp directory
    scratch = Path(tempfile.mkdtemp(prefix="fasthealth-demo-"))
    env = os.environ.get(INDUCTOR_CACHE)
    os.environ[INDUCTOR_CACHE] = env if env is not None else str(scratch / "inductor")
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _interrupted) if main_thread else None
    try:
        log_dir = Path(args.log_dir) if args.log_dir else scratch / "logs"
        ok = run(log_dir)
        if not args.no_report:
            out = args.out or (log_dir if args.log_dir else "fasthealth-demo")
            path, text = write_report(log_dir, out=out)
            print("\n" + text)
            print(f"report: {path}" + ("" if args.log_dir else
                                       " (the logs and dumps, in a temp folder, are removed: "
                                       "--log-dir DIR keeps them)"))
    except KeyboardInterrupt:
        print("\nfasthealth demo: interrupted" + ("" if args.log_dir else
                                                 "; its temp folder is removed"), file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)
        if env is None:
            del os.environ[INDUCTOR_CACHE]
        shutil.rmtree(scratch, ignore_errors=True)
    print("\ndemo: every planted fault was caught" if ok else "\ndemo: SOME FAULTS WERE MISSED")
    return 0 if ok else 1
