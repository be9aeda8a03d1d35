"""The training-loop monitor (SPEC section 6): checks every step on the device, acts without a
sync, looks at the numbers once per flush.

``Monitor.step(loss, ...)`` replaces ``optimizer.step()``; it is *record + gate*:

1. one fused pass over all gradients (``grads_stats``) and an ``isfinite`` on the loss;
2. gate (``gate.py``): clip with the norm that pass computed, then step the optimizer or skip it
   when the loss or a gradient is non-finite, on the device where the optimizer allows;
3. record (``record.py``): one row of scalars and per-tensor norms and non-finite counts in a
   device buffer.

``Monitor.flush()`` is *detect + write*: every ``flush_every`` steps the buffer comes to the host
in one copy, every rule of ``detectors.py`` looks at each step, and the sinks (``sinks.py``)
write the JSONL logs, TensorBoard and the dumps of the steps behind events.
"""

from __future__ import annotations

import atexit
import math
import numbers
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..checks import grad_values, grads_stats
from ..ops.backends import BACKENDS, unsupported
from ..ops.layout import COL
from ..stats import MultiTensorStats
from . import gate
from .detectors import Detector, default_detectors
from .events import FATAL_KINDS, Event, NonFiniteError, Observation
from .record import (
    DeviceRecord,
    HostStep,
    loss_scale,
    optimizer_nonfinite,
    or_nan,
)
from .sinks import JsonlSink, TensorBoardSink, map_tensors, step_json, write_dump

ON_NONFINITE = ("skip", "raise", "warn")
# what a loss or grad-norm spike does: "warn" records it; "skip" (skip the step) is to come
ON_SPIKE = ("warn",)


def _shown(v: Any) -> str:
    """A bad argument as an error message shows it: the value when it is short, else its type."""
    if v is None or type(v) in (bool, int, float, str):
        r = repr(v)
        return r if len(r) <= 60 else f"{r[:57]}..."
    if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
        r = repr(v)
        if len(r) <= 60:
            return f"{r} (a {type(v).__name__})"
    return f"a {type(v).__name__}"


def _integer(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"fasthealth: {name} must be an integer >= {lo}, got {_shown(v)}")
    if v < lo:
        raise ValueError(f"fasthealth: {name} must be >= {lo}, got {v}")


def _number(name: str, v: Any, lo: float, *, strict: bool, optional: bool = False,
            finite: bool = True) -> None:
    """``v`` is a real number above ``lo`` (``strict``) or at least ``lo``; finite unless
    not ``finite``; None passes when ``optional``."""
    if v is None and optional:
        return
    what = (f"a {'finite ' if finite else ''}number {'>' if strict else '>='} {lo:g}"
            + (" or None" if optional else ""))
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"fasthealth: {name} must be {what}, got {_shown(v)}")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not (x > lo if strict else x >= lo) or (finite and not math.isfinite(x)):
        raise ValueError(f"fasthealth: {name} must be {what}, got {_shown(v)}")


