"""The alarms for faults that do not show in the loss, and their causes, through the real
Hugging Face Trainer, with
``HealthCallback()`` at its defaults: a flipped exponent bit in a weight (``weight_corruption``,
cause "weights"), a stuck loader (``repeated_batch``, cause "batch"), and a loss x100 in the
loss code, which replay of the incident's dump names as "outside"."""

from __future__ import annotations

import pytest
import torch

import fasthealth as fh

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from fasthealth.integrations.transformers import HealthCallback  # noqa: E402

STEPS, AT = 120, 50  # the weight scans run at steps 0, 49 and 99 (the end of each flush)
EARLY = 30  # past the spike rule's warm-up, before the loss reaches its floor near 0


def _wine():
    from sklearn.datasets import load_wine

    d = load_wine()
    x = torch.tensor(d.data, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(d.target)


class Rows(torch.utils.data.Dataset):
    def __init__(self, stuck_from=None):
        self.x, self.y = _wine()
        self.stuck_from, self.calls = stuck_from, 0

    def __len__(self):
        return 16 * STEPS

    def __getitem__(self, i):
        self.calls += 1
        if self.stuck_from is not None and self.calls > 16 * self.stuck_from:
            i = self.calls % 16  # the loader hands out the same 16 rows from then on
        i = i % len(self.x)
        return {"x": self.x[i], "labels": self.y[i]}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.ReLU(),
                                     torch.nn.Linear(32, 3))

    def forward(self, x, labels=None):
        logits = self.f(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class FlipBit(TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == AT:
            with torch.no_grad():
                w = model.f[0].weight.view(-1)[:1].view(torch.int32)
                w ^= 1 << 30  # the top exponent bit: ~0.1 becomes ~1e37


class TimesHundred(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 100 if self.model.training and self.state.global_step == EARLY else loss


def _train(tmp_path, ds=None, callbacks=(), cls=Trainer):
    torch.manual_seed(0)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=16, max_steps=STEPS,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             seed=0, learning_rate=1e-2)
    health = HealthCallback()
    trainer = cls(Net(), args, train_dataset=ds or Rows(), callbacks=[health, *callbacks])
    trainer.train()
    mon = health.monitor
    return trainer, mon, [i for i in mon.incidents if i.severity == "alarm"]


def test_a_flipped_weight_bit_is_weight_corruption_caused_by_the_weights(tmp_path):
    _, mon, incidents = _train(tmp_path, callbacks=[FlipBit()])
    found = [e for e in mon.events if e.kind == "weight_corruption"]
    assert found and AT <= found[0].step < AT + 50  # the next weight scan: once per flush
    assert "f.0.weight" in found[0].message
    assert incidents and incidents[0].cause == "weights", incidents


def test_a_stuck_loader_is_repeated_batch_caused_by_the_batch(tmp_path):
    _, mon, incidents = _train(tmp_path, ds=Rows(stuck_from=AT))
    found = [e for e in mon.events if e.kind == "repeated_batch"]
    assert found and AT <= found[0].step <= AT + 5, [(e.step, e.kind) for e in mon.events]
    assert [i.cause for i in incidents] == ["batch"]


def test_a_loss_x100_in_the_loss_code_is_outside_on_replay(tmp_path):
    trainer, mon, incidents = _train(tmp_path, cls=TimesHundred)
    assert [i.start for i in incidents] == [EARLY] and incidents[0].dump
    r = fh.replay(incidents[0].dump, trainer.model,
                  lambda m, b: trainer.compute_loss(m, dict(b)), save=False)
    assert not r.reproduced and r.cause == "outside", r.verdict
    assert "loss code" in r.verdict
