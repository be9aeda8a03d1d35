"""Faults planted in healthy families (or in setups of their own) at a known onset.

A ``FaultSpec`` names the setup it is planted in (a family of ``families.py``, or a builder of
its own), what it does from its onset on (``before(step, batch, setup, onset)``: it may replace
the batch or touch the model, optimizer or schedule), the event kinds that would name it, and
the delay a user would accept (non-finite values and single bad batches at their
step, LR jumps within 10, 1%-a-step rises within 40, dead layers within 10, stalls within 100).
``HELD_OUT`` faults run only under ``evaluation/eval_detectors.py --final``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import data
import models
import synthetic
import torch
from families import FAMILIES
from runner import Setup, ce, mse
from torch import nn

NAN, INF = float("nan"), float("inf")

NONFINITE = ("nonfinite_loss", "nonfinite_grad")
SPIKES = ("loss_spike", "grad_norm_spike")
LR_KINDS = SPIKES + ("divergence", "oscillation", "lr_jump") + NONFINITE
STALL = ("stall", "vanishing_grad")


@dataclass
class FaultSpec:
    name: str
    setup: str | Callable  # a family's name, or a builder (g, steps) -> Setup
    expect: tuple[str, ...]
    max_delay: int
    before: Callable  # (step, batch, setup, onset) -> batch
    onset: float = 0.6  # a fraction of the run's steps
    steps: int = 400
    about: str = ""
    held_out: bool = False

    @property
    def group(self) -> str:
        """What leave-one-family-out leaves out with it: its family, or itself."""
        return self.setup if isinstance(self.setup, str) else self.name

    def build(self, g: torch.Generator, steps: int) -> Setup:
        build = FAMILIES[self.setup].build if isinstance(self.setup, str) else self.setup
        return build(g, steps)


FAULTS: dict[str, FaultSpec] = {}


def fault(name, setup, expect, max_delay, about, **kw):
    def register(before):
        FAULTS[name] = FaultSpec(name, setup, expect, max_delay, before, about=about, **kw)
        return before
    return register


def _once(fn):
    """``fn(batch, setup, step)`` at the onset only."""
    def before(step, batch, s, at):
        return fn(batch, s, step) if step == at else batch
    before.__name__ = fn.__name__
    return before


def _from_onset(fn):
    """``fn(batch, setup, steps since onset)`` from the onset on."""
    def before(step, batch, s, at):
        return fn(batch, s, step - at) if step >= at else batch
    before.__name__ = fn.__name__
    return before


# ---- non-finite values ----------------------------------------------------------------------

def nan_feature(batch, s, t):
    x, y = batch
    x = x.clone()
    x[3, 2] = NAN  # one missing value of one sample (a NaN that a CSV reader let through)
    return x, y


def inf_feature(batch, s, t):
    x, y = batch
    x = x.clone()
    x[1, 4] = INF  # an overflowed feature
    return x, y


def masked_row(batch, s, t):
    ids, targets = batch[:2]
    pad = torch.zeros(ids.shape, dtype=torch.bool)
    pad[5, :] = True  # a sample whose every key is masked: softmax of all -inf is NaN
    return ids, targets, pad


def all_padding(batch, s, t):
    ids, targets = batch[:2]
    return ids, targets, None, torch.zeros(targets.shape)  # mean over no token: 0/0


# ---- bad batches ----------------------------------------------------------------------------

def random_tokens(batch, s, t):
    """A corrupt shard: uniformly random tokens (random bytes decoded as text)."""
    ids, targets = batch[:2]
    g = torch.Generator().manual_seed(1234)
    junk = torch.randint(0, data.CHAR_VOCAB, (ids.shape[0], ids.shape[1] + 1), generator=g)
    return junk[:, :-1], junk[:, 1:]


def random_words(batch, s, t):
    ids, targets = batch[:2]
    vocab = s.model.head.out_features
    g = torch.Generator().manual_seed(1234)
    junk = torch.randint(0, vocab, (ids.shape[0], ids.shape[1] + 1), generator=g)
    return junk[:, :-1], junk[:, 1:]


def shifted_labels(batch, s, t):
    """Every label of the batch replaced by another class (a misaligned label file)."""
    x, y = batch
    classes = models.linears(s.model)[-1].out_features
    return x, (y + 1 + torch.randint(0, classes - 1, y.shape)) % classes


def target_x50(batch, s, t):
    """Targets in other units for one batch (grams for kilograms, say): 50x."""
    x, y = batch
    return x, y * 50.0


# ---- data changes ---------------------------------------------------------------------------

def raw_features(batch, s, t):
    """From the onset the features arrive unstandardized (the preprocessing step dropped): the
    raw diabetes columns, in years, mm Hg and mg/dl."""
    x, y = batch
    raw = data.table("diabetes", raw=True)[0]
    return x * raw.std(0) + raw.mean(0), y  # undo the standardisation the loader applied


def growing_label_noise(rate):
    """A growing share of each batch's target tokens is random from the onset (``rate`` more a
    step: a data pipeline going bad): the loss rises about 1% a step."""
    def noise(batch, s, t):
        ids, targets = batch[:2]
        vocab = s.model.head.out_features
        g = torch.Generator().manual_seed(1000 + t)
        junk = torch.rand(targets.shape, generator=g) < min(1.0, rate * t)
        targets = torch.where(junk, torch.randint(0, vocab, targets.shape, generator=g), targets)
        return ids, targets
    return noise


def alternate_noisy(batch, s, t):
    """From onset the loader alternates between two unshuffled sources, one clean and one with
    labels far noisier: large swings every other step, no progress."""
    if t % 2:
        x, y = batch
        g = torch.Generator().manual_seed(t)
        return x, y + 2.0 * torch.randn(y.shape, generator=g)
    return batch


def scale_x(factor):
    def scale(batch, s, t):
        x, y = batch
        return x * factor, y
    return scale


# ---- optimizer and model --------------------------------------------------------------------

def lr_times(factor):
    """The learning rate multiplied once (a hand edit, a resumed run with another config);
    the schedule keeps it."""
    def jump(batch, s, t):
        for group in s.opt.param_groups:
            group["lr"] *= factor
        if s.sched is not None and hasattr(s.sched, "base_lrs"):
            s.sched.base_lrs = [b * factor for b in s.sched.base_lrs]
        return batch
    return jump


def lr_ramp(factor):
    """The learning rate multiplied by ``factor`` every step from the onset (a schedule with
    its exponent's sign flipped): the schedule keeps the growth."""
    return lr_times(factor)


def dead_bias(layer):
    """Layer ``layer``'s bias set to -100 (a bad init, a diverged update): every ReLU after it
    dies."""
    def kill(batch, s, t):
        with torch.no_grad():
            mod = dict(s.model.named_modules())[layer]
            mod.bias.fill_(-100.0)
        return batch
    return kill


def grow_weights(layer, factor=1.08):
    def grow(batch, s, t):
        with torch.no_grad():
            dict(s.model.named_modules())[layer].weight.mul_(factor)  # negative weight decay
        return batch
    return grow


def nan_adam_moments(batch, s, t):
    p = next(iter(s.model.parameters()))
    state = s.opt.state[p]
    state["exp_avg_sq"].view(-1)[:5] = NAN  # a bad checkpoint of the optimizer
    return batch


# ---- setups of the faults' own --------------------------------------------------------------

class _Flat:
    def __init__(self, loader):
        self.loader = loader

    def __call__(self, step):
        x, y = self.loader(step)
        return x.flatten(1), y


def sigmoid_stack_digits(g, steps):
    """12 sigmoid layers on digits, default init, SGD: the gradient reaching the first layers
    is ~0.25^12 of the last's and the loss never leaves ln 10."""
    m = models.mlp([64] + [32] * 11 + [10], nn.Sigmoid)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=0.05),
                 _Flat(data.table_loader(g, "digits", 32)), ce)


