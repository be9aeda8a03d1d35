"""The checkpoint guard (docs/spec.md section 11) through the real trainers: a weight turned NaN
mid-run (written into the parameter by a callback, for real) never reaches a checkpoint, the
rotation (HF ``save_total_limit=2``, Lightning ``save_top_k``) keeps a healthy one, the log
says so once per incident, and saving resumes once the run has recovered. Also
``Monitor.safe_to_save`` in a plain loop."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import pytest
import torch

import fasthealth as fh

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from fasthealth.integrations.transformers import HealthCallback  # noqa: E402

VOCAB, LEN = 16, 8


class Counting(torch.utils.data.Dataset):
    """Sequences that count up mod VOCAB from a random start: learnable in a few steps."""

    def __init__(self, n=512):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(LEN)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LEN, n_embd=16, n_layer=1,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


class Poison(TrainerCallback):
    """Writes NaN into one weight at the start of step ``at``; puts the weight back as it was
    at the start of step ``back`` (None: never)."""

    def __init__(self, at, back=None):
        self.at, self.back, self.saved = at, back, None

    def on_step_begin(self, args, state, control, model=None, **kw):
        w = model.transformer.h[0].mlp.c_fc.weight
        with torch.no_grad():
            if state.global_step == self.at:
                self.saved = w.detach().clone()
                w.view(-1)[:3] = float("nan")
            if state.global_step == self.back:
                w.copy_(self.saved)


def hf_args(out, **kw):
    base = dict(per_device_train_batch_size=8, max_steps=30, report_to=[], use_cpu=True,
                save_strategy="steps", save_steps=5, save_total_limit=2, disable_tqdm=True,
                seed=0, learning_rate=3e-3, logging_steps=5, dataloader_drop_last=True)
    return TrainingArguments(str(out), **{**base, **kw})


def checkpoints(out):
    """{step: whether every tensor of its model.safetensors is finite}."""
    found = {}
    for d in sorted(Path(out).glob("checkpoint-*")):
        tensors = load_file(str(d / "model.safetensors"))
        found[int(d.name.split("-")[1])] = all(bool(torch.isfinite(t).all())
                                               for t in tensors.values())
    return found


def refusals(caplog):
    return [r.getMessage() for r in caplog.records if "checkpoint not saved" in r.getMessage()]


def test_hf_nan_weight_never_reaches_a_checkpoint(tmp_path, caplog):
    # without the callback the same run does write poisoned checkpoints, and its rotation keeps
    # only those: the injection is real and the guard is what changes it
    plain = tmp_path / "plain"
    Trainer(tiny_gpt2(), hf_args(plain), train_dataset=Counting(),
            callbacks=[Poison(at=12)]).train()
    assert checkpoints(plain) == {25: False, 30: False}

    out = tmp_path / "guarded"
    health = HealthCallback()
    with caplog.at_level(logging.WARNING, logger="fasthealth"):
        Trainer(tiny_gpt2(), hf_args(out), train_dataset=Counting(),
                callbacks=[health, Poison(at=12)]).train()
    assert checkpoints(out) == {5: True, 10: True}  # 15..30 refused, the healthy two kept
    lines = refusals(caplog)
    assert len(lines) == 1, lines  # four refused saves, one incident: one line
    inc = next(i for i in health.monitor.incidents if i.severity == "alarm")
    assert f"incident {inc.id} (nonfinite_loss" in lines[0] and "cause so far" in lines[0]
    assert "saved again once the incident closes as recovered" in lines[0]
    assert health.guard is not None and health.guard.refused == [15, 20, 25, 30]
    for step in (5, 10):
        assert (out / f"checkpoint-{step}" / "fasthealth_monitor.pt").is_file()


def test_hf_epoch_saves_are_guarded_too(tmp_path):
    # save_strategy="epoch": DefaultFlowCallback sets should_save in on_epoch_end
    out = tmp_path / "epochs"
    args = hf_args(out, save_strategy="epoch", max_steps=-1, num_train_epochs=6)
    Trainer(tiny_gpt2(), args, train_dataset=Counting(n=40),
            callbacks=[HealthCallback(), Poison(at=12)]).train()
    assert checkpoints(out) == {5: True, 10: True}  # 5 steps an epoch; 15..30 refused


class SaveEvery5(TrainerCallback):
    """A user's callback after ours that asks for a save itself (as ``save_strategy="best"``
    does after the evaluation): only the backstop on ``_save_checkpoint`` sees it."""

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % 5 == 0:
            control.should_save = True


def test_hf_saves_asked_for_after_the_callback_are_guarded(tmp_path):
    out = tmp_path / "late"
    Trainer(tiny_gpt2(), hf_args(out, save_strategy="no", max_steps=20), train_dataset=Counting(),
            callbacks=[HealthCallback(), SaveEvery5(), Poison(at=12)]).train()
    assert checkpoints(out) == {5: True, 10: True}
    assert not (out / "checkpoint-15").exists()  # nor a folder with only the state in it


def test_hf_saving_resumes_after_recovery(tmp_path, caplog):
    out = tmp_path / "run"
    health = HealthCallback()
    with caplog.at_level(logging.WARNING, logger="fasthealth"):
        Trainer(tiny_gpt2(), hf_args(out, save_total_limit=None), train_dataset=Counting(),
                callbacks=[health, Poison(at=14, back=16)]).train()
    saved = checkpoints(out)
    assert all(saved.values()), saved
    assert 15 not in saved  # the weight was NaN then
    assert {5, 10, 20, 25, 30} <= set(saved)  # back to finite at 16, the incident closed
    inc = next(i for i in health.monitor.incidents if i.severity == "alarm")
    assert not inc.open and inc.start == 14
    msgs = [r.getMessage() for r in caplog.records]
    assert len(refusals(caplog)) == 1
    assert any("checkpoints are saved again" in m for m in msgs), msgs


def test_safe_to_save_plain_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, flush_every=10)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        mon.step(loss)
    assert mon.safe_to_save()
    with torch.no_grad():
        model[2].bias.fill_(math.inf)  # outside any step: only the direct pass can see it
    assert not mon.safe_to_save()
    with torch.no_grad():
        model[2].bias.zero_()
        opt.state[model[0].weight]["exp_avg_sq"].view(-1)[0] = math.nan
    assert not mon.safe_to_save()  # the optimizer's state is in the same pass
    mon.close()


def _regression():
    """A small tanh net learning a sum with SGD, and the batch of each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def batch(t):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(32, 10, generator=g)
        return x, x[:, :3].sum(1, keepdim=True)
    return model, batch


