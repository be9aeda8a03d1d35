"""Replay the step behind an event: tell a data problem (it reproduces) from a transient fault,
name where the first non-finite value came from, and which samples cause it.

``fh.replay(event.dump, model, loss_fn)`` loads the dump a Monitor saved (batch, sample ids, RNG
state and, when they fit the snapshot budget, the parameters as they were before that step's
update) without running any code from it (``weights_only``), re-runs that forward and backward
on a deep copy of ``model`` with a hook on every module, and compares with what was recorded.
``loss_fn(model, batch) -> loss``.

- ``source``: ``"batch"`` when the dumped batch itself holds NaN/Inf (checked directly),
  ``"forward"`` / ``"backward"`` when a module (or the loss function) made the first non-finite
  value in that pass, None when the step does not reproduce.
- ``first_nonfinite``: the innermost module, leaf or not, whose inputs were finite and whose
  output was not (a masked softmax inside an attention block names the block).
- ``culprit_ids``: with sample ids and a batch whose tensors share their first dimension, a
  group test finds every sample that alone reproduces the event: halves are replayed, and
  every half that reproduces is split again (at most ``max_replays``, by default ``4 x`` the
  batch size: ``capped`` says the search stopped there). A part of ``m`` samples reproduces
  a spike when its excess over the window's median is at least half the recorded excess
  divided by ``m`` (a mean over ``m`` samples dilutes one bad sample ``m``-fold), and it is
  judged on its non-finite values and spikes only (its loss is not the batch's). When no
  single sample reproduces but the batch does, ``culprit_ids`` is the smallest part found that
  does.
- ``cause`` (``kinds.CAUSES``), the first that applies: non-finite optimizer state in the
  dump: "optimizer_state"; reproduced with dumped parameters that hold NaN/Inf or a value of
  1e10 or more: "weights", whichever samples reproduce it (they only read the broken weights:
  a NaN row of an embedding, a 1e30 weight that only some inputs reach); a weight scan's
  finding among the events (``weight_corruption``: the damage seen itself): "weights"; not
  reproduced:
  "numeric_range" under a GradScaler with non-finite gradients (replay runs unscaled), else
  "outside" (the loss code first: a loss computed differently at that step; then a transient
  hardware fault); reproduced by the batch's own NaN/Inf: "batch"; when the dump's learning
  rate (the last 8 steps) is 3x or more its earlier median: "learning_rate" (whichever samples
  reproduce it: the model it damaged fails on some of them); events that no batch makes (a
  trend, a state problem: no non-finite value, no spike): their kind's own cause; by some
  samples only: "batch";
  by every sample alone, only by the whole batch, or without a search: the batch of the step
  before (the dump's ``control``), replayed on the same weights, tells whether it makes the
  same non-finite values or spikes: it does too, the model state, "weights"; it does not,
  "batch" (a batch that is junk throughout). The verdict names the control's finding only
  where it decided the cause. Without a
  control: "weights" when every sample reproduces, "batch" without a search (the verdict says
  the model state may be).

``loss_far``: not reproduced, with a replayed loss far from the recorded one (beyond 3 noise
units of the run's loss, else 5% of it): the verdict then says first that the dump may not hold
the batch trained on (a prefetched next batch, one micro-batch of an accumulation step, a loss
scaled differently), before the loss code and a transient fault.

What replay found is also written beside the dump, as ``<dump>.replay.json`` (``result_path``):
reproduced, source, first_nonfinite, culprit_ids, the verdict, so that ``fasthealth report``
shows it with the incident. The file is new (written to a temporary name, then renamed over
any earlier result of the same dump); the dump and the user's files are never touched, and a
failed write warns without failing the replay.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..activations import ActivationMonitor
from ..checks import check_grads, multi_tensor_stats
from ..stats import MultiTensorStats
from .kinds import cause_of, fatal_kinds
from .record import map_tensors
from .replay_text import cause_text, loss_far, verdict_text

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
RESULT_SUFFIX = ".replay.json"  # what replay found, beside the dump: "<dump>.replay.json"
SPIKES = ("loss_spike", "grad_norm_spike")  # judged by their excess; samples can cause them


@dataclass
class ReplayResult:
    reproduced: bool
    loss: float
    grads: MultiTensorStats
    first_nonfinite: str | None
    verdict: str
    exact: bool  # parameters restored from the dump (else: the model's current ones)
    kinds: list[str] = field(default_factory=list)
    recorded: dict = field(default_factory=dict)
    source: str | None = None  # "batch", "forward", "backward", or None (did not reproduce)
    culprit_ids: list | None = None  # sample ids of every sample that alone reproduces
    replays: int = 1  # forward + backward passes run, the group test's included
    cause: str | None = None  # the likely cause, one of kinds.CAUSES
    capped: bool = False  # the group test stopped at its cap of replays
    loss_far: bool = False  # not reproduced, with a loss far from the recorded one: the dump
    # may not hold the batch trained on (a prefetched one, one micro-batch of the step)


def _bare(name: str) -> str:
    """A parameter name without the prefixes of DDP / DataParallel (``module.``) and
    torch.compile (``_orig_mod.``)."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
        name = name.replace("._orig_mod.", ".")
    return name


