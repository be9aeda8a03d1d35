"""The trainer callbacks against the real libraries (transformers' Trainer, Lightning), tiny
models built from config, faults planted at a known step: events at that step, the step skipped
(parameters untouched, steps.jsonl and events.jsonl agree), the gradients checked before the
trainer's clipping, gradient accumulation, mixed precision, and fh.watch in a plain loop."""

import json
import math

import pytest
import torch

import fasthealth as fh

transformers = pytest.importorskip("transformers")
NAN = float("nan")


def read_jsonl(path):
    return [json.loads(s) for s in path.read_text().splitlines()]


class EmbedDataset(torch.utils.data.Dataset):
    """Counting sequences (each token the last plus one) given as embeddings: float inputs, so
    a NaN can sit in the data; learnable in a few dozen steps."""

    def __init__(self, n=256, seq=8, d=32, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.labels = (start + torch.arange(seq)) % vocab
        table = torch.randn(vocab, d, generator=g)
        self.embeds = table[self.labels]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"inputs_embeds": self.embeds[i], "labels": self.labels[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def plant_at(model, call, fn):
    """A forward pre-hook that lets fn change the inputs of the call-th training forward."""
    calls = {"n": 0}

    def pre(module, args, kwargs):
        if module.training:
            calls["n"] += 1
            if calls["n"] == call:
                return args, fn(dict(kwargs))
    return model.register_forward_pre_hook(pre, with_kwargs=True)


class PlantAt(torch.utils.data.Dataset):
    """``base`` whose ``at``-th item fetched (0-based; one loader worker fetches in order, so
    row ``at % batch`` of batch ``at // batch``) is changed by ``fn``: a fault in the data,
    which the batch the Trainer hands to ``training_step`` (the dump's) carries."""

    def __init__(self, base, at, fn):
        self.base, self.at, self.fn, self.n = base, at, fn, 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        item, self.n = self.base[i], self.n + 1
        return self.fn(dict(item)) if self.n - 1 == self.at else item


def nan_embed(item):
    item["inputs_embeds"] = item["inputs_embeds"].clone()
    item["inputs_embeds"][2, 5] = NAN
    return item


def hf_train(tmp_path, model, steps=40, monitor=None, dataset=None, **kw):
    from fasthealth.integrations.transformers import HealthCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8,
        learning_rate=5e-3, report_to="none", save_strategy="no", logging_steps=1000,
        use_cpu=True, disable_tqdm=True, seed=0, **kw)
    cb = HealthCallback(warmup_steps=10, **(monitor or {}))
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=dataset or EmbedDataset(), callbacks=[cb])
    before = {}

    class Snapshot(transformers.TrainerCallback):  # parameters before each optimizer step
        def on_step_begin(self, args, state, control, **k):
            before[state.global_step] = [p.detach().clone() for p in model.parameters()]

    trainer.add_callback(Snapshot())
    trainer.train()
    return cb.monitor, before


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_transformers_nan_sample_is_caught_skipped_and_logged(tmp_path, optim, caplog):
    model = tiny_gpt2()
    caplog.set_level("WARNING", logger="fasthealth")
    # sample 3 of optimizer step 15 (batch size 8, in the order the loader fetches)
    mon, before = hf_train(tmp_path, model, optim=optim,
                           dataset=PlantAt(EmbedDataset(), 8 * 15 + 3, nan_embed))
    kinds = {(e.step, e.kind) for e in mon.events}
    assert (15, "nonfinite_loss") in kinds and (15, "nonfinite_grad") in kinds, kinds
    assert all(e.step >= 15 for e in mon.events), kinds
    steps = read_jsonl(mon.run_dir / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(40))
    assert steps[15]["skipped"] is True and not any(r["skipped"] for r in steps[:15])
    events = read_jsonl(mon.run_dir / "events.jsonl")
    assert all(e["details"].get("skipped") is True for e in events if e["step"] == 15)
    # the skipped step left the parameters as they were before it
    for a, b in zip(before[15], before[16]):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    dump = torch.load(next(e.dump for e in mon.events if e.step == 15))
    assert torch.isnan(dump["batch"]["inputs_embeds"][3, 2, 5])
    r = fh.replay(next(e.dump for e in mon.events if e.step == 15), model,
                  lambda m, b: m(**b).loss)
    assert r.reproduced and r.source == "batch"
    # one line in the trainer's log when the fault's incident opens (two alarms at step 15:
    # one incident), one when it closes
    lines = [r.getMessage() for r in caplog.records if r.name == "fasthealth"]
    assert len(lines) == 2 and lines[0].startswith("fasthealth: step 15: alarm #0 ") and \
        "nonfinite_loss" in lines[0] and "closed" in lines[1], lines


