"""The GPU results file (<card>.json, named after the GPU it ran on: h200.json,
h100-80gb-hbm3.json): read, merged into and rewritten after every case and every step of
bench/gpu_check.sh, so that a run cut short at any point leaves a whole file with what it did.

Standard library only: the device script records its steps here even where torch or the build
is broken. One JSON object:

  machine   the GPU and versions (bench_gpu.py)
  method    how the rows were timed (bench_gpu.py)
  rows      one per (case, dtype, provider): gpu_ms, wall_ms, GB/s, host_sync, or an error
  goals     the GPU goals read off the rows, recomputed at every write; a goal whose rows are
            missing says so (met: null)
  selftest  `fasthealth selftest --json`'s record
  rollback  bench/bench_rollback.py --device cuda's record: what rollback's snapshots cost
            training on the GPU
  steps     the device script's steps: status, seconds, limit, exit status, and a note where
            the script gave one (why a step failed or was not run)
  prebuilt  the manifest of the prebuilt extension, when the device script loaded it
            (bench/prebuilt.py)
  run       the deadline, time used, whether it was a dry run

Every write goes to a temporary file beside the target, then os.replace: a reader (or a run
killed mid-write) sees the old file or the new one, never half of one.

    python bench/gpu_results.py --results R.json [--copy C.json] steps STEPS.tsv [--deadline S]
    python bench/gpu_results.py --results R.json attach selftest SELFTEST.json
    python bench/gpu_results.py --results R.json attach rollback ROLLBACK.json
    python bench/gpu_results.py --results R.json finish [--plot R.png]
    python bench/gpu_results.py card        # the file name's stem for this machine's GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

GOAL_READ_SHARE = 0.85  # of the read limit (torch.sum over one flat buffer of the same bytes)
GOAL_OVER_NAIVE = 50.0
GOAL_NONFINITE_SHARE = 0.8  # of the same case's healthy speed, gradients holding NaN/Inf
READ_SHARE_CASES = (("gpt2-small", "bfloat16"), ("7b-like", "bfloat16"))
FUSED = ("cuda", "triton")


def load(path: Path) -> dict:
    """The file's object; a missing or unreadable file gives an empty one (and says why)."""
    try:
        doc = json.loads(Path(path).read_text())
        if isinstance(doc, dict):
            doc.setdefault("rows", [])
            return doc
        reason = "not a JSON object"
    except FileNotFoundError:
        return {"rows": []}
    except (OSError, ValueError) as exc:
        reason = str(exc)
    print(f"gpu_results: starting {path} afresh: {reason}", file=sys.stderr)
    return {"rows": []}


