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
events of its replay under each of those Monitor settings); with ``cache``, a run trained
before with the same sources is replayed from its recording instead (``recording_key``).
Held-out families and faults are listed apart (``HELD_OUT_*``): ``evaluation/eval_detectors.py``
runs them only with ``--final``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import runner
import torch
from families import FAMILIES
from faults import FAULTS

HEALTHY = {n: f for n, f in FAMILIES.items() if not f.held_out and not f.long}
HELD_OUT_HEALTHY = {n: f for n, f in FAMILIES.items() if f.held_out and not f.long}
TUNING_FAULTS = {n: f for n, f in FAULTS.items() if not f.held_out}
HELD_OUT_FAULTS = {n: f for n, f in FAULTS.items() if f.held_out}


def onset_of(spec, steps: int, seed: int, at: float | None = None) -> int:
    """The fault's first step: its fraction of the run (``at``, else the fault's own), moved
    by the seed (0-18 steps) so that onsets do not always meet the same point of a schedule;
    0 stays 0."""
    at = spec.onset if at is None else at
    if spec.onset <= 0:
        return 0
    return int(at * steps) + (7 * seed) % 19


# what shapes a run's recorded steps: the corpus and every fasthealth source but the host rules
# that only judge them (a change to those leaves a cached recording valid)
_JUDGES = {"kinds.py", "incidents.py", "events.py"}


def recording_key() -> str:
    """A digest of the sources a recorded run depends on (``_JUDGES`` and the rules left out)."""
    import fasthealth

    package = Path(fasthealth.__file__).resolve().parent
    files = sorted(Path(__file__).resolve().parent.glob("*.py")) + sorted(
        p for p in package.rglob("*.py")
        if not (p.parent.name == "monitor" and p.name in _JUDGES
                or p.parent.name == "rules" and p.parent.parent.name == "monitor"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _recorded(cache: Path | None, kind: str, name: str, seed: int, steps: int,
              train: Callable[[], dict]) -> tuple[dict, bool]:
    """``train()``'s output, or the one kept under ``cache`` for the same run and sources:
    (output, whether it came from the cache)."""
    if cache is None:
        return train(), False
    path = cache / recording_key() / f"{kind}-{name}-{seed}-{steps}.pkl"
    if path.exists():
        with path.open("rb") as f:
            return pickle.load(f), True
    out = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        pickle.dump(out, f)
    os.replace(tmp, path)  # whole or absent, even with two workers
    return out, False


def run(kind: str, name: str, seed: int, steps: int | None = None,
        options: list[dict] | tuple = (), cache: Path | None = None,
        onset: float | None = None) -> dict:
    """One run: ``kind`` "healthy" (a family) or "fault" (at its onset, or at the fraction
    ``onset`` of the run); trained under the Monitor's defaults, then replayed under each of
    ``options``. With ``cache`` (a folder), the recorded
    steps of an earlier identical run are replayed instead of training again (``cached`` in
    the result; its training-time events are then those of the defaults' replay)."""
    t0, c0 = time.time(), time.process_time()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    tag = name
    if kind == "healthy":
        fam = FAMILIES[name]
        steps = steps or fam.steps
        setup, before, first, group = fam.build(g, steps), None, None, name
        meta = {"held_out": fam.held_out}
    else:
        spec = FAULTS[name]
        steps = steps or spec.steps
        setup, first, group = spec.build(g, steps), onset_of(spec, steps, seed, onset), spec.group
        meta = {"expect": list(spec.expect), "max_delay": spec.max_delay,
                "held_out": spec.held_out}
        if onset is not None:  # a recording of its own: the same run with another onset
            tag = f"{name}@{onset}"

        def before(step, batch, s):
            return spec.before(step, batch, s, first)

    out, cached = _recorded(cache, kind, tag, seed, steps,
                            lambda: runner.train(setup, steps, before))
    trained = time.time() - t0
    replays = [runner.replay(setup, out["steps"], opts) for opts in options]
    if cached:  # the events of training were judged by the rules of then: judge them anew
        fresh = replays[0] if options and not options[0] else runner.replay(setup, out["steps"],
                                                                            {})
        out = dict(out, events=fresh["events"], incidents=fresh["incidents"])
    loss = [x for x in out["loss"] if x == x and abs(x) != float("inf")]
    return {"kind": kind, "name": name, "seed": seed, "steps": steps, "onset": first,
            "group": group, **meta, "events": out["events"], "incidents": out["incidents"],
            "replays": replays,
            "loss_first": statistics.median(loss[:10]) if loss else None,
            "loss_last": statistics.median(loss[-20:]) if loss else None,
            "curve": out["loss"],
            "cached": cached,
            "train_seconds": round(trained, 2), "seconds": round(time.time() - t0, 2),
            "cpu_seconds": round(time.process_time() - c0, 2)}
