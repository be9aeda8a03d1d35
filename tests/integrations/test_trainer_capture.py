"""The trainer callbacks see the loss however the trainer computes it, and change nothing the
trainer logs (docs/spec.md section 10).

Through the real trainers (transformers' Trainer, Lightning), tiny models built from config:
for every way the loss can be computed, each step record's loss is the one the trainer logged
for that step, and a loss planted x1000 at one step in that very path is an alarm at that
step; with and without the callback, the same seed gives the same logs and the same weights
(on a healthy run, and up to the first skipped step with a NaN planted)."""

import json
import math

import pytest
import torch
from runlog import run_of

transformers = pytest.importorskip("transformers")
from fasthealth.integrations import transformers as fh_hf  # noqa: E402

VOCAB, SEQ, PLANT = 64, 8, 15  # the planted step


def read_jsonl(path):
    return [json.loads(s) for s in path.read_text().splitlines()]


class Tokens(torch.utils.data.Dataset):
    """Counting sequences of token ids (each the last plus one); ``labels`` the ids, some set
    to -100 (so that num_items_in_batch differs between micro-batches), or one class of 4."""

    def __init__(self, n=512, classes=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB
        if classes:
            self.labels = start.reshape(-1) % 4
        else:
            self.labels = self.ids.clone()
            self.labels[torch.rand(n, SEQ, generator=g) < 0.3] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16))


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))


def bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=4))


class Times:
    """Multiplies the loss of its ``at``-th call (a training micro-batch) by ``factor``."""

    def __init__(self, at, factor=1e3):
        self.at, self.factor, self.n = at, factor, 0

    def __call__(self, loss):
        self.n += 1
        return loss * self.factor if self.n == self.at else loss


def hf_args(tmp_path, steps, **kw):
    kw = {"learning_rate": 5e-3, "optim": "adamw_torch", **kw}
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8,
        report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
        seed=0, **kw)


class WeightedLoss(transformers.Trainer):
    """A ``compute_loss`` override: class-weighted cross-entropy on the logits, the model's
    own loss unused."""

    times = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        out = model(**inputs)
        w = torch.tensor([1.0, 2.0, 0.5, 1.5])
        loss = self.times(torch.nn.functional.cross_entropy(out.logits, labels, weight=w))
        return (loss, out) if return_outputs else loss


def setup_path(path, tmp_path, steps):
    """(trainer, the Times planted in that loss path) for one way of computing the loss."""
    if path == "compute_loss":
        times = Times(PLANT + 1)
        WeightedLoss.times = times
        return WeightedLoss(model=bert(), args=hf_args(tmp_path, steps, learning_rate=1e-3),
                            train_dataset=Tokens(classes=True)), times
    if path == "compute_loss_func":
        times = Times(PLANT + 1)

        def loss_func(outputs, labels, num_items_in_batch=None):
            logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
            target = labels[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100,
                                                     reduction="sum")
            return times(loss / (num_items_in_batch or (target != -100).sum()))

        return transformers.Trainer(model=llama(), args=hf_args(tmp_path, steps),
                                    train_dataset=Tokens(),
                                    compute_loss_func=loss_func), times
    accumulate = 2 if path == "num_items" else 1
    smoothing = 0.1 if path == "label_smoothing" else 0.0
    model = llama() if path == "num_items" else gpt2()
    trainer = transformers.Trainer(
        model=model, train_dataset=Tokens(),
        args=hf_args(tmp_path, steps, gradient_accumulation_steps=accumulate,
                     label_smoothing_factor=smoothing))
    times = Times(PLANT * accumulate + 1)  # the first micro-batch of step PLANT
    if path == "label_smoothing":
        smoother = trainer.label_smoother
        trainer.label_smoother = lambda *a, **k: times(smoother(*a, **k))
    else:
        def hook(module, args, kwargs, output):
            if module.training:
                output.loss = times(output.loss)
                return output
        model.register_forward_hook(hook, with_kwargs=True)
    return trainer, times


@pytest.mark.parametrize("path", ["model", "compute_loss", "label_smoothing",
                                  "compute_loss_func", "num_items"])
