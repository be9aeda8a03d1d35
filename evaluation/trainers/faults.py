"""Faults planted in trainer runs as they happen in real ones, at a known step.

Each ``Fault`` declares the step it is planted at (``at``: a share of the run's steps), its
``delay`` (how many steps after that step an alarm may still come and count as catching it:
0-1 for acute faults, more for a stuck loader or a learning rate that only starts to harm),
and the ``cause`` a user should be told, in the vocabulary agreed for ``Incident.cause``:
"batch", "weights", "learning_rate", "optimizer_state", "numeric_range", "outside".
``needs`` names what a family must have for the fault to apply (``tokens``: a token input;
``float_input``: a float input; ``embedding``: an input embedding; ``bf16``: bf16 autocast).

How they are planted (never through the monitor's internals):

- the data faults by the loader: ``Planted`` wraps the collator, counts the micro-batches it
  builds (micro-batch ``i`` is optimizer step ``i // accum``, see ``sets.py``) and replaces the
  faulted step's batch (labels shuffled across the batch; tokens or pixels replaced by noise;
  Inf and NaN in one sample's float input; from the step on, the same batch again and again);
- the model and optimizer faults by a callback of the harness's own, at the start of the step
  (before its first forward): one float32 weight's exponent bit flipped
  (``.view(torch.int32) ^ (1 << 30)``), one weight set to 1e30, a NaN in the embedding of the
  commonest token, and, from the step on, the learning rate times 20 in the optimizer's
  ``param_groups`` as a buggy scheduler would leave it (restored after each optimizer step, so
  the real scheduler's own arithmetic goes on);
- the loss fault by the training code: the Trainer's ``compute_loss`` or the module's
  ``training_step`` returns the loss times 100 at one step.

fp16 is not planted (no loss-scale fault): on CPU, accelerate 1.15 accepts ``fp16=True`` but
trains in float32 without a GradScaler (its ``native_amp`` stays off), and Lightning 2.6 turns
``precision="16-mixed"`` on CPU into ``"bf16-mixed"``, so neither trainer has a loss scale to
break here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Fault:
    name: str
    cause: str
    delay: int
    about: str
    needs: tuple[str, ...] = ()
    at: float = 0.6


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("shuffled_labels", "batch", 1, "the labels of one batch shuffled across its samples"),
    Fault("garbage_batch", "batch", 1, "one batch of noise: random token ids, or pixels and "
          "features replaced by Gaussian noise of std 5"),
    Fault("nonfinite_input", "batch", 1, "one sample of one batch with Inf features and a NaN",
          needs=("float_input",)),
    Fault("stuck_loader", "batch", 60, "the loader repeats the same batch from the step on"),
    # a flip the loss does not show is found by the weight scan, which runs at least once per
    # flush (flush_every, 50 by default: docs/spec.md section 6), not at the step
    Fault("bit_flip", "weights", 50, "one float32 weight's top exponent bit flipped"),
    Fault("huge_weight", "weights", 50, "one weight set to 1e30 (a bf16 run); where the loss "
          "does not show it at once, the weight scan finds it, as bit_flip", needs=("bf16",)),
    Fault("nan_embedding", "weights", 1, "a NaN in the embedding of the commonest token",
          needs=("embedding",)),
    Fault("lr_x20", "learning_rate", 10, "the learning rate times 20 from the step on, in the "
          "optimizer's param_groups"),
    Fault("loss_x100", "outside", 1, "the loss the training code returns times 100 at one step"),
)}

ACUTE = tuple(n for n, f in FAULTS.items() if f.delay <= 1)


def applies(fault: Fault, tags: tuple[str, ...]) -> bool:
    return all(t in tags for t in fault.needs)


def target_weight(model: nn.Module) -> tuple[str, torch.Tensor]:
    """The parameter a weight fault hits: the first matrix (2-d float parameter) that is not an
    embedding (a projection of the first block, or the first layer)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, p in model.named_parameters():
        if p.dim() == 2 and p.is_floating_point() and id(p) not in embeddings:
            return name, p
    raise ValueError("no weight matrix to corrupt")


def embedding_of(model: nn.Module) -> nn.Embedding:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:
        emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    return emb


