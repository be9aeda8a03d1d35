"""The detector evaluation corpus: healthy training runs and faulty ones with a known onset.

Every run is a real training loop of a small model on synthetic data (nothing is downloaded),
watched by ``fh.Monitor`` with its default rules. A healthy run must raise no event; a faulty
one must raise one of its ``expect`` kinds at or after ``onset`` within ``max_delay`` steps.

Healthy kinds: regression to a noise floor, classification with SGD and a cosine schedule, a
char-level transformer, a CNN, noisy labels with small batches, a plateau then an LR drop, an
MLP with LayerNorm under warm-up and decay, a GRU on sequences, an autoencoder.

Faults: non-finite input, a non-finite value made inside the model (a fully masked attention
row), one garbage batch, one mislabelled batch, an LR far too high from the start, an LR jump,
alternating data sources, a slow steady divergence (1% a step), dead ReLUs, saturated
sigmoids, exploding weights, fp16 overflow under a GradScaler, optimizer-state corruption.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fasthealth as fh
from fasthealth.monitor.detectors import Detector
from fasthealth.monitor.record import HostStep

NAN, INF = float("nan"), float("inf")


# ---- models -----------------------------------------------------------------------------------

def mlp(sizes: list[int], act: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


class Attention(nn.Module):
    """Causal self-attention written out (a masked softmax inside a non-leaf module, where LLMs
    most often make their first NaN): ``pad`` marks key positions to mask out."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        if pad is not None:
            mask = mask | pad[:, None, None, :]
        scores = scores.masked_fill(mask, -INF)
        y = scores.softmax(-1) @ v  # a row with every key masked is NaN
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad=None):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, heads: int = 2, layers: int = 2,
                 ctx: int = 24):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, pad=None):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x, pad)
        return self.head(self.ln(x))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class GRURegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 24, batch_first=True)
        self.out = nn.Linear(24, 1)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


class ResidualLN(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 48, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
            for _ in range(depth))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


# ---- data -------------------------------------------------------------------------------------

class Regression:
    """y = a smooth function of x plus Gaussian noise: the loss settles at the noise floor."""

    def __init__(self, g: torch.Generator, d: int = 16, noise: float = 0.3, batch: int = 32):
        self.g, self.d, self.noise, self.batch = g, d, noise, batch
        self.w = torch.randn(d, generator=g) / math.sqrt(d)

    def __call__(self, step: int):
        x = torch.randn(self.batch, self.d, generator=self.g)
        y = torch.sin(2 * x @ self.w) + 0.5 * (x[:, 0] * x[:, 1])
        y = y + self.noise * torch.randn(self.batch, generator=self.g)
        return x, y[:, None]


class Clusters:
    """Gaussian clusters, one per class, overlapping; ``flip`` of the labels are random."""

    def __init__(self, g: torch.Generator, d: int = 20, classes: int = 5, batch: int = 64,
                 flip: float = 0.0, spread: float = 1.3):
        self.g, self.d, self.classes, self.batch, self.flip = g, d, classes, batch, flip
        self.centers = torch.randn(classes, d, generator=g) * spread / math.sqrt(d) * 3
        self.spread = spread

    def __call__(self, step: int):
        y = torch.randint(0, self.classes, (self.batch,), generator=self.g)
        x = self.centers[y] + torch.randn(self.batch, self.d, generator=self.g)
        if self.flip:
            noisy = torch.rand(self.batch, generator=self.g) < self.flip
            y = torch.where(noisy, torch.randint(0, self.classes, (self.batch,),
                                                 generator=self.g), y)
        return x, y


class MarkovText:
    """Character sequences from a random sparse Markov chain: learnable, with an entropy floor."""

    def __init__(self, g: torch.Generator, vocab: int = 32, ctx: int = 24, batch: int = 16):
        self.g, self.vocab, self.ctx, self.batch = g, vocab, ctx, batch
        logits = torch.randn(vocab, vocab, generator=g) * 3
        self.trans = logits.softmax(-1)

    def __call__(self, step: int):
        ids = torch.empty(self.batch, self.ctx + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=self.g)
        for t in range(self.ctx):
            ids[:, t + 1] = torch.multinomial(self.trans[ids[:, t]], 1, generator=self.g)[:, 0]
        return ids[:, :-1], ids[:, 1:]