def save(doc: dict, paths: Iterable[Path]) -> None:
    """``doc`` into every path, each atomically; a copy that cannot be written is reported and
    skipped (the first path is the one that matters)."""
    doc["goals"] = goals(doc.get("rows", []))
    doc["updated"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    text = json.dumps(doc, indent=1, default=str)
    for path in paths:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as exc:
            print(f"gpu_results: could not write {path}: {exc}", file=sys.stderr)
        finally:
            tmp.unlink(missing_ok=True)


def merge_rows(doc: dict, rows: Iterable[dict]) -> None:
    """Rows replace earlier ones with the same (case, dtype, provider); order is kept."""
    new = {(r["case"], r["dtype"], r["provider"]): r for r in rows}
    kept = [r for r in doc.get("rows", [])
            if (r.get("case"), r.get("dtype"), r.get("provider")) not in new]
    doc["rows"] = kept + list(new.values())


def update(paths: list[Path], rows: Iterable[dict] = (), **sections) -> dict:
    """Read the first path, merge ``rows``, set ``sections``, write every path."""
    doc = load(paths[0])
    merge_rows(doc, rows)
    doc.update(sections)
    save(doc, paths)
    return doc


def _ms(rows: list[dict], kind: str) -> dict[tuple[str, str, str], float]:
    return {(r["case"], r["dtype"], r["provider"]): r[kind] for r in rows
            if isinstance(r.get(kind), (int, float)) and r[kind] > 0}


def goals(rows: list[dict]) -> list[dict]:
    """The goals of the fused backends, read off the rows. GPU time (graph replay) for the
    read-bandwidth share; both GPU and wall time for the comparison with _foreach_norm; wall
    time against the naive loop (its .item() calls cannot be captured). A goal that the rows
    cannot decide has met None and says what is missing."""
    gpu, wall = _ms(rows, "gpu_ms"), _ms(rows, "wall_ms")
    out: list[dict] = []
    for b in FUSED:
        if not any(r.get("provider") == b for r in rows):
            continue
        for case, dtype in READ_SHARE_CASES:
            name = f"{b}: >= {GOAL_READ_SHARE:.0%} of the read limit, {case} {dtype} (GPU time)"
            lim, got = gpu.get((case, dtype, "read_sum")), gpu.get((case, dtype, b))
            if lim and got:
                share = lim / got
                out.append({"goal": name, "value": round(share, 3),
                            "met": share >= GOAL_READ_SHARE})
            else:
                out.append({"goal": name, "value": None, "met": None,
                            "missing": "read_sum or this backend's GPU time"})
        for kind, ms in (("GPU", gpu), ("wall", wall)):
            cases = [(c, d) for (c, d, p) in ms if p == b and (c, d, "foreach_norm") in ms]
            slower = [f"{c} {d}" for c, d in cases if ms[(c, d, b)] >= ms[(c, d, "foreach_norm")]]
            out.append({"goal": f"{b}: faster than torch._foreach_norm in every case "
                                f"({kind} time)",
                        "value": f"{len(cases) - len(slower)}/{len(cases)} cases",
                        "met": (not slower) if cases else None, "slower_in": slower})
        key = ("gpt2-small", "bfloat16")
        name = f"{b}: >= {GOAL_OVER_NAIVE:g}x faster than the naive loop, gpt2-small bfloat16 " \
               "(wall time)"
        if (*key, "naive") in wall and (*key, b) in wall:
            x = wall[(*key, "naive")] / wall[(*key, b)]
            out.append({"goal": name, "value": round(x, 1), "met": x >= GOAL_OVER_NAIVE})
        else:
            out.append({"goal": name, "value": None, "met": None, "missing": "naive or " + b})
        mine = [r for r in rows if r.get("provider") == b]  # an error row counts as a miss
        synced = [f"{r['case']} {r['dtype']}" for r in mine if r.get("host_sync") is not False]
        out.append({"goal": f"{b}: no host sync", "met": (not synced) if mine else None,
                    "value": f"{len(mine) - len(synced)}/{len(mine)} cases", "in": synced})
        faulty = [(c, d) for (c, d, p) in gpu if p == b and "/" in c]
        slow = {f"{c} {d}": round(gpu[(c.split('/')[0], d, b)] / gpu[(c, d, b)], 3)
                for c, d in faulty if (c.split("/")[0], d, b) in gpu}
        out.append({"goal": f"{b}: gradients with NaN/Inf at >= {GOAL_NONFINITE_SHARE:.0%} of "
                            "the healthy speed (GPU time)",
                    "met": all(v >= GOAL_NONFINITE_SHARE for v in slow.values())
                    if slow else None, "value": slow})
        checked = [r for r in mine if "ref_ok" in r]
        wrong = [f"{r['case']} {r['dtype']}" for r in checked if not r["ref_ok"]]
        out.append({"goal": f"{b}: every result equal to the float64 reference within "
                            "docs/spec.md's tolerances", "met": (not wrong) if checked else None,
                    "value": f"{len(checked) - len(wrong)}/{len(checked)} cases", "in": wrong})
        uncaptured = [f"{r['case']} {r['dtype']}" for r in mine if not r.get("gpu_ms")]
        out.append({"goal": f"{b}: CUDA-graph capture and replay",
                    "met": (not uncaptured) if mine else None,
                    "value": f"{len(mine) - len(uncaptured)}/{len(mine)} cases",
                    "in": uncaptured})
    return out


def read_steps(tsv: Path) -> list[dict]:
    """The device script's step records: name, status, seconds, limit, rc and, when not empty,
    a note (tab-separated)."""
    steps = []
    try:
        lines = Path(tsv).read_text().splitlines()
    except OSError:
        return steps
    for line in lines:
        f = line.split("\t")
        if len(f) >= 5:
            steps.append({"name": f[0], "status": f[1], "seconds": int(f[2]),
                          "limit": int(f[3]), "rc": int(f[4])})
            if len(f) > 5 and f[5]:
                steps[-1]["note"] = f[5]
    return steps


def plot(doc: dict, path: Path) -> None:
    # harness.plot needs matplotlib, and harness imports torch and fasthealth: imported here
    # only, so that recording steps never depends on them
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import plot as bar_plot

    rows = [dict(r, ms=r.get("gpu_ms") or r["wall_ms"]) for r in doc.get("rows", [])
            if r.get("gpu_ms") or r.get("wall_ms")]
    if rows:
        m = doc.get("machine", {})
        bar_plot(rows, Path(path), f"fasthealth on {m.get('device', '?')}, torch "
                                   f"{m.get('torch', '?')}: GPU ms per call (graph replay; "
                                   "wall time where it cannot be captured)")


def card_slug(name: str) -> str:
    """A GPU's name as a file name's stem: lower case, the vendor dropped, any other run of
    characters but letters and digits one dash ("NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3",
    "NVIDIA H200" -> "h200"); "gpu" for an empty name."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    return "-".join(w for w in words if w not in ("nvidia", "corporation")) or "gpu"


def card() -> str:
    """This machine's first GPU as ``card_slug`` names it (nvidia-smi, the standard library
    only); "no-gpu" where none answers."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "no-gpu"
    first = out.strip().splitlines()[0] if out.strip() else ""
    return card_slug(first) if first else "no-gpu"


def main(argv: list[str] | None = None) -> int:
    if (argv if argv is not None else sys.argv[1:])[:1] == ["card"]:
        print(card())
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--copy", type=Path, action="append", default=[],
                    help="also write the file here (bench/results/ in the tree)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("steps", help="record the device script's steps")
    st.add_argument("tsv", type=Path)
    st.add_argument("--deadline", type=int)
    st.add_argument("--elapsed", type=int)
    st.add_argument("--dry", action="store_true")
    at = sub.add_parser("attach", help="a JSON file as one section (the selftest record, "
                                          "the rollback benchmark's)")
    at.add_argument("name")
    at.add_argument("file", type=Path)
    fi = sub.add_parser("finish", help="goals, and the plot")
    fi.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    paths = [args.results, *args.copy]
    if args.cmd == "steps":
        update(paths, steps=read_steps(args.tsv),
               run={"deadline_s": args.deadline, "elapsed_s": args.elapsed, "dry_run": args.dry})
    elif args.cmd == "attach":
        try:
            section = json.loads(args.file.read_text())
        except (OSError, ValueError) as exc:
            section = {"missing": f"{args.file}: {exc}"}
        update(paths, **{args.name: section})
    else:
        doc = update(paths)
        for g in doc["goals"]:
            met = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
            print(f"goal: {g['goal']:<78} {g['value']!s:>12} {met}")
        if args.plot:
            plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
