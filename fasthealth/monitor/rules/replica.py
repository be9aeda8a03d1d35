"""``replica_divergence``: under a process group, ranks whose replicas (DDP's copies of the
gradients) disagree (``fasthealth.distributed``): reported once until they agree again,
naming the ranks."""

from __future__ import annotations

import math

from ...stats import decode_ranks
from ..record import StepRecord
from .base import Finding, NoConfig, Rule, listed


class ReplicaDivergence(Rule[NoConfig]):
    name = "replica_divergence"
    kinds = ("replica_divergence",)
    STATE = ("active",)

    def __init__(self, config=None, ctx=None) -> None:
        super().__init__(config, ctx)
        self.active = False

    def observe(self, s: StepRecord) -> list[Finding]:
        count = s.values.get("replica_mismatch", math.nan)
        if not count > 0:
            self.active = False
            return []
        if self.active:
            return []
        self.active = True
        ranks = decode_ranks(s.values["replica_mismatch_mask"])
        lowest = s.values.get("replica_mismatch_rank", math.nan)
        if not ranks and math.isfinite(lowest):  # named above rank 51: the lowest of them
            ranks = [int(lowest)]
        named = (f": ranks {listed(map(str, ranks))}" if ranks else
                 " (several ranks of a set disagree alike: counted, not named)")
        return [Finding(
            "replica_divergence",
            f"the gradients of {int(count)} rank(s) differ from their replicas'{named}. Check "
            "first: those ranks' hardware (silent data corruption: ECC errors, a failing GPU), "
            "then whether every rank runs the same code and data order (a desynchronised "
            "rank)", {"ranks": ranks, "count": int(count)})]