def load_dump(path: str | os.PathLike) -> dict:
    """A Monitor dump, loaded without running code from it (``weights_only``): an error names
    the file when it is missing, truncated or not a dump."""
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"fasthealth: no dump at {path}") from None
    except Exception as exc:
        raise ValueError(f"fasthealth: {path} is not a readable Monitor dump (corrupt, "
                         f"truncated, or holds objects other than tensors and plain data): "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(d, dict) or "batch" not in d or "step" not in d:
        raise ValueError(f"fasthealth: {path} is not a Monitor dump")
    return d


def _restore(m: torch.nn.Module, params: dict[str, torch.Tensor], path: str) -> None:
    """Copies the dumped parameters into ``m``, matching names with or without wrapper
    prefixes, after checking that every name and shape matches."""
    own = {_bare(n): p for n, p in m.named_parameters()}
    for name, value in params.items():
        p = own.get(_bare(name))
        if p is None:
            raise ValueError(f"fasthealth: {path} has parameter {name!r}, which this model "
                             "lacks: is it the same model?")
        if tuple(p.shape) != tuple(value.shape):
            raise ValueError(f"fasthealth: {path} has {name!r} of shape {tuple(value.shape)}, "
                             f"the model's is {tuple(p.shape)}: is it the same model?")
    with torch.no_grad():
        for name, value in params.items():
            own[_bare(name)].copy_(value)


def _float_leaves(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(lambda t: out.append(t) if t.is_floating_point() else None, obj)
    return out


def _batch_nonfinite(batch: Any) -> int:
    ts = [t.detach() for t in _float_leaves(batch)]
    if not ts:
        return 0
    total = multi_tensor_stats(ts).total
    return int(total.nan_count + total.inf_count)


class _Pass:
    """One forward + backward of ``loss_fn`` on ``m``, with hooks on every module."""

    def __init__(self, m: torch.nn.Module, loss_fn: Any, batch: Any, rng: dict):
        cpu_state = torch.get_rng_state()
        try:
            if "cpu" in rng:
                torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            m.zero_grad(set_to_none=True)
            am = ActivationMonitor(m, modules="all", grads="leaves")
            try:
                with warnings.catch_warnings():  # hooks on modules whose inputs need no grad
                    warnings.filterwarnings("ignore", message="Full backward hook")
                    loss = loss_fn(m, batch)
                    loss.backward()
                self.grads = check_grads(m)
                self.first = am.first_nonfinite
                self.where = am.source
            finally:
                am.remove()
        finally:
            torch.set_rng_state(cpu_state)
        self.loss = float(loss.detach().float())


def _reproduces(p: _Pass, events: list[dict], record: dict, part: int | None = None) -> bool:
    """Whether pass ``p`` reproduces ``events``; ``part``: the samples of a part of the batch
    replayed (a spike's excess diluted that many times counts, and only the non-finite values
    and spikes are judged: a part's loss is not the batch's)."""
    checks = []
    if part is not None:
        judged = [e for e in events if e["kind"] in fatal_kinds() or e["kind"] in SPIKES]
        events = judged or events
    for e in events:
        if e["kind"] in fatal_kinds():
            checks.append(not math.isfinite(p.loss) or not p.grads.ok)
        elif e["kind"] in SPIKES:
            value = p.loss if e["kind"] == "loss_spike" else float(p.grads.total.norm)
            checks.append(_spike_reproduced(value, e["details"], part or 1))
        else:  # trends and state problems: the step itself replays to the same loss
            rec = record.get("loss")
            checks.append(rec is not None and math.isclose(p.loss, rec, rel_tol=1e-3))
    return bool(checks) and all(checks)


def _spike_reproduced(value: float, details: dict, part: int = 1) -> bool:
    """At least half of the recorded excess over the window's median comes back (divided by
    ``part``, the samples of a part: one bad sample among them shows diluted that much)."""
    if not math.isfinite(value):
        return True
    median, recorded = details.get("window_median"), details.get("value")
    if median is None or recorded is None:
        return False
    return value - median >= 0.5 * (recorded - median) / part


def _split(batch: Any, n: int, idx: torch.Tensor) -> Any:
    return map_tensors(lambda t: t[idx.to(t.device)] if t.dim() and t.shape[0] == n else t,
                       batch)


def _shares_first_dim(batch: Any, n: int) -> bool:
    """Every tensor of ``batch`` with a batch dimension has ``n`` rows. 0-dim tensors (the
    Hugging Face Trainer's ``num_items_in_batch``) ride along unchanged into each part."""
    leaves: list[torch.Tensor] = []
    map_tensors(leaves.append, batch)
    batched = [t for t in leaves if t.dim()]
    return bool(batched) and all(t.shape[0] == n for t in batched)


CAP = 4  # the group test's replays, at most this many times the batch size


def _part_pass(m: torch.nn.Module, loss_fn: Any, part: Any, rng: dict) -> _Pass:
    """A part of the batch replayed in train mode as the step was; where train mode cannot
    run it (BatchNorm on one sample whose feature maps are 1x1: "Expected more than 1 value
    per channel when training"), with the batch norms on their running statistics instead,
    which keeps each sample's NaN/Inf its own. On the copy of the model: nothing of the
    user's moves."""
    try:
        return _Pass(m, loss_fn, part, rng)
    except ValueError:
        norms = [x for x in m.modules()
                 if isinstance(x, torch.nn.modules.batchnorm._BatchNorm) and x.training]
        if not norms:
            raise
        for x in norms:
            x.eval()
        try:
            return _Pass(m, loss_fn, part, rng)
        finally:
            for x in norms:
                x.train()


def _group_test(m, loss_fn, batch, d: dict, n: int, cap: int
                ) -> tuple[list[int], list[int], int, bool]:
    """Replays halves of the batch, splitting again every half that reproduces the events:
    (the samples that alone reproduce them, the smallest part found that does, the replays
    run, whether the search stopped at ``cap`` replays)."""
    singles: list[int] = []
    smallest, replays, capped = torch.arange(n), 0, False
    stack = [torch.arange(n)]
    while stack and not capped:
        current = stack.pop()
        if len(current) == 1:
            singles.append(int(current[0]))
            continue
        half = len(current) // 2
        for part in (current[:half], current[half:]):
            if replays >= cap:
                capped = True
                break
            replays += 1
            p = _part_pass(m, loss_fn, _split(batch, n, part), d.get("rng") or {})
            if _reproduces(p, d.get("events", []), d.get("record", {}), len(part)):
                stack.append(part)
                if len(part) < len(smallest):
                    smallest = part
    return sorted(singles), smallest.tolist(), replays, capped


LR_RECENT, LR_FAR = 8, 3.0  # the lr of the last 8 steps 3x its earlier median: far above


def _lr_far_above(d: dict) -> bool:
    """Whether the dump's learning rate (the highest of its last ``LR_RECENT`` steps) is
    ``LR_FAR`` times or more the median of the earlier ones it recorded (lr_jump's 3x)."""
    lrs = [lr for _, lr in d.get("recent_lr") or [] if isinstance(lr, (int, float))]
    if len(lrs) <= LR_RECENT:
        return False
    earlier = sorted(lrs[:-LR_RECENT])[len(lrs[:-LR_RECENT]) // 2]
    return earlier > 0 and max(lrs[-LR_RECENT:]) >= LR_FAR * earlier


HUGE_WEIGHT = 1e10  # no trained weight comes near: a parameter this large is corrupt


def _params_broken(d: dict) -> list[str]:
    """The dumped parameters that hold NaN/Inf or a value of ``HUGE_WEIGHT`` or more."""
    params = d.get("params") or {}
    return [n for n, t in params.items()
            if t.is_floating_point() and not bool((t.abs() < HUGE_WEIGHT).all())]


def _control(m, loss_fn, d: dict, dev: torch.device) -> bool | None:
    """Whether the batch of the step before (the dump's ``control``), replayed on the same
    weights, reproduces the events too (then the model state causes them, not this batch);
    None without one or when it cannot be replayed."""
    control = d.get("control")
    judged = [e for e in d.get("events", []) if e["kind"] in fatal_kinds() or e["kind"] in SPIKES]
    if not isinstance(control, dict) or control.get("batch") is None or not judged:
        return None  # (a trend or a state problem: no batch makes it, this one or another)
    ours: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    map_tensors(ours.append, d["batch"])
    map_tensors(theirs.append, control["batch"])
    if len(ours) == len(theirs) and all(a.shape == b.shape and torch.equal(a, b)
                                        for a, b in zip(ours, theirs)):
        return None  # the same values (a loader that refills one buffer): no control
    try:
        p = _Pass(m, loss_fn, map_tensors(lambda t: t.to(dev), control["batch"]),
                  d.get("rng") or {})
    except Exception:  # a loss_fn that cannot take that batch: no control
        return None
    # judged on what a batch makes, its non-finite values and spikes (``part``): another
    # batch never replays to this step's loss, so a trend's or a state problem's test of the
    # step itself says nothing about it
    return _reproduces(p, judged, d.get("record", {}), 1)


def _cause(d: dict, kinds: list[str], reproduced: bool, source: str | None,
           singles: list | None, n: int, control: bool | None) -> str:
    """The likely cause (see the module docstring)."""
    if (d.get("optimizer") or {}).get("nonfinite"):
        return "optimizer_state"
    if reproduced and _params_broken(d):
        return "weights"  # the samples that reproduce it only read the broken weights
    if "weight_corruption" in kinds:
        return "weights"  # a weight scan saw the damage itself (a finite jump included)
    if not reproduced:
        scaled = d.get("record", {}).get("loss_scale") is not None
        ranged = {"nonfinite_grad", "loss_scale_collapse", "overflow_streak"} & set(kinds)
        return "numeric_range" if scaled and ranged else "outside"
    if source == "batch":
        return "batch"
    if _lr_far_above(d):
        return "learning_rate"  # the samples that reproduce it are the ones it hurts most
    if not any(k in fatal_kinds() or k in SPIKES for k in kinds):
        return cause_of(kinds[0]) if kinds else "batch"  # no batch makes a trend
    if singles and len(singles) < n:
        return "batch"
    if control is not None:  # every sample (or no search): the batch before tells
        return "weights" if control else "batch"
    return "batch" if singles is None else "weights"


def result_path(dump: str | os.PathLike) -> Path:
    """Where replay writes what it found for ``dump``: beside it, ``<dump>.replay.json``."""
    p = Path(dump)
    return p.with_name(p.name + RESULT_SUFFIX)


def _jsonable_id(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def save_result(dump: str | os.PathLike, d: dict, r: ReplayResult) -> Path | None:
    """Writes ``r`` (what replay found for ``dump``, loaded as ``d``) to ``result_path(dump)``
    atomically: a temporary file in the same folder, renamed over the result's name. Returns
    the path, or None (with a warning) when it could not be written: the replay stands."""
    out = result_path(dump)
    rec = {"record": "replay", "dump": Path(dump).name, "step": d.get("step"),
           "reproduced": r.reproduced, "source": r.source, "first_nonfinite": r.first_nonfinite,
           "culprit_ids": None if r.culprit_ids is None else [_jsonable_id(i)
                                                               for i in r.culprit_ids],
           "kinds": r.kinds, "exact": r.exact, "replays": r.replays, "cause": r.cause,
           "capped": r.capped, "loss_far": r.loss_far,
           "loss": r.loss if math.isfinite(r.loss) else None, "verdict": r.verdict}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, out)
        return out
    except (OSError, TypeError, ValueError) as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        warnings.warn(f"fasthealth: replay's result could not be written to {out}: {exc} "
                      "(the replay itself is unaffected)", RuntimeWarning, stacklevel=3)
        return None


def replay(dump: str | os.PathLike, model: torch.nn.Module, loss_fn: Any, *,
           device: torch.device | str | None = None,
           find_samples: bool | None = None, save: bool = True,
           max_replays: int | None = None) -> ReplayResult:
    """Re-run the captured step on a copy of ``model``; see the module docstring.
    ``find_samples``: search the batch for the samples that cause the event (default: when
    the dump has sample ids, the batch's tensors all have a first dimension of that length,
    and the event is a non-finite value or a spike: a trend has no samples to find); False
    also skips the control replay of the batch before.
    ``save``: write the result beside the dump (``result_path``) for ``fasthealth report``.
    ``max_replays``: the group test's cap (default ``4 x`` the batch size; halving needs at
    most twice the batch size: the cap bounds the cost on a large batch)."""
    if dump is None:
        raise ValueError("fasthealth: this event has no dump (was the Monitor given log_dir?)")
    path = str(dump)
    d = load_dump(path)
    m = copy.deepcopy(model)
    exact = d.get("params") is not None
    if exact:
        _restore(m, d["params"], path)
    dev = torch.device(device) if device is not None else next(m.parameters()).device
    batch = map_tensors(lambda t: t.to(dev), d["batch"])
    p = _Pass(m, loss_fn, batch, d.get("rng") or {})
    events = d.get("events", [])
    reproduced = _reproduces(p, events, d.get("record", {}))
    source = None
    if reproduced and any(e["kind"] in fatal_kinds() for e in events):
        source = ("batch" if _batch_nonfinite(batch) else
                  "backward" if p.where == "backward" else "forward")
    ids = d.get("sample_ids")
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    id_list = ids if isinstance(ids, (list, tuple)) else []
    n = len(id_list)
    searches = find_samples is not False  # False: the one replay only, no control either
    if find_samples is None:  # a trend or a state problem has no samples to find
        find_samples = n > 1 and _shares_first_dim(batch, n) and any(
            e["kind"] in fatal_kinds() or e["kind"] in SPIKES for e in events)
    culprits, singles, replays, capped = None, None, 1, False
    if reproduced and find_samples:
        if not (n > 1 and _shares_first_dim(batch, n)):
            raise ValueError("fasthealth: find_samples needs sample ids in the dump and a batch "
                             "whose tensors all have that many rows")
        cap = CAP * n if max_replays is None else max_replays
        singles, smallest, k, capped = _group_test(m, loss_fn, batch, d, n, cap)
        culprits, replays = [id_list[i] for i in singles or smallest], 1 + k
    kinds = [e["kind"] for e in events]
    whole = reproduced and source != "batch" and not (singles and len(singles) < n)
    control = _control(m, loss_fn, d, dev) if whole and searches else None
    cause = _cause(d, kinds, reproduced, source, singles, n, control)
    verdict = verdict_text(d, kinds, reproduced, source, p.loss, p.first,
                           culprits if singles else None, replays, exact)
    verdict += cause_text(cause, singles, [] if singles else culprits or [], n,
                           capped and replays - 1, control, d)
    replays += control is not None
    broken = _params_broken(d)
    if broken:
        verdict += (f"; the weights before this step hold NaN/Inf or values of {HUGE_WEIGHT:g} "
                    f"or more: {', '.join(broken[:5])}{' ...' if len(broken) > 5 else ''}")
    result = ReplayResult(reproduced, p.loss, p.grads, p.first, verdict, exact, kinds,
                          d.get("record", {}), source, culprits, replays, cause, capped,
                          not reproduced and loss_far(d, p.loss) is not None)
    if save:
        save_result(path, d, result)
    return result