def _guarded_steps(model, opt, batch, steps, before_step):
    """Trains ``steps``; ``before_step(t)`` may harm the run; yields (step, the verdict after
    it) where the verdict is ``save_verdict()`` (what ``safe_to_save`` returns, and why)."""
    mon = fh.Monitor(model, opt, flush_every=5)
    for t in steps:
        before_step(t)
        x, y = batch(t)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        mon.step(loss, batch=(x, y))
        opt.step()
        if t >= 95:
            yield t, mon, mon.save_verdict()
    mon.close()


def test_safe_to_save_is_false_for_a_finite_corrupted_weight(monkeypatch):
    """A first-layer weight multiplied by 1e6 at step 100: finite (the direct pass finds
    nothing), the loss barely moves (not broken, not harmed); the incident the weight scan
    opens forbids saving from that scan on, by its cause (weights) and by its kind alone."""
    from fasthealth.monitor import guard

    model, batch = _regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def corrupt(t):
        if t == 100:
            with torch.no_grad():
                model[0].weight.view(-1)[0] *= 1e6
    seen = None
    for t, mon, v in _guarded_steps(model, opt, batch, range(131), corrupt):
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if t < 100:
            assert v.safe and mon.safe_to_save(), (t, v.reason)
            continue
        if seen is None and v.incident is not None:
            seen = t
        if seen is None:  # the weight scan has not run since the corruption
            continue
        assert seen <= 104 and not v.safe and not mon.safe_to_save(), (t, v)
        inc = v.incident
        assert inc is mon.incidents[-1] and inc.open and "weight_corruption" in inc.kinds
        assert v.reason == f"its cause is weights ({inc.why})", v.reason
        tracker = mon.analyser.tracker
        assert not tracker.broken() and not (tracker.harmed and tracker._unrecovered())
        with monkeypatch.context() as mp:  # were the weights not its cause: its kind alone
            mp.setattr(guard, "DAMAGED_CAUSES", frozenset())
            alone = mon.save_verdict()
            assert not alone.safe and alone.incident is inc, (t, alone)
            assert alone.reason == "it holds weight_corruption", alone.reason
    assert seen is not None


