"""The training-loop monitor (docs/spec.md section 6): checks every step on the device, acts
without a sync, looks at the numbers once per flush.

``Monitor.step(loss, ...)`` replaces ``optimizer.step()``; it is *record + gate*:

1. one fused pass over all gradients (``checks.GradPass``, its backend chosen when the Monitor
   is made) and an ``isfinite`` on the loss; the learning rate and the schedule's verdict;
2. gate (``gate.py``): clip with the norm that pass computed, then step the optimizer or skip it
   when the loss or a gradient is non-finite, on the device where the optimizer allows;
3. record (``record.py``): one row of scalars and per-tensor norms and non-finite counts in a
   device buffer, and the step's ``StepHost``.

``Monitor.flush()`` is *analyse + write* (``journal.py``): every ``flush_every`` steps the
buffer comes to the host in one copy, as ``StepRecord``s; the analyser (``analyser.py``) runs
every rule of ``rules/`` on each step and files its events under incidents, and the sinks write
the JSONL logs, TensorBoard and a dump per incident.
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from ..activations import ActivationMonitor
from ..checks import GradPass
from ..ops.backends import unsupported
from ..ops.layout import COL
from ..replicas import NonFiniteOrigin
from ..stats import MultiTensorStats
from . import gate
from .analyser import Analyser
from .buffers import BufferGuard, averaged_models, averaged_state, scanned_buffers
from .events import Event, Incident, Observation
from .incidents import IncidentTracker
from .journal import Journal
from .long_run import LongRun
from .option_groups import (
    FLAT,
    ActOptions,
    DetectOptions,
    LogOptions,
    MeasureOptions,
    PrecursorOptions,
    gather,
)
from .options import check_options, loss_value, refuse_misuse
from .precursors import PrecursorProbe
from .record import (
    DeviceRecord,
    across_ranks,
    loss_scale,
    optimizer_nonfinite,
    rng_state,
    step_host,
)
from .rollback import Rollback
from .rules import Context, Rule
from .rules import build as build_rules
from .rules.own_grads import OwnGrads
from .runs import writer_root
from .scans import AlikeRanks, Scans
from .schedule import ScheduleSource, ScheduleView
from .skip_rule import SkipConfig, SkipRule
from .view import RunView


def _grad_pass(backend: str | None, device: torch.device) -> GradPass:
    """The Monitor's fused pass, its backend chosen now; a backend that cannot run on the
    model's device is a ValueError naming both."""
    why = None if backend in (None, "auto") else unsupported(backend, device)
    if why is not None:
        raise ValueError(f"fasthealth: backend={backend!r} cannot run on model's device "
                         f"({device}): {why}")
    return GradPass(backend, device)


def _open_journal(self: Monitor, tensorboard: bool, dumps: str, snapshot_max_bytes: int,
                  **options: Any) -> None:
    """A Monitor's host side (events, incidents, logs), its parts' view of the run and, with
    a log_dir, the parameter snapshots that dumps need (``Monitor.__init__``'s last step)."""
    param_bytes = sum(p.numel() * p.element_size() for _, p in self.params)
    meta = {"names": self.names, "flush_every": self.flush_every,
            "on_nonfinite": self.on_nonfinite, **options,
            "max_grad_norm": self.max_grad_norm, "per_tensor_every": self.per_tensor_every,
            "started": time.time(), "param_bytes": param_bytes}
    root = (None if self.log_dir is None else  # under torch.distributed: one rank writes
            writer_root(self.log_dir, self.process_group, self.options.log.all_ranks))
    self.analyser = Analyser(self.detectors, IncidentTracker(self.options.detect.incidents))
    self.journal = Journal(self.names, self.analyser, log_dir=root, meta=meta,
                           tensorboard=tensorboard, dumps=dumps,
                           per_tensor_every=self.per_tensor_every,
                           on_nonfinite=self.on_nonfinite)
    self._view = RunView.of(self)  # what its parts read of the run (view.py)
    jsonl = self.journal.jsonl
    if jsonl is None:
        return
    atexit.register(self._close_at_exit)  # the last steps reach the log even on a crash
    if param_bytes * self.flush_every <= snapshot_max_bytes:
        self._snapshots = [[torch.empty_like(p.detach()) for _, p in self.params]
                           for _ in range(self.flush_every)]