def sigmoid_stack_diabetes(g, steps):
    m = models.mlp([10] + [24] * 11 + [1], nn.Sigmoid)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.5),
                 data.table_loader(g, "diabetes", 16), mse)


def sigmoid_stack_synthetic(g, steps):
    m = models.mlp([16, 32, 32, 32, 32, 1], nn.Sigmoid)
    return Setup(m, torch.optim.Adam(m.parameters(), lr=3e-3), synthetic.Regression(g), mse)


def too_high_lr(g, steps):
    m = models.mlp([20, 64, 64, 5], nn.ReLU)
    return Setup(m, torch.optim.SGD(m.parameters(), lr=3.0, momentum=0.9),
                 synthetic.Clusters(g), ce)


# ---- the faults -----------------------------------------------------------------------------

fault("nonfinite_input", "wine_mlp_adam_dropout", NONFINITE, 0,
      "one NaN feature in one batch")(_once(nan_feature))
fault("nonfinite_inside_model", "python_char_transformer_clip", NONFINITE, 0,
      "a fully masked attention row: NaN made inside the model")(_once(masked_row))
fault("nonfinite_loss_empty_batch", "pydoc_word_lstm_sgd_clip", NONFINITE, 0,
      "a batch of padding only: the loss is a mean over no token, 0/0")(_once(all_padding))
