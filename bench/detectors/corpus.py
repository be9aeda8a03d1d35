"""The detector evaluation corpus: healthy training-run families and planted faults,
each a real training loop under ``fh.Monitor`` on real data (nothing downloaded).

- ``families.py``: the healthy families (data, task, model, optimizer, schedule, batch size,
  regularisation, precision, clipping), some ``held_out``;
- ``faults.py``: the faults, each planted in a family (or a setup of its own) at an onset, with
  the kinds that name it and the delay a user accepts, some ``held_out``;
- ``data.py`` (scikit-learn's bundled tables and photos, the standard library's source, the
  interpreter's help texts), ``models.py``, ``synthetic.py`` (the first corpus's data);
- ``runner.py``: the training loop, and the replay of a recorded run under other detector
  settings.

``run(kind, name, seed)`` trains one run and returns its events (and, for ``options``, the
events of its replay under each of those Monitor settings). Held-out families and faults are
listed apart (``HELD_OUT_*``): ``bench/bench_detectors.py`` runs them only with ``--final``.
"""

from __future__ import annotations

import statistics
import time

import runner
import torch
from families import FAMILIES
from faults import FAULTS

HEALTHY = {n: f for n, f in FAMILIES.items() if not f.held_out}
HELD_OUT_HEALTHY = {n: f for n, f in FAMILIES.items() if f.held_out}
TUNING_FAULTS = {n: f for n, f in FAULTS.items() if not f.held_out}
HELD_OUT_FAULTS = {n: f for n, f in FAULTS.items() if f.held_out}


def onset_of(spec, steps: int, seed: int) -> int:
    """The fault's first step: its fraction of the run, moved by the seed (0-18 steps) so that
    onsets do not always meet the same point of a schedule; 0 stays 0."""
    if spec.onset <= 0:
        return 0
    return int(spec.onset * steps) + (7 * seed) % 19


def run(kind: str, name: str, seed: int, steps: int | None = None,
        options: list[dict] | tuple = ()) -> dict:
    """One run: ``kind`` "healthy" (a family) or "fault"; trained under the Monitor's
    defaults, then replayed under each of ``options``."""
    t0, c0 = time.time(), time.process_time()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if kind == "healthy":
        fam = FAMILIES[name]
        steps = steps or fam.steps
        setup, before, onset, group = fam.build(g, steps), None, None, name
        meta = {"held_out": fam.held_out}
    else:
        spec = FAULTS[name]
        steps = steps or spec.steps
        setup, onset, group = spec.build(g, steps), onset_of(spec, steps, seed), spec.group
        meta = {"expect": list(spec.expect), "max_delay": spec.max_delay,
                "held_out": spec.held_out}

        def before(step, batch, s):
            return spec.before(step, batch, s, onset)

    out = runner.train(setup, steps, before)
    trained = time.time() - t0
    replays = [runner.replay(setup, out["steps"], opts) for opts in options]
    loss = [x for x in out["loss"] if x == x and abs(x) != float("inf")]
    return {"kind": kind, "name": name, "seed": seed, "steps": steps, "onset": onset,
            "group": group, **meta, "events": out["events"], "incidents": out["incidents"],
            "replays": replays,
            "loss_first": statistics.median(loss[:10]) if loss else None,
            "loss_last": statistics.median(loss[-20:]) if loss else None,
            "train_seconds": round(trained, 2), "seconds": round(time.time() - t0, 2),
            "cpu_seconds": round(time.process_time() - c0, 2)}