def test_hf_step_loss_is_the_trainers_and_a_fault_in_it_is_caught(tmp_path, path):
    steps = 20
    trainer, times = setup_path(path, tmp_path, steps)
    cb = fh_hf.HealthCallback(warmup_steps=10)
    trainer.add_callback(cb)
    trainer.train()
    assert times.n >= times.at  # the planted path was the one the Trainer ran
    logged = {h["step"] - 1: h["loss"] for h in trainer.state.log_history if "loss" in h}
    records = read_jsonl(run_of(tmp_path / "fasthealth") / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert r["loss"] is not None and math.isfinite(r["loss"]), r
        assert r["loss"] == pytest.approx(logged[r["step"]], rel=1e-6), (r["step"], path)
    alarms = {(e.step, e.kind) for e in cb.monitor.events if e.severity == "alarm"}
    assert (PLANT, "loss_spike") in alarms, sorted(alarms)
    assert min(s for s, _ in alarms) == PLANT, sorted(alarms)
    assert "training_step" not in vars(trainer)  # the Trainer's own again


def test_hf_without_the_trainer_falls_back_to_the_forward_hook(tmp_path, monkeypatch, caplog):
    """Where the Trainer is not known: the model's output.loss, through the forward hook,
    still equals the logged loss; where the loss is outside the model (label smoothing), one
    warning says so and the gradient rules go on."""
    caplog.set_level("WARNING", logger="fasthealth")
    # as a callback driven by something else than a Trainer's training would be
    monkeypatch.setattr(fh_hf.adapter, "training_trainer", lambda callback: None)
    trainer, _ = setup_path("model", tmp_path / "a", 12)
    trainer.add_callback(fh_hf.HealthCallback())
    trainer.train()
    logged = {h["step"] - 1: h["loss"] for h in trainer.state.log_history if "loss" in h}
    records = read_jsonl(run_of(tmp_path / "a" / "fasthealth") / "steps.jsonl")
    assert [r["loss"] for r in records] == pytest.approx([logged[i] for i in range(12)],
                                                         rel=1e-6)
    assert not [r for r in caplog.records if r.name == "fasthealth"]

    trainer, _ = setup_path("label_smoothing", tmp_path / "b", 12)
    target = trainer.model.transformer.h[1].mlp.c_proj.weight
    calls = {"n": 0}

    def flip(grad):
        calls["n"] += 1
        return grad * NAN_AT(calls["n"] == 8)

    target.register_hook(flip)
    cb = fh_hf.HealthCallback()
    trainer.add_callback(cb)
    trainer.train()
    records = read_jsonl(run_of(tmp_path / "b" / "fasthealth") / "steps.jsonl")
    assert len(records) == 12 and all(r["loss"] is None for r in records)
    lines = [r.getMessage() for r in caplog.records if r.name == "fasthealth"
             and "no loss to check" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("fasthealth: step 0: "), lines
    assert {(e.step, e.kind) for e in cb.monitor.events} == {(7, "nonfinite_grad")}


def NAN_AT(cond):
    return float("nan") if cond else 1.0


def hf_run(tmp_path, callback, steps=12, nan_at=None, scaler=False, **kw):
    """A GPT2 run of ``steps``; with ``nan_at`` one NaN in one gradient at that step; with
    ``scaler`` fp16 under a CPU GradScaler (accelerate makes none on the CPU: given here as it
    makes one on a GPU). Returns (log_history, final weights)."""
    model = gpt2()
    if nan_at is not None:
        calls = {"n": 0}

        def flip(grad):
            calls["n"] += 1
            return grad * NAN_AT(calls["n"] == nan_at + 1)

        model.transformer.h[1].mlp.c_proj.weight.register_hook(flip)
    trainer = transformers.Trainer(model=model, args=hf_args(tmp_path, steps, **kw),
                                   train_dataset=Tokens(),
                                   callbacks=[callback] if callback else [])
    if scaler:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        trainer.accelerator.native_amp = True
    trainer.train()
    history = [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
               for h in trainer.state.log_history]
    return history, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kw", [{}, {"optim": "adamw_torch_fused"},
                                {"gradient_accumulation_steps": 2},
                                {"fp16": True, "scaler": True}],
                         ids=["adamw", "fused", "accumulation", "fp16_scaler"])
def test_hf_logs_and_weights_identical_with_and_without_the_callback(tmp_path, kw):
    """The Trainer clips (max_grad_norm=1.0 by default) and logs its pre-clip grad_norm as it
    would without fasthealth; under fp16 the check's unscaling and the Trainer's coexist."""
    plain, w0 = hf_run(tmp_path / "a", None, **kw)
    cb = fh_hf.HealthCallback()
    watched, w1 = hf_run(tmp_path / "b", cb, **kw)
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert any(h.get("grad_norm", 0) > 1.0 for h in plain)  # the Trainer did clip
    assert len(read_jsonl(run_of(tmp_path / "b" / "fasthealth") / "steps.jsonl")) == 12
    assert cb.monitor.max_grad_norm is None  # the clipping stayed the Trainer's
    if kw.get("scaler"):
        assert cb.monitor.scaler is not None


