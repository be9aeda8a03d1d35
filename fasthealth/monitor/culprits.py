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

A loss alone cannot tell a garbage sample the model happens to get half right from a hard good
one. Its pull can: the norm of the gradient that sample alone gives the weights. Over clean
samples the pull follows the loss closely (on a log-log scale, a line), and a sample whose
pull stands far above the line at its own loss moves the weights as no good sample of that
loss does (inputs of another scale, features the data never had). ``PullLine`` fits that
line to the pool, and a sample far above it is a culprit too.
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


PULL_SPREAD = 4.0
"""A sample's pull is out of line when it stands this many noise units (the residuals' median
absolute deviation, scaled to a normal's sigma) above the pool's line, and at least
``PULL_FLOOR`` above it. In the recovery evaluation's tuning families (an MLP on digits under
AdamW and under SGD, 8 rollback pools of 1,000-1,250 samples, 4-10% of them garbage) the clean
samples' residuals stood within 0.3 of the line (one at 0.6; the noise unit 0.12-0.13); at 4
units no clean sample was out of line, and the line found 4-35 garbage samples per pool that
the losses had missed (recall in the pools 0.75 -> 0.90); at 5, 0.86; at 6, 0.82."""
PULL_FLOOR = math.log(1.5)
"""The least a sample's pull must stand above the line (1.5 times a clean sample's pull at
its loss), whatever the noise: a pool of near-identical samples has a noise near 0."""


@dataclass(frozen=True)
class PullLine:
    """log(pull) = a + b log(loss) over a pool's clean samples, and the bar of a residual
    (``PULL_SPREAD``). ``fit`` trims the samples out of line and fits again, so that the bad
    samples of a pool do not bend the line toward them."""

    a: float
    b: float
    bar: float

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]], passes: int = 3) -> PullLine | None:
        """The line of ``points`` (loss, pull); None for fewer than ``MIN_POOL`` points with
        a positive, finite loss and pull, or losses all alike."""
        pts = [(math.log(x), math.log(y)) for x, y in points
               if 0 < x < math.inf and 0 < y < math.inf]
        line = None
        for _ in range(passes):
            if len(pts) < MIN_POOL:
                return line
            n = len(pts)
            mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
            sxx = sum((p[0] - mx) ** 2 for p in pts)
            if not sxx > 0:
                return line
            b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
            a = my - b * mx
            res = sorted(p[1] - a - b * p[0] for p in pts)
            mid = res[n // 2]
            sigma = 1.4826 * sorted(abs(r - mid) for r in res)[n // 2]
            width = max(PULL_SPREAD * sigma, PULL_FLOOR)
            line = cls(a + mid, b, width)
            pts = [p for p in pts if abs(p[1] - a - b * p[0] - mid) <= width]
        return line

    def above(self, loss: float, pull: float) -> bool:
        """Whether ``pull`` at ``loss`` stands above the bar: an infinite pull does; a NaN one
        or a loss of 0 or less or not finite is not judged here (a non-finite loss is a
        culprit already)."""
        if pull == math.inf:
            return True
        if not (0 < loss < math.inf and 0 < pull < math.inf):
            return False
        return math.log(pull) - self.a - self.b * math.log(loss) > self.bar


def sample_pulls(model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any], batch: Any,
                 n: int) -> list[float] | None:
    """Each of the ``n`` samples' pulls: the norm of the gradient its loss alone gives the
    model's trainable parameters, on the model as it is, in eval mode (no sample then depends
    on another), the RNG put back after and no ``.grad`` touched; None where it cannot be
    computed (a batch that cannot be split by sample, a loss without a gradient). Each sample
    alone, a forward and a backward of one: about a training step's arithmetic for the batch
    in all, where one backward per sample through the whole batch's graph would cost a
    batch's backward each (docs/performance.md, "The watch after a rollback"). Not
    ``torch.func.vmap``: the user's loss runs the model, and whatever its hooks keep (the
    Monitor's own probes among them) would keep vmap's batched tensors past it."""
    params = [p for p in model.parameters() if p.requires_grad]
    if n < 1 or not params or not _shares_first_dim(batch, n):
        return None
    modes = [(m, m.training) for m in model.modules()]
    device = params[0].device
    try:
        model.eval()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.enable_grad():
            return [_norm(torch.autograd.grad(
                torch.as_tensor(loss_fn(model, _split(batch, n, torch.tensor([i])))).float()
                .sum(), params, allow_unused=True)) for i in range(n)]
    except RuntimeError:  # no gradient to take: the search goes on the losses alone
        return None
    finally:
        for m, mode in modes:
            m.training = mode


def _norm(grads: Sequence[torch.Tensor | None]) -> float:
    return float(sum(g.detach().float().pow(2).sum() for g in grads if g is not None) ** 0.5)


@dataclass
class Found:
    """What ``search`` found: the culprits' sample ids, the samples run again, the batches
    above the threshold and those of them bad as a whole, the pool's outlier bar and its pull
    line."""

    ids: list[int] = field(default_factory=list)
    ran: int = 0
    bad: int = 0
    whole: int = 0
    bar: float = math.inf
    line: PullLine | None = None

    @property
    def source(self) -> bool:
        """Most bad batches bad as a whole: the data's source, not some samples of it."""
        return self.bad > 0 and 2 * self.whole > self.bad


def search(model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any],
           batches: Sequence[tuple[list[int], Any]], limit: float,
           bar: float = math.inf, line: PullLine | None = None) -> Found:
    """The culprits of ``batches``, (ids, batch) pairs (the module docstring): the samples
    that make their batch bad, those above the outlier bar (``outlier_bar`` of the pool, or
    ``bar`` where the pool is smaller) and those whose pull is out of line (``PullLine`` of
    the pool, or ``line``); a batch whose ids do not match its rows is passed over."""
    out, ids_found = Found(), set[int]()
    pool: list[tuple[int, float, float]] = []
    for ids, batch in batches:
        if not ids or out.ran + len(ids) > MAX_SAMPLES:
            continue
        losses = sample_losses(model, loss_fn, batch, len(ids))
        if losses is None:
            continue
        pulls = sample_pulls(model, loss_fn, batch, len(ids)) or [math.nan] * len(ids)
        out.ran += len(ids)
        pool += zip(ids, losses, pulls)
        where = culprits(losses, limit)
        out.bad += where is None or bool(where)
        out.whole += where is None
        ids_found.update(ids if where is None else [ids[i] for i in where])
    own = outlier_bar([v for _, v, _ in pool])
    out.bar = own if own < math.inf else bar
    out.line = PullLine.fit([(v, p) for _, v, p in pool]) or line
    bar = max(out.bar, limit)
    if not out.source:
        ids_found.update(i for i, v, _ in pool if v > bar)
        if out.line is not None:
            ids_found.update(i for i, v, p in pool if not math.isnan(p) and out.line.above(v, p))
    out.ids = sorted(ids_found)
    return out