class Plan:
    """What a run plants: ``fault`` (None: a healthy run) at ``step``. ``vocab`` and
    ``frequent_id`` come from the data set (the noise's range, the embedding row to break)."""

    def __init__(self, fault: Fault | None, steps: int, seed: int, vocab: int = 0,
                 frequent_id: int = 0):
        self.fault = fault
        self.step = int(round(fault.at * steps)) if fault else -1
        self.name = fault.name if fault else None
        self.vocab, self.frequent_id = vocab, frequent_id
        self.g = torch.Generator().manual_seed(4000 + seed)
        self.stuck: dict[int, Any] = {}
        self.saved: list[float] = []
        self.planted: list[int] = []  # the steps something was planted at (the harness's check)
        self.hit = ""  # what a weight fault hit

    # ---- the loader -------------------------------------------------------------------------

    def batch(self, batch: dict, step: int, micro: int) -> dict:
        n, k = self.name, self.step
        if n is None or step < k:
            return batch
        if n == "stuck_loader":
            if step == k:
                self.stuck[micro] = {key: v.clone() for key, v in batch.items()}
            self._mark(step)
            return {key: v.clone() for key, v in self.stuck.get(micro, self.stuck[0]).items()}
        if step != k:
            return batch
        batch = dict(batch)
        if n == "shuffled_labels":
            y = batch["labels"]
            batch["labels"] = y[torch.randperm(len(y), generator=self.g)]
        elif n == "garbage_batch":
            if "input_ids" in batch:
                ids = batch["input_ids"]
                noise = torch.randint(0, self.vocab, ids.shape, generator=self.g)
                batch["input_ids"] = noise
                if batch["labels"].shape == ids.shape:  # a language model: the noise is its text
                    batch["labels"] = noise.clone()
            else:
                batch["x"] = 5.0 * torch.randn(batch["x"].shape, generator=self.g)
        elif n == "nonfinite_input":
            x = batch["x"].clone()
            x[0] = float("inf")
            x[0, 0] = float("nan")
            batch["x"] = x
        else:
            return batch
        self._mark(step)
        return batch

    # ---- the model and the optimizer, at the start of a step --------------------------------

    @torch.no_grad()
    def before_step(self, model: nn.Module, optimizer: Any, step: int) -> None:
        n, k = self.name, self.step
        if n == "lr_x20" and step >= k:
            opt = getattr(optimizer, "optimizer", optimizer)
            self.saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 20
            self._mark(step)
        if step != k:
            return
        if n == "bit_flip":
            name, p = target_weight(model)
            flat = p.data.view(-1)
            assert flat.dtype == torch.float32
            before = float(flat[0])
            flat[:1] = (flat[:1].view(torch.int32) ^ (1 << 30)).view(torch.float32)
            self.hit = f"{name}[0]: {before:.3g} -> {float(flat[0]):.3g}"
        elif n == "huge_weight":
            name, p = target_weight(model)
            p.data.view(-1)[0] = 1e30
            self.hit = f"{name}[0] = 1e30"
        elif n == "nan_embedding":
            emb = embedding_of(model)
            emb.weight.data[self.frequent_id, 0] = float("nan")
            self.hit = f"embedding[{self.frequent_id}, 0] = nan"
        else:
            return
        self._mark(step)

    def after_optimizer_step(self) -> None:
        """The optimizer step hook: the real learning rates back, for the scheduler's step."""
        if self.saved:
            opt_groups = self._groups
            for g, lr in zip(opt_groups, self.saved):
                g["lr"] = lr
            self.saved = []

    def hook(self, optimizer: Any) -> Any:
        """Registers ``after_optimizer_step`` on ``optimizer`` (unwrapped); returns the handle."""
        opt = getattr(optimizer, "optimizer", optimizer)
        self._groups = opt.param_groups
        return opt.register_step_post_hook(lambda *a, **kw: self.after_optimizer_step())

    # ---- the training code ------------------------------------------------------------------

    def loss_factor(self, step: int) -> float:
        if self.name == "loss_x100" and step == self.step:
            self._mark(step)
            return 100.0
        return 1.0

    def _mark(self, step: int) -> None:
        if not self.planted or self.planted[-1] != step:
            self.planted.append(step)


class Planted:
    """A collator that builds batches with ``collate`` and lets ``plan`` fault them: call ``i``
    (counted from 0) is micro-batch ``i % accum`` of optimizer step ``i // accum``."""

    def __init__(self, collate: Any, plan: Plan, accum: int = 1):
        self.collate, self.plan, self.accum = collate, plan, accum
        self.calls = 0

    def __call__(self, samples: list) -> dict:
        i = self.calls
        self.calls += 1
        return self.plan.batch(self.collate(samples), i // self.accum, i % self.accum)


def replay_loss(loss_of: Any, batch: Any) -> Any:
    """The step's loss for ``fh.replay``: under gradient accumulation the dump holds the list
    of micro-batches, and the step's loss is the mean of theirs (as the callbacks record it)."""
    if isinstance(batch, list):
        return sum(loss_of(b) for b in batch) / len(batch)
    return loss_of(batch)