def test_transformers_one_bad_gradient_is_named_before_clipping(tmp_path):
    """The Trainer clips with max_grad_norm=1.0 by default: a NaN norm would smear the NaN
    over every tensor. The check runs first, so only the tensor that went bad is named."""
    model = tiny_gpt2()
    target = model.transformer.h[1].mlp.c_proj.weight
    calls = {"n": 0}

    def flip(grad):
        calls["n"] += 1
        if calls["n"] == 21:  # a bit flip in one gradient at optimizer step 20
            grad = grad.clone()
            grad[0, 0] = NAN
        return grad

    target.register_hook(flip)
    mon, before = hf_train(tmp_path, model)
    ev = [e for e in mon.events if e.kind == "nonfinite_grad"]
    assert [e.step for e in ev] == [20], [(e.step, e.kind) for e in mon.events]
    assert list(ev[0].details["tensors"]) == ["transformer.h.1.mlp.c_proj.weight"]
    assert ev[0].details["nan_count"] == 1 and ev[0].details["skipped"] is True
    assert mon.max_grad_norm is None  # the Trainer's clipping stays its own, after the check
    steps = read_jsonl(mon.run_dir / "steps.jsonl")
    assert steps[20]["skipped"] is True and steps[20]["nan_count"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_transformers_garbage_batch_accumulation_and_bf16(tmp_path):
    model = tiny_gpt2()

    def garbage(kw):
        kw["inputs_embeds"] = torch.randn_like(kw["inputs_embeds"]) * 30
        kw["labels"] = torch.randint(0, 64, kw["labels"].shape)
        return kw

    plant_at(model, 2 * 150 + 1, garbage)  # the first micro-batch of optimizer step 150
    mon, _ = hf_train(tmp_path, model, steps=170, gradient_accumulation_steps=2, bf16=True)
    kinds = {(e.step, e.kind) for e in mon.events}
    assert (150, "loss_spike") in kinds, sorted(kinds)
    assert all(e.step == 150 for e in mon.events), sorted(kinds)
    steps = read_jsonl(mon.run_dir / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(170))  # once per optimizer step
    assert all(math.isfinite(r["loss"]) for r in steps)
    # the step's loss is the whole accumulation's (Hugging Face divides each micro-batch's
    # loss by the tokens of both): about what the model's own full-batch loss would be
    assert 0.0 < steps[100]["loss"] < 2.5
    dump = torch.load(next(e.dump for e in mon.events if e.step == 150))
    assert isinstance(dump["batch"], list) and len(dump["batch"]) == 2  # both micro-batches


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_transformers_on_spike_skip(tmp_path, optim):
    """HealthCallback(on_spike="skip"): a garbage batch at optimizer step 60 is skipped (the
    parameters stay as they were), the step is logged as skipped, and nothing after it
    alarms."""
    model = tiny_gpt2()

    def garbage(kw):
        kw["inputs_embeds"] = torch.randn_like(kw["inputs_embeds"]) * 30
        kw["labels"] = torch.randint(0, 64, kw["labels"].shape)
        return kw

    plant_at(model, 61, garbage)
    mon, before = hf_train(tmp_path, model, steps=80, optim=optim,
                           monitor={"on_spike": "skip"})
    steps = read_jsonl(mon.run_dir / "steps.jsonl")
    assert [r["step"] for r in steps if r["spike_skip"]] == [60]
    assert steps[60]["skipped"] is True
    for a, b in zip(before[60], before[61]):
        assert torch.equal(a, b)
    assert any(e.step == 60 and e.kind == "loss_spike" and e.details.get("skipped")
               for e in mon.events)
    assert not [e for e in mon.events if e.step > 60 and e.severity == "alarm"]


def test_transformers_takes_the_monitor_keywords(tmp_path):
    """The Monitor's keywords pass through the callback; the user's clipping (the Monitor's,
    before the Trainer's own) and log_dir are taken, the latter over the default
    <output_dir>/fasthealth."""
    mon, _ = hf_train(tmp_path, tiny_gpt2(), steps=12,
                      monitor={"log_dir": tmp_path / "mine", "flush_every": 5,
                               "max_grad_norm": 0.5})
    assert mon.flush_every == 5 and mon.max_grad_norm == 0.5
    assert mon.options.detect.warmup_steps == 10  # hf_train's flat keyword
    assert mon.run_dir.parent == tmp_path / "mine"
    assert [r["step"] for r in read_jsonl(mon.run_dir / "steps.jsonl")] == list(range(12))
    assert not (tmp_path / "fasthealth").exists()


lightning = pytest.importorskip("lightning")


@pytest.mark.parametrize("fused", [True, False])
def test_lightning_on_spike_skip(tmp_path, fused):
    """The Lightning callback takes on_spike="skip": a batch of targets x50 at optimizer step
    150 is skipped, the parameters untouched."""
    from fasthealth.integrations.lightning import HealthCallback

    class Bad(DictData):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            if 8 * 150 <= i < 8 * 151:
                item = dict(item, y=item["y"] * 50)
            return item

    module = regression_module(lightning.pytorch, fused)
    seen = {}

    class Snapshot(lightning.pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    cb = HealthCallback(on_spike="skip")
    trainer = lightning.pytorch.Trainer(
        max_steps=160, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[cb, Snapshot()])
    loader = torch.utils.data.DataLoader(Bad(n=8 * 160), batch_size=8, shuffle=False)
    trainer.fit(module, loader)
    steps = read_jsonl(cb.monitor.run_dir / "steps.jsonl")
    assert [r["step"] for r in steps if r["spike_skip"]] == [150]
    for a, b in zip(seen[150], seen[151]):
        assert torch.equal(a, b)


def test_lightning_takes_the_monitor_keywords(tmp_path):
    """The Monitor's keywords pass through the callback; the user's clipping is the Monitor's
    (before Lightning's), and gradient_clip_val stays Lightning's."""
    from fasthealth.integrations.lightning import HealthCallback

    cb = HealthCallback(flush_every=5, max_grad_norm=0.5)
    trainer = lightning.pytorch.Trainer(
        max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        default_root_dir=str(tmp_path), callbacks=[cb])
    loader = torch.utils.data.DataLoader(DictData(n=96), batch_size=8, shuffle=False)
    trainer.fit(regression_module(lightning.pytorch, True), loader)
    assert cb.monitor.flush_every == 5 and cb.monitor.max_grad_norm == 0.5
    assert trainer.gradient_clip_val == 1.0
    steps = read_jsonl(cb.monitor.run_dir / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(12))


def regression_module(pl, fused):
    """A small regression LightningModule of the package ``pl`` (lightning.pytorch or
    pytorch_lightning)."""

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 1))

        def loss(self, batch):
            return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

        def training_step(self, batch, batch_idx):
            return self.loss(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused)

    return Regression()


