"""Do the precursors come before the spike? A small transformer LM trained into instability.

    python evaluation/eval_precursors.py             # 5 seeds, ~10 min on 2 CPU cores
    python evaluation/eval_precursors.py --seeds 2 --steps 300

The model is the corpus's GPT (evaluation/detectors/models.py: pre-LN blocks, attention written out,
no qk-layernorm, no z-loss) on character windows of the standard library's source, AdamW with
betas (0.9, 0.95) warmed up linearly over ``--warmup`` steps to a peak learning rate ``--lr``
far above what the model tolerates (the usual way real runs meet instability: the warm-up
reaches it), then held. The Monitor runs at its defaults plus the LM head's logits and the
attention logits (``logits="head", attention="attn$"``).

For each seed: the step where the loss is first damaged (``instability``: the median of the
last 20 losses 10% above the best such median so far; at this size the instability shows as a
climb and a plateau far above the healthy run, more than as one-step spikes), the first loss
alarm of the Monitor (``loss_spike``, ``divergence``, ``oscillation``), and the first
precursor notice of each kind; a seed counts when a precursor came before the damage. The
same model at a sane learning rate (``--healthy-lr``) must raise no precursor.
Writes bench/results/precursors.json and a plot of the loss with the precursors' signals
(bench/results/precursors.png).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite
sys.path.insert(0, str(HERE / "detectors"))

import data  # noqa: E402  (evaluation/detectors, put on the path above)
import models  # noqa: E402

import fasthealth as fh  # noqa: E402

LOSS_ALARMS = ("loss_spike", "divergence", "oscillation")


def instability(losses: list[float], span: int = 20, rise: float = 1.1) -> int | None:
    """The first step whose trailing median of ``span`` losses stands ``rise`` x above the best
    trailing median before it (a non-finite loss counts at once)."""
    best = math.inf
    for t in range(len(losses)):
        if not math.isfinite(losses[t]):
            return t
        if t + 1 < span:
            continue
        med = sorted(losses[t + 1 - span:t + 1])[span // 2]
        if med > rise * best:
            return t
        best = min(best, med)
    return None


def run(seed: int, steps: int, lr: float, warmup: int, log_dir=None) -> tuple[fh.Monitor, list]:
    """Trains the model under a Monitor (closed at the end); returns it and the losses."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = models.TransformerLM(data.CHAR_VOCAB, d=64, heads=4, layers=2, ctx=64)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup))
    win = data.Windows(g, data.char_ids(), 16, 64)
    rec = []
    with fh.Monitor(model, opt, logits="head", attention=r"attn$", log_dir=log_dir) as mon:
        for step in range(steps):
            ids, targets = win(step)[:2]
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            mon.step(loss)
            opt.zero_grad(set_to_none=True)
            sched.step()
            rec.append(float(loss.detach()))
    return mon, rec


def train(seed: int, steps: int, lr: float, warmup: int) -> dict:
    mon, rec = run(seed, steps, lr, warmup)
    events = [(e.step, e.kind, e.severity) for e in mon.events]
    first_alarm = next((s for s, k, sev in events if k in LOSS_ALARMS and sev == "alarm"), None)
    first_pre: dict[str, int] = {}
    for s, k, _ in events:
        if k.startswith("precursor_"):
            first_pre.setdefault(k, s)
    damaged = instability(rec)
    return {"seed": seed, "lr": lr, "loss": rec, "events": events, "first_loss_alarm":
            first_alarm, "instability": damaged, "first_precursor": first_pre,
            "precursor_first": bool(first_pre) and damaged is not None
            and min(first_pre.values()) < damaged}


