"""The Monitor's arguments, checked before anything is made or written (types, ranges and
combinations), and the loss each step is given; each error names the argument and its value
(docs/spec.md section 6). The arguments come by their flat keywords, whether they were given
flat or in a group (``option_groups.py``)."""

from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any

import torch

from ..ops.backends import BACKENDS
from . import gate
from .incidents import DUMPS, IncidentConfig
from .rollback import RollbackConfig
from .rules import Rule

ON_NONFINITE = ("skip", "raise", "warn")
# what a loss or grad-norm spike does: "warn" records it; "skip" also skips the step, decided
# on the device (skip_rule.py)
ON_SPIKE = ("warn", "skip")


def shown(v: Any) -> str:
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
        raise TypeError(f"fasthealth: {name} must be an integer >= {lo}, got {shown(v)}")
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
        raise TypeError(f"fasthealth: {name} must be {what}, got {shown(v)}")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not (x > lo if strict else x >= lo) or (finite and not math.isfinite(x)):
        raise ValueError(f"fasthealth: {name} must be {what}, got {shown(v)}")


def _choice(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(v, str) or v not in allowed:
        raise ValueError(f"fasthealth: {name} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {shown(v)}")


def _check_model_and_optimizer(model: Any, optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch.optim optimizer to gate (inside a trainer's wrapper), after checking that
    ``model`` is a module and ``optimizer`` an optimizer of (some of) its parameters."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fasthealth: model must be a torch.nn.Module, got {shown(model)}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("fasthealth: model has no trainable parameters to monitor (none "
                         "with requires_grad=True)")
    if optimizer is None:
        return None
    inner = gate.unwrap(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        hint = (" (Monitor(model, optimizer): the second argument is the optimizer, or None)"
                if isinstance(optimizer, torch.nn.Module) else "")
        raise TypeError("fasthealth: optimizer must be a torch.optim.Optimizer or None, got "
                        f"{shown(optimizer)}{hint}")
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
    _integer("warmup_steps", o["warmup_steps"], 1)  # 0: the vanishing rule would take a median
    # of no values
    _number("max_grad_norm", o["max_grad_norm"], 0, strict=True, optional=True, finite=False)
    _number("min_loss_scale", o["min_loss_scale"], 0, strict=False)
    _integer("per_tensor_every", o["per_tensor_every"], 1)
    _integer("optimizer_check_every", o["optimizer_check_every"], 0)
    _integer("snapshot_max_bytes", o["snapshot_max_bytes"], 0)
    _number("vanishing_threshold", o["vanishing_threshold"], 0, strict=False)
    _choice("on_nonfinite", o["on_nonfinite"], ON_NONFINITE)
    _choice("on_spike", o["on_spike"], ON_SPIKE)
    _choice("dumps", o["dumps"], DUMPS)
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
                            f"got {shown(log_dir)}")
        path = os.fspath(log_dir)
        if not path:
            raise ValueError("fasthealth: log_dir is an empty path; give a folder for the "
                             "logs, or None for none")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"fasthealth: log_dir {path!r} exists and is not a directory")
    if not isinstance(tensorboard, bool):
        raise TypeError(f"fasthealth: tensorboard must be True or False, got "
                        f"{shown(tensorboard)}")
    if not tensorboard:
        return
    if log_dir is None:
        raise ValueError("fasthealth: tensorboard=True needs log_dir= (TensorBoard's files go "
                         "to the run's tensorboard/), got log_dir=None")
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
                             f"{shown(replica_group)} and process_group=None")
        return
    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError("fasthealth: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD) or None, got {shown(process_group)}")
    if not dist.is_initialized():
        raise ValueError("fasthealth: process_group= needs torch.distributed initialized "
                         "first (dist.init_process_group)")
    if replica_group not in (None, False) and not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError("fasthealth: replica_group must be a ProcessGroup, False or None, got "
                        f"{shown(replica_group)}")


def _check_parts(activations: Any, scaler: Any, backend: Any, detectors: Any, logits: Any,
                 attention: Any) -> None:
    """The arguments that name or hand over parts: activations, logits, attention, scaler,
    backend, detectors."""
    names_ok = isinstance(activations, (list, tuple)) and all(
        isinstance(n, str) for n in activations)
    if not (activations is None or isinstance(activations, (bool, str)) or names_ok):
        raise TypeError("fasthealth: activations must be None, True (every leaf module), a "
                        "regex over module names or a list of module names, got "
                        f"{shown(activations)}")
    if isinstance(activations, str) and activations != "all":
        try:
            re.compile(activations)
        except re.error as exc:
            raise ValueError(f"fasthealth: activations={activations!r} is not a valid regular "
                             f"expression ({exc})") from None
    if not (logits is None or logits is False or isinstance(logits, str)):
        raise TypeError("fasthealth: logits must be None (find the LM head), a module name or "
                        f"False, got {shown(logits)}")
    if attention is not None:
        if not isinstance(attention, str):
            raise TypeError("fasthealth: attention must be None or a regex over module names, "
                            f"got {shown(attention)}")
        try:
            re.compile(attention)
        except re.error as exc:
            raise ValueError(f"fasthealth: attention={attention!r} is not a valid regular "
                             f"expression ({exc})") from None
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"fasthealth: scaler must be a torch.amp.GradScaler or None, got "
                        f"{shown(scaler)}")
    if backend is not None and (not isinstance(backend, str)
                                or backend not in (*BACKENDS, "auto")):
        raise ValueError(f"fasthealth: backend must be one of {', '.join(BACKENDS)}, 'auto' or "
                         f"None, got {shown(backend)}")
    if detectors is None:
        return
    if isinstance(detectors, (Rule, str)) or not isinstance(detectors, (list, tuple)):
        raise TypeError("fasthealth: detectors must be a list of Rule (see "
                        f"fasthealth.monitor.rules) or None, got {shown(detectors)}")
    for i, d in enumerate(detectors):
        if not callable(getattr(d, "observe", None)):
            raise TypeError(f"fasthealth: detectors[{i}] must be a Rule (an object with "
                            f"observe(step)), got {shown(d)}")