def test_hf_logs_identical_up_to_the_first_skipped_step(tmp_path):
    plain, _ = hf_run(tmp_path / "a", None, nan_at=6)
    cb = fh_hf.HealthCallback()
    watched, w1 = hf_run(tmp_path / "b", cb, nan_at=6)
    assert plain[:6] == watched[:6]
    assert plain[6]["loss"] == watched[6]["loss"]  # the loss the Trainer logs, unchanged
    assert math.isnan(plain[6]["grad_norm"])
    records = read_jsonl(run_of(tmp_path / "b" / "fasthealth") / "steps.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [6]
    assert all(torch.isfinite(p).all() for p in w1)


lightning = pytest.importorskip("lightning")
from fasthealth.integrations.lightning import HealthCallback as LightningCallback  # noqa: E402


class Data(torch.utils.data.Dataset):
    def __init__(self, n=512):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) * 0.3

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Regression(lightning.pytorch.LightningModule):
    """Logs its loss (and, in on_before_optimizer_step, its gradient norm as the user sees
    it) each micro-batch, into ``seen``: (global_step, loss, grad_norm)."""

    def __init__(self, manual=False, times=None, backward="manual"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.automatic_optimization = not manual
        self.times, self.how = times or (lambda x: x), backward
        self.losses, self.norms = [], []

    def training_step(self, batch, batch_idx):
        loss = self.times(torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"]))
        self.losses.append((self.trainer.global_step, loss.item()))
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        if self.how == "manual":
            self.manual_backward(loss)
        else:
            loss.backward()
        opt.step()

    def on_before_optimizer_step(self, optimizer):
        norm = torch.cat([p.grad.reshape(-1) for p in self.parameters()]).norm()
        self.norms.append(norm.item())
        self.log("grad_norm", norm)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def pl_fit(tmp_path, module, *callbacks, steps=20, **kw):
    clip = {} if not module.automatic_optimization else {"gradient_clip_val": 0.5}
    trainer = lightning.pytorch.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=list(callbacks), **clip, **kw)
    trainer.fit(module, torch.utils.data.DataLoader(Data(), batch_size=8))
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic_accumulate2", "manual"])
def test_lightning_step_loss_and_a_fault_in_it(tmp_path, manual):
    accumulate = 1 if manual else 2
    module = Regression(manual, times=Times(PLANT * accumulate + 1))
    cb = LightningCallback(warmup_steps=10)
    pl_fit(tmp_path, module, cb, accumulate_grad_batches=accumulate)
    records = read_jsonl(run_of(tmp_path / "fasthealth") / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(20))
    for r in records:
        mine = [v for s, v in module.losses if s == r["step"]]
        assert len(mine) == accumulate
        assert r["loss"] == pytest.approx(sum(mine) / accumulate, rel=1e-5), r["step"]
    alarms = {(e.step, e.kind) for e in cb.monitor.events if e.severity == "alarm"}
    assert (PLANT, "loss_spike") in alarms and min(s for s, _ in alarms) == PLANT, alarms


@pytest.mark.parametrize("manual,fp16", [(False, False), (True, False), (False, True)],
                         ids=["automatic", "manual", "automatic_fp16_scaler"])
def test_lightning_logs_unchanged_by_the_callback(tmp_path, manual, fp16):
    """Lightning's clipping (gradient_clip_val) stays its own: the module sees the same
    gradients in on_before_optimizer_step, logs the same values, ends with the same weights;
    under fp16 with a GradScaler too (Lightning unscales before the check, which then does
    not; on the CPU Lightning makes 16-mixed bf16 unless given the plugin)."""
    def kw():  # a plugin (and GradScaler) of its own for each run
        return {"plugins": [lightning.pytorch.plugins.MixedPrecision("16-mixed", "cpu")]} \
            if fp16 else {}
    seen = []

    class Clip(lightning.pytorch.Callback):  # the clipping Lightning is set to, mid-run
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(trainer.gradient_clip_val)

    a, b = Regression(manual), Regression(manual)
    ta = pl_fit(tmp_path / "a", a, Clip(), **kw())
    cb = LightningCallback()
    tb = pl_fit(tmp_path / "b", b, cb, Clip(), **kw())
    assert (cb.monitor.scaler is not None) == fp16
    assert seen[:20] == seen[20:] and len(seen) == 40
    assert a.losses == b.losses and a.norms == b.norms
    assert max(a.norms) > 0.5 or manual  # Lightning's clipping had work to do
    assert {k: v.item() for k, v in ta.callback_metrics.items()} == \
        {k: v.item() for k, v in tb.callback_metrics.items()}
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert tb.gradient_clip_val == ta.gradient_clip_val and cb.monitor.max_grad_norm is None


def test_lightning_no_loss_warns_once(tmp_path, caplog):
    """Manual optimization with loss.backward() (not manual_backward): Lightning never sees
    the loss; one warning, every step recorded with a null loss, the gradients checked."""
    caplog.set_level("WARNING", logger="fasthealth")
    cb = LightningCallback()
    pl_fit(tmp_path, Regression(True, backward="plain"), cb, steps=8)
    records = read_jsonl(run_of(tmp_path / "fasthealth") / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    assert all(r["loss"] is None and r["grad_norm"] > 0 for r in records)
    lines = [r.getMessage() for r in caplog.records if "no loss to check" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("fasthealth: step 0: "), lines