def _choice(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(v, str) or v not in allowed:
        raise ValueError(f"fasthealth: {name} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {_shown(v)}")


def _check_model_and_optimizer(model: Any, optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch.optim optimizer to gate (inside a trainer's wrapper), after checking that
    ``model`` is a module and ``optimizer`` an optimizer of (some of) its parameters."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fasthealth: model must be a torch.nn.Module, got {_shown(model)}")
    if optimizer is None:
        return None
    inner = gate.unwrap(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        hint = (" (Monitor(model, optimizer): the second argument is the optimizer, or None)"
                if isinstance(optimizer, torch.nn.Module) else "")
        raise TypeError("fasthealth: optimizer must be a torch.optim.Optimizer or None, got "
                        f"{_shown(optimizer)}{hint}")
    # torch.optim's own classes hold the parameters they update; a trainer's (DeepSpeed's)
    # may hold flattened copies, which no model parameter is
    if type(inner).__module__.startswith("torch.optim"):
        mine = {id(p) for p in model.parameters()}
        theirs = [p for g in inner.param_groups for p in g["params"]]
        if theirs and not any(id(p) in mine for p in theirs):
            raise ValueError(
                f"fasthealth: optimizer ({type(inner).__name__}) updates none of model's "
                "parameters: was it made for another model? The Monitor checks model's "
                "gradients and steps or skips optimizer")
    return inner


def _check_numbers(o: dict[str, Any]) -> None:
    _integer("flush_every", o["flush_every"], 1)
    _number("spike_zscore", o["spike_zscore"], 0, strict=True)
    _integer("spike_window", o["spike_window"], 3)  # a noise level needs 3 values
    _integer("warmup_steps", o["warmup_steps"], 1)  # 0: VanishingDetector would take a median
    # of no values
    _number("max_grad_norm", o["max_grad_norm"], 0, strict=True, optional=True, finite=False)
    _number("min_loss_scale", o["min_loss_scale"], 0, strict=False)
    _integer("per_tensor_every", o["per_tensor_every"], 1)
    _integer("optimizer_check_every", o["optimizer_check_every"], 0)
    _integer("snapshot_max_bytes", o["snapshot_max_bytes"], 0)
    _number("vanishing_threshold", o["vanishing_threshold"], 0, strict=False)
    _choice("on_nonfinite", o["on_nonfinite"], ON_NONFINITE)
    _choice("on_spike", o["on_spike"], ON_SPIKE)
    if o["detectors"] is None and o["warmup_steps"] > o["spike_window"]:
        raise ValueError(
            f"fasthealth: warmup_steps={o['warmup_steps']} is more than "
            f"spike_window={o['spike_window']}: the window would never hold warmup_steps "
            "values, so no spike would ever be scored; use warmup_steps <= spike_window")


def _check_log_options(log_dir: Any, tensorboard: Any) -> None:
    """``log_dir`` and ``tensorboard``, before anything is written."""
    if log_dir is not None:
        if not isinstance(log_dir, (str, os.PathLike)) or isinstance(os.fspath(log_dir), bytes):
            raise TypeError("fasthealth: log_dir must be a path (str or os.PathLike) or None, "
                            f"got {_shown(log_dir)}")
        path = os.fspath(log_dir)
        if not path:
            raise ValueError("fasthealth: log_dir is an empty path; give a folder for the "
                             "logs, or None for none")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"fasthealth: log_dir {path!r} exists and is not a directory")
    if not isinstance(tensorboard, bool):
        raise TypeError(f"fasthealth: tensorboard must be True or False, got "
                        f"{_shown(tensorboard)}")
    if not tensorboard:
        return
    if log_dir is None:
        raise ValueError("fasthealth: tensorboard=True needs log_dir= (TensorBoard's files go "
                         "to LOG_DIR/tensorboard), got log_dir=None")
    try:  # an optional dependency, imported only when asked for
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "fasthealth: tensorboard=True needs the tensorboard package, which cannot be "
            f"imported here ({exc}): pip install tensorboard (or leave tensorboard=False: the "
            "JSONL logs in log_dir need nothing more)") from exc


def _check_distributed(process_group: Any, replica_group: Any) -> None:
    dist = torch.distributed
    if process_group is None:
        if replica_group is not None and replica_group is not False:
            raise ValueError("fasthealth: replica_group= needs process_group= (it says which "
                             f"of its ranks hold copies), got replica_group="
                             f"{_shown(replica_group)} and process_group=None")
        return
    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError("fasthealth: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD) or None, got {_shown(process_group)}")
    if not dist.is_initialized():
        raise ValueError("fasthealth: process_group= needs torch.distributed initialized "
                         "first (dist.init_process_group)")
    if replica_group not in (None, False) and not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError("fasthealth: replica_group must be a ProcessGroup, False or None, got "
                        f"{_shown(replica_group)}")


def _check_parts(activations: Any, scaler: Any, backend: Any, detectors: Any) -> None:
    """The arguments that name or hand over parts: activations, scaler, backend, detectors."""
    names_ok = isinstance(activations, (list, tuple)) and all(
        isinstance(n, str) for n in activations)
    if not (activations is None or isinstance(activations, (bool, str)) or names_ok):
        raise TypeError("fasthealth: activations must be None, True (every leaf module), a "
                        "regex over module names or a list of module names, got "
                        f"{_shown(activations)}")
    if isinstance(activations, str) and activations != "all":
        try:
            re.compile(activations)
        except re.error as exc:
            raise ValueError(f"fasthealth: activations={activations!r} is not a valid regular "
                             f"expression ({exc})") from None
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"fasthealth: scaler must be a torch.amp.GradScaler or None, got "
                        f"{_shown(scaler)}")
    if backend is not None and (not isinstance(backend, str)
                                or backend not in (*BACKENDS, "auto")):
        raise ValueError(f"fasthealth: backend must be one of {', '.join(BACKENDS)}, 'auto' or "
                         f"None, got {_shown(backend)}")
    if detectors is None:
        return
    if isinstance(detectors, (Detector, str)) or not isinstance(detectors, (list, tuple)):
        raise TypeError("fasthealth: detectors must be a list of Detector (see "
                        f"fasthealth.monitor.detectors) or None, got {_shown(detectors)}")
    for i, d in enumerate(detectors):
        if not callable(getattr(d, "observe", None)):
            raise TypeError(f"fasthealth: detectors[{i}] must be a Detector (an object with "
                            f"observe(step)), got {_shown(d)}")