def _precursor_probe(mon: Monitor, pr: PrecursorOptions) -> PrecursorProbe:
    """The precursors' probe of the Monitor's model; its LM-head hook learns the coming step
    from the Monitor through a weak reference (the model's hook must not keep it alive)."""
    this = weakref.ref(mon)
    return PrecursorProbe(mon.model, mon.params, mon.device, logits=pr.logits,
                          attention=pr.attention, stats=mon._grad_pass,
                          next_step=lambda: getattr(this(), "_next_step", 0))


def _step_inputs(mon: Monitor, model: torch.nn.Module, process_group: Any) -> None:
    """What every step reads, made once: the parameters and their indices, and under DDP the
    communication hook that notes whether this rank's own gradients held NaN/Inf before the
    all-reduce (``NonFiniteOrigin``; None where the model is not a DDP or has a hook)."""
    mon._tensors, mon._all = [p for _, p in mon.params], list(range(len(mon.params)))
    mon.buffer_guard = BufferGuard.for_model(model) if mon.gate.guard else None
    mon._snapshots = None  # the dumps' (_open_journal)
    mon.averaged_state = averaged_state(mon.averaged)
    mon.schedule = ScheduleSource(mon.optimizer, mon.options.detect.scheduler)
    mon._restarts = ScheduleView()  # the step's side: the skip rule re-arms at a restart
    mon.names_by_id = {id(p): n for n, p in mon.params}
    mon._origin = None if process_group is None else NonFiniteOrigin.attach(model,
                                                                            process_group)
    mon._alike = AlikeRanks(process_group)
    # on_spike="skip": a step whose average holds a rank's far outlying gradients is skipped
    # on every rank too, at the ratio that names the rank (rules/own_grads.py)
    mon._own_skip = next((r.config.ratio for r in mon.detectors if isinstance(r, OwnGrads)),
                         None) if mon.on_spike == "skip" and mon._origin is not None else None


def _gradients(mon: Monitor) -> tuple[list[torch.Tensor], list[int], list[str]]:
    """(the watched parameters' gradients, their indices, their names): each ``.grad`` read
    once, the lists kept when every parameter has one (the usual step)."""
    found = [p.grad for p in mon._tensors]
    grads, present, names = cast("list[torch.Tensor]", found), mon._all, mon.names
    if any(g is None for g in found):
        present = [i for i, g in enumerate(found) if g is not None]
        grads, names = [grads[i] for i in present], [mon.names[i] for i in present]
    return grads, present, names


