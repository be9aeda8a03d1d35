"""The training-loop monitor (SPEC section 6): checks every step on the device, acts without a
sync, looks at the numbers once per flush.

Per step, ``Monitor.step(loss, ...)`` replaces ``optimizer.step()``:

1. one fused pass over all gradients (``multi_tensor_stats``) and an ``isfinite`` on the loss;
2. optional clipping with the norm that pass computed (``clip_grad_norm_``'s rule, one pass
   fewer);
3. the optimizer step, skipped when the loss or a gradient is non-finite: for optimizers that
   take a ``found_inf`` tensor (torch.optim Adam/AdamW/SGD/Adagrad with ``fused=True``, CPU or
   CUDA) without any host sync, for the others with one ``bool()`` per step;
4. one row of scalars (and per-tensor norms and non-finite counts) written into a device
   buffer; every ``flush_every`` steps the buffer is copied to the host once, the detectors run
   over it, events are recorded, the JSONL log written and the batches behind events saved.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checks import grads_stats, multi_tensor_stats
from .detectors import DivergenceDetector, OscillationDetector, SpikeDetector, VanishingDetector
from .stats import COL, MultiTensorStats

ON_NONFINITE = ("skip", "raise", "warn")
SCALARS = (
    "loss", "grad_norm", "grad_finite_norm", "grad_amax", "nan_count", "inf_count",
    "grads_finite", "loss_finite", "skipped", "loss_scale", "optimizer_nonfinite",
)
_S = {name: i for i, name in enumerate(SCALARS)}


class NonFiniteError(RuntimeError):
    """Raised at a flush that saw a non-finite loss or gradient with ``on_nonfinite="raise"``."""

    def __init__(self, events: list[Event]):
        self.events = events
        first = events[0]
        super().__init__(f"fasthealth: step {first.step}: {first.message}"
                         + (f" (and {len(events) - 1} more)" if len(events) > 1 else ""))


@dataclass
class Event:
    step: int
    kind: str
    message: str
    details: dict = field(default_factory=dict)
    dump: str | None = None

    def to_json(self) -> dict:
        return {"step": self.step, "kind": self.kind, "message": self.message,
                "details": _jsonable(self.details), "dump": self.dump}


@dataclass
class Observation:
    """What ``Monitor.step`` saw: ``skip`` is a 0-dim bool tensor on the device (no sync)."""

    step: int
    skip: torch.Tensor
    loss: torch.Tensor
    stats: MultiTensorStats


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return _jsonable(v.tolist())
    return v


def _supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """torch.optim's fused kernels read ``optimizer.found_inf`` and skip the update on device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def _first_step_creates_garbage(optimizer: torch.optim.Optimizer) -> bool:
    # Fused SGD with momentum creates its buffers with empty_like on the first step, even when
    # found_inf skips that step; a skipped first step would leave garbage momentum behind.
    return isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0) != 0 and any(
            optimizer.state.get(p, {}).get("momentum_buffer") is None for p in g["params"])
        for g in optimizer.param_groups
    )


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _batch_refs(batch: Any) -> Any:
    """Detached references to the batch's tensors (no copy): kept until the next flush."""
    if isinstance(batch, torch.Tensor):
        return batch.detach()
    if isinstance(batch, dict):
        return {k: _batch_refs(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_batch_refs(v) for v in batch)
    return batch


class Monitor:
    """Watches a training loop; see SPEC section 6 and the module docstring.

    Args beyond SPEC: ``scaler`` (a ``torch.amp.GradScaler``: mon.step then unscales, steps and
    updates through it, and watches its scale), ``min_loss_scale`` (1.0: a scale below it, or
    NaN, is ``loss_scale_collapse``), ``per_tensor_every`` (50: per-tensor norms in the JSONL log),
    ``optimizer_check_every`` (10: how often optimizer state is scanned for NaN/Inf; 0 never),
    ``snapshot_max_bytes`` (256 MiB: the pre-step parameters of every pending step are kept for
    replay when they fit this budget, flush_every copies in all), ``vanishing_threshold`` (1e-8),
    ``tensorboard`` (also write scalars to TensorBoard under log_dir), ``backend``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        log_dir: str | os.PathLike | None = None,
        flush_every: int = 50,
        on_nonfinite: str = "skip",
        spike_zscore: float = 6.0,
        spike_window: int = 128,
        warmup_steps: int = 20,
        max_grad_norm: float | None = None,
        activations: Any = None,
        process_group: Any = None,
        scaler: Any = None,
        min_loss_scale: float = 1.0,
        per_tensor_every: int = 50,
        optimizer_check_every: int = 10,
        snapshot_max_bytes: int = 256 * 2**20,
        vanishing_threshold: float = 1e-8,
        tensorboard: bool = False,
        backend: str | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fasthealth: Monitor needs an nn.Module, got {type(model).__name__}")
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"fasthealth: on_nonfinite must be one of {ON_NONFINITE}, "
                             f"got {on_nonfinite!r}")
        if flush_every < 1:
            raise ValueError(f"fasthealth: flush_every must be >= 1, got {flush_every}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"fasthealth: max_grad_norm must be > 0, got {max_grad_norm}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.flush_every, self.on_nonfinite = flush_every, on_nonfinite
        self.max_grad_norm, self.min_loss_scale = max_grad_norm, min_loss_scale
        self.per_tensor_every = max(1, per_tensor_every)
        self.optimizer_check_every = optimizer_check_every
        self.backend = backend
        self.process_group = process_group
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("fasthealth: the model has no trainable parameters to monitor")
        self.names = [n for n, _ in self.params]
        self._index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self.device = self.params[0][1].device
        n = len(self.params)
        self._width = len(SCALARS) + 2 * n
        self._buf = torch.full((flush_every, self._width), math.nan, dtype=torch.float64,
                               device=self.device)
        self._fill = 0
        self._pending: list[dict] = []
        self._next_step = 0
        self.events: list[Event] = []
        self.steps_seen = 0
        self._spike_loss = SpikeDetector("loss_spike", "loss", spike_zscore, spike_window,
                                         warmup_steps)
        self._spike_norm = SpikeDetector("grad_norm_spike", "global grad norm", spike_zscore,
                                         spike_window, warmup_steps)
        self._divergence = DivergenceDetector(warmup=warmup_steps)
        self._oscillation = OscillationDetector(warmup=warmup_steps)
        self._vanishing = VanishingDetector(abs_threshold=vanishing_threshold,
                                            window=spike_window, warmup=warmup_steps)
        self._scale_collapsed = False
        self._opt_bad = False
        self._last_opt_stats: MultiTensorStats | None = None
        self._row_index: dict[tuple[int, ...], torch.Tensor] = {}  # when some grads are None
        self._rng = self._rng_state()

        param_bytes = sum(p.numel() * p.element_size() for _, p in self.params)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._snapshots: list[list[torch.Tensor]] | None = None
        self._steps_file = self._events_file = None
        self._tb = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / "dumps").mkdir(exist_ok=True)
            self._steps_file = open(self.log_dir / "steps.jsonl", "a")
            self._events_file = open(self.log_dir / "events.jsonl", "a")
            meta = {"names": self.names, "flush_every": flush_every,
                    "on_nonfinite": on_nonfinite, "spike_zscore": spike_zscore,
                    "spike_window": spike_window, "warmup_steps": warmup_steps,
                    "max_grad_norm": max_grad_norm, "started": time.time(),
                    "param_bytes": param_bytes}
            (self.log_dir / "meta.json").write_text(json.dumps(meta, indent=1))
            if param_bytes * flush_every <= snapshot_max_bytes:
                self._snapshots = [[torch.empty_like(p.detach()) for _, p in self.params]
                                   for _ in range(flush_every)]
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
        self.activations = None
        if activations is not None:
            from .activations import ActivationMonitor

            self.activations = ActivationMonitor(
                model, modules=None if activations is True else activations)

    # ---- the hot path ---------------------------------------------------------------------

    def step(self, loss: torch.Tensor | float, batch: Any = None, sample_ids: Any = None, *,
             step: int | None = None) -> Observation:
        """Check this step's loss and gradients, then step the optimizer unless they are
        non-finite (with ``on_nonfinite`` "skip" or "raise"). No host sync for fused
        optimizers; the records reach the host at the next flush."""
        t = self._next_step if step is None else int(step)
        self._next_step = t + 1
        opt = self.optimizer
        if self.scaler is not None and opt is not None:
            self.scaler.unscale_(opt)

        grads, rows = [], []
        for i, (_, p) in enumerate(self.params):
            if p.grad is not None:
                grads.append(p.grad)
                rows.append(i)
        if not torch.is_tensor(loss):
            loss = torch.tensor(float(loss))
        loss_d = loss.detach().reshape(-1)[0].to(self.device, torch.float64)
        loss_ok = torch.isfinite(loss_d)
        # with a process group the verdict is every rank's: a NaN anywhere skips everywhere
        stats = grads_stats(grads, [self.names[i] for i in rows], [], backend=self.backend,
                            process_group=self.process_group, extra_bad=~loss_ok)
        table = stats.raw.to(self.device)
        grads_ok = table[-1, COL["all_finite"]] != 0
        bad = ~(loss_ok & grads_ok)
        if self.process_group is not None:
            bad = ~grads_ok  # the gathered flag already holds every rank's loss check

        if self.max_grad_norm is not None and grads:
            # clip_grad_norm_'s rule with the norm already computed: no second pass
            norm = table[-1, COL["norm"]].float()
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)

        slot = self._fill
        if self._snapshots is not None:
            torch._foreach_copy_(self._snapshots[slot], [p.detach() for _, p in self.params])
        skipped = self._step_optimizer(bad) if opt is not None else torch.zeros_like(bad)
        opt_bad = self._optimizer_nonfinite(t)

        scale = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        if self.scaler is not None and getattr(self.scaler, "_scale", None) is not None:
            scale = self.scaler._scale.detach().reshape(()).to(self.device, torch.float64)
        total = table[-1]
        row = torch.stack([
            loss_d, total[COL["norm"]], total[COL["finite_norm"]], total[COL["amax"]],
            total[COL["nan_count"]], total[COL["inf_count"]], grads_ok.double(),
            loss_ok.double(), skipped.double(), scale, opt_bad,
        ])
        n_sc, n = len(SCALARS), len(self.params)
        self._buf[slot, :n_sc] = row
        per_norm = table[:-1, COL["norm"]]
        per_bad = table[:-1, COL["nan_count"]] + table[:-1, COL["inf_count"]]
        if len(rows) == n:
            self._buf[slot, n_sc:n_sc + n] = per_norm
            self._buf[slot, n_sc + n:] = per_bad
        else:
            self._buf[slot, n_sc:] = math.nan
            if rows:
                idx = self._row_index.get(tuple(rows))
                if idx is None:  # copied to the device once per pattern of missing grads
                    idx = self._row_index.setdefault(tuple(rows),
                                                     torch.tensor(rows, device=self.device))
                self._buf[slot, n_sc:n_sc + n].index_copy_(0, idx, per_norm)
                self._buf[slot, n_sc + n:].index_copy_(0, idx, per_bad)

        lr = opt.param_groups[0].get("lr") if opt is not None else None
        self._pending.append({
            "step": t, "lr": float(lr) if isinstance(lr, (int, float)) else None,
            "batch": _batch_refs(batch) if self.log_dir is not None else None,
            "sample_ids": _batch_refs(sample_ids) if self.log_dir is not None else None,
            "rng": self._rng, "opt_stats": self._last_opt_stats,
        })
        self._rng = self._rng_state()  # the state the next step's forward starts from
        self._fill += 1
        self.steps_seen += 1
        if self._fill == self.flush_every:
            self.flush()
        return Observation(step=t, skip=bad, loss=loss_d, stats=stats)

    def _step_optimizer(self, bad: torch.Tensor) -> torch.Tensor:
        opt, scaler = self.optimizer, self.scaler
        guard = self.on_nonfinite in ("skip", "raise")
        if scaler is not None:
            state = scaler._per_optimizer_states[id(opt)]
            found = state.get("found_inf_per_device", {})
            if guard:
                for f in found.values():  # our verdict joins the scaler's own overflow check
                    f.copy_(torch.maximum(f, bad.to(f.device, f.dtype)))
            skipped = sum((f.to(self.device) for f in found.values()),
                          torch.zeros((), device=self.device)) > 0
            scaler.step(opt)
            scaler.update()
            return skipped
        if not guard:
            opt.step()
            return torch.zeros_like(bad)
        if _supports_found_inf(opt) and not _first_step_creates_garbage(opt):
            opt.grad_scale = None
            opt.found_inf = bad.float()
            try:
                opt.step()
            finally:
                del opt.grad_scale
                del opt.found_inf
            return bad
        if not bool(bad):  # the one host sync per step for optimizers without found_inf
            opt.step()
        return bad

    def _optimizer_nonfinite(self, t: int) -> torch.Tensor:
        nan = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        self._last_opt_stats = None
        k = self.optimizer_check_every
        if self.optimizer is None or not k or t % k:
            return nan
        from .optim import optimizer_state_tensors

        names, tensors = optimizer_state_tensors(self.optimizer, self._param_names())
        if not tensors:
            return nan
        s = multi_tensor_stats(tensors, names=names, backend=self.backend)
        self._last_opt_stats = s
        total = s.raw[-1].to(self.device)
        return total[COL["nan_count"]] + total[COL["inf_count"]]

    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.params}

    @staticmethod
    def _rng_state() -> dict:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    # ---- the flush: one device-to-host copy, then the detectors ---------------------------

    def flush(self) -> list[Event]:
        """Copy the pending records to the host (once), run the detectors, write logs and
        dumps. Returns the new events; raises NonFiniteError with ``on_nonfinite="raise"``."""
        k = self._fill
        if k == 0:
            return []
        host = self._buf[:k].cpu()
        new: list[Event] = []
        n_sc, n = len(SCALARS), len(self.params)
        for j in range(k):
            info = self._pending[j]
            vals = {name: float(host[j, i]) for i, name in enumerate(SCALARS)}
            step_events = self._detect(info, vals, host[j, n_sc + n:])
            if step_events and self.log_dir is not None:
                dump = self._dump(info, vals, host[j], step_events, j)
                for e in step_events:
                    e.dump = dump
            self._log(info, vals, host[j, n_sc:n_sc + n], step_events)
            new.extend(step_events)
        self._fill = 0
        self._pending.clear()
        self.events.extend(new)
        if self._events_file is not None:
            for e in new:
                self._events_file.write(json.dumps(e.to_json()) + "\n")
            self._events_file.flush()
            self._steps_file.flush()
        if self.on_nonfinite == "raise":
            fatal = [e for e in new if e.kind in ("nonfinite_loss", "nonfinite_grad")]
            if fatal:
                raise NonFiniteError(fatal)
        return new

    def _detect(self, info: dict, v: dict, per_bad: torch.Tensor) -> list[Event]:
        t = info["step"]
        found: list[tuple[str, str, dict]] = []
        skipped = v["skipped"] > 0
        action = " (step skipped)" if skipped else ""
        if not v["loss_finite"]:
            found.append(("nonfinite_loss", f"loss is {v['loss']}{action}",
                          {"loss": v["loss"], "skipped": skipped}))
        if not v["grads_finite"]:
            bad = {self.names[i]: int(c) for i, c in enumerate(per_bad.tolist())
                   if c == c and c > 0}
            shown = ", ".join(list(bad)[:5]) + (" ..." if len(bad) > 5 else "")
            found.append(("nonfinite_grad",
                          f"{int(v['nan_count'])} NaN and {int(v['inf_count'])} Inf gradient "
                          f"values in {len(bad)} tensor(s): {shown}{action}",
                          {"tensors": bad, "nan_count": int(v["nan_count"]),
                           "inf_count": int(v["inf_count"]), "skipped": skipped}))
        found += self._spike_loss.update(v["loss"])
        found += self._divergence.update(v["loss"])
        found += self._oscillation.update(v["loss"])
        if v["grads_finite"]:
            found += self._spike_norm.update(v["grad_norm"])
            found += self._vanishing.update(v["grad_norm"])
        checked = v["optimizer_nonfinite"] == v["optimizer_nonfinite"]
        if checked and v["optimizer_nonfinite"] == 0:
            self._opt_bad = False
        if checked and v["optimizer_nonfinite"] > 0 and not self._opt_bad:
            self._opt_bad = True  # reported once until a later check finds the state clean
            names = info["opt_stats"].nonfinite() if info["opt_stats"] is not None else []
            found.append(("optimizer_state_nonfinite",
                          f"{int(v['optimizer_nonfinite'])} NaN/Inf values in optimizer state: "
                          + ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
                          {"tensors": names, "count": int(v["optimizer_nonfinite"])}))
        scale = v["loss_scale"]
        if self.scaler is not None:
            collapsed = not math.isfinite(scale) or scale < self.min_loss_scale
            if collapsed and not self._scale_collapsed:
                found.append(("loss_scale_collapse",
                              f"GradScaler scale fell to {scale:.3g} "
                              f"(below {self.min_loss_scale:g}): fp16 gradients are "
                              "overflowing step after step",
                              {"scale": scale, "min_loss_scale": self.min_loss_scale}))
            self._scale_collapsed = collapsed
        return [Event(t, kind, msg, dict(details, step_loss=v["loss"], lr=info["lr"]))
                for kind, msg, details in found]

    def _log(self, info: dict, v: dict, per_norm: torch.Tensor, events: list[Event]) -> None:
        if self._steps_file is None:
            return
        rec = {"step": info["step"], **{k: v[k] for k in SCALARS}, "lr": info["lr"]}
        for k in ("nan_count", "inf_count"):
            rec[k] = int(rec[k]) if rec[k] == rec[k] else None
        for k in ("grads_finite", "loss_finite", "skipped"):
            rec[k] = bool(rec[k])
        if rec["optimizer_nonfinite"] == rec["optimizer_nonfinite"]:
            rec["optimizer_nonfinite"] = int(rec["optimizer_nonfinite"])
        if events:
            rec["events"] = [e.kind for e in events]
        if info["step"] % self.per_tensor_every == 0 or events:
            rec["per_tensor_norms"] = dict(zip(self.names, per_norm.tolist()))
        self._steps_file.write(json.dumps(_jsonable(rec)) + "\n")
        if self._tb is not None:
            for k in ("loss", "grad_norm", "loss_scale"):
                if math.isfinite(v[k]):
                    self._tb.add_scalar(k, v[k], info["step"])
            if info["lr"] is not None:
                self._tb.add_scalar("lr", info["lr"], info["step"])

    def _dump(self, info: dict, v: dict, row: torch.Tensor, events: list[Event],
              slot: int) -> str:
        path = self.log_dir / "dumps" / f"step_{info['step']:08d}.pt"
        params = None
        if self._snapshots is not None:
            params = {name: t.cpu().clone() for name, t in zip(self.names, self._snapshots[slot])}
        torch.save({
            "step": info["step"],
            "events": [e.to_json() for e in events],
            "batch": _to_cpu(info["batch"]),
            "sample_ids": _to_cpu(info["sample_ids"]),
            "record": _jsonable(v),
            "per_tensor": {"names": self.names,
                           "norm": row[len(SCALARS):len(SCALARS) + len(self.names)].tolist()},
            "rng": info["rng"],
            "lr": info["lr"],
            "params": params,
        }, path)
        return str(path)

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Final flush; closes the log files and removes activation hooks."""
        try:
            self.flush()
        finally:
            for f in (self._steps_file, self._events_file):
                if f is not None:
                    f.close()
            self._steps_file = self._events_file = None
            if self._tb is not None:
                self._tb.close()
            if self.activations is not None:
                self.activations.remove()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
