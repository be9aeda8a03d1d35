"""The families split into TUNING and HELD_OUT, and the jobs a run of the evaluation does.

The split is each family's ``held_out`` (hf.py, lit.py). TUNING (15 families: ten HF Trainer,
five Lightning) is what the monitor may be tuned on. Five of them (the fused AdamW with label
smoothing, RMSprop on the breast-cancer table, a BERT under Adafactor and bf16, RMSprop with
OneCycleLR, Lightning's manual optimization) were held out until the first held-out scoring and
are tuning families since. HELD_OUT (5: three HF Trainer, two Lightning), chosen after that
scoring and not tuned on, differs from every tuning family in kind, not only in seed: Llama on
bytes under warmup_stable_decay with accumulation, the user's NAdam with ExponentialLR on the
iris table, a ``compute_loss_func`` (cross-entropy plus a z-loss) with inverse_sqrt under bf16,
a regression (mean squared error, the diabetes table) under SGD with Nesterov momentum and
CosineAnnealingLR, and Adamax with PolynomialLR, accumulation 4 and ``gradient_clip_val``.
``evaluation/eval_trainers.py`` runs the held-out set only under ``--final``, scored once at the
end.

Every fault that applies to a family (``faults.applies``: its data and model have what the
fault needs) is planted in it; healthy runs take every seed, faulted runs the first.
``--quick`` is a smoke run: 100 steps, one seed, three faults, the log check on one family
of each trainer.
"""

from __future__ import annotations

from .faults import FAULTS, applies
from .runner import FAMILIES

TUNING = tuple(n for n, f in FAMILIES.items() if not f.held_out)
HELD_OUT = tuple(n for n, f in FAMILIES.items() if f.held_out)

# steps None: each family's own (``steps``: 300, 400 for the warm restarts of T_0=100)
FULL = {"steps": None, "seeds": (0, 1), "faults": tuple(FAULTS), "log_checks": "all"}
QUICK = {"steps": 100, "seeds": (0,), "faults": ("garbage_batch", "bit_flip", "lr_x20"),
         "log_checks": "one per trainer"}


def faults_for(family: str, names: tuple[str, ...] = tuple(FAULTS)) -> list[str]:
    tags = FAMILIES[family].tags
    return [n for n in names if applies(FAULTS[n], tags)]


def jobs(families: tuple[str, ...], cfg: dict) -> tuple[list[dict], list[dict]]:
    """(runs, log checks) for ``families`` under ``cfg`` (FULL or QUICK, possibly narrowed)."""
    runs, checks = [], []
    seeds = cfg["seeds"]
    for fam in families:
        steps = cfg["steps"] or FAMILIES[fam].steps
        for seed in seeds:
            runs.append({"family": fam, "fault": None, "seed": seed, "steps": steps})
        for fault in faults_for(fam, cfg["faults"]):
            runs.append({"family": fam, "fault": fault, "seed": seeds[0], "steps": steps})
    seen: set[str] = set()
    for fam in families:
        trainer = FAMILIES[fam].trainer
        if cfg["log_checks"] == "all" or trainer not in seen:
            checks.append({"family": fam, "seed": seeds[0],
                           "steps": cfg["steps"] or FAMILIES[fam].steps})
            seen.add(trainer)
    return runs, checks