def _active(scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
    """The scaler, or None for a disabled one: nanoGPT's ``GradScaler(enabled=dtype ==
    "float16")`` outside float16, or a CUDA scaler where CUDA is unavailable, scales nothing and
    steps the optimizer as it is."""
    return scaler if scaler is not None and scaler.is_enabled() else None

def _measured(mon: Monitor, t: int, loss_d: torch.Tensor, loss_ok: torch.Tensor,
              skipped: torch.Tensor, stats: MultiTensorStats, spike: Any, held: Any,
              bad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's record fields beside the totals (which the record takes from the fused
    pass's table): only those measured this step; the others stay NaN (not measured)."""
    scalars = {"loss": loss_d, "loss_finite": loss_ok, "skipped": skipped,
               **mon.gate.precursor_scalars()}
    if mon.scaler is not None:
        scalars["loss_scale"] = loss_scale(mon.scaler, mon.device)
    if (count := mon._scan_optimizer(t)) is not None:
        scalars["optimizer_nonfinite"] = count
    scalars.update(across_ranks(stats, mon.device))
    if spike is not None:
        scalars["spike_skip"], z = spike
        scalars["skip_z_loss"], scalars["skip_z_grad_norm"] = z[0], z[1]
    if mon.rollback is not None:
        scalars["quarantine_skip"] = held if held is not None else torch.zeros_like(bad)
    return scalars


def _idle(mon: Monitor, loss: torch.Tensor) -> Observation:
    """A micro-batch that accelerate's optimizer does not step on (its ``gradient_state
    .sync_gradients`` is False under ``accumulate``): its gradients are still being summed, and
    the step that syncs them checks them all. Nothing is checked, recorded or stepped."""
    return Observation(step=mon._next_step, loss=loss, stats=None,
                       skip=torch.zeros((), dtype=torch.bool, device=mon.device))


class Monitor(LongRun):
    """Watches a training loop; see docs/spec.md section 6 and the module docstring.

    Each option is a keyword (``Monitor(model, opt, flush_every=20, dumps="alarm")``): those of
    docs/spec.md's signature are spelled out here, the others come through ``**options``. Five
    groups document them by concern (``option_groups.py``), and ``mon.options`` holds them so:
    ``fh.MeasureOptions(backend, process_group, replica_group, activations)``;
    ``fh.DetectOptions(spike_zscore, spike_window, warmup_steps, vanishing_threshold,
    min_loss_scale, optimizer_check_every, scheduler, rules, detectors, incidents)``;
    ``fh.PrecursorOptions(enabled, logits, attention)`` (``precursors=True/False``);
    ``fh.ActOptions(on_nonfinite, on_spike, max_grad_norm, scaler, rollback)``;
    ``fh.LogOptions(log_dir, flush_every, per_tensor_every, tensorboard, dumps,
    snapshot_max_bytes, all_ranks)``. A group passed as ``measure=``, ``detect=``, ``act=``,
    ``log=`` or ``precursors=`` still works in this release and warns (DeprecationWarning);
    an option given both ways is a ValueError, an unknown keyword a TypeError.

    Every argument is checked here, before anything is made or written (types, ranges and
    combinations: ``tensorboard=True`` needs ``log_dir`` and an importable tensorboard,
    ``warmup_steps <= spike_window``, an optimizer of the model's parameters): a bad one raises
    TypeError or ValueError (ImportError for tensorboard) that names it and its value.
    """

    analyser: Analyser  # the host side's rules, events and incidents (analyser.py)
    _tensors: list[torch.Tensor]  # _step_inputs: the parameters, their indices, the DDP hook
    _all: list[int]
    _origin: NonFiniteOrigin | None
    _alike: AlikeRanks
    journal: Journal  # the flushes' analysis and writing (journal.py)
    _view: RunView  # what its parts read of the run (view.py)
    _snapshots: list[list[torch.Tensor]] | None  # the parameters before each step, for dumps
    buffer_guard: BufferGuard | None  # _step_inputs: puts a skipped step's buffers back
    names_by_id: dict[int, str]  # _step_inputs: each watched parameter's name by its id
    averaged_state: list[tuple[str, torch.Tensor]]  # _step_inputs: the averaged models'
    schedule: ScheduleSource  # _step_inputs: the step's rate and the scheduler's
    _restarts: ScheduleView  # _step_inputs: the skip rule re-arms at a restart
    _own_skip: float | None  # _step_inputs: the own-gradient ratio that skips a step

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        # docs/spec.md section 6's keywords; their defaults are their groups' (written once)
        log_dir: str | os.PathLike | None = LogOptions.log_dir,
        flush_every: int = LogOptions.flush_every,
        on_nonfinite: str = ActOptions.on_nonfinite,
        on_spike: str = ActOptions.on_spike,
        spike_zscore: float = DetectOptions.spike_zscore,
        spike_window: int = DetectOptions.spike_window,
        warmup_steps: int = DetectOptions.warmup_steps,
        max_grad_norm: float | None = ActOptions.max_grad_norm,
        activations: Any = MeasureOptions.activations,
        process_group: Any = MeasureOptions.process_group,
        precursors: bool | PrecursorOptions = True,
        # deprecated: the option groups (their options are keywords)
        measure: MeasureOptions | None = None,
        detect: DetectOptions | None = None,
        act: ActOptions | None = None,
        log: LogOptions | None = None,
        **options: Any,
    ) -> None:
        flat = {k: v for k, v in locals().items() if k in FLAT}
        self.options = gather({**flat, **options}, measure=measure, detect=detect, act=act,
                              log=log)
        self._gradient_state = getattr(optimizer, "gradient_state", None)  # _idle's
        optimizer = check_options(model, optimizer, self.options.flat())  # before anything
        me, de, pr, ac, lg = (self.options.measure, self.options.detect,
                              self.options.precursors, self.options.act, self.options.log)
        self.model, self.optimizer, self.scaler = model, optimizer, _active(ac.scaler)
        self.flush_every, self.on_nonfinite, self.on_spike = (lg.flush_every, ac.on_nonfinite,
                                                              ac.on_spike)
        self.max_grad_norm, self.min_loss_scale = ac.max_grad_norm, de.min_loss_scale
        self.per_tensor_every, self.optimizer_check_every = (lg.per_tensor_every,
                                                             de.optimizer_check_every)
        self.backend, self.process_group, self.replica_group = (me.backend, me.process_group,
                                                                me.replica_group)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in self.params]
        self.device, self.buffers = self.params[0][1].device, scanned_buffers(model)  # state too
        self._grad_pass = _grad_pass(me.backend, self.device)  # the backend chosen once
        self.record = DeviceRecord(self.names, lg.flush_every, self.device)
        self.precursors = _precursor_probe(self, pr) if pr.enabled else None
        self.rule_context = Context(
            names=self.names, buffer_names=[n for n, _ in self.buffers],
            numels=[p.numel() for _, p in self.params], params=self.params,
            optimizer=optimizer, scaler=self.scaler is not None, spike_zscore=de.spike_zscore,
            spike_window=de.spike_window, warmup_steps=de.warmup_steps,
            vanishing_threshold=de.vanishing_threshold, min_loss_scale=de.min_loss_scale,
            probe=self.precursors, overrides=dict(de.rules or {}))
        self.detectors: list[Rule] = list(
            build_rules(self.rule_context, precursors=pr.enabled) if de.detectors is None
            else de.detectors)
        self.scans = Scans.for_rules(self.detectors, lg.flush_every, self.params, me.backend,
                                     me.process_group, me.replica_group, self.buffers)
        self.skip_rule = SkipRule.beside(self.detectors, SkipConfig(
            de.spike_zscore, de.spike_window, de.warmup_steps), self.device) \
            if ac.on_spike == "skip" else None
        self.gate = gate.Gate(optimizer, self.scaler, self.record, self.device,
                              guard=ac.on_nonfinite in ("skip", "raise") or ac.on_spike == "skip"
                              or ac.rollback not in (None, False),  # its quarantine skips
                              skip_rule=self.skip_rule, precursors=self.precursors)
        self.averaged = averaged_models(ac.averaged)  # EMA/SWA copies: state like the model
        self.rollback = Rollback.build(ac.rollback, model, optimizer, self.scaler, de.scheduler,
                                       self.averaged)
        self.steps_seen = self._next_step = 0  # the Monitor's steps, then its state's flags
        self._stepped = self._resumed = self._closed = self._closing = False  # state, close()
        self._rng, self._opt_stats = rng_state(), None  # the dumps'; the optimizer scan's
        _step_inputs(self, model, me.process_group)
        self.hooks: list[Any] = []  # removed at close(): what an integration registered
        self.activations: ActivationMonitor | None = None  # before the sinks: a bad regex
        if me.activations is not None and me.activations is not False:
            self.activations = ActivationMonitor(  # ... writes nothing
                model, modules=None if me.activations is True else me.activations)
        self.log_dir = Path(lg.log_dir) if lg.log_dir is not None else None
        _open_journal(self, lg.tensorboard, lg.dumps, lg.snapshot_max_bytes,
                      spike_zscore=de.spike_zscore, spike_window=de.spike_window,
                      warmup_steps=de.warmup_steps)

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
        refuse_misuse(self, "step" if take_step else "check")  # no optimizer; closed
        loss_d, loss_ok = loss_value(loss, self.device)  # a bad loss raises before anything
        if self._gradient_state is not None and not self._gradient_state.sync_gradients:
            return _idle(self, loss_d)
        self._stepped = True
        if self.journal.jsonl is not None and self.journal.jsonl.run is None:
            self.journal.open_run()  # a new run, unless _continue_run opened one
        t = self._next_step if step is None else int(step)
        self._next_step = t + 1
        if self.scaler is not None and self.optimizer is not None:
            gate.unscale(self.optimizer, self.scaler)
        grads, present, names = _gradients(self)
        # with a process group the verdict is every rank's: a NaN anywhere skips everywhere,
        # and the skip rule sees the ranks' mean loss
        pg = self.process_group
        # a batch holding a sample a rollback quarantined: skipped as well (rollback.py), on
        # every rank when any rank's batch holds one
        held = None if self.rollback is None else self.rollback.holds(sample_ids, self.device,
                                                                      batch, t)
        stats = self._grad_pass(grads, names, process_group=pg, extra_bad=~loss_ok,
                                replica_group=self.replica_group,
                                extra_loss=loss_d if self.skip_rule is not None else None,
                                origin=None if self._origin is None else self._origin.take(),
                                extra_skip=held)
        if pg is not None and self.rollback is not None:
            held = stats.skip_any
        table = stats.raw.to(self.device)
        total = table[-1]
        grads_ok = total[COL["all_finite"]]  # 1.0 or 0.0
        bad = (grads_ok == 0) if pg is not None else ~torch.logical_and(loss_ok, grads_ok)
        rates = self.schedule.rates()
        restart, unexplained = self._restarts.observe(*rates)  # the run's one schedule view
        spike = self.gate.spike(loss_d if pg is None else stats.loss_mean, total, bad)
        if restart and self.skip_rule is not None:  # as the host rules do (analyser.py)
            self.skip_rule.rearm()
        nonfinite_gate = bad if self.on_nonfinite in ("skip", "raise") else torch.zeros_like(bad)
        skip = spike[0] if spike is not None else None  # what skips beside non-finite values
        if held is not None:
            skip = held if skip is None else skip | held
        if self._own_skip is not None and stats.own_ratio is not None:  # a rank's GPU's fault
            own = (stats.own_ratio >= self._own_skip).to(self.device)  # NaN: not measured
            skip = own if skip is None else skip | own
        decided = nonfinite_gate if skip is None else nonfinite_gate | skip
        skipped = self._act(t, grads, table, decided, take_step)
        if self.buffer_guard is not None:
            self.buffer_guard.settle(skipped)
        scalars = _measured(self, t, loss_d, loss_ok, skipped, stats, spike, held, bad)
        scanned, weight_table, batch_key = self.scans.measure(self.steps_seen, batch,
                                                              sample_ids)
        scalars.update(scanned)
        self.record.write(scalars, table, present, step_host(self, 
            t, batch, sample_ids, rates, restart, unexplained, len(present), weight_table,
            batch_key))
        self.steps_seen += 1
        if self.record.full:
            self.flush()
        # the step as taken (a GradScaler's own skip too); without an optimizer, the verdict
        # the user's own step should follow. Under on_nonfinite="warn" a non-finite step is
        # taken, as asked, and says so
        return Observation(step=t, skip=skipped if self.optimizer is not None else decided,
                           loss=loss_d, stats=stats)

    def _act(self, t: int, grads: list[torch.Tensor], table: torch.Tensor, bad: torch.Tensor,
             take_step: bool) -> torch.Tensor:
        """Clip, snapshot the parameters for replay, then step or skip when ``bad`` (or,
        without ``take_step``, arm the skip of the trainer's step); returns skipped."""
        if self.max_grad_norm is not None and grads:
            gate.clip_(grads, table[-1, COL["norm"]], self.max_grad_norm)
        if self._snapshots is not None:
            torch._foreach_copy_(self._snapshots[self.record.fill],
                                 [p.detach() for _, p in self.params])
        return self.gate.act(t, bad, take_step)

    def _scan_optimizer(self, t: int) -> torch.Tensor | None:
        """NaN + Inf count of the optimizer's state every ``optimizer_check_every`` steps;
        None at the other steps (not scanned)."""
        k = self.optimizer_check_every
        self._opt_stats = None
        if self.optimizer is None or not k or t % k:
            return None
        count, self._opt_stats = optimizer_nonfinite(self.optimizer, self.names_by_id,
                                                     self._grad_pass, self.device)
        return count

    # ---- flush: detect + write --------------------------------------------------------------

    def flush(self) -> list[Event]:
        """Rules, incidents, logs and dumps for the pending records (one host copy): the new
        events. NonFiniteError with ``on_nonfinite="raise"``; failed writes: write_errors."""
        refuse_misuse(self, "flush")
        steps = self._alike.name(self.record.take(), self._closing)  # scans.py
        found = self.journal.flush(steps, self._snapshots)
        if self.skip_rule is not None:  # the floor's rule on the device (skip_rule.py)
            self.skip_rule.set_start(self.analyser.loss_start())
        if self.rollback is not None and not self._closing:
            self.rollback.after_flush(self._view, steps, found)
        return found

    @property
    def events(self) -> list[Event]:
        """Every event so far, in step order."""
        return self.analyser.events

    @property
    def incidents(self) -> list[Incident]:
        """Every incident so far, in order of opening (``Incident.open``: still collecting)."""
        return self.analyser.incidents

    def on_alarm(self, listener: Callable[[Incident], None]) -> None:
        """Calls ``listener(incident)`` once per incident, at the flush where it becomes an
        alarm (notices never call it): how the trainer callbacks log one line per fault."""
        self.analyser.alarm_listeners.append(listener)

    @property
    def write_errors(self) -> list[str]:
        """What could not be written to ``log_dir`` (the first one was also warned)."""
        return list(self.journal.errors)

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Final flush; closes the log files and removes activation hooks. Runs by itself at
        interpreter exit (an unhandled exception included) and at the end of a ``with``; once
        (again: nothing), then ``step``, ``check`` and ``flush`` raise RuntimeError."""
        atexit.unregister(self._close_at_exit)
        self._closing = True
        try:
            if not self._closed:
                self.flush()
        finally:
            self._closed = True
            self.journal.close()
            if self.activations is not None:
                self.activations.remove()
            if self.precursors is not None:
                self.precursors.remove()
            for h in self.hooks:
                h.remove()
            self.hooks = []
            self.gate.remove()
            if self.buffer_guard is not None:
                self.buffer_guard.remove()

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


def analyser_for(model: torch.nn.Module, optimizer: Any = None, **options: Any) -> Analyser:
    """A fresh analyser (``analyser.py``) with the rules and incident settings a
    ``Monitor(model, optimizer, **options)`` has (its detection options and groups:
    ``spike_zscore``, ``incidents``, ``detect=``, ``precursors=``, ``scaler=``, ...), for step
    records made elsewhere (a recorded run). The Monitor it is built from writes nothing and is
    closed at once."""
    options.pop("log_dir", None)
    mon = Monitor(model, optimizer, **options)
    mon.close()
    return Analyser(mon.detectors, IncidentTracker(mon.options.detect.incidents))
