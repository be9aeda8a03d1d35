"""The recovery evaluation's trainer families (``eval_recovery.py``): the digits MLP of the
plain loops, trained by ``transformers.Trainer`` (``hf_``) and by Lightning (``pl_``) with
the callbacks' ``HealthCallback(rollback=fh.RollbackConfig())`` as the rollback guide shows,
their own replay (the trainer's loss) and the trainers' own samplers. The same faults at the
same step, planted by a callback at the start of a step; the data faults change the dataset's
tensors in place, so the loader serves them from its next batch on. A quarantined sample is
still served by the trainer's loader: the callback leaves its row out of the batch."""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fasthealth as fh

FAMILIES = ("hf_digits_mlp_adamw", "pl_digits_mlp_adamw")


class Net(nn.Module):
    """The loops' MLP, answering as a Hugging Face model does (``{"loss", "logits"}``); the
    sample ids ride in the batch (``idx``) for the callback."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        return {"logits": logits} if labels is None else \
            {"loss": F.cross_entropy(logits, labels), "logits": logits}


def cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The loops' cosine decay from 3e-4 to 3e-5, in closed form (a ``LambdaLR``, as the
    Trainer's own schedules are): each step sets the rate anew, so the rate bug's rate, set
    before the optimizer step, does not carry into the next (``CosineAnnealingLR`` steps from
    the rate it finds, and would compound it; the loops put the schedule's rate back)."""
    floor = 0.1
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: floor + (1 - floor) * (1 + math.cos(math.pi * min(t, steps) / steps)) / 2)


class Samples(torch.utils.data.Dataset):
    """The training samples by index; from ``stream_from`` on, each one garbage."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, garbage: Any) -> None:
        self.x, self.y, self.garbage = x, y, garbage
        self.stream_seed: int | None = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        x, y = self.x[i], self.y[i]
        if self.stream_seed is not None:
            self.stream_seed += 1
            bx, by = self.garbage(x[None], y[None], self.stream_seed, 10)
            x, y = bx[0], by[0]
        return {"x": x, "labels": y, "idx": i}


def faults_callback(fault: str, onset: int, data: Samples, bad: list[int], swap: Any,
                    seed: int):
    from transformers import TrainerCallback

    class Faults(TrainerCallback):
        """Plants ``fault`` at the start of the step ``onset`` (the rate bug at every step
        from it on, as the loop sets it)."""

        def on_step_begin(self, args, state, control, model=None, optimizer=None,
                          lr_scheduler=None, **kw):
            t = state.global_step
            if t == onset and bad:
                data.x[bad], data.y[bad] = swap
            if fault == "stream" and t == onset:
                data.stream_seed = 10_000 * seed
            if fault == "lr_bug" and t >= onset:
                for g, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr()):
                    g["lr"] = lr * 30
            if fault == "weight" and t == onset:
                with torch.no_grad():
                    w = next(model.parameters()).view(-1)
                    w[w.abs().argmax()] *= 1e4

    return Faults()


def run_trainer(name: str, fault: str, seed: int, rollback: bool, out: Any, bad: set[int],
                data: tuple[torch.Tensor, ...], garbage: Any, steps: int, batch: int) -> None:
    """Trains ``out``'s run (an ``eval_recovery.Run``) through its family's trainer and fills
    in its end: the eval loss, the stop, the rollbacks and the quarantine."""
    run = run_pl if name.startswith("pl_") else run_hf
    run(fault, seed, rollback, out, bad, data, garbage, steps, batch)


def run_hf(fault: str, seed: int, rollback: bool, out: Any, bad: set[int],
           data: tuple[torch.Tensor, ...], garbage: Any, steps: int, batch: int) -> None:
    """The Hugging Face Trainer's run."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from fasthealth.integrations.transformers import HealthCallback

    xt, yt, xe, ye, swap = data
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = cosine(opt, steps)
    ds = Samples(xt, yt, garbage)
    health = HealthCallback(rollback=fh.RollbackConfig() if rollback else None)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir=d, max_steps=steps, per_device_train_batch_size=batch,
                                 use_cpu=True, report_to=[], save_strategy="no", seed=seed,
                                 disable_tqdm=True, dataloader_num_workers=0, logging_steps=500,
                                 remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, sched),
                          callbacks=[health, faults_callback(fault, out.onset, ds, sorted(bad),
                                                             swap, seed)])
        trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        except fh.RollbackBudgetError as e:
            out.stopped, out.stop_step = e.cause or "budget", trainer.state.global_step
        mon = health.monitor
        out.quarantine_skips = quarantine_skips(mon)
    out.seconds = time.perf_counter() - t0
    finish(out, model, mon, bad, xe, ye)