class DictData(torch.utils.data.Dataset):
    def __init__(self, n=640, bad=None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) * 0.3
        if bad is not None:
            self.x[bad, 4] = NAN

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "idx": i}


# bf16-mixed with a fused optimizer: Lightning refuses gradient_clip_val (the optimizer
# unscales internally) with or without fasthealth, which no longer takes that clipping over
@pytest.mark.parametrize("fused,accumulate,precision,package", [
    (True, 1, "32-true", "lightning"), (False, 1, "32-true", "lightning"),
    (True, 2, "32-true", "lightning"), (False, 1, "bf16-mixed", "lightning"),
    (False, 1, "32-true", "pytorch_lightning")])
def test_lightning_nan_sample_caught_skipped_and_replayed(tmp_path, fused, accumulate,
                                                          precision, package):
    if package == "lightning":
        from fasthealth.integrations.lightning import HealthCallback
        pl = lightning.pytorch
    else:
        pl = pytest.importorskip("pytorch_lightning")
        from fasthealth.integrations.pytorch_lightning import HealthCallback
    module = regression_module(pl, fused)

    bad = 8 * 24 * accumulate + 5  # sample 5 of optimizer step 24 (batch size 8, in order)
    cb = HealthCallback(warmup_steps=10)
    trainer = pl.Trainer(
        max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        accumulate_grad_batches=accumulate, default_root_dir=str(tmp_path), callbacks=[cb],
        precision=precision)
    loader = torch.utils.data.DataLoader(DictData(bad=bad), batch_size=8, shuffle=False)
    trainer.fit(module, loader)
    mon = cb.monitor
    kinds = {(e.step, e.kind) for e in mon.events}
    assert kinds == {(24, "nonfinite_loss"), (24, "nonfinite_grad")}, sorted(kinds)
    # Lightning's clipping stays its own (it clips after the check)
    assert mon.max_grad_norm is None and trainer.gradient_clip_val == 1.0
    steps = read_jsonl(mon.run_dir / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(40))
    assert [r["step"] for r in steps if r["skipped"]] == [24]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    r = fh.replay(ev.dump, module, lambda m, b: m.loss(b) if isinstance(b, dict)
                  else sum(m.loss(x) for x in b))
    assert r.reproduced and r.source == "batch"
    if accumulate == 1:
        assert r.culprit_ids == [bad], r.verdict


