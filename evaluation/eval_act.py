"""Acting before the damage, measured on the corpus of evaluation/detectors/:
``on_spike="skip"`` and the precursors (docs/spec.md section 6).

    python evaluation/eval_act.py                 # tuning families and faults, 2 seeds
    python evaluation/eval_act.py --final         # also the held-out families and faults
    python evaluation/eval_act.py --only NAME,... # some families / faults

Every run is a real training loop under ``fh.Monitor(on_spike="skip")`` with the precursors on
(the LM families also watch their head's logits and, for transformers, their attention
logits). Scores:

- healthy families: skipped steps per 5,000 (the goal: at most 1), precursor notices, alarms;
- bad-batch and LR-jump faults: whether the step that first showed the fault was skipped (a
  bad batch at its step; an LR jump at the first step after it whose loss shows it, within 10),
  and, for a bad batch, the loss after it against the same run without the bad batch
  (``damage``: the mean loss over the 20 steps after, relative to the clean run's; 1.0 is no
  damage) and the alarms after the bad step (the aftermath: none is the goal).

Writes bench/results/act.json (or --out) under --label and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench" / "results"  # the recorded figures the docs cite
sys.path.insert(0, str(HERE / "detectors"))
sys.path.insert(0, str(HERE))

import eval_detectors  # noqa: E402  (the results' key and the code's provenance)

BAD_BATCH = ("garbage_batch", "mislabelled_batch", "target_x50_batch", "garbage_batch_words")
LR_JUMPS = ("lr_jump_x25_cnn", "lr_jump_x25_transformer", "lr_jump_x25_word_transformer")
FAULT_SEED = 1000
WITHIN = 10  # an LR jump shows in the loss within this many steps


def options_for(model) -> dict:
    """The Monitor options of a run: skip on, and the LM head and attention watched where the
    model has them (the corpus's LMs name their head ``head``)."""
    from torch import nn

    opts: dict = {"on_spike": "skip"}
    names = dict(model.named_modules())
    head = names.get("head")
    if isinstance(head, nn.Linear) and hasattr(model, "tok"):  # an LM: token embedding in
        opts["logits"] = "head"
    if any(n.endswith("attn") and hasattr(m, "qkv") for n, m in names.items()):
        opts["attention"] = r"attn$"
    return opts


SERIES = ("loss", "grad_norm", "grads_finite", "loss_finite", "spike_skip", "skip_z_loss",
          "skip_z_grad_norm", "update_ratio_max", "logit_max", "log_z", "attention_logit_max")


def _events(out: dict) -> list[tuple]:
    return [tuple(e) for e in out["events"]]


def _series(out: dict) -> dict:
    """Every step's recorded values of SERIES (NaN as None): for offline looks at the rules."""
    return {k: [s.values.get(k) if s.values.get(k) == s.values.get(k) else None
                for s in out["steps"]] for k in SERIES}


def run_healthy(name: str, seed: int) -> dict:
    import runner
    import torch
    from families import FAMILIES

    torch.set_num_threads(1)  # two workers on two cores: no oversubscribed OpenMP spinning
    torch.manual_seed(seed)
    fam = FAMILIES[name]
    setup = fam.build(torch.Generator().manual_seed(seed), fam.steps)
    t0 = time.time()
    out = runner.train(setup, fam.steps, options=options_for(setup.model))
    skipped = [s.step for s in out["steps"] if s.values.get("spike_skip", 0) > 0]
    return {"kind": "healthy", "name": name, "seed": seed, "steps": fam.steps,
            "held_out": fam.held_out, "skipped": skipped, "events": _events(out),
            "series": _series(out), "seconds": round(time.time() - t0, 1)}


def run_fault(name: str, seed: int) -> dict:
    import runner
    import torch
    from corpus import onset_of
    from faults import FAULTS

    torch.set_num_threads(1)
    spec = FAULTS[name]
    onset = onset_of(spec, spec.steps, seed)
    res: dict = {"kind": "fault", "name": name, "seed": seed, "steps": spec.steps,
                 "onset": onset, "held_out": spec.held_out}
    t0 = time.time()
    curves = {}
    for variant in ("skip", "clean", "warn"):
        torch.manual_seed(seed + FAULT_SEED)
        setup = spec.build(torch.Generator().manual_seed(seed + FAULT_SEED), spec.steps)
        opts = options_for(setup.model)
        if variant == "warn":
            opts["on_spike"] = "warn"
        before = None if variant == "clean" else (
            lambda step, batch, s: spec.before(step, batch, s, onset))
        out = runner.train(setup, spec.steps, before, options=opts)
        curves[variant] = out["loss"]
        if variant == "skip":
            res["skipped"] = [s.step for s in out["steps"] if s.values.get("spike_skip", 0) > 0]
            res["events"] = _events(out)
            res["series"] = _series(out)
        if name in LR_JUMPS:
            break  # no clean twin: the jump is the run
    res["loss_skip"], res["loss_clean"] = curves["skip"], curves.get("clean")
    res["loss_warn"] = curves.get("warn")
    res["seconds"] = round(time.time() - t0, 1)
    return res


def score_fault(r: dict) -> dict:
    onset, skipped = r["onset"], r["skipped"]
    if r["name"] in LR_JUMPS:
        hit = [s for s in skipped if onset < s <= onset + WITHIN]
        return {"caught": bool(hit), "delay": hit[0] - onset if hit else None}
    after = [e for e in r["events"] if e[0] > onset and e[2] == "alarm"]
    window = slice(onset + 1, onset + 21)

    def mean(xs):
        xs = [x for x in xs[window] if x == x]
        return statistics.mean(xs) if xs else float("nan")

    damage = mean(r["loss_skip"]) / mean(r["loss_clean"])
    damage_warn = mean(r["loss_warn"]) / mean(r["loss_clean"])
    return {"caught": onset in skipped, "delay": 0 if onset in skipped else None,
            "damage": round(damage, 4), "damage_without_skip": round(damage_warn, 4),
            "aftermath_alarms": len(after)}


def summarize(results: list[dict]) -> dict:
    out: dict = {"healthy": {}, "faults": {}}
    for held in (False, True):
        runs = [r for r in results if r["kind"] == "healthy" and r["held_out"] == held]
        if not runs:
            continue
        steps = sum(r["steps"] for r in runs)
        skips = sum(len(r["skipped"]) for r in runs)
        notices = [e for r in runs for e in r["events"] if e[1].startswith("precursor_")]
        key = "held_out" if held else "tuning"
        out["healthy"][key] = {
            "runs": len(runs), "steps": steps, "skipped": skips,
            "skipped_per_5000": round(5000 * skips / steps, 3),
            "precursor_notices": len(notices),
            "precursor_alarms": sum(1 for e in notices if e[2] == "alarm"),
            "by_family": {r["name"]: {"skipped": 0, "precursors": 0, "steps": 0}
                          for r in runs}}
        for r in runs:
            f = out["healthy"][key]["by_family"][r["name"]]
            f["skipped"] += len(r["skipped"])
            f["steps"] += r["steps"]
            f["precursors"] += sum(1 for e in r["events"] if e[1].startswith("precursor_"))
    for r in results:
        if r["kind"] == "fault":
            out["faults"].setdefault(r["name"], []).append({"seed": r["seed"], **score_fault(r)})
    return out


def print_tables(summary: dict) -> None:
    for key, h in summary["healthy"].items():
        print(f"healthy ({key}): {h['runs']} runs, {h['steps']} steps, {h['skipped']} skipped "
              f"({h['skipped_per_5000']} per 5,000), {h['precursor_notices']} precursor notices "
              f"({h['precursor_alarms']} alarms)")
        for name, f in h["by_family"].items():
            if f["skipped"] or f["precursors"]:
                print(f"  {name:<45} skipped {f['skipped']:>3}  precursors {f['precursors']:>3}")
    for name, rows in summary["faults"].items():
        caught = sum(r["caught"] for r in rows)
        extra = ""
        if "damage" in rows[0]:
            extra = (f"  damage {statistics.mean(r['damage'] for r in rows):.3f} (without skip "
                     f"{statistics.mean(r['damage_without_skip'] for r in rows):.3f}), "
                     f"aftermath alarms {sum(r['aftermath_alarms'] for r in rows)}")
        print(f"{name:<35} skipped at its step {caught}/{len(rows)}{extra}")


def plot_skip(results: list[dict], path: Path) -> None:
    """The loss of each bad-batch fault's first seed with on_spike="skip", with "warn" (the
    update lands) and without the bad batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in results if r["kind"] == "fault" and r["name"] in BAD_BATCH
                   and r.get("loss_clean")), key=lambda r: (r["name"], r["seed"]))
    firsts = {r["name"]: r for r in reversed(runs)}
    if not firsts:
        return
    fig, axes = plt.subplots(len(firsts), 1, figsize=(9, 2.6 * len(firsts)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], sorted(firsts.items())):
        o = r["onset"]
        lo, hi = max(0, o - 40), min(len(r["loss_skip"]), o + 80)
        xs = range(lo, hi)
        ax.plot(xs, r["loss_clean"][lo:hi], lw=2.5, alpha=0.35, color="C2",
                label="no bad batch")
        ax.plot(xs, r["loss_warn"][lo:hi], lw=0.9, color="C3", label='on_spike="warn"')
        ax.plot(xs, r["loss_skip"][lo:hi], lw=0.9, color="C0", label='on_spike="skip"')
        ax.axvline(o, color="k", ls=":", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{name} (seed {r['seed']}): the bad batch at step {o}", fontsize=9)
        ax.set_ylabel("loss")
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--final", action="store_true", help="also the held-out families/faults")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--only", help="comma-separated family/fault names")
    ap.add_argument("--label", help="key of the results in --out (default: the date and the "
                    "commit measured)")
    ap.add_argument("--out", default=str(RESULTS / "act.json"))
    ap.add_argument("--series", help="also write every run's per-step values to this file")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    from families import FAMILIES
    from faults import FAULTS

    only = set(args.only.split(",")) if args.only else None
    jobs = []
    for name, fam in FAMILIES.items():
        if (only is None or name in only) and (args.final or not fam.held_out) \
                and not fam.long:  # the long runs have their own evaluation
            jobs += [(run_healthy, name, s) for s in range(args.seeds)]
    for name in BAD_BATCH + LR_JUMPS:
        if (only is None or name in only) and (args.final or not FAULTS[name].held_out):
            jobs += [(run_fault, name, s) for s in range(args.seeds)]
    t0 = time.time()
    results = []
    with ProcessPoolExecutor(args.workers) as ex:
        futures = [ex.submit(fn, name, seed) for fn, name, seed in jobs]
        for i, fut in enumerate(as_completed(futures), 1):
            r = fut.result()
            results.append(r)
            print(f"[{i}/{len(jobs)}] {r['name']} seed {r['seed']}: skipped {r['skipped']} "
                  f"({r['seconds']} s)", flush=True)
    summary = summarize(results)
    print_tables(summary)
    path = Path(args.out)
    doc = json.loads(path.read_text()) if path.exists() else {}
    machine = eval_detectors.provenance()
    args.label = eval_detectors.results_key(args.label, args.final, machine.get("commit"),
                                            bool(machine.get("monitor_modified")))
    doc[args.label] = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": machine.get("commit"),
                       "machine": platform.processor()
                       or platform.machine(), "cpus": os.cpu_count(), "seeds": args.seeds,
                       "final": args.final, "seconds": round(time.time() - t0),
                       "summary": summary,
                       "runs": [{k: v for k, v in r.items()
                                 if not k.startswith("loss_") and k != "series"}
                                for r in results]}
    path.write_text(json.dumps(doc, indent=1))
    plot_skip(results, path.with_name("act_skip.png"))
    if args.series:
        Path(args.series).write_text(json.dumps(
            [{k: r[k] for k in ("kind", "name", "seed", "onset", "series") if k in r}
             for r in results]))
    print(f"wrote {path} [{args.label}] in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