def test_safe_to_save_is_false_while_a_loss_harmed_by_a_rate_jump_is_not_back():
    """The learning rate 50x for two steps (then back): the loss jumps 100-fold and comes back
    over some 40 steps. The incident's cause is the rate (not the weights), its kinds say
    nothing of damaged state and the run is not broken: only the loss that is not back (at the
    last step, then the harmed median) forbids saving, and saving is allowed again once the
    loss is back."""
    model, batch = _regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def jump(t):
        for g in opt.param_groups:
            g["lr"] *= 50 if t == 100 else 1 / 50 if t == 102 else 1
    verdicts = {t: v for t, _, v in _guarded_steps(model, opt, batch, range(170), jump)}
    refused = sorted(t for t, v in verdicts.items() if not v.safe)
    # from the first step the jump harmed (its loss 7x the level, before the median of the
    # recent losses that ``harmed`` reads has moved) until the loss is back
    assert refused and refused[0] == 101 and refused[-1] < 160, refused
    assert verdicts[101].reason.startswith("the loss at its last step"), verdicts[101].reason
    assert refused[:20] == list(range(101, 121)), refused
    assert all(verdicts[t].safe for t in range(95, 101)) and verdicts[165].safe
    reasons = set()
    for t in refused:
        v = verdicts[t]
        assert v.incident is not None and v.incident.cause == "learning_rate", (t, v)
        assert "lr_jump" in v.incident.kinds and "weight_corruption" not in v.incident.kinds
        reasons.add(v.reason.split(" (")[0].split(" to its level")[0])
    assert "the loss it harmed has not come back" in reasons, reasons
    harmed = next(verdicts[t].reason for t in refused if "it harmed" in verdicts[t].reason)
    assert "Resume from a checkpoint saved before step 100" in harmed, harmed


def _ranks_agree(rank, world):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = fh.Monitor(ddp, opt, process_group=dist.group.WORLD)
    loss = ddp(torch.randn(8, 4)).square().mean()
    loss.backward()
    mon.step(loss)
    assert mon.safe_to_save()
    if rank == 1:  # only this rank's copy: its local scan alone would not tell rank 0
        with torch.no_grad():
            model.bias[0] = math.nan
    assert not mon.safe_to_save(), rank
    mon.close()


@pytest.mark.slow
def test_safe_to_save_is_every_ranks_answer():
    import ranks

    ranks.spawn(_ranks_agree, 2)


lightning = pytest.importorskip("lightning")
pl = lightning.pytorch


class Counter(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_gpt2()

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class PoisonPL(pl.Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at:
            with torch.no_grad():
                module.model.transformer.h[0].mlp.c_fc.weight.view(-1)[:3] = float("nan")


def lightning_fit(root, callbacks, steps=30, **ckpt_options):
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=5,
                                        save_top_k=2, monitor="step", mode="max",
                                        filename="{step}", **ckpt_options)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root), callbacks=[*callbacks, ckpt])
    loader = torch.utils.data.DataLoader(Counting(), batch_size=8)
    trainer.fit(Counter(), loader)
    return trainer, ckpt


def lightning_files(root):
    found = {}
    for f in sorted((root / "ckpt").glob("*.ckpt")):
        sd = torch.load(f, map_location="cpu", weights_only=True)["state_dict"]
        found[int(f.stem.split("=")[1])] = all(bool(torch.isfinite(t).all())
                                               for t in sd.values() if t.is_floating_point())
    return found


def test_lightning_nan_weight_never_reaches_a_checkpoint(tmp_path, caplog):
    torch.manual_seed(0)
    lightning_fit(tmp_path / "plain", [PoisonPL(at=12)])
    assert lightning_files(tmp_path / "plain") == {25: False, 30: False}  # the injection is real

    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    health = PLHealth()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fasthealth"):
        _, ckpt = lightning_fit(tmp_path / "guarded", [health, PoisonPL(at=12)])
    # the refused saves counted as saved in ModelCheckpoint's books; their rotation removed
    # nothing: the healthy files stay
    assert lightning_files(tmp_path / "guarded") == {5: True, 10: True}
    assert len(refusals(caplog)) == 1
    assert health.guard is not None and health.guard.refused == [15, 20, 25, 30]
    assert not os.path.exists(ckpt.best_model_path)  # what ModelCheckpoint thinks it kept


def test_lightning_save_on_exception_is_guarded(tmp_path, caplog):
    # on_nonfinite="raise": the flush of the guard at step 15 raises; ModelCheckpoint's
    # save on the exception then gets the guard's last verdict, and writes nothing
    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fasthealth"), \
            pytest.raises(fh.NonFiniteError):
        lightning_fit(tmp_path, [PLHealth(on_nonfinite="raise"), PoisonPL(at=12)],
                      save_on_exception=True)
    assert lightning_files(tmp_path) == {5: True, 10: True}
    assert any("the run raised" in r.getMessage() for r in caplog.records)