def _check_options(model: Any, optimizer: Any, o: dict[str, Any]) -> torch.optim.Optimizer | None:
    """Validates every argument of ``Monitor`` (types, ranges, combinations) before anything
    is made or written; returns the optimizer to gate. Errors start with "fasthealth:" and
    name the argument and its value."""
    inner = _check_model_and_optimizer(model, optimizer)
    _check_numbers(o)
    _check_log_options(o["log_dir"], o["tensorboard"])
    _check_distributed(o["process_group"], o["replica_group"])
    _check_parts(o["activations"], o["scaler"], o["backend"], o["detectors"])
    return inner


def _loss_value(loss: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's loss as a float64 0-dim tensor on ``device``, whether it is finite), on the
    device, with no host sync. A loss of several elements (``reduction="none"``) is checked
    element by element: the step is non-finite when any element is, and the loss recorded is
    the float64 mean of all of them (docs/spec.md, section 6). A Python number (already on the
    host) is taken as it is; an unknown loss (None) is NaN and counts as finite."""
    if loss is None:  # a tensor of its own: it goes back to the user in the Observation
        return (torch.full((), math.nan, dtype=torch.float64, device=device),
                torch.ones((), dtype=torch.bool, device=device))
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        try:
            value = float(loss)
        except OverflowError:  # an integer beyond any float: as good as infinite
            value = math.inf if str(loss)[:1] != "-" else -math.inf
        loss_d = torch.tensor(value, dtype=torch.float64, device=device)
        return loss_d, torch.isfinite(loss_d)
    if not isinstance(loss, torch.Tensor):
        raise TypeError("fasthealth: loss must be a floating-point tensor, a Python number or "
                        f"None, got {_shown(loss)}")
    if not loss.is_floating_point() or loss.layout != torch.strided:
        raise TypeError(f"fasthealth: loss must be a dense floating-point tensor, got a "
                        f"{loss.dtype} tensor of shape {list(loss.shape)}"
                        + ("" if loss.layout == torch.strided else f" ({loss.layout})"))
    if loss.numel() == 0:
        raise ValueError(f"fasthealth: loss is empty (shape {list(loss.shape)}): nothing to "
                         "check; pass the loss the backward pass started from")
    x = loss.detach()
    if x.numel() == 1:
        loss_d = x.reshape(()).to(device, torch.float64)
        return loss_d, torch.isfinite(loss_d)
    return x.mean(dtype=torch.float64).to(device), torch.isfinite(x).all().to(device)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class Monitor:
    """Watches a training loop; see SPEC section 6 and the module docstring.

    Args beyond SPEC: ``scaler`` (a ``torch.amp.GradScaler``: mon.step then unscales, steps and
    updates through it, and watches its scale), ``min_loss_scale`` (1.0: a scale below it, or
    NaN, is ``loss_scale_collapse``), ``per_tensor_every`` (50: per-tensor norms in the JSONL log),
    ``optimizer_check_every`` (10: how often optimizer state is scanned for NaN/Inf; 0 never),
    ``snapshot_max_bytes`` (256 MiB: the pre-step parameters of every pending step are kept for
    replay when they fit this budget, flush_every copies in all), ``vanishing_threshold`` (1e-8),
    ``tensorboard`` (also write scalars to TensorBoard under log_dir), ``backend``,
    ``replica_group`` (with ``process_group``: which ranks hold copies; see
    ``fasthealth.distributed``),
    ``detectors`` (the event rules, ``monitor.detectors.Detector`` instances, in reporting
    order; default ``default_detectors(...)`` with the options above).

    Every argument is checked here, before anything is made or written (types, ranges and
    combinations: ``tensorboard=True`` needs ``log_dir`` and an importable tensorboard,
    ``warmup_steps <= spike_window``, an optimizer of the model's parameters): a bad one raises
    TypeError or ValueError (ImportError for tensorboard) that names it and its value.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        log_dir: str | os.PathLike | None = None,
        flush_every: int = 50,
        on_nonfinite: str = "skip",
        on_spike: str = "warn",
        spike_zscore: float = 6.0,
        spike_window: int = 128,
        warmup_steps: int = 20,
        max_grad_norm: float | None = None,
        activations: Any = None,
        process_group: Any = None,
        replica_group: Any = None,
        scaler: Any = None,
        min_loss_scale: float = 1.0,
        per_tensor_every: int = 50,
        optimizer_check_every: int = 10,
        snapshot_max_bytes: int = 256 * 2**20,
        vanishing_threshold: float = 1e-8,
        tensorboard: bool = False,
        backend: str | None = None,
        detectors: list[Detector] | None = None,
    ) -> None:
        opts = {k: v for k, v in locals().items() if k not in ("self", "model", "optimizer")}
        optimizer = _check_options(model, optimizer, opts)  # before anything is made
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.flush_every, self.on_nonfinite, self.on_spike = flush_every, on_nonfinite, on_spike
        self.max_grad_norm, self.min_loss_scale = max_grad_norm, min_loss_scale
        self.per_tensor_every = per_tensor_every
        self.optimizer_check_every = optimizer_check_every
        self.backend, self.process_group = backend, process_group
        self.replica_group = replica_group
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("fasthealth: model has no trainable parameters to monitor (none "
                             "with requires_grad=True)")
        self.names = [n for n, _ in self.params]
        self.names_by_id = {id(p): n for n, p in self.params}
        self.device = self.params[0][1].device
        why = None if backend in (None, "auto") else unsupported(backend, self.device)
        if why is not None:
            raise ValueError(f"fasthealth: backend={backend!r} cannot run on model's device "
                             f"({self.device}): {why}")
        self.record = DeviceRecord(self.names, flush_every, self.device)
        if detectors is None:
            detectors = default_detectors(
                self.names, spike_zscore=spike_zscore, spike_window=spike_window,
                warmup_steps=warmup_steps, vanishing_threshold=vanishing_threshold,
                min_loss_scale=min_loss_scale if scaler is not None else None)
        self.detectors = list(detectors)
        self.events: list[Event] = []
        self.steps_seen = 0
        self._next_step = 0
        self._rng = _rng_state()
        self._opt_stats: MultiTensorStats | None = None
        self._disarm = None  # the optimizer step post-hook of check()
        self._backlog: list[HostStep] = []  # taken from the record, not yet fully flushed
        self._write_errors: list[str] = []
        self.hooks: list[Any] = []  # removed at close(): what an integration registered
        self.activations = None  # made before the sinks: a bad module regex writes nothing
        if activations is not None and activations is not False:
            from ..activations import ActivationMonitor

            self.activations = ActivationMonitor(
                model, modules=None if activations is True else activations)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._jsonl: JsonlSink | None = None
        self._tb: TensorBoardSink | None = None
        self._snapshots: list[list[torch.Tensor]] | None = None
        if self.log_dir is not None:
            self._open_sinks(tensorboard, snapshot_max_bytes, spike_zscore=spike_zscore,
                             spike_window=spike_window, warmup_steps=warmup_steps)

    def _open_sinks(self, tensorboard: bool, snapshot_max_bytes: int, **options: Any) -> None:
        param_bytes = sum(p.numel() * p.element_size() for _, p in self.params)
        meta = {"names": self.names, "flush_every": self.flush_every,
                "on_nonfinite": self.on_nonfinite, **options,
                "max_grad_norm": self.max_grad_norm, "per_tensor_every": self.per_tensor_every,
                "started": time.time(),
                "param_bytes": param_bytes}
        self._jsonl = JsonlSink(self.log_dir, meta)
        self._write_errors = self._jsonl.errors
        atexit.register(self._close_at_exit)  # the last steps reach the log even on a crash
        if self._jsonl.last_step is not None:  # a reopened log_dir: the run goes on
            self._next_step = self._jsonl.last_step + 1
        if param_bytes * self.flush_every <= snapshot_max_bytes:
            self._snapshots = [[torch.empty_like(p.detach()) for _, p in self.params]
                               for _ in range(self.flush_every)]
        if tensorboard:
            self._tb = TensorBoardSink(self.log_dir)

    # ---- step: record + gate -----------------------------------------------------------------

    def step(self, loss: torch.Tensor | float, batch: Any = None, sample_ids: Any = None, *,
             step: int | None = None) -> Observation:
        """Check this step's loss and gradients, then step the optimizer unless they are
        non-finite (with ``on_nonfinite`` "skip" or "raise"). No host sync for fused
        optimizers; the records reach the host at the next flush.

        ``loss``: a floating-point tensor of any shape (every element is checked: one NaN/Inf
        makes the step non-finite; the loss recorded is the float64 mean), or a Python number;
        anything else raises TypeError."""
        return self._run(loss, batch, sample_ids, step, take_step=True)

    def check(self, loss: torch.Tensor | float | None = None, batch: Any = None,
              sample_ids: Any = None, *, step: int | None = None) -> Observation:
        """Everything ``step`` does but the optimizer step itself, for a trainer that takes it
        next (the framework callbacks, ``fh.watch``): checks, clips, records, and makes that
        step skip when the loss or a gradient is non-finite (``found_inf`` for fused torch
        optimizers and under a GradScaler: no sync; else the gradients are dropped, one sync).
        ``loss`` may be None when the trainer's loss is not known (logged as null)."""
        return self._run(loss, batch, sample_ids, step, take_step=False)

    def _run(self, loss: Any, batch: Any, sample_ids: Any, step: int | None,
             take_step: bool) -> Observation:
        loss_d, loss_ok = _loss_value(loss, self.device)  # a bad loss raises before anything
        t = self._next_step if step is None else int(step)
        self._next_step = t + 1
        if self.scaler is not None and self.optimizer is not None:
            gate.unscale(self.optimizer, self.scaler)
        present = [i for i, (_, p) in enumerate(self.params) if p.grad is not None]
        grads = [self.params[i][1].grad for i in present]
        values = [grad_values(g) for g in grads]  # a sparse gradient's stored values
        # with a process group the verdict is every rank's: a NaN anywhere skips everywhere
        stats = grads_stats(values, [self.names[i] for i in present], [], backend=self.backend,
                            process_group=self.process_group, extra_bad=~loss_ok,
                            replica_group=self.replica_group)
        table = stats.raw.to(self.device)
        grads_ok = table[-1, COL["all_finite"]] != 0
        bad = ~grads_ok if self.process_group is not None else ~(loss_ok & grads_ok)

        skipped = self._act(grads, table, bad, take_step)
        total = table[-1]
        scalars = {
            "loss": loss_d, "grad_norm": total[COL["norm"]],
            "grad_finite_norm": total[COL["finite_norm"]], "grad_amax": total[COL["amax"]],
            "nan_count": total[COL["nan_count"]], "inf_count": total[COL["inf_count"]],
            "grads_finite": grads_ok, "loss_finite": loss_ok, "skipped": skipped,
            "loss_scale": loss_scale(self.scaler, self.device),
            "optimizer_nonfinite": self._scan_optimizer(t),
            "replica_mismatch": or_nan(stats.replica_mismatch, self.device),
            "replica_mismatch_mask": or_nan(stats.replica_mismatch_mask, self.device),
        }
        self.record.write(scalars, table, present, self._step_info(t, batch, sample_ids))
        self.steps_seen += 1
        if self.record.full:
            self.flush()
        return Observation(step=t, skip=bad, loss=loss_d, stats=stats)

    def _act(self, grads: list[torch.Tensor], table: torch.Tensor, bad: torch.Tensor,
             take_step: bool) -> torch.Tensor:
        """Clip, snapshot the parameters for replay, then step or skip (or, without
        ``take_step``, arm the skip of the trainer's step); returns skipped."""
        if self.max_grad_norm is not None and grads:
            gate.clip_(grads, table[-1, COL["norm"]], self.max_grad_norm)
        if self._snapshots is not None:
            torch._foreach_copy_(self._snapshots[self.record.fill],
                                 [p.detach() for _, p in self.params])
        opt = self.optimizer
        if opt is None:
            return torch.zeros_like(bad)
        guard = self.on_nonfinite in ("skip", "raise")
        if take_step:
            if self.scaler is not None:
                return gate.step_with_scaler(opt, self.scaler, bad, guard)
            return gate.step_or_skip(opt, bad, guard)
        if self._disarm is None:
            self._disarm = opt.register_step_post_hook(gate.disarm)
        return gate.arm_skip(opt, bad if guard else torch.zeros_like(bad), self.scaler)

    def _scan_optimizer(self, t: int) -> torch.Tensor:
        """NaN + Inf count of the optimizer's state every ``optimizer_check_every`` steps."""
        k = self.optimizer_check_every
        due = self.optimizer is not None and k and t % k == 0
        count, self._opt_stats = optimizer_nonfinite(
            self.optimizer if due else None, self.names_by_id, self.backend, self.device)
        return count

    def _step_info(self, t: int, batch: Any, sample_ids: Any) -> dict[str, Any]:
        """What the flush needs of this step on the host: references to the batch (no copy,
        kept until the flush), the RNG state its forward started from."""
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None else None
        keep = self.log_dir is not None
        info = {
            "step": t, "lr": float(lr) if isinstance(lr, (int, float)) else None,
            "slot": self.record.fill,
            "batch": map_tensors(torch.Tensor.detach, batch) if keep else None,
            "sample_ids": map_tensors(torch.Tensor.detach, sample_ids) if keep else None,
            "rng": self._rng, "opt_stats": self._opt_stats,
        }
        self._rng = _rng_state()  # the state the next step's forward starts from
        return info

    # ---- flush: detect + write --------------------------------------------------------------

    def flush(self) -> list[Event]:
        """Copy the pending records to the host (once), run the detectors, write logs and
        dumps. Returns the new events; raises NonFiniteError with ``on_nonfinite="raise"``.

        A step leaves the backlog only once its events are in ``events`` and its lines queued:
        an interrupted flush (Ctrl-C in a save) loses and repeats nothing. Writing failures are
        recorded in ``write_errors``, never raised."""
        self._backlog += self.record.take()
        new: list[Event] = []
        while self._backlog:
            s = self._backlog[0]
            events = s.info.get("events")
            if events is None:  # detectors see each step once, even when a flush is retried
                events = s.info["events"] = self._detect(s)
                self.events.extend(events)
                new.extend(events)
            if events and self._jsonl is not None and "dump" not in s.info:
                s.info["dump"] = self._save_dump(s, events)
            if self._jsonl is not None:
                per_tensor = s.step % self.per_tensor_every == 0 or bool(events)
                self._jsonl.queue(step_json(s, self.names, events, per_tensor), events)
            if self._tb is not None:
                self._tb.write(s)
            self._backlog.pop(0)
        if self._jsonl is not None:
            self._jsonl.drain()
        if self.on_nonfinite == "raise":
            fatal = [e for e in new if e.kind in FATAL_KINDS]
            if fatal:
                raise NonFiniteError(fatal)
        return new

    def _save_dump(self, s: HostStep, events: list[Event]) -> str | None:
        params = self._snapshots[s.info["slot"]] if self._snapshots is not None else None
        try:
            dump = write_dump(self.log_dir, s, self.names, events, params)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            self._jsonl.fail(exc)
            return None
        for e in events:
            e.dump = dump
        return dump

    @property
    def write_errors(self) -> list[str]:
        """What could not be written to ``log_dir`` (the first one was also warned)."""
        return list(self._write_errors)

    def _detect(self, s: HostStep) -> list[Event]:
        details = {"step_loss": s.values["loss"], "lr": s.info["lr"]}
        return [Event(s.step, kind, msg, dict(d, **details))
                for rule in self.detectors for kind, msg, d in rule.observe(s)]

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Final flush; closes the log files and removes activation hooks. Runs by itself at
        interpreter exit (an unhandled exception included) and at the end of a ``with``."""
        atexit.unregister(self._close_at_exit)
        try:
            self.flush()
        finally:
            for sink in (self._jsonl, self._tb):
                if sink is not None:
                    sink.close()
            self._jsonl = self._tb = None
            if self.activations is not None:
                self.activations.remove()
            for h in self.hooks + ([self._disarm] if self._disarm is not None else []):
                h.remove()
            self.hooks, self._disarm = [], None

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # never a traceback at exit
            warnings.warn(f"fasthealth: the final flush at exit failed: {exc}", RuntimeWarning,
                          stacklevel=1)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
