"""What the trainer callbacks take from the trainers beyond their callback APIs, one test per
item of each adapter's list (``fasthealth/integrations/_hf_trainer.py``, the Lightning list in
``fasthealth/integrations/_lightning.py``, GradScaler's state in ``fasthealth/monitor/gate.py``).
Each fails when the library changes what the item relies on, before a user's training does:
upgrading transformers, accelerate, Lightning or torch and running these says whether the
callbacks still hold."""

from __future__ import annotations

import inspect

import pytest
import torch

from fasthealth.monitor import gate

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import GradientState  # noqa: E402
from torch.amp.grad_scaler import OptState  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from fasthealth.integrations import _hf_trainer as hf_adapter  # noqa: E402
from fasthealth.integrations.transformers import HealthCallback  # noqa: E402


def _params(fn) -> list[str]:
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return {"x": x, "labels": x.sum(0, keepdim=True)}


class _Seen(TrainerCallback):
    """What the HealthCallback found at ``on_train_begin`` (called after it), and what the
    Trainer instance had of its own then."""

    def __init__(self, health):
        self.health, self.at_begin, self.own = health, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = self.health.trainer
        self.own = set(vars(self.health.trainer)) if self.health.trainer is not None else None


def _trainer(tmp_path, **kw) -> Trainer:
    torch.manual_seed(0)
    options = dict(per_device_train_batch_size=8, max_steps=4, report_to=[], use_cpu=True,
                   save_strategy="no", disable_tqdm=True)
    args = TrainingArguments(str(tmp_path), **{**options, **kw})
    return Trainer(_Tiny(), args, train_dataset=_Data())


# ---- transformers / accelerate: _hf_trainer.py's items -------------------------------------

def test_item_1_and_2_the_trainer_is_found_on_the_stack_and_left_as_it_was(tmp_path):
    """The Trainer that calls ``on_train_begin`` is found on the call stack (its
    ``_inner_training_loop`` with ``resume_from_checkpoint``), the callbacks in
    ``callback_handler.callbacks``; ``Trainer.train`` is never replaced, the instance's
    patches last one ``train()``, and a second Trainer in the process is untouched."""
    train = Trainer.__dict__["train"]
    assert "resume_from_checkpoint" in _params(Trainer._inner_training_loop)
    trainer = _trainer(tmp_path)
    health = HealthCallback(log_dir=False)
    assert Trainer.__dict__["train"] is train  # making the callback installs nothing
    seen = _Seen(health)
    trainer.add_callback(health)
    trainer.add_callback(seen)  # after the HealthCallback: it sees what health found
    assert health in trainer.callback_handler.callbacks
    trainer.train()
    assert seen.at_begin is trainer
    assert {"training_step", "_save_checkpoint"} <= seen.own  # patched while it trains
    assert not {"training_step", "_save_checkpoint"} & set(vars(trainer))  # its own again
    assert Trainer.__dict__["train"] is train
    assert health.trainer is None  # let go at the end of training
    assert health.monitor is not None and health.monitor.steps_seen == 4

    other = _trainer(tmp_path / "other")  # no HealthCallback: nothing of ours on it
    spy = _Spy()
    other.add_callback(spy)
    other.train()
    assert spy.own is not None and not {"training_step", "_save_checkpoint"} & spy.own


class _Spy(TrainerCallback):
    def __init__(self):
        self.own = None

    def on_step_end(self, args, state, control, **kwargs):
        trainer = hf_adapter.training_trainer(self)
        self.own = set(vars(trainer[0])) if trainer is not None else None


def test_item_1_resume_from_checkpoint_reaches_the_callback(tmp_path):
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    trainer.add_callback(HealthCallback(log_dir=False))
    trainer.train()
    found = []

    class Found(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            found.append(hf_adapter.training_trainer(self))

    again = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=6)
    again.add_callback(Found())
    again.train(resume_from_checkpoint=True)
    assert found[0][0] is again and str(found[0][1]).endswith("checkpoint-4")


def test_item_3_training_step_is_looked_up_on_the_instance_and_returns_the_loss(tmp_path):
    assert _params(Trainer.training_step) == ["self", "model", "inputs", "num_items_in_batch"]
    trainer = _trainer(tmp_path)
    returned = []
    original = trainer.training_step

    def spy(model, inputs, *args, **kwargs):
        loss = original(model, inputs, *args, **kwargs)
        returned.append(loss)
        return loss

    trainer.training_step = spy  # as the adapter's Patch sets it
    trainer.train()
    assert len(returned) == 4
    assert all(isinstance(x, torch.Tensor) and x.numel() == 1 for x in returned)
    logged = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]
    assert logged and logged[0] == pytest.approx(float(sum(returned)) / 4, rel=1e-5)


def test_item_4_save_checkpoint_is_called_through_the_instance(tmp_path):
    assert _params(Trainer._save_checkpoint) == ["self", "model", "trial"]
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    calls = []
    original = trainer._save_checkpoint
    trainer._save_checkpoint = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.train()
    assert len(calls) == 2


def test_item_5_output_dir_is_the_args_output_dir_without_a_trial(tmp_path):
    assert _params(Trainer._get_output_dir) == ["self", "trial"]
    trainer = _trainer(tmp_path)
    assert trainer._get_output_dir(trial=None) == str(tmp_path)


def test_item_6_unscale_gradients_and_the_prepared_optimizers():
    assert _params(Accelerator.unscale_gradients) == ["self", "optimizer"]
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert list(acc._optimizers) == [opt]
    assert gate.unwrap(opt) is opt.optimizer


def test_item_7_gradient_state_says_whether_the_accumulation_ends():
    state = GradientState()
    assert isinstance(state.sync_gradients, bool)
    sync = hf_adapter.sync_step()
    for flag in (False, True):  # the adapter reads the flag accelerate keeps, as it is now
        state._set_sync_gradients(flag)
        assert sync() is flag


# ---- torch: GradScaler's per-optimizer state (gate.py) --------------------------------------

def test_grad_scaler_keeps_its_stage_and_found_inf_per_optimizer():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    assert not gate.unscaled(opt, scaler)
    gate.unscale(opt, scaler)
    assert gate.unscaled(opt, scaler)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert found and all(isinstance(f, torch.Tensor) and f.numel() == 1
                         for f in found.values())
    skipped = gate.step_with_scaler(opt, scaler, torch.tensor(True), guard=True)
    assert bool(skipped)  # the verdict joined found_inf: the scaler skipped the step
    assert id(opt) not in scaler._per_optimizer_states or \
        scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


# ---- Lightning: _lightning.py's items --------------------------------------------------------

def test_lightning_save_and_remove_checkpoint_and_the_precision_scaler():
    """``trainer.save_checkpoint(filepath, ...)`` and ``strategy.remove_checkpoint(filepath)``
    are wrapped on the instances (ModelCheckpoint calls them through the instances); the AMP
    plugin keeps its GradScaler as ``.scaler``; schedulers are in ``lr_scheduler_configs``."""
    assert _params(pl.Trainer.save_checkpoint)[:2] == ["self", "filepath"]
    from lightning.pytorch.strategies import Strategy
    assert _params(Strategy.remove_checkpoint) == ["self", "filepath"]
    from lightning.pytorch.plugins.precision import MixedPrecision
    assert "scaler" in _params(MixedPrecision.__init__)
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert hasattr(plugin, "scaler")
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert trainer.lr_scheduler_configs == []
    src = inspect.getsource(pl.callbacks.ModelCheckpoint)
    assert "trainer.save_checkpoint(" in src and "trainer.strategy.remove_checkpoint(" in src