fault("garbage_batch", "python_char_gru", SPIKES, 0,
      "one batch of random bytes", onset=0.8)(_once(random_tokens))
fault("mislabelled_batch", "digits_mlp_adamw_label_smoothing", SPIKES, 0,
      "one batch whose every label is another class", onset=0.7)(_once(shifted_labels))
fault("target_x50_batch", "diabetes_mlp_rmsprop", SPIKES, 0,
      "one batch of targets 50x (other units)")(_once(target_x50))
fault("data_scale_change", "diabetes_mlp_rmsprop", SPIKES + ("divergence", "exploding_grad"),
      0, "from the onset the features arrive unstandardized")(_from_onset(raw_features))
fault("lr_jump_x25_cnn", "digits_cnn_nesterov_step", LR_KINDS, 10,
      "the learning rate x25 at once")(_once(lr_times(25)))
fault("lr_jump_x25_transformer", "python_char_transformer_clip", LR_KINDS, 10,
      "the learning rate x25 at once, under the Monitor's clipping")(_once(lr_times(25)))
fault("lr_ramp", "cancer_mlp_adamw_batch256_warmup", LR_KINDS + ("exploding_grad",), 30,
      "the learning rate x1.1 every step from the onset", onset=0.5)(_from_onset(lr_ramp(1.1)))
fault("slow_divergence", "python_char_gru", ("divergence", "loss_spike"), 40,
      "a growing share of random targets: the loss rises ~1% a step",
      onset=0.5)(_from_onset(growing_label_noise(0.0075)))
fault("dead_relu_layer", "diabetes_mlp_rmsprop", ("vanishing_grad",), 10,
      "the second layer's bias at -100: its ReLUs die")(_once(dead_bias("2")))
fault("never_learning_sigmoid_stack", sigmoid_stack_digits, STALL, 100,
      "12 sigmoid layers: the loss never falls from step 0", onset=0.0,
      steps=300)(lambda step, batch, s, at: batch)
fault("exploding_weights", "diabetes_mlp_rmsprop", SPIKES + ("exploding_grad", "divergence"),
      20, "one layer's weights x1.08 a step", onset=0.5)(_from_onset(grow_weights("2")))
fault("fp16_overflow_gradscaler", "diabetes_fp16_gradscaler",
      NONFINITE + ("loss_scale_collapse",), 10,
      "inputs x3000 from the onset: float16 overflows every step")(_from_onset(scale_x(3000.0)))
fault("optimizer_state_corruption", "digits_mlp_adam_bf16_batch128",
      NONFINITE + ("optimizer_state_nonfinite",), 10,
      "NaN in Adam's second moments")(_once(nan_adam_moments))
fault("lr_too_high_from_start", too_high_lr, LR_KINDS, 100,
      "SGD at lr 3 with momentum from step 0", onset=0.0)(lambda step, batch, s, at: batch)
fault("alternating_sources", "synthetic_regression_noise_floor", ("oscillation",), 40,
      "every other batch from a far noisier source")(_from_onset(alternate_noisy))
fault("saturated_sigmoids", sigmoid_stack_synthetic, ("vanishing_grad",) + STALL, 10,
      "features x30000 from the onset: the first sigmoid layer saturates")(
          _from_onset(scale_x(30000.0)))

# ---- held out -------------------------------------------------------------------------------

fault("nonfinite_input_inf", "diabetes_linear_sgd_batch8", NONFINITE, 0,
      "one Inf feature in one batch", held_out=True)(_once(inf_feature))
fault("lr_jump_x25_word_transformer", "descr_word_transformer_restarts", LR_KINDS, 10,
      "the learning rate x25 at once (the restarts keep it)", held_out=True)(
          _once(lr_times(25)))
fault("slow_divergence_lstm", "stdlib_char_lstm_rmsprop_clip", ("divergence", "loss_spike"),
      40, "a growing share of random targets: the loss rises ~1% a step", onset=0.5,
      held_out=True)(_from_onset(growing_label_noise(0.0075)))
fault("dead_relu_conv", "digits_cnn_sgd_onecycle_bf16_ls", ("vanishing_grad",), 10,
      "the second convolution's bias at -100: its ReLUs die",
      held_out=True)(_once(dead_bias("conv2")))
fault("never_learning_sigmoid_regression", sigmoid_stack_diabetes, STALL, 100,
      "12 sigmoid layers on a regression: the loss never falls from step 0", onset=0.0,
      steps=300, held_out=True)(lambda step, batch, s, at: batch)
fault("garbage_batch_words", "descr_word_transformer_restarts", SPIKES, 0,
      "one batch of random words", onset=0.8, held_out=True)(_once(random_words))