class Bars:
    """16x16 images of a horizontal, vertical or diagonal bar, or a blob, with noise."""

    def __init__(self, g: torch.Generator, batch: int = 32):
        self.g, self.batch = g, batch

    def __call__(self, step: int):
        y = torch.randint(0, 4, (self.batch,), generator=self.g)
        pos = torch.randint(2, 14, (self.batch,), generator=self.g)
        x = 0.6 * torch.randn(self.batch, 1, 16, 16, generator=self.g)
        r = torch.arange(16)
        for i in range(self.batch):
            p = int(pos[i])
            if y[i] == 0:
                x[i, 0, p] += 1.0
            elif y[i] == 1:
                x[i, 0, :, p] += 1.0
            elif y[i] == 2:
                x[i, 0, r, r] += 1.0
            else:
                x[i, 0, p - 2:p + 2, p - 2:p + 2] += 1.0
        return x, y


class Sequences:
    """Sequences of 3 features; the target is a noisy weighted sum of the first feature."""

    def __init__(self, g: torch.Generator, batch: int = 32, length: int = 12):
        self.g, self.batch, self.length = g, batch, length

    def __call__(self, step: int):
        x = torch.randn(self.batch, self.length, 3, generator=self.g)
        w = torch.linspace(0.2, 1.0, self.length)
        y = (x[:, :, 0] * w).sum(1, keepdim=True) / 3 + 0.2 * torch.randn(
            self.batch, 1, generator=self.g)
        return x, y


# ---- a run ------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What a scenario trains: model, optimizer, data(step) -> batch, loss(model, batch)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    data: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    sched: Any = None
    scaler: Any = None
    monitor: dict = field(default_factory=dict)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def lm_loss(model, batch):
    ids, targets = batch[:2]
    pad = batch[2] if len(batch) > 2 else None
    logits = model(ids, pad)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Recorder(Detector):
    """Keeps every step's host record, so that rules can be re-run over a run without training
    it again (``replay_rules``): raises no event."""

    def __init__(self) -> None:
        self.steps: list[HostStep] = []

    def observe(self, s: HostStep) -> list:
        opt = s.info.get("opt_stats")
        info = {"lr": s.info.get("lr"), "opt_bad": opt.nonfinite() if opt is not None else None}
        self.steps.append(HostStep(s.step, dict(s.values), list(s.per_norm), list(s.per_bad),
                                   info))
        return []


class _Names:
    """Stands in for the optimizer's MultiTensorStats in a replayed record."""

    def __init__(self, names: list[str]):
        self.names = names

    def nonfinite(self) -> list[str]:
        return self.names


def replay_rules(steps: list[HostStep], rules: list[Detector]) -> list[tuple[int, str, str]]:
    """The events ``rules`` raise over a recorded run."""
    out = []
    for s in steps:
        bad = s.info.get("opt_bad")
        s = HostStep(s.step, s.values, s.per_norm, s.per_bad,
                     {"lr": s.info.get("lr"), "opt_stats": _Names(bad) if bad else None})
        out += [(s.step, kind, msg) for rule in rules for kind, msg, _ in rule.observe(s)]
    return out


Fault = Callable[[int, Any, Setup], Any]


def train(setup: Setup, steps: int, before: Fault | None = None,
          after_backward: Fault | None = None, record: bool = False) -> tuple[list, list]:
    """Trains ``steps`` steps under a Monitor; ``before(step, batch, setup)`` may replace the
    batch, ``after_backward(step, batch, setup)`` may touch gradients. Returns the events as
    (step, kind, message) and, with ``record``, every step's record."""
    m = setup.model
    mon = fh.Monitor(m, setup.opt, flush_every=50, scaler=setup.scaler, **setup.monitor)
    rec = Recorder()
    if record:
        mon.detectors.append(rec)
    for step in range(steps):
        batch = setup.data(step)
        if before is not None:
            batch = before(step, batch, setup)
        setup.opt.zero_grad(set_to_none=True)
        loss = setup.loss(m, batch)
        (setup.scaler.scale(loss) if setup.scaler is not None else loss).backward()
        if after_backward is not None:
            after_backward(step, batch, setup)
        mon.step(loss, batch=batch)
        if setup.sched is not None:
            setup.sched.step()
    mon.close()
    return [(e.step, e.kind, e.message) for e in mon.events], rec.steps


# ---- healthy setups -------------------------------------------------------------------------

def cosine(opt, steps):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps)))


def warmup_linear(opt, warm, steps):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: min((t + 1) / warm, max(0.05, (steps - t) / (steps - warm))))


def h_regression(g, steps):
    m = mlp([16, 64, 64, 1])
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3), Regression(g), mse)


def h_classification_cosine(g, steps):
    m = mlp([20, 64, 64, 5], nn.ReLU)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return Setup(m, opt, Clusters(g), ce, sched=cosine(opt, steps))


def h_char_transformer(g, steps):
    m = CharGPT()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
    return Setup(m, opt, MarkovText(g), lm_loss, sched=warmup_linear(opt, 30, steps))


