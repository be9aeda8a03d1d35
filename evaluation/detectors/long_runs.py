"""The long runs: what the corpus's families and faults become over thousands of steps.

The families of ``families.py`` run 400-600 steps; real runs go on for tens of thousands, long
after the loss has reached its floor (converged, at the entropy label smoothing leaves, a small
set memorised), through schedules that end, plateaus after a decay, restarts many cycles long.
A rule tuned on short runs meets there what it never saw: a floor so quiet that an ordinary
hard batch stands many noise units out, minima over thousands of steps that only the noise
made.

- ``HEALTHY``: every family at ``LONG`` steps (some at ``LONGEST``), and the families made for
  long runs only (``Family.long``). Tuning or held out as in the short corpus: the long runs
  of the held-out families, and the long-only families marked ``held_out``, are run only with
  ``evaluation/eval_long_runs.py --final``.
- ``FAULTS``: every fault that starts after step 0, planted at ``LATE`` of a ``LONG``-step
  run: caught as early, or not?
- ``UNSTABLE``: families that, run that long, go unstable by themselves (seen once, reported
  with their alarms, not counted as healthy steps; the reason beside each).
"""

from __future__ import annotations

from dataclasses import dataclass

from families import FAMILIES
from faults import FAULTS as ALL_FAULTS

LONG = 8000
LONGEST = 30000
LATE = 0.85  # of the run: a fault in its last sixth
HEALTHY_SEEDS = (0, 1)
FAULT_SEEDS = (1000, 1001)

UNSTABLE: dict[str, str] = {
    "diabetes_mlp_rmsprop": (
        "RMSprop at a constant learning rate memorises the 442 rows (the loss 0.6 -> 0.004) and "
        "from step ~3000 on spikes again and again, the loss 2-12x and the gradient norm 2-6x "
        "their level: the instability of Adam-like optimizers near zero gradients, a fault of "
        "the run, not a healthy floor"),
}


@dataclass(frozen=True)
class LongRun:
    kind: str  # "healthy" or "fault"
    name: str
    steps: int
    held_out: bool
    onset: float | None = None  # a fault's onset, a fraction of the run

    @property
    def key(self) -> str:
        return f"{self.name}@{self.steps}"


def _runs() -> list[LongRun]:
    runs = [LongRun("healthy", n, LONG if not f.long else f.steps, f.held_out)
            for n, f in FAMILIES.items()]
    runs += [LongRun("healthy", n, LONGEST, FAMILIES[n].held_out)
             for n in ("iris_mlp_sgd_constant", "digits_mlp_adamw_label_smoothing",
                       "diabetes_linear_sgd_batch8")]
    runs += [LongRun("fault", n, LONG, f.held_out, LATE) for n, f in ALL_FAULTS.items()
             if f.onset > 0]
    return runs


RUNS = _runs()
HEALTHY = [r for r in RUNS if r.kind == "healthy" and r.name not in UNSTABLE]
FAULTS = [r for r in RUNS if r.kind == "fault"]