def signals(seed: int, steps: int, lr: float, warmup: int) -> dict:
    """The same run's per-step precursor signals, read from its log (for the plot)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mon, _ = run(seed, steps, lr, warmup, log_dir=d)
        rows = [json.loads(line) for line in open(Path(mon.run_dir) / "steps.jsonl")]
    keys = ("loss", "update_ratio_max", "logit_max", "log_z", "attention_logit_max")
    return {k: [r.get(k) for r in rows] for k in keys}


def plot(result: dict, sig: dict, healthy: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    steps = range(len(sig["loss"]))
    axes[0].plot(steps, sig["loss"], lw=0.8, label=f"loss, peak lr {result['lr']:g}")
    axes[0].plot(range(len(healthy["loss"])), healthy["loss"], lw=0.8, alpha=0.7,
                 label=f"loss, peak lr {healthy['lr']:g} (healthy)")
    axes[0].set_ylabel("loss")
    att = [(i, v) for i, v in enumerate(sig["attention_logit_max"]) if v is not None]
    axes[1].semilogy([i for i, _ in att], [v for _, v in att], lw=0.8, color="C2")
    axes[1].set_ylabel("largest attention logit")
    ur = [(i, v) for i, v in enumerate(sig["update_ratio_max"]) if v is not None]
    axes[2].semilogy([i for i, _ in ur], [v for _, v in ur], ".-", lw=0.8, ms=3, color="C3")
    axes[2].set_ylabel("largest update/weight")
    axes[2].set_xlabel("step")
    colors = {"precursor_attention_logits": "C2", "precursor_update_ratio": "C3",
              "precursor_logit_growth": "C4", "precursor_adam_eps": "C5"}
    for s, k, sev in result["events"]:
        if k.startswith("precursor_"):
            for ax in axes:
                ax.axvline(s, color=colors.get(k, "k"), ls="--", lw=0.8)
        elif sev == "alarm" and k in LOSS_ALARMS:
            axes[0].axvline(s, color="C1", lw=1.2)
    if result["instability"] is not None:
        axes[0].axvline(result["instability"], color="k", lw=1.2)
    axes[0].plot([], [], color="C1", label="loss alarm (Monitor)")
    axes[0].plot([], [], color="k", label="loss damaged (trailing median +10%)")
    for k, c in colors.items():
        axes[0].plot([], [], color=c, ls="--", label=k)
    axes[0].legend(fontsize=7, loc="upper right")
    axes[0].set_title(f"seed {result['seed']}: the precursors (dashed) and the loss (solid)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--healthy-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--out", default=str(RESULTS / "precursors.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    runs = []
    for seed in range(args.seeds):
        r = train(seed, args.steps, args.lr, args.warmup)
        h = train(seed, args.steps, args.healthy_lr, args.warmup)
        r["healthy"] = {k: h[k] for k in ("lr", "events", "first_precursor", "first_loss_alarm",
                                          "instability")}
        r["healthy_loss"] = h["loss"]
        runs.append(r)
        print(f"seed {seed}: loss damaged at {r['instability']}, first loss alarm "
              f"{r['first_loss_alarm']}, first precursors {r['first_precursor']}; healthy lr: "
              f"damaged at {h['instability']}, precursors {h['first_precursor']}, loss alarms "
              f"{h['first_loss_alarm']} ({time.time() - t0:.0f} s)", flush=True)
    spiked = [r for r in runs if r["instability"] is not None]
    before = sum(r["precursor_first"] for r in spiked)
    healthy_pre = sum(bool(r["healthy"]["first_precursor"]) for r in runs)
    summary = {"seeds": args.seeds, "spiked": len(spiked), "precursor_before_spike": before,
               "healthy_runs_with_precursor": healthy_pre}
    print(json.dumps(summary))
    sig = signals(0, args.steps, args.lr, args.warmup)
    plot(runs[0], sig, {"lr": args.healthy_lr, "loss": runs[0]["healthy_loss"]},
         Path(args.out).with_suffix(".png"))
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or
           platform.machine(), "args": vars(args), "seconds": round(time.time() - t0),
           "summary": summary,
           "runs": [{k: v for k, v in r.items() if k not in ("loss", "healthy_loss")}
                    | {"loss_every_10": [round(x, 4) for x in r["loss"][::10]]} for r in runs]}
    Path(args.out).write_text(json.dumps(doc, indent=1, default=lambda x: None
                                         if isinstance(x, float) and math.isnan(x) else x))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