def h_cnn(g, steps):
    m = SmallCNN()
    return Setup(m, torch.optim.Adam(m.parameters(), lr=2e-3), Bars(g), ce)


def h_noisy_labels(g, steps):
    m = mlp([20, 32, 5], nn.ReLU)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=0.05),
                 Clusters(g, batch=8, flip=0.3), ce)


def h_plateau_drop(g, steps):
    m = mlp([16, 32, 32, 1])
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, steps // 2), gamma=0.1)
    return Setup(m, opt, Regression(g, noise=0.5), mse, sched=sched)


def h_layernorm_warmup(g, steps):
    m = ResidualLN()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.05)
    return Setup(m, opt, Regression(g), mse, sched=warmup_linear(opt, 50, steps))


def h_gru(g, steps):
    m = GRURegressor()
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3), Sequences(g), mse)


def h_autoencoder(g, steps):
    m = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 20))
    data = Clusters(g, classes=8)
    return Setup(m, torch.optim.RMSprop(m.parameters(), lr=1e-3), lambda t: data(t)[0],
                 lambda model, x: F.mse_loss(model(x), x))


HEALTHY: dict[str, Callable] = {
    "regression_noise_floor": h_regression,
    "classification_sgd_cosine": h_classification_cosine,
    "char_transformer": h_char_transformer,
    "cnn": h_cnn,
    "noisy_labels_small_batch": h_noisy_labels,
    "plateau_then_lr_drop": h_plateau_drop,
    "layernorm_warmup_decay": h_layernorm_warmup,
    "gru_sequences": h_gru,
    "autoencoder_rmsprop": h_autoencoder,
    "fp16_gradscaler": None,  # set below: the fp16 setup is defined with the faults
}


# ---- faults -----------------------------------------------------------------------------------

@dataclass
class FaultSpec:
    """A fault planted in a healthy setup at ``onset`` (a fraction of the run's steps)."""

    setup: Callable
    expect: tuple[str, ...]
    max_delay: int
    onset: float = 0.6
    before: Callable | None = None  # (step, batch, setup, onset) -> batch


NONFINITE = ("nonfinite_loss", "nonfinite_grad")
SPIKES = ("loss_spike", "grad_norm_spike")


def f_nan_input(step, batch, s, at):
    if step == at:
        x, y = batch
        x = x.clone()
        x[3, 2] = NAN
        return x, y
    return batch


def f_masked_row(step, batch, s, at):
    if step == at:
        ids, targets = batch
        pad = torch.zeros(ids.shape, dtype=torch.bool)
        pad[5, :] = True  # a sample whose every key is masked: softmax of all -inf
        return ids, targets, pad
    return batch


def f_garbage(step, batch, s, at):
    """A batch of random bytes decoded as text (a corrupt shard): uniformly random tokens."""
    if step == at:
        ids, targets = batch
        g = torch.Generator().manual_seed(step)
        junk = torch.randint(0, 32, (ids.shape[0], ids.shape[1] + 1), generator=g)
        return junk[:, :-1], junk[:, 1:]
    return batch


def f_mislabel(step, batch, s, at):
    if step == at:
        x, y = batch
        return x, (y + 1 + torch.randint(0, 4, y.shape)) % 5
    return batch


def f_alternate(step, batch, s, at):
    """From onset the loader alternates between two unshuffled sources, one clean and one with
    labels far noisier: large swings every other step, no progress."""
    if step >= at and step % 2:
        x, y = batch
        g = torch.Generator().manual_seed(step)
        return x, y + 2.0 * torch.randn(y.shape, generator=g)
    return batch


def f_lr_jump(step, batch, s, at):
    if step == at:
        for group in s.opt.param_groups:
            group["lr"] *= 30
        if s.sched is not None:  # the schedule keeps the jump
            s.sched.base_lrs = [b * 30 for b in s.sched.base_lrs]
    return batch


def f_drift(step, batch, s, at):
    """From onset, a growing share of each batch's tokens is random (0.65% more a step: a data
    pipeline going bad): the loss rises about 1% a step."""
    if step >= at:
        ids, targets = batch
        g = torch.Generator().manual_seed(step)
        junk = torch.rand(targets.shape, generator=g) < min(1.0, 0.0065 * (step - at))
        targets = torch.where(junk, torch.randint(0, 32, targets.shape, generator=g), targets)
        return ids, targets
    return batch


def f_dead_relu(step, batch, s, at):
    if step == at:
        with torch.no_grad():
            s.model[2].bias.fill_(-100.0)  # every unit of the second layer dies
    return batch


