"""Which samples of an incident's batches are bad: what a rollback quarantines
(``rollback.py``), found on the restored state, from the data's own losses.

Each batch the incident's steps were given is run again without gradients on the state just
restored, in eval mode (dropout off, BatchNorm on its running statistics: one sample can be
run alone, and no buffer moves), through the user's ``replay(model, batch)``. Where it gives
one loss per sample (``reduction="none"``) that is one forward per batch; else each sample is
run alone. A batch whose mean loss there stands no higher than ``threshold`` (the level before
the incident, plus the larger of ``recover`` of it and ``zscore`` noise units of the batch
losses before it: what a healthy batch reaches) holds no culprit. In a batch above it, the
culprits are the fewest samples, the highest losses first (any non-finite one first of all),
whose removal brings the rest under it: the samples that alone make the batch bad, not the
bystanders beside them. A sample whose loss stands far above the pool of all the samples
searched (``OUTLIER_SPREAD``) is one too, in any batch: one bad sample among 32 seldom lifts
its batch that far. A sample of ordinary difficulty is never one: removing the bad ones
already brought its batch back. A batch that needs more than half its samples removed is bad
as a whole at this state: no few samples explain it, and all of its samples are culprits (a
corrupt shard served again after a resume must not be trained on). When most of the bad
batches are bad as a whole, the source of the data is bad (a stream of garbage), not some
samples of it: the rollback's ladder counts it as a rollback that made no progress
(``rollback.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .replay import _shares_first_dim, _split

MAX_SAMPLES = 4096
"""Samples run again at most per rollback (each alone, where the loss is not per sample): the
search's cost stays a few seconds on a small model; the incident's later batches wait for the
fault's next return."""


def threshold(level: float, noise: float, recover: float, zscore: float) -> float:
    """The highest mean loss a healthy batch reaches (the module docstring)."""
    return level + max(recover * abs(level), zscore * noise)


def culprits(losses: Sequence[float], limit: float) -> list[int] | None:
    """The positions of ``losses`` (one batch's, per sample) that make its mean exceed
    ``limit`` (the module docstring); [] when it does not; None when the batch is bad as a
    whole."""
    n = len(losses)
    if n == 0:
        return []
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    ok = [i for i, v in enumerate(losses) if math.isfinite(v)]
    total = sum(losses[i] for i in ok)
    if not bad and total / n <= limit:
        return []
    out, rest = list(bad), len(ok)
    for i in sorted(ok, key=lambda i: losses[i], reverse=True):
        if rest <= 1 or total / rest <= limit:
            break
        out.append(i)
        total -= losses[i]
        rest -= 1
    if len(out) > n // 2:  # bad as a whole at this state
        return None
    return sorted(out)


def sample_losses(model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any], batch: Any,
                  n: int) -> list[float] | None:
    """Each of the ``n`` samples' losses on ``model`` as it is, in eval mode, without
    gradients, the RNG put back after; None where the batch cannot be split by sample."""
    if n < 1 or not _shares_first_dim(batch, n):
        return None
    modes = [(m, m.training) for m in model.modules()]
    device = next(model.parameters()).device
    try:
        model.eval()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.no_grad():
            whole = torch.as_tensor(loss_fn(model, batch)).detach().float().flatten()
            if whole.numel() == n and n > 1:
                return whole.cpu().tolist()
            return [float(torch.as_tensor(loss_fn(model, _split(batch, n, torch.tensor([i]))))
                          .detach().float().mean()) for i in range(n)]
    finally:
        for m, mode in modes:
            m.training = mode


OUTLIER_SPREAD = 2.0
"""A sample is also a culprit, whatever its batch, when its loss stands this many times the
pool's log-spread (the log of its 0.9 quantile over its median) above the pool's median: the
pool of every sample searched, clean for the most part. In the recovery evaluation's tuning
families the clean samples' losses on the restored state reached 3.1-3.9 at most (of 7,000 or
more each), garbage samples mostly 4-55; their spread put the bar at 3.0-3.1 (at 2.5, 4.0 and
5.5: half the garbage passed). A bad sample rarely lifts its batch of 32 past the batch's own
threshold (``threshold``: 6 noise units of the batch losses), which alone found half of them."""
MIN_POOL = 64
"""Samples a pool needs before its outlier bar is used (the watch's single batches use the
bar of the rollback's pool)."""


def outlier_bar(losses: Sequence[float]) -> float:
    """The per-sample bar of a pool of losses (``OUTLIER_SPREAD``); inf for a pool smaller
    than ``MIN_POOL`` or without a positive median."""
    finite = sorted(v for v in losses if math.isfinite(v))
    if len(finite) < MIN_POOL:
        return math.inf
    median, q90 = finite[len(finite) // 2], finite[int(0.9 * (len(finite) - 1))]
    if not median > 0 or not q90 > median:
        return math.inf
    return median * (q90 / median) ** OUTLIER_SPREAD


@dataclass
class Found:
    """What ``search`` found: the culprits' sample ids, the samples run again, the batches
    above the threshold and those of them bad as a whole, and the pool's outlier bar."""

    ids: list[int] = field(default_factory=list)
    ran: int = 0
    bad: int = 0
    whole: int = 0
    bar: float = math.inf

    @property
    def source(self) -> bool:
        """Most bad batches bad as a whole: the data's source, not some samples of it."""
        return self.bad > 0 and 2 * self.whole > self.bad


def search(model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any],
           batches: Sequence[tuple[list[int], Any]], limit: float,
           bar: float = math.inf) -> Found:
    """The culprits of ``batches``, (ids, batch) pairs (the module docstring), and the samples
    above the outlier bar (``outlier_bar`` of the pool, or ``bar`` where the pool is smaller);
    a batch whose ids do not match its rows is passed over."""
    out, ids_found = Found(), set[int]()
    pool: list[tuple[int, float]] = []
    for ids, batch in batches:
        if not ids or out.ran + len(ids) > MAX_SAMPLES:
            continue
        losses = sample_losses(model, loss_fn, batch, len(ids))
        if losses is None:
            continue
        out.ran += len(ids)
        pool += zip(ids, losses)
        where = culprits(losses, limit)
        out.bad += where is None or bool(where)
        out.whole += where is None
        ids_found.update(ids if where is None else [ids[i] for i in where])
    own = outlier_bar([v for _, v in pool])
    out.bar = own if own < math.inf else bar
    bar = max(out.bar, limit)
    if not out.source:
        ids_found.update(i for i, v in pool if v > bar)
    out.ids = sorted(ids_found)
    return out
