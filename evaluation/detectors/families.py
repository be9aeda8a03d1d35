"""Healthy training-run families: each differs from the others the way real runs differ (data,
task, model, optimizer, schedule, batch size, regularisation, precision, clipping).

A family is a builder ``(generator, steps) -> Setup`` and a length. Every run of a family is
healthy: its loss falls, or sits at its noise floor, and nothing in it is broken, so any alarm
it raises is a false alarm. ``HELD_OUT`` families are never run while the thresholds are
chosen (``evaluation/eval_detectors.py --final`` scores them, once).

Real data: scikit-learn's bundled tables and photos, the standard library's source, the
interpreter's help texts (``data.py``). The four cases users reported as false alarms are
``digits_mlp_onecycle_bf16_ls`` and ``pydoc_word_transformer_onecycle_bf16_ls`` (OneCycle
warm-up, bf16 autocast, label smoothing), ``digits_mlp_sgd_momentum_plateau`` (an
SGD-momentum classifier leaving its initial plateau: the gradient norm grows several-fold
while the loss falls), ``python_char_transformer_clip`` (clipping) and
``cancer_logreg_sgd_batch8`` (a small-batch logistic regression).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import data
import models
import synthetic
import torch
from runner import (
    Setup,
    autoencoder,
    bce,
    ce,
    cosine,
    cross_entropy,
    lm,
    mse,
    one_cycle,
    restarts,
    step_decay,
    warmup_cosine,
    warmup_linear,
)
from torch import nn


@dataclass
class Family:
    name: str
    build: Callable[[torch.Generator, int], Setup]
    steps: int
    about: str
    held_out: bool = False
    long: bool = False  # only in the long-run evaluation (long_runs.py), never at 500 steps


FAMILIES: dict[str, Family] = {}


def family(steps: int, about: str, held_out: bool = False, long: bool = False):
    def register(build):
        name = build.__name__
        FAMILIES[name] = Family(name, build, steps, about, held_out, long)
        return build
    return register


# ---- tables ---------------------------------------------------------------------------------

@family(500, "iris, MLP, plain SGD (no momentum), constant LR, batch 16")
def iris_mlp_sgd_constant(g, steps):
    m = models.mlp([4, 32, 3], nn.ReLU)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=0.05),
                 data.table_loader(g, "iris", 16), ce)


@family(500, "wine, MLP with dropout 0.3, Adam, constant LR, batch 32")
def wine_mlp_adam_dropout(g, steps):
    m = models.mlp([13, 64, 64, 3], nn.ReLU, dropout=0.3)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=1e-3),
                 data.table_loader(g, "wine", 32), ce)


@family(600, "breast cancer, logistic regression, SGD at lr 2 (high, and convergent: the loss "
        "is convex), batch 8, constant LR")
def cancer_logreg_sgd_batch8(g, steps):
    m = nn.Linear(30, 1)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=2.0),
                 data.table_loader(g, "breast_cancer", 8), bce)


@family(400, "breast cancer, MLP, AdamW, batch 256 (2 batches an epoch), linear warm-up "
        "then decay")
def cancer_mlp_adamw_batch256_warmup(g, steps):
    m = models.mlp([30, 64, 64, 1], nn.GELU)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.05)
    return Setup(m, opt, data.table_loader(g, "breast_cancer", 256), bce,
                 sched=warmup_linear(opt, 30, steps))


@family(500, "diabetes regression, ReLU MLP, RMSprop, batch 32: a noisy floor (R^2 ~0.5)")
def diabetes_mlp_rmsprop(g, steps):
    m = models.mlp([10, 64, 64, 1], nn.ReLU)
    return Setup(m, torch.optim.RMSprop(m.parameters(), lr=1e-3),
                 data.table_loader(g, "diabetes", 32), mse)


@family(400, "linnerud, 3 targets from 3 features of 20 athletes, tanh MLP, Adagrad, batch 8")
def linnerud_adagrad_batch8(g, steps):
    m = models.mlp([3, 16, 3], nn.Tanh)
    return Setup(m, torch.optim.Adagrad(m.parameters(), lr=0.05),
                 data.table_loader(g, "linnerud", 8), mse)


@family(500, "diabetes, first layer in float16 under a GradScaler, Adam")
def diabetes_fp16_gradscaler(g, steps):
    m = models.mlp([10, 32, 32, 1])
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=50)

    def loss(model, batch):
        x, y = batch
        first = model[0]  # in float16, as autocast runs a matmul: float16 gradients too
        h = torch.nn.functional.linear(x.half(), first.weight.half(), first.bias.half())
        return torch.nn.functional.mse_loss(model[1:](h.float()), y)

    return Setup(m, opt, data.table_loader(g, "diabetes", 32), loss, scaler=scaler)


# ---- digits (8x8 images) --------------------------------------------------------------------

class _Flat:
    def __init__(self, loader):
        self.loader = loader

    def __call__(self, step):
        x, y = self.loader(step)
        return x.flatten(1), y


@family(600, "digits, 4-layer ReLU MLP at a small init, SGD momentum 0.9: a plateau at "
        "ln 10, then the loss falls while the gradient norm grows several-fold")
def digits_mlp_sgd_momentum_plateau(g, steps):
    m = models.mlp([64, 64, 64, 64, 10], nn.ReLU)
    with torch.no_grad():
        for lin in models.linears(m):
            lin.weight.mul_(0.5)
            lin.bias.zero_()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return Setup(m, opt, _Flat(data.table_loader(g, "digits", 32)), ce)


@family(500, "digits, CNN, SGD Nesterov momentum, step decay x0.3 every 150, batch 64")
def digits_cnn_nesterov_step(g, steps):
    m = models.DigitsCNN()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    return Setup(m, opt, data.table_loader(g, "digits", 64), ce,
                 sched=step_decay(opt, 150, 0.3))


@family(400, "digits, MLP with dropout 0.25, Adam, bf16 autocast, batch 128")
def digits_mlp_adam_bf16_batch128(g, steps):
    m = models.mlp([64, 128, 64, 10], nn.ReLU, dropout=0.25)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=2e-3),
                 _Flat(data.table_loader(g, "digits", 128)), ce, autocast=torch.bfloat16)


@family(500, "digits, GELU MLP, AdamW, warm-up 40 then cosine, label smoothing 0.1")
def digits_mlp_adamw_label_smoothing(g, steps):
    m = models.mlp([64, 128, 10], nn.GELU)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
    return Setup(m, opt, _Flat(data.table_loader(g, "digits", 32)), cross_entropy(0.1),
                 sched=warmup_cosine(opt, 40, steps))


@family(400, "digits, GELU MLP, AdamW under OneCycle (max lr 1e-2, warm-up 30%), bf16 "
        "autocast, label smoothing 0.1, batch 64")
def digits_mlp_onecycle_bf16_ls(g, steps):
    m = models.mlp([64, 128, 128, 10], nn.GELU)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)
    return Setup(m, opt, _Flat(data.table_loader(g, "digits", 64)), cross_entropy(0.1),
                 sched=one_cycle(opt, 1e-2, steps), autocast=torch.bfloat16)


@family(500, "digits, autoencoder 64-32-8-32-64, Adam, batch 64")
def digits_autoencoder_adam(g, steps):
    m = models.mlp([64, 32, 8, 32, 64], nn.ReLU)
    loader = _Flat(data.table_loader(g, "digits", 64))
    return Setup(m, torch.optim.Adam(m.parameters(), lr=2e-3), lambda t: (loader(t)[0],),
                 autoencoder)


# ---- photographs ----------------------------------------------------------------------------

@family(500, "16x16 patches of scikit-learn's sample photos, conv autoencoder, Adam, cosine "
        "with warm restarts (100, then 200 steps)")
def photo_conv_autoencoder_restarts(g, steps):
    m = models.ConvAE()
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    return Setup(m, opt, data.Patches(g, 32), autoencoder, sched=restarts(opt, 100))


# ---- text -----------------------------------------------------------------------------------

@family(400, "char-level transformer on stdlib source, AdamW, warm-up 50 then cosine, "
        "clipped by the Monitor (max_grad_norm=1)")
def python_char_transformer_clip(g, steps):
    m = models.TransformerLM(data.CHAR_VOCAB, d=48, heads=2, layers=2, ctx=32)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    return Setup(m, opt, data.Windows(g, data.char_ids(), 16, 32), lm(),
                 sched=warmup_cosine(opt, 50, steps), monitor={"max_grad_norm": 1.0})


@family(500, "char-level GRU on stdlib source, Adam, constant LR, the user's "
        "clip_grad_norm_(1.0) before mon.step")
def python_char_gru(g, steps):
    m = models.RNNLM(data.CHAR_VOCAB, d=32, hidden=64, cell="gru")
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3),
                 data.Windows(g, data.char_ids(), 16, 32), lm(), clip=1.0)


@family(500, "word-level LSTM on the interpreter's help texts, plain SGD lr 1 with "
        "clip_grad_norm_(0.5), step decay x0.5 every 200, batch 20")
def pydoc_word_lstm_sgd_clip(g, steps):
    m = models.RNNLM(512, d=48, hidden=96, cell="lstm")
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    return Setup(m, opt, data.Windows(g, data.word_ids("pydoc"), 20, 24), lm(),
                 sched=step_decay(opt, 200, 0.5), clip=0.5)


@family(400, "word-level transformer on the help texts, AdamW under OneCycle (warm-up 30%), "
        "bf16 autocast, label smoothing 0.1, batch 8")
def pydoc_word_transformer_onecycle_bf16_ls(g, steps):
    m = models.TransformerLM(256, d=32, heads=2, layers=2, ctx=24)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    return Setup(m, opt, data.Windows(g, data.word_ids("pydoc", 256), 8, 24), lm(0.1),
                 sched=one_cycle(opt, 3e-3, steps), autocast=torch.bfloat16)


# ---- synthetic (the first corpus's runs) ----------------------------------------------------

@family(500, "synthetic smooth regression to a noise floor, tanh MLP, Adam")
def synthetic_regression_noise_floor(g, steps):
    m = models.mlp([16, 64, 64, 1])
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3), synthetic.Regression(g), mse)


@family(500, "synthetic Gaussian clusters, 30% noisy labels, ReLU MLP, SGD, batch 8")
def synthetic_noisy_labels_batch8(g, steps):
    m = models.mlp([20, 32, 5], nn.ReLU)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=0.05),
                 synthetic.Clusters(g, batch=8, flip=0.3), ce)


@family(500, "synthetic sequences, GRU regressor, Adam")
def synthetic_gru_sequences(g, steps):
    m = models.GRURegressor()
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3), synthetic.Sequences(g), mse)


@family(500, "synthetic 16x16 bar images, CNN, SGD momentum under cosine decay")
def synthetic_bars_cnn_cosine(g, steps):
    m = models.SmallCNN()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return Setup(m, opt, synthetic.Bars(g), ce, sched=cosine(opt, steps))


# ---- held out: never run while thresholds are chosen ----------------------------------------

@family(500, "wine, residual pre-LN MLP, AdamW, linear warm-up 50 then decay, batch 16",
        held_out=True)
def wine_resmlp_layernorm_warmup(g, steps):
    m = models.ResidualLN(13, d=48, depth=3, d_out=3)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.05)
    return Setup(m, opt, data.table_loader(g, "wine", 16), ce,
                 sched=warmup_linear(opt, 50, steps))


@family(500, "char-level 2-layer LSTM with dropout on other stdlib modules' source, RMSprop, "
        "Monitor max_grad_norm=0.5", held_out=True)
def stdlib_char_lstm_rmsprop_clip(g, steps):
    m = models.RNNLM(data.CHAR_VOCAB, d=32, hidden=80, cell="lstm", layers=2, dropout=0.1)
    ids = data.char_ids(data.HELD_OUT_SOURCE_MODULES)
    return Setup(m, torch.optim.RMSprop(m.parameters(), lr=2e-3),
                 data.Windows(g, ids, 24, 40), lm(), monitor={"max_grad_norm": 0.5})


@family(500, "digits, CNN, SGD momentum under OneCycle, bf16 autocast, label smoothing 0.1, "
        "batch 32", held_out=True)
def digits_cnn_sgd_onecycle_bf16_ls(g, steps):
    m = models.DigitsCNN(width=12)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return Setup(m, opt, data.table_loader(g, "digits", 32), cross_entropy(0.1),
                 sched=one_cycle(opt, 0.1, steps), autocast=torch.bfloat16)


@family(600, "diabetes, linear regression, SGD, batch 8", held_out=True)
def diabetes_linear_sgd_batch8(g, steps):
    m = nn.Linear(10, 1)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=0.01),
                 data.table_loader(g, "diabetes", 8), mse)


@family(500, "word-level transformer with dropout 0.1 on scikit-learn's data-set "
        "descriptions, Adam, cosine with warm restarts (150, then 300)", held_out=True)
def descr_word_transformer_restarts(g, steps):
    m = models.TransformerLM(384, d=32, heads=2, layers=2, ctx=24, dropout=0.1)
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    return Setup(m, opt, data.Windows(g, data.word_ids("sklearn", 384), 16, 24), lm(),
                 sched=restarts(opt, 150))


# ---- long runs only (long_runs.py): what a run looks like after thousands of steps ----------

@family(8000, "100 digits, GELU MLP, Adam, constant LR, batch 20: the set memorised, the "
        "loss at 1e-4 and below", long=True)
def digits_100_memorised_adam(g, steps):
    x, y = data.table("digits")
    pick = torch.randperm(len(y), generator=g)[:100]
    m = models.mlp([64, 128, 10], nn.GELU)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=1e-3),
                 data.Loader(g, (x[pick].flatten(1), y[pick]), 20), ce)


@family(8000, "iris, MLP, SGD momentum, linear decay to 0 at 60% of the run, then 0: a "
        "schedule that ended and a run that goes on", long=True)
def iris_mlp_schedule_ended(g, steps):
    m = models.mlp([4, 32, 3], nn.ReLU)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    end = int(0.6 * steps)
    return Setup(m, opt, data.table_loader(g, "iris", 16), ce,
                 sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda t: max(0.0, 1 - t / end)))


@family(8000, "wine, MLP, AdamW, warm-up 100, stable, decay to 0 over the last 20% (WSD), "
        "label smoothing 0.2, batch 16", held_out=True, long=True)
def wine_mlp_wsd_label_smoothing(g, steps):
    m = models.mlp([13, 64, 64, 3], nn.GELU)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
    decay = int(0.8 * steps)

    def wsd(t):
        return min((t + 1) / 100, 1.0, max(0.0, (steps - t) / (steps - decay)))

    return Setup(m, opt, data.table_loader(g, "wine", 16), cross_entropy(0.2),
                 sched=torch.optim.lr_scheduler.LambdaLR(opt, wsd))


@family(8000, "breast cancer, MLP with dropout 0.2, Adam, step decay x0.5 every 1000, "
        "batch 32: a plateau after each decay (held out until its alarms were seen in the long "
        "runs of 2026-12-06, code 49e20e7; tuning since)", long=True)
def cancer_mlp_adam_dropout_step_plateaus(g, steps):
    m = models.mlp([30, 64, 64, 1], nn.ReLU, dropout=0.2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return Setup(m, opt, data.table_loader(g, "breast_cancer", 32), bce,
                 sched=step_decay(opt, 1000, 0.5))


@family(8000, "wine, MLP with dropout 0.1, Adam at a constant 3e-3, batch 16: the 178 rows "
        "memorised under dropout (held out until its alarms were seen in the long runs of "
        "2026-12-06, code 31f00e8; tuning since)", long=True)
def wine_mlp_dropout_memorised(g, steps):
    m = models.mlp([13, 128, 128, 3], nn.ReLU, dropout=0.1)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3),
                 data.table_loader(g, "wine", 16), ce)


# Held out from the start (added with the cancer family moved to tuning, before they were ever
# run): dropout and noisy floors on other data, optimizers and schedules.

@family(8000, "digits, MLP 64-256-256-10 with dropout 0.3, AdamW, cosine decay to 0 over the "
        "run, batch 64", held_out=True, long=True)
def digits_mlp_dropout_adamw_cosine(g, steps):
    m = models.mlp([64, 256, 256, 10], nn.ReLU, dropout=0.3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    return Setup(m, opt, _Flat(data.table_loader(g, "digits", 64)), ce, sched=cosine(opt, steps))


@family(8000, "diabetes regression, MLP with dropout 0.2, AdamW, step decay x0.5 every 2000, "
        "batch 16: a noisy floor under dropout", held_out=True, long=True)
def diabetes_mlp_dropout_step(g, steps):
    m = models.mlp([10, 64, 64, 1], nn.ReLU, dropout=0.2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    return Setup(m, opt, data.table_loader(g, "diabetes", 16), mse,
                 sched=step_decay(opt, 2000, 0.5))


# Held out from the start (added with the wine family moved to tuning, before they were ever
# run): warm restarts under Nesterov momentum, a CNN under weight decay and label smoothing.
# Scored once (long_runs.json, "2026-12-06 50a9339 with held out"): the iris family's 2 alarms
# came 89-149 steps after warm restarts. The spike rule's restart phase (rules/spike.py,
# RESTART_RISE) was studied on them: that family is tuning since.

@family(8000, "iris, MLP with dropout 0.1, SGD with Nesterov momentum, cosine with warm "
        "restarts after 1000, 2000 and 4000 steps, batch 16 (held out until its alarms were "
        "seen in the long runs of 2026-12-06, code 50a9339; tuning since)", long=True)
def iris_mlp_dropout_nesterov_restarts(g, steps):
    m = models.mlp([4, 64, 64, 3], nn.ReLU, dropout=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    return Setup(m, opt, data.table_loader(g, "iris", 16), ce, sched=restarts(opt, 1000))


@family(8000, "digits, CNN, AdamW with weight decay 0.05, warm-up 200 then linear decay to 5%, "
        "label smoothing 0.1, batch 32", held_out=True, long=True)
def digits_cnn_adamw_warmup_decay_ls(g, steps):
    m = models.DigitsCNN(width=8)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.05)
    return Setup(m, opt, data.table_loader(g, "digits", 32), cross_entropy(0.1),
                 sched=warmup_linear(opt, 200, steps))


# Held out from the start (added with the iris family moved to tuning, before they were ever
# run): warm restarts that throw a fitted model back to a high rate, under SGD momentum with
# restarts at a fixed period and under Adam with growing cycles, on other data. Scored once
# (long_runs.json, "2026-12-06 8e3861d with held out"): one alarm each, 60 and 143 steps after
# a restart. Divergence in a restart's high-rate phase (rules/divergence.py) was studied on
# them: both are tuning since.

@family(8000, "breast cancer, MLP with LayerNorm and dropout 0.1, SGD momentum 0.9 at 0.02, "
        "cosine warm restarts every 1,500 steps to 1e-4, batch 16 (held out until its alarm "
        "was seen in the long runs of 2026-12-06, code 8e3861d; tuning since)", long=True)
def cancer_mlp_sgd_fixed_restarts(g, steps):
    m = models.mlp([30, 64, 64, 1], nn.ReLU, dropout=0.1, norm=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1500, eta_min=1e-4)
    return Setup(m, opt, data.table_loader(g, "breast_cancer", 16), bce, sched=sched)


@family(8000, "digits, MLP 64-128-128-10, Adam at 2e-3, cosine with warm restarts after 500, "
        "1,000, 2,000 and 4,000 steps, batch 32 (held out until its alarm was seen in the long "
        "runs of 2026-12-06, code 8e3861d; tuning since)", long=True)
def digits_mlp_adam_restarts(g, steps):
    m = models.mlp([64, 128, 128, 10], nn.GELU)
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    return Setup(m, opt, _Flat(data.table_loader(g, "digits", 32)), ce, sched=restarts(opt, 500))


# Held out from the start (added with the two restart families above moved to tuning, before
# they were ever run): warm restarts on a residual network under AdamW, and on a regression at
# a noisy floor under Nesterov momentum. Scored once (long_runs.json, "2026-12-06 27aca7d with
# held out"): the regression memorised its set, and both seeds raised divergence 74-97 steps
# after the restart at 6,000 (the loss's median from 2e-4 to 0.24). Divergence's verdict in a
# restart's high-rate phase (rules/divergence.py) was studied on the regression: it is tuning
# since.

@family(8000, "wine, pre-LN residual MLP, AdamW at 1e-3 with weight decay 0.01, cosine warm "
        "restarts after 1,000, 2,000 and 4,000 steps to 1e-5, batch 32", held_out=True,
        long=True)
def wine_resmlp_adamw_restarts(g, steps):
    m = models.ResidualLN(13, d_out=3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1000, T_mult=2,
                                                                 eta_min=1e-5)
    return Setup(m, opt, data.table_loader(g, "wine", 32), ce, sched=sched)


@family(8000, "diabetes regression, MLP, SGD with Nesterov momentum at 0.01, cosine warm "
        "restarts every 2,000 steps, batch 32: restarts at a noisy floor (held out until its "
        "alarms were seen in the long runs of 2026-12-06, code 27aca7d; tuning since)",
        long=True)
def diabetes_mlp_nesterov_restarts(g, steps):
    m = models.mlp([10, 64, 64, 1], nn.ReLU)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    return Setup(m, opt, data.table_loader(g, "diabetes", 32), mse,
                 sched=restarts(opt, 2000, mult=1))


# Held out from the start (added with the regression above moved to tuning, before they were
# ever run): warm restarts on a convolutional network under SGD momentum with dropout, and on
# a multi-target regression of 20 rows under Adam, restarting every 1,000 steps. Scored once
# (long_runs.json, "2026-12-06 be83586 with held out"): the regression memorised its rows to
# 1e-9 and one seed raised exploding_grad 46 and 71 steps after the restarts at 3,000 and
# 5,000 (the loss x10 and more, a sliver of its first). The gradient-trend rule's confirmation
# in a restart's high-rate phase (rules/grad_trend.py) was studied on it: it is tuning since.

@family(8000, "digits, CNN with dropout 0.1, SGD momentum 0.9 at 0.05, cosine warm restarts "
        "every 1,500 steps to 0, batch 32", held_out=True, long=True)
def digits_cnn_sgd_restarts(g, steps):
    m = models.DigitsCNN(width=8, dropout=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1500)
    return Setup(m, opt, data.table_loader(g, "digits", 32), ce, sched=sched)


@family(8000, "linnerud, 3 targets from 3 features of 20 athletes, MLP 3-32-32-3, Adam at 3e-3, "
        "cosine warm restarts every 1,000 steps to 1e-5, batch 8: a tiny set memorised, then "
        "shaken (held out until its alarms were seen in the long runs of 2026-12-06, code "
        "be83586; tuning since)", long=True)
def linnerud_mlp_adam_restarts(g, steps):
    m = models.mlp([3, 32, 32, 3], nn.ReLU)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1000, eta_min=1e-5)
    return Setup(m, opt, data.table_loader(g, "linnerud", 8), mse, sched=sched)


# Held out from the start (added with the 20-row regression above moved to tuning, before they
# were ever run): warm restarts at a floor that label smoothing keeps up, under Nesterov
# momentum with cycles that double; and on a set memorised in batches of 8 under AdamW.

@family(8000, "digits, MLP 64-128-10, SGD with Nesterov momentum at 0.05, label smoothing 0.1, "
        "cosine warm restarts after 500, 1,500 and 3,500 steps, batch 64", held_out=True,
        long=True)
def digits_mlp_nesterov_restarts_ls(g, steps):
    m = models.mlp([64, 128, 10], nn.ReLU)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=500, T_mult=2)
    return Setup(m, opt, _Flat(data.table_loader(g, "digits", 64)), cross_entropy(0.1),
                 sched=sched)


@family(8000, "iris, MLP 4-32-32-3, AdamW at 5e-3 with weight decay 0.01, cosine warm "
        "restarts every 1,000 steps to 1e-5, batch 8", held_out=True, long=True)
def iris_mlp_adamw_restarts_batch8(g, steps):
    m = models.mlp([4, 32, 32, 3], nn.ReLU)
    opt = torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=1000, eta_min=1e-5)
    return Setup(m, opt, data.table_loader(g, "iris", 8), ce, sched=sched)