def f_saturate(step, batch, s, at):
    """From onset the features arrive raw, in the tens of thousands (a normalisation step dropped),
    and the first sigmoid layer saturates: its gradients collapse to 1e-12 and below."""
    if step >= at:
        x, y = batch
        return x * 30000.0, y
    return batch


def f_explode_weights(step, batch, s, at):
    if step >= at:
        with torch.no_grad():
            s.model[2].weight.mul_(1.08)  # e.g. a negative weight decay on one layer
    return batch


def f_fp16_overflow(step, batch, s, at):
    if step >= at:
        x, y = batch
        return x * 3000.0, y  # activations beyond float16's range
    return batch


def f_corrupt_state(step, batch, s, at):
    if step == at:
        p = s.model[0].weight
        s.opt.state[p]["exp_avg_sq"].view(-1)[:5] = NAN
    return batch


def sigmoid_stack(g, steps):
    m = mlp([16, 32, 32, 32, 32, 1], nn.Sigmoid)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3), Regression(g), mse)


def relu_deep(g, steps):
    m = mlp([16, 48, 48, 48, 1], nn.ReLU)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=2e-3), Regression(g), mse)


def too_high_lr(g, steps):
    m = mlp([20, 64, 64, 5], nn.ReLU)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=3.0, momentum=0.9), Clusters(g), ce)


def fp16_scaler(g, steps):
    m = mlp([16, 32, 32, 1])
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=50)
    data = Regression(g)

    def loss(model, batch):
        x, y = batch
        first = model[0]  # in float16, as autocast runs a matmul: float16 gradients too
        h = F.linear(x.half(), first.weight.half(), first.bias.half()).float()
        return F.mse_loss(model[1:](h), y)

    return Setup(m, opt, data, loss, scaler=scaler)


HEALTHY["fp16_gradscaler"] = fp16_scaler

FAULTS: dict[str, FaultSpec] = {
    "nonfinite_input": FaultSpec(h_regression, NONFINITE, 0, before=f_nan_input),
    "nonfinite_inside_model": FaultSpec(h_char_transformer, NONFINITE, 0, before=f_masked_row),
    "garbage_batch": FaultSpec(h_char_transformer, SPIKES, 0, onset=0.8, before=f_garbage),
    "mislabelled_batch": FaultSpec(h_classification_cosine, SPIKES, 0, onset=0.7,
                                   before=f_mislabel),
    "lr_too_high_from_start": FaultSpec(too_high_lr, NONFINITE + SPIKES + (
        "divergence", "oscillation"), 100, onset=0.0),
    "alternating_sources": FaultSpec(h_regression, ("oscillation",), 40, before=f_alternate),
    "lr_jump": FaultSpec(h_char_transformer, SPIKES + ("divergence", "oscillation", "lr_jump"), 10,
                         before=f_lr_jump),
    "slow_divergence": FaultSpec(h_char_transformer, ("divergence",), 40, onset=0.5,
                                 before=f_drift),
    "dead_relu_layer": FaultSpec(relu_deep, ("vanishing_grad",), 5, before=f_dead_relu),
    "saturated_sigmoids": FaultSpec(sigmoid_stack, ("vanishing_grad",), 5, before=f_saturate),
    "exploding_weights": FaultSpec(relu_deep, SPIKES + ("exploding_grad", "divergence"), 20,
                                   onset=0.5, before=f_explode_weights),
    "fp16_overflow_gradscaler": FaultSpec(fp16_scaler, NONFINITE + ("loss_scale_collapse",), 10,
                                          before=f_fp16_overflow),
    "optimizer_state_corruption": FaultSpec(h_regression, NONFINITE + (
        "optimizer_state_nonfinite",), 10, before=f_corrupt_state),
}


def run_healthy(name: str, seed: int, steps: int, record: bool = False) -> dict:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    setup = HEALTHY[name](g, steps)
    events, curve = train(setup, steps, record=record)
    return {"kind": name, "seed": seed, "steps": steps, "events": events, "curve": curve,
            "names": [n for n, p in setup.model.named_parameters() if p.requires_grad],
            "scaler": setup.scaler is not None}


def run_fault(name: str, seed: int, steps: int, record: bool = False) -> dict:
    spec = FAULTS[name]
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    setup = spec.setup(g, steps)
    at = int(spec.onset * steps)

    def before(step, batch, s):
        return spec.before(step, batch, s, at) if spec.before else batch

    events, curve = train(setup, steps, before=before, record=record)
    return {"kind": name, "seed": seed, "steps": steps, "onset": at, "expect": spec.expect,
            "max_delay": spec.max_delay, "events": events, "curve": curve,
            "names": [n for n, p in setup.model.named_parameters() if p.requires_grad],
            "scaler": setup.scaler is not None}