def test_watch_in_a_plain_loop(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mon = fh.watch(model, opt, log_dir=tmp_path, max_grad_norm=1.0, warmup_steps=5)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        embeds = model.transformer.wte(ids).detach()
        if step == 7:
            embeds[1, 2, 3] = NAN
        opt.zero_grad()
        model(inputs_embeds=embeds, labels=ids).loss.backward()
        opt.step()
    mon.close()
    assert {(e.step, e.kind) for e in mon.events} == {(7, "nonfinite_loss"),
                                                      (7, "nonfinite_grad")}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    steps = read_jsonl(mon.run_dir / "steps.jsonl")
    assert len(steps) == 12 and steps[7]["skipped"] and steps[3]["loss"] > 0
    assert not hasattr(opt, "found_inf")  # the skip is taken away after the step


def test_transformers_train_again_after_a_crash(tmp_path):
    """A train() that raises never reaches on_train_end. The next train() on the same Trainer
    (a notebook after a crash) must check each gradient once, not run with the dead run's
    training_step wrapper still on the Trainer; the clipping was never touched."""
    from fasthealth.integrations.transformers import HealthCallback

    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=8,
        learning_rate=5e-3, report_to="none", save_strategy="no", logging_steps=1000,
        use_cpu=True, disable_tqdm=True, seed=0)
    cb = HealthCallback(warmup_steps=5)

    class Crash(transformers.TrainerCallback):
        armed = True

        def on_step_end(self, args, state, control, **k):
            if self.armed and state.global_step == 5:
                raise RuntimeError("data loader died")

    trainer = transformers.Trainer(model=model, args=args, train_dataset=EmbedDataset(),
                                   callbacks=[cb, Crash()])
    with pytest.raises(RuntimeError, match="data loader died"):
        trainer.train()
    assert args.max_grad_norm == 1.0  # never the callback's to change
    assert "training_step" in vars(trainer)  # the dead run's wrapper, until the next train()
    first = cb.monitor
    checks = {"n": 0}
    real = fh.Monitor.check

    def counting(self, *a, **k):
        checks["n"] += 1
        return real(self, *a, **k)

    Crash.armed = False
    fh.Monitor.check = counting
    try:
        trainer.train()
    finally:
        fh.Monitor.check = real
    assert cb.monitor is not first and cb.monitor.max_grad_norm is None
    assert checks["n"] == 12  # one check a step: the first run's wrapper is gone
    assert args.max_grad_norm == 1.0 and "training_step" not in vars(trainer)


def test_transformers_sample_ids_column_bisects_to_the_sample(tmp_path):
    """A Hugging Face user keeps sample ids with ``remove_unused_columns=False`` and a
    ``sample_ids`` column: the dump's batch (the Trainer's inputs) carries them, and replay
    splits the rows down to the one bad sample."""

    class WithIds(EmbedDataset):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "sample_ids": torch.tensor(1000 + i)}

    model = tiny_gpt2()
    from fasthealth.integrations.transformers import HealthCallback  # as hf_train does

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=8,
        learning_rate=5e-3, report_to="none", save_strategy="no", logging_steps=1000,
        use_cpu=True, disable_tqdm=True, seed=0, remove_unused_columns=False)
    cb = HealthCallback(warmup_steps=10)
    transformers.Trainer(model=model, args=args, callbacks=[cb],
                         train_dataset=PlantAt(WithIds(), 8 * 15 + 3, nan_embed)).train()
    ev = next(e for e in cb.monitor.events if e.dump)
    dump = torch.load(ev.dump, weights_only=True)
    assert ev.step == 15 and "labels" in dump["batch"]  # taken before compute_loss pops it
    ids = dump["sample_ids"].tolist()
    r = fh.replay(ev.dump, model, lambda m, b: m(**b).loss)
    assert r.reproduced and r.source == "batch" and r.culprit_ids == [ids[3]], r
