"""``sdc_suspect``: under data parallelism, a rank whose own gradients stood far above the
other ranks' before the reduction averaged them into every replica.

A GPU that computes a wrong product (a flipped bit in a matmul of the forward or the
backward) gives finite, wrong gradients on its rank; the all-reduce then spreads them, the
replicas stay equal, and no check that compares replicas sees anything. Before the
reduction each rank's own gradients are still its own: the Monitor's DDP hook (FSDP2: its
reduce-scatter) measures their norm, and the step's collectives give the largest over the
mean of the others' and the rank that holds it (``own_grad_ratio``, ``own_grad_rank``; no
host sync). Ranks that see different batches differ by a little; the corrupted elements that
harm a run are those a flipped top exponent bit makes 2^128 times larger (of a float32 or
bfloat16 value below 2: most activations and gradients), whose rank then stands 1e20 and more
above the others. ``OwnGradsConfig.ratio`` sits far above the first and far below the second.

With ``on_spike="skip"`` the step the rank corrupted is skipped on every rank, on the device
(``Monitor``: the average never reaches the weights or the optimizer's moments). The first time
a rank is named, a notice (the step it made may have been clipped away or skipped); the
``repeat``-th time the same rank is named in a run, an alarm that says to take that GPU out
of the job. ``named`` counts each rank's namings (the state)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..record import StepRecord
from .base import Finding, Rule, skipped


@dataclass(frozen=True)
class OwnGradsConfig:
    ratio: float = 1e4
    """A rank's own gradient norm over the mean of the other ranks': at or above this, the
    rank is named. Far above what data can do (a rank whose inputs are a thousand times too
    large stands about 1,600x out, so unnormalised pixels on one rank are not named) and far
    below what a flipped top exponent bit does (1e20 and more); the figures behind it are in
    docs/spec.md, next to the record's ``own_grad_ratio``."""
    repeat: int = 3
    """Namings of the same rank in a run that make the alarm: one flip is a cosmic ray, a GPU
    that keeps making them is failing."""


class OwnGrads(Rule[OwnGradsConfig]):
    name = "own_grads"
    kinds = ("sdc_suspect",)
    Config = OwnGradsConfig
    STATE = ("named",)

    def __init__(self, config: OwnGradsConfig | None = None, ctx=None) -> None:
        super().__init__(config, ctx)
        self.named: dict[int, int] = {}

    def observe(self, s: StepRecord) -> list[Finding]:
        ratio = s.values.get("own_grad_ratio", math.nan)
        rank = s.values.get("own_grad_rank", math.nan)
        if not ratio >= self.config.ratio or not math.isfinite(rank):
            return []
        r = int(rank)
        self.named[r] = n = self.named.get(r, 0) + 1
        again = n >= self.config.repeat
        what = (f"rank {r}'s own gradients were {ratio:.3g}x the other ranks' mean before they "
                f"were averaged into every replica")
        if again:
            advice = (f"; rank {r} has been named {n} times in this run: take its GPU out of "
                      "the job (a failing GPU's arithmetic: silent data corruption), and resume "
                      "from a checkpoint saved before the first")
        else:
            advice = (". Check first: that rank's hardware (silent data corruption: a flipped "
                      "bit in a matmul; the GPU's ECC and error logs), then that rank's batch")
        if skipped(s):
            what += " (the step was skipped on every rank)"
        return [Finding("sdc_suspect", what + advice,
                        {"rank": r, "ratio": ratio, "times": n},
                        severity="alarm" if again else None)]
