"""Synthetic data of the first corpus (kept as families of their own): a smooth regression with
a noise floor, overlapping Gaussian clusters, text from a random Markov chain, images of bars,
sequences with a weighted-sum target."""

from __future__ import annotations

import math

import torch


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