def _check_averaged(averaged: Any, model: Any) -> None:
    items = [averaged] if isinstance(averaged, torch.nn.Module) else averaged
    if averaged is None:
        return
    if not isinstance(items, (list, tuple)) or not all(isinstance(m, torch.nn.Module)
                                                       for m in items):
        raise TypeError("fasthealth: averaged must be a torch.nn.Module (an EMA or SWA copy "
                        "of the model: timm's ModelEmaV3, torch's AveragedModel), a list of "
                        f"them, or None, got {shown(averaged)}")
    if any(m is model for m in items):
        raise ValueError("fasthealth: averaged is the model itself; pass the averaged copy "
                         "(ModelEmaV3(model), AveragedModel(model))")


def check_options(model: Any, optimizer: Any, o: dict[str, Any]) -> torch.optim.Optimizer | None:
    """Validates every argument of ``Monitor`` (types, ranges, combinations) before anything
    is made or written; returns the optimizer to gate. Errors start with "fasthealth:" and
    name the argument and its value."""
    inner = _check_model_and_optimizer(model, optimizer)
    _check_numbers(o)
    if o["on_spike"] == "skip" and inner is None:
        raise ValueError("fasthealth: on_spike='skip' needs the optimizer (Monitor(model, "
                         "optimizer, on_spike='skip')): the step it skips is the optimizer's")
    _check_log_options(o["log_dir"], o["tensorboard"])
    if not isinstance(o["all_ranks"], bool):
        raise TypeError(f"fasthealth: all_ranks must be True or False, got {shown(o['all_ranks'])}")
    _check_distributed(o["process_group"], o["replica_group"])
    _check_parts(o["activations"], o["scaler"], o["backend"], o["detectors"], o["logits"],
                 o["attention"])
    sched = o["scheduler"]
    if sched is not None and not callable(getattr(sched, "get_last_lr", None)) and not all(
            callable(getattr(sched, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise TypeError(f"fasthealth: scheduler must be a learning-rate scheduler (torch's "
                        f"LRScheduler and those built on it, HF's and Lightning's; or one with "
                        f"step(), state_dict() and load_state_dict(), as timm's) or None, got "
                        f"{shown(sched)}")
    if o["incidents"] is not None and not isinstance(o["incidents"], IncidentConfig):
        raise TypeError(f"fasthealth: incidents must be a fasthealth.monitor.IncidentConfig or "
                        f"None, got {shown(o['incidents'])}")
    if not isinstance(o["precursors"], bool):
        raise TypeError(f"fasthealth: precursors must be True, False or a "
                        f"fh.PrecursorOptions, got {shown(o['precursors'])}")
    _check_rollback(o["rollback"], inner, o["process_group"])
    _check_averaged(o["averaged"], model)
    return inner


def _check_rollback(rollback: Any, optimizer: Any, process_group: Any) -> None:
    if rollback is None or rollback is False:
        return
    if rollback is not True and not isinstance(rollback, RollbackConfig):
        raise TypeError(f"fasthealth: rollback must be a fh.RollbackConfig, True or None, got "
                        f"{shown(rollback)}")
    if optimizer is None:
        raise ValueError("fasthealth: rollback needs the optimizer (Monitor(model, optimizer, "
                         "rollback=...)): its state is rolled back with the model's")
    if rollback is not True:
        for name in ("every", "keep", "max_bytes", "max_in_row", "max_total"):
            _integer(f"rollback.{name}", getattr(rollback, name), 1)
        if rollback.max_skips is not None:
            _integer("rollback.max_skips", rollback.max_skips, 0)
        if rollback.replay is not None and not callable(rollback.replay):
            raise TypeError("fasthealth: rollback.replay must be a loss function "
                            f"replay(model, batch) or None, got {shown(rollback.replay)}")


def loss_value(loss: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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
                        f"None, got {shown(loss)}")
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


def refuse_misuse(mon: Any, call: str) -> None:
    """RuntimeError for a call that cannot do what it is for: ``mon.step`` on a Monitor
    without an optimizer (nothing to step: the model would silently never train), and
    ``step``, ``check`` or ``flush`` after ``close()`` (its logs are final)."""
    if mon._closed:
        raise RuntimeError(f"fasthealth: mon.{call}() after mon.close(): this Monitor is "
                           "closed (its logs are final); make a new Monitor to go on")
    if call == "step" and mon.optimizer is None:
        raise RuntimeError(
            "fasthealth: mon.step() on a Monitor made without an optimizer: there is nothing "
            "to step, so the model would not train. Pass the optimizer (fh.Monitor(model, "
            "optimizer)), or call mon.check(loss) where the trainer steps the optimizer itself")
