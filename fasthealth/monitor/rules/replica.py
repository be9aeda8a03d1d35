"""``replica_divergence``: under a process group, ranks whose replicas disagree
(``fasthealth.distributed``): DDP's copies of the gradients at every step, or of the parameters
after the step, compared once per flush (silent data corruption that reached the weights, or a
desynchronised rank). Reported once until they agree again, naming the ranks and, for the
parameters, the first tensor that differs. ``active`` holds what is being reported: 1 the
gradients, 2 the parameters (a state saved as True reads as the gradients)."""

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
        self.active = 0

    def observe(self, s: StepRecord) -> list[Finding]:
        found = self._gradients(s)
        weights = s.values.get("weight_replica_mismatch", math.nan)
        if weights == 0:
            self.active = int(self.active) & 1
        elif weights > 0 and not int(self.active) & 2:
            self.active = int(self.active) | 2
            found += self._weights(s, int(weights))
        return found

    def _gradients(self, s: StepRecord) -> list[Finding]:
        count = s.values.get("replica_mismatch", math.nan)
        if not count > 0:
            self.active = int(self.active) & 2
            return []
        if int(self.active) & 1:
            return []
        self.active = int(self.active) | 1
        ranks = _named(s, "replica_mismatch", "replica_mismatch_mask", "replica_mismatch_rank")
        named = (f": ranks {listed(map(str, ranks))}" if ranks else
                 " (several ranks of a set disagree alike: counted, not named)")
        return [Finding(
            "replica_divergence",
            f"the gradients of {int(count)} rank(s) differ from their replicas'{named}. Check "
            "first: those ranks' hardware (silent data corruption: ECC errors, a failing GPU), "
            "then whether every rank runs the same code and data order (a desynchronised "
            "rank)", {"ranks": ranks, "count": int(count)})]

    def _weights(self, s: StepRecord, count: int) -> list[Finding]:
        ranks = _named(s, "weight_replica_mismatch", None, "weight_replica_rank")
        at = s.values.get("weight_replica_tensor", math.nan)
        names = self.ctx.names if self.ctx is not None else []
        tensor = names[int(at)] if math.isfinite(at) and int(at) < len(names) else None
        where = f" first in {tensor}" if tensor else ""
        who = (f"rank {ranks[0]}" if ranks and count == 1 else
               f"ranks {listed(map(str, ranks))}" if ranks and len(ranks) >= count else
               f"{count} ranks (rank {ranks[0]} among them)" if ranks else f"{count} rank(s)")
        return [Finding(
            "replica_divergence",
            f"the parameters of {who} differ from their replicas'{where} after the step: a "
            "replica that no longer trains the same model. Check first: that rank's hardware "
            "(silent data corruption in memory or in the optimizer's update), then restart it "
            "from a replica's weights", {"ranks": ranks, "count": count, "tensor": tensor,
                                         "what": "parameters"})]


def _named(s: StepRecord, count: str, mask: str | None, lowest: str) -> list[int]:
    """The ranks a record names: every one, where several differ alike and the flush named
    them (``StepHost.alike``); else those of the bit mask (below 52), else the lowest named."""
    if s.host.alike and count in s.host.alike:
        return s.host.alike[count]
    ranks = decode_ranks(s.values.get(mask, math.nan)) if mask else []
    low = s.values.get(lowest, math.nan)
    if not ranks and math.isfinite(low):
        ranks = [int(low)]
    return ranks
