"""fh.replay (docs/spec.md section 6): where the first non-finite value came from (the batch, the
forward or the backward pass, the innermost module), which samples cause it, dumps of wrapped
models, and dumps that must not run code."""

import json
import math
import pickle

import pytest
import torch
from torch import nn

import fasthealth as fh

NAN = float("nan")


class Attention(nn.Module):
    """Self-attention with a padding mask applied in functional code: a sample whose every key
    is masked gets softmax(all -inf) = NaN inside this (non-leaf) module."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2)).masked_fill(pad[:, None, :], -math.inf)
        return self.out(scores.softmax(-1) @ v)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Attention(), Attention()])
        self.head = nn.Linear(8, 16)

    def forward(self, ids, pad):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(h, pad)
        return self.head(h)


def lm_loss(model, batch):
    ids, pad = batch
    logits = model(ids, pad)
    return nn.functional.cross_entropy(logits.reshape(-1, 16), ids.roll(-1, 1).reshape(-1))


def run(model, tmp_path, bad_step, plant, steps=12, n=8, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=4, warmup_steps=5) as mon:
        for step in range(steps):
            ids = torch.randint(0, 16, (n, 6), generator=g)
            pad = torch.zeros(n, 6, dtype=torch.bool)
            batch = plant(ids, pad) if step == bad_step else (ids, pad)
            opt.zero_grad()
            lm_loss(model, batch).backward()
            mon.step(lm_loss(model, batch).detach(), batch=batch,
                     sample_ids=torch.arange(n) + 100 * step)
    return mon


def mask_sample(i):
    def plant(ids, pad):
        pad = pad.clone()
        pad[i] = True
        return ids, pad
    return plant


def test_nan_made_inside_a_non_leaf_module_is_blamed_on_it(tmp_path):
    torch.manual_seed(0)
    model = Net()
    mon = run(model, tmp_path, 7, mask_sample(5))
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    assert ev.step == 7
    r = fh.replay(ev.dump, model, lm_loss)
    assert r.reproduced and r.source == "forward"
    assert r.first_nonfinite == "blocks.0", r.first_nonfinite  # the innermost: the attention
    assert "batch" not in r.verdict.split(":")[1]
    assert r.culprit_ids == [705], r.verdict  # sample 5 of step 7
    assert "samples [705] alone reproduce it" in r.verdict


def test_nan_made_in_the_backward_pass(tmp_path):
    class SafeSqrt(nn.Module):
        def forward(self, x):
            return (x * x).sqrt()  # finite, but d/dx at x = 0 is 0 * inf = NaN

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = SafeSqrt()
            self.out = nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.act(self.lin(x)))

    torch.manual_seed(0)
    m = Model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)

    def loss_fn(model, batch):
        return model(batch[0]).pow(2).mean()

    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
        for step in range(10):
            x = torch.randn(6, 4)
            if step == 6:  # inputs that make one pre-activation exactly 0
                with torch.no_grad():
                    x = torch.zeros(6, 4)
                    m.lin.bias.zero_()
            opt.zero_grad()
            loss = loss_fn(m, (x,))
            loss.backward()
            mon.step(loss, batch=(x,), sample_ids=torch.arange(6))
    ev = next(e for e in mon.events if e.kind == "nonfinite_grad")
    r = fh.replay(ev.dump, m, loss_fn)
    assert r.reproduced and r.source == "backward" and math.isfinite(r.loss)
    assert r.first_nonfinite == "act", r


def test_dump_of_a_wrapped_model_replays_on_the_bare_one_and_back(tmp_path):
    class Wrapper(nn.Module):  # names its child "module", as DDP and DataParallel do
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, *a):
            return self.module(*a)

    torch.manual_seed(0)
    bare = Net()
    mon = run(Wrapper(bare), tmp_path / "a", 3, mask_sample(2))
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    assert any(k.startswith("module.") for k in torch.load(ev.dump)["params"])
    r = fh.replay(ev.dump, bare, lm_loss)
    assert r.exact and r.reproduced and r.culprit_ids == [302]

    torch.manual_seed(0)
    bare = Net()
    mon = run(bare, tmp_path / "b", 3, mask_sample(2))
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    r = fh.replay(ev.dump, Wrapper(bare), lm_loss)
    assert r.exact and r.reproduced

    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="is it the same model"):
        fh.replay(ev.dump, other, lambda m, b: m(torch.ones(3)).sum())


def test_find_samples_off_and_a_batch_without_ids(tmp_path):
    torch.manual_seed(0)
    model = Net()
    mon = run(model, tmp_path, 4, mask_sample(1))
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    r = fh.replay(ev.dump, model, lm_loss, find_samples=False)
    assert r.reproduced and r.culprit_ids is None and r.replays == 1


class Payload:
    def __reduce__(self):
        return (open, ("/tmp/fasthealth-payload-ran", "w"))


def test_dump_with_code_is_refused_and_runs_nothing(tmp_path):
    import os

    marker = "/tmp/fasthealth-payload-ran"
    if os.path.exists(marker):
        os.remove(marker)
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"step": 1, "batch": Payload()}, f)
    with pytest.raises(ValueError, match="evil.pt"):
        fh.replay(str(evil), nn.Linear(2, 2), lambda m, b: m(b).sum())
    assert not os.path.exists(marker)
    truncated = tmp_path / "cut.pt"
    torch.save({"step": 1, "batch": torch.ones(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:50])
    with pytest.raises(ValueError, match="cut.pt"):
        fh.replay(str(truncated), nn.Linear(2, 2), lambda m, b: m(b).sum())


def test_a_0_dim_tensor_in_the_batch_rides_along_and_the_batch_still_bisects(tmp_path):
    """The Hugging Face Trainer adds ``num_items_in_batch``, a 0-dim tensor, to every batch:
    it has no batch dimension, so it goes unchanged into each half while the rows are split."""
    model = Net()

    def loss_fn(m, batch):
        ids, pad, count = batch
        logits = m(ids, pad)
        return nn.functional.cross_entropy(logits.reshape(-1, 16), ids.roll(-1, 1).reshape(-1),
                                           reduction="sum") / count

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=4, warmup_steps=5) as mon:
        for step in range(8):
            ids = torch.randint(0, 16, (8, 6), generator=g)
            pad = torch.zeros(8, 6, dtype=torch.bool)
            if step == 5:
                pad[6] = True
            batch = (ids, pad, torch.tensor(48.0))
            opt.zero_grad()
            loss = loss_fn(model, batch)
            loss.backward()
            mon.step(loss, batch=batch, sample_ids=torch.arange(8) + 100 * step)
    ev = next(e for e in mon.events if e.step == 5 and e.dump)
    r = fh.replay(ev.dump, model, loss_fn)
    assert r.reproduced and r.culprit_ids == [506], r


def test_replay_writes_its_result_beside_the_dump_and_the_report_shows_it(tmp_path, monkeypatch):
    """A real run, a real dump, a real replay, then `fasthealth report`: the incident's line
    and its plot label say what replay found (the module, the sample), and the dump and the
    logs are left as they were."""
    import importlib

    from fasthealth import report

    # the module (fasthealth.monitor.replay, the name, is the function)
    replay_mod = importlib.import_module("fasthealth.monitor.replay")

    torch.manual_seed(0)
    model = Net()
    mon = run(model, tmp_path, 7, mask_sample(5))
    inc = next(i for i in mon.incidents if i.trigger == "nonfinite_loss")
    logged = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = fh.replay(inc.dump, model, lm_loss)
    assert r.culprit_ids == [705]
    written = replay_mod.result_path(inc.dump)
    assert written.name == f"{inc.dump.rsplit('/', 1)[-1]}.replay.json"
    rec = json.loads(written.read_text())
    assert rec["reproduced"] is True and rec["source"] == "forward"
    assert rec["first_nonfinite"] == "blocks.0" and rec["culprit_ids"] == [705]
    assert rec["step"] == 7 and rec["verdict"] == r.verdict
    for p in tmp_path.rglob("*"):  # nothing else changed, nothing left behind
        if p.is_file() and p != written:
            assert logged[p.name] == p.read_bytes(), p
    assert not list(tmp_path.rglob("*.tmp"))

    _, text = report.write(tmp_path)
    line = next(t for t in text.splitlines() if "replay:" in t)
    assert ("reproduces; first non-finite module blocks.0; source forward; samples 705; "
            "likely cause batch") in line
    log = report.read_run(tmp_path)[1]
    shown = next(i for i in log.incidents if i["trigger"] == "nonfinite_loss")
    assert report.replay_brief(shown["replay"]) == "samples 705"
    fig = report.figure(log.meta, log.steps, log.events, log.incidents)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.endswith("batch: samples 705") for t in labels), labels

    # a replay that cannot write its result warns and still returns it
    def refuse(*a, **k):
        raise PermissionError("read-only log_dir")

    monkeypatch.setattr(replay_mod.tempfile, "mkstemp", refuse)
    with pytest.warns(RuntimeWarning, match="could not be written"):
        again = fh.replay(inc.dump, model, lm_loss)
    assert again.culprit_ids == [705]
    assert json.loads(written.read_text())["culprit_ids"] == [705]  # the earlier one stands
    assert fh.replay(inc.dump, model, lm_loss, save=False).reproduced


def test_replay_runs_a_compiled_channels_last_model_with_hooks_of_its_own(tmp_path):
    """torch.compile (the eager backend: dynamo's tracing, no code generation), channels_last
    inputs and a forward hook of the user's: the NaN sample is found on the compiled model
    and on the module inside it."""
    import warnings

    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4)).to(memory_format=torch.channels_last)
    seen = []
    base[0].register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    model = torch.compile(base, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=5) as mon:
            for t in range(10):
                x = torch.randn(8, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
                y = torch.randint(0, 4, (8,), generator=g)
                if t == 6:
                    x[3, 0, 2, 2] = NAN
                loss = loss_fn(model, (x, y))
                opt.zero_grad()
                loss.backward()
                mon.step(loss, batch=(x, y), sample_ids=torch.arange(8) + 8 * t)
        ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
        for m in (model, base):
            r = fh.replay(ev.dump, m, loss_fn)
            assert r.reproduced and r.source == "batch" and r.culprit_ids == [51], r.verdict
    assert seen  # the user's hook ran in training
