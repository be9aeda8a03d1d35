"""The Lightning families: ``LightningModule`` s on the digits, the wine table, the diabetes
table (a regression: mean squared error) and text, each with its own
``configure_optimizers``, trained by ``lightning.Trainer`` with
``fasthealth.integrations.lightning.HealthCallback()`` at its defaults (its logs in
``<default_root_dir>/fasthealth``, a temporary directory), ``enable_progress_bar=False``,
``logger=False``, ``enable_checkpointing=False``, on the CPU.

What the families vary: SGD with momentum and a CosineAnnealingWarmRestarts stepped every
step, RMSprop with OneCycleLR, Adagrad with MultiStepLR milestones, AdamW with a LinearLR
warm-up then a linear decay (SequentialLR), SGD with Nesterov momentum and CosineAnnealingLR,
Adamax with a quadratic PolynomialLR; ``accumulate_grad_batches``; ``gradient_clip_val``;
``bf16-mixed``; and one module with manual optimization (``manual_backward``, its own
``opt.step()`` and ``sched.step()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import sets
from .faults import Plan, Planted, replay_loss


def sgd_warm_restarts(params, steps):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50)


def rmsprop_one_cycle(params, steps):
    opt = torch.optim.RMSprop(params, lr=1e-3)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps + 1)


def adagrad_milestones(params, steps):
    opt = torch.optim.Adagrad(params, lr=0.05)
    return opt, torch.optim.lr_scheduler.MultiStepLR(
        opt, milestones=[int(0.4 * steps), int(0.8 * steps)], gamma=0.3)


def adamw_warmup_decay(params, steps, lr=3e-3):
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.05, total_iters=20)
    decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.05,
                                              total_iters=max(1, steps - 20))
    return opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[20])


def sgd_nesterov_cosine(params, steps):
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


def adamax_polynomial(params, steps):
    opt = torch.optim.Adamax(params, lr=5e-3)
    return opt, torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=steps, power=2.0)


@dataclass
class LitFamily:
    name: str
    about: str
    data: Callable[[int, int], Any]
    net: str  # "table" (a classifier), "regression" (mean squared error) or "chars"
    optim: Callable  # (params, steps) -> (opt, sched)
    precision: str = "32-true"
    accum: int = 1
    gradient_clip_val: float | None = None
    manual: bool = False
    tags: tuple[str, ...] = ()
    batch: int = 16
    steps: int = 300
    held_out: bool = False
    trainer: str = "lightning"


FAMILIES: dict[str, LitFamily] = {f.name: f for f in (
    LitFamily("pl_digits_sgd_momentum_warm_restarts", "an MLP on the digits; SGD momentum 0.9 "
              "with CosineAnnealingWarmRestarts (T_0=50) stepped every step",
              lambda seed, n: sets.Rows(seed, n, "digits"), "table", sgd_warm_restarts,
              tags=("float_input",)),
    LitFamily("pl_wine_adagrad_multistep_accum2", "an MLP on the wine table; Adagrad with "
              "MultiStepLR milestones, accumulate_grad_batches=2",
              lambda seed, n: sets.Rows(seed, n, "wine"), "table", adagrad_milestones,
              accum=2, tags=("float_input",), batch=8),
    LitFamily("pl_chars_adamw_linearlr_bf16", "a one-block causal transformer on stdlib "
              "source by characters; AdamW, LinearLR warm-up then decay; bf16-mixed",
              lambda seed, n: sets.TokenWindows(seed, n, "stdlib", "chars"), "chars",
              adamw_warmup_decay, precision="bf16-mixed",
              tags=("tokens", "embedding", "bf16"), batch=8),
    # ---- held out until the first held-out scoring, tuning since --------------------------------
    LitFamily("pl_digits_rmsprop_one_cycle", "an MLP on the digits; RMSprop with OneCycleLR",
              lambda seed, n: sets.Rows(seed, n, "digits"), "table", rmsprop_one_cycle,
              tags=("float_input",), held_out=False),
    LitFamily("pl_pydoc_bytes_manual_adamw", "a one-block causal transformer on pydoc topics "
              "by bytes; manual optimization (AdamW, LinearLR warm-up then decay)",
              lambda seed, n: sets.TokenWindows(seed, n, "pydoc", "bytes"), "chars",
              adamw_warmup_decay, manual=True, tags=("tokens", "embedding"), batch=8,
              held_out=False),
    # ---- held out (chosen after the first held-out scoring; not tuned on) -----------------------
    LitFamily("pl_diabetes_mse_sgd_nesterov_cosine", "a regression MLP (mean squared error) on "
              "the diabetes table, targets standardised; SGD with Nesterov momentum 0.9 and "
              "CosineAnnealingLR over the run", lambda seed, n: sets.Rows(seed, n, "diabetes"),
              "regression", sgd_nesterov_cosine, tags=("float_input",), batch=32,
              held_out=True),
    LitFamily("pl_pydoc_chars_adamax_poly_clip_accum4", "a one-block causal transformer on "
              "pydoc topics by characters; Adamax with PolynomialLR (power 2), "
              "accumulate_grad_batches=4, gradient_clip_val=0.5",
              lambda seed, n: sets.TokenWindows(seed, n, "pydoc", "chars"), "chars",
              adamax_polynomial, accum=4, gradient_clip_val=0.5,
              tags=("tokens", "embedding"), batch=8, held_out=True),
)}


class CharNet(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.block = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx))

    def forward(self, ids):
        h = self.emb(ids) + self.pos[:ids.shape[1]]
        n = ids.shape[1]
        return self.head(self.block(h, src_mask=self.mask[:n, :n], is_causal=True))


def make_module(family: LitFamily, ds, plan: Plan, steps: int):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            if family.net in ("table", "regression"):
                out = ds.targets if family.net == "regression" else ds.classes
                self.net = nn.Sequential(nn.Linear(ds.features, 64), nn.GELU(),
                                         nn.Linear(64, out))
            else:
                self.net = CharNet(ds.vocab, ds.ctx)
            self.automatic_optimization = not family.manual

        def loss_of(self, batch):
            if family.net == "table":
                return F.cross_entropy(self.net(batch["x"]).float(), batch["labels"])
            if family.net == "regression":
                return F.mse_loss(self.net(batch["x"]).float(), batch["labels"].float())
            ids = batch["input_ids"]
            logits = self.net(ids[:, :-1]).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   batch["labels"][:, 1:].reshape(-1))

        def training_step(self, batch, batch_idx):
            loss = self.loss_of(batch) * plan.loss_factor(self.trainer.global_step)
            self.log("train_loss", loss.detach())
            if family.manual:
                opt, sched = self.optimizers(), self.lr_schedulers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                sched.step()
            return loss

        def configure_optimizers(self):
            opt, sched = family.optim(self.parameters(), steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def make_harness_callback(plan: Plan, accum: int):
    import lightning as L

    class Harness(L.Callback):
        """Plants the model and optimizer faults at the start of a step; keeps the trainer's
        own record of each batch (its loss, what the module logged, the learning rate) for
        the log comparison."""

        def __init__(self):
            self.record: list[dict] = []

        def on_train_start(self, trainer, pl_module):
            self.handle = plan.hook(trainer.optimizers[0])

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % accum == 0:
                plan.before_step(pl_module, trainer.optimizers[0], trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = {"batch": batch_idx, "step": trainer.global_step,
                   "loss": float(loss), "lr": trainer.optimizers[0].param_groups[0]["lr"]}
            row.update({k: float(v) for k, v in trainer.callback_metrics.items()})
            self.record.append(row)

        def on_train_end(self, trainer, pl_module):
            self.handle.remove()

    return Harness()


def train(family: LitFamily, plan: Plan | None, seed: int, steps: int, out_dir: str,
          callback: bool = True, logging_steps: int | None = None) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, default_collate

    from fasthealth.integrations.lightning import HealthCallback

    n = steps * family.batch * family.accum
    ds = family.data(seed, n)
    L.seed_everything(seed, verbose=False)
    if plan is None:
        plan = Plan(None, steps, seed)
    plan.vocab, plan.frequent_id = getattr(ds, "vocab", 0), getattr(ds, "frequent_id", 0)
    module = make_module(family, ds, plan, steps)
    loader = DataLoader(ds, batch_size=family.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(seed),
                        collate_fn=Planted(default_collate, plan, family.accum))
    health = HealthCallback() if callback else None
    harness = make_harness_callback(plan, family.accum)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1,
                        precision=family.precision, accumulate_grad_batches=family.accum,
                        gradient_clip_val=family.gradient_clip_val,
                        callbacks=[c for c in (health, harness) if c], default_root_dir=out_dir,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    return {"callback": health, "log": harness.record, "steps": trainer.global_step,
            "log_dir": f"{out_dir}/fasthealth", "plan": plan, "model": module,
            "loss_fn": lambda m, b: replay_loss(m.loss_of, b)}