def finish(out: Any, model: nn.Module, mon: Any, bad: set[int], xe: torch.Tensor,
           ye: torch.Tensor) -> None:
    """``out``'s end: the eval loss, the alarms, the rollbacks and the quarantine."""
    with torch.no_grad():
        model.eval()
        out.eval_loss = float(F.cross_entropy(model(xe)["logits"], ye))
    if mon is None:
        out.eval_loss = math.nan
        return
    outcome(out, mon, bad)


def outcome(out: Any, mon: Any, bad: set[int]) -> None:
    """What the Monitor ``mon`` did in ``out``'s run: its alarm incidents, its rollbacks (step,
    the step restored, the incident's cause, the samples quarantined) and its quarantine
    against the ``bad`` samples planted (the plain loops' runs too)."""
    out.alarms = sum(i.severity == "alarm" for i in mon.incidents)
    out.rollbacks = [(r.step, r.to_step, next((i.cause for i in mon.incidents
                                               if i.id == r.incident), None), len(r.quarantined))
                     for r in mon.rollbacks]
    q = set(mon.rollback.quarantine) if mon.rollback is not None else set()
    out.quarantined, out.quarantined_bad = len(q), len(q & bad)


def quarantine_skips(mon: Any) -> int:
    """The steps the callback skipped because their batch held a quarantined sample (their
    ``quarantine_skip`` in ``steps.jsonl``)."""
    if mon is None or mon.run_dir is None:
        return 0
    mon.close()  # its steps written (closing twice is a no-op)
    path = Path(mon.run_dir) / "steps.jsonl"
    if not path.is_file():
        return 0
    return sum((json.loads(line).get("quarantine_skip") or 0) > 0
               for line in path.read_text().splitlines() if line.strip())


def run_pl(fault: str, seed: int, rollback: bool, out: Any, bad: set[int],
           data: tuple[torch.Tensor, ...], garbage: Any, steps: int, batch: int) -> None:
    """Lightning's run: a module around ``Net`` with AdamW and the cosine decay stepped per
    step, a shuffled DataLoader, ``HealthCallback(rollback=...)``."""
    import lightning.pytorch as pl

    from fasthealth.integrations.lightning import HealthCallback

    xt, yt, xe, ye, swap = data
    ds = Samples(xt, yt, garbage)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, b, batch_idx):
            return self.net(b["x"], b["labels"])["loss"]

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-4)
            sched = cosine(opt, steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Faults(pl.Callback):
        """``faults_callback``'s faults, at Lightning's start of a step."""

        def on_train_batch_start(self, trainer, module, b, batch_idx):
            t, opt = trainer.global_step, trainer.optimizers[0]
            if t == out.onset and bad:
                ds.x[sorted(bad)], ds.y[sorted(bad)] = swap
            if fault == "stream" and t == out.onset:
                ds.stream_seed = 10_000 * seed
            if fault == "lr_bug" and t >= out.onset:
                sched = trainer.lr_scheduler_configs[0].scheduler
                for g, lr in zip(opt.param_groups, sched.get_last_lr()):
                    g["lr"] = lr * 30
            if fault == "weight" and t == out.onset:
                with torch.no_grad():
                    w = next(module.parameters()).view(-1)
                    w[w.abs().argmax()] *= 1e4

    torch.manual_seed(seed)
    module = Module()
    health = HealthCallback(rollback=fh.RollbackConfig() if rollback else None)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=d,
                             callbacks=[health, Faults()])
        try:
            trainer.fit(module, loader)
        except fh.RollbackBudgetError as e:
            out.stopped, out.stop_step = e.cause or "budget", trainer.global_step
        mon = health.monitor
        out.quarantine_skips = quarantine_skips(mon)
    out.seconds = time.perf_counter() - t0
    finish(out, module.net, mon, bad, xe, ye)
