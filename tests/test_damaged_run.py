"""A run a fault left damaged but finite (nanoGPT's loop, a learning-rate burst): its incident
stays open while the loss stays up beyond its noise, ``safe_to_save()`` says no and what to do,
the run's end closes it as not recovered, lasting to the last step, and the report says so.
A healthy twin of the same run raises nothing and saves freely."""

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fasthealth as fh
from fasthealth import report

CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
D, HEADS, LAYERS, CTX, MICRO, ACCUM = 64, 4, 2, 64, 8, 2
STEPS, WARM, LR, BURST_AT, BURST_FOR, BURST = 600, 50, 1e-3, 280, 20, 100.0


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                       torch.nn.Linear(4 * D, D))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in
                   self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """nanoGPT's shape at 2 layers and 64 wide: token and position embeddings, pre-LN blocks."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(len(CHARS) + 1, D)
        self.wpe = torch.nn.Parameter(torch.randn(CTX, D) * 0.02)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(D)
        self.lm_head = torch.nn.Linear(D, len(CHARS) + 1)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _text() -> torch.Tensor:
    """Character ids of a standard-library module's source (nothing downloaded)."""
    index = {ch: i for i, ch in enumerate(CHARS)}
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    return torch.tensor([index.get(ch, len(CHARS)) for ch in text])


def _train(log_dir: Path, burst: bool):
    """nanoGPT's train.py loop: AdamW, warm-up and cosine decay, clipping at 1, gradient
    accumulation; with ``burst``, the learning rate 100x for 20 steps from step 280."""
    torch.manual_seed(0)
    data, g = _text(), torch.Generator().manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    mon = fh.Monitor(model, opt, max_grad_norm=1.0, log_dir=log_dir)
    losses, safe = [], {}
    for step in range(STEPS):
        lr = LR * (step + 1) / WARM if step < WARM else LR / 10 + 0.45 * LR * (
            1 + math.cos(math.pi * (step - WARM) / (STEPS - WARM)))
        if burst and BURST_AT <= step < BURST_AT + BURST_FOR:
            lr *= BURST
        for group in opt.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros(())
        for _ in range(ACCUM):
            ix = torch.randint(len(data) - CTX - 1, (MICRO,), generator=g)
            x = torch.stack([data[i:i + CTX] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + CTX] for i in ix])
            loss = model(x, y) / ACCUM
            loss.backward()
            step_loss += loss.detach()
        mon.step(step_loss)
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss.item())
        if step % 100 == 99:
            safe[step] = mon.save_verdict()
    open_at_end = [(i.id, i.open) for i in mon.incidents]
    mon.close()
    return mon, losses, safe, open_at_end


@pytest.mark.slow
def test_a_learning_rate_burst_that_leaves_the_loss_up_is_not_called_recovered(tmp_path):
    mon, losses, safe, open_at_end = _train(tmp_path / "burst", burst=True)
    before = sorted(losses[BURST_AT - 32:BURST_AT])[16]
    after = sorted(losses[-50:])[25]
    assert after > 1.1 * before, (before, after)  # the damage this test is about: still up
    alarms = [i for i in mon.incidents if i.severity == "alarm"]
    assert len(alarms) == 1 and alarms[0].cause == "learning_rate", mon.incidents
    inc = alarms[0]
    assert (inc.id, True) in open_at_end  # open to the last step: never called recovered
    assert inc.recovered is False and inc.end == STEPS - 1 and not inc.open
    assert safe[199].safe
    for step in (299, 399, 499, 599):
        v = safe[step]
        assert not v.safe and v.incident is inc, (step, v)
    assert "Resume from a checkpoint saved before step 28" in safe[599].reason, safe[599]

    rec = [json.loads(line) for line in (tmp_path / "burst/run-000/incidents.jsonl").open()]
    last = [r for r in rec if r["id"] == inc.id][-1]
    assert last["state"] == "closed" and last["recovered"] is False and last["end"] == STEPS - 1
    text = report.write(tmp_path / "burst")[1]
    assert f"{inc.start}-{STEPS - 1} not back" in text, text

    twin, _, safe, _ = _train(tmp_path / "healthy", burst=False)
    assert not twin.incidents and all(v.safe for v in safe.values()), twin.incidents
