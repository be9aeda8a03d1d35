"""The small models the detector corpus trains: each runs a step in a few milliseconds on one
CPU thread."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INF = float("inf")


def mlp(sizes: list[int], act: type[nn.Module] = nn.Tanh, dropout: float = 0.0,
        norm: bool = False) -> nn.Sequential:
    """Linear layers with ``act`` between them (and dropout, LayerNorm when asked): for
    ``dropout == 0`` and no norm, layer ``2 * i`` is the i-th Linear."""
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers.append(nn.Linear(a, b))
        if norm:
            layers.append(nn.LayerNorm(b))
        layers.append(act())
        if dropout:
            layers.append(nn.Dropout(dropout))
    k = 1 + int(norm) + int(bool(dropout))
    return nn.Sequential(*layers[:-k])


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


class Attention(nn.Module):
    """Causal self-attention written out (a masked softmax inside a non-leaf module, where LLMs
    most often make their first NaN): ``pad`` marks key positions to mask out."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        if pad is not None:
            mask = mask | pad[:, None, None, :]
        scores = scores.masked_fill(mask, -INF)
        att = F.dropout(scores.softmax(-1), self.dropout, self.training)
        y = att @ v  # a row with every key masked is NaN
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x, pad=None):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """A GPT: token and position embeddings, pre-LN blocks, a linear head."""

    def __init__(self, vocab: int, d: int = 32, heads: int = 2, layers: int = 2, ctx: int = 32,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, pad=None):
        x = self.drop(self.tok(ids) + self.pos[: ids.shape[1]])
        for blk in self.blocks:
            x = blk(x, pad)
        return self.head(self.ln(x))


class RNNLM(nn.Module):
    """Embedding, a GRU or an LSTM, a linear head."""

    def __init__(self, vocab: int, d: int = 48, hidden: int = 96, cell: str = "gru",
                 layers: int = 1, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.rnn = rnn(d, hidden, num_layers=layers, batch_first=True,
                       dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, pad=None):
        return self.head(self.drop(self.rnn(self.drop(self.tok(ids)))[0]))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a max-pool on 8x8 digit images, then a linear head."""

    def __init__(self, classes: int = 10, width: int = 16, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(self.drop(x.flatten(1)))


class ConvAE(nn.Module):
    """A convolutional autoencoder for 16x16 patches: 16x16 -> 8 channels of 4x4 -> 16x16."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1), nn.ReLU(),
                                 nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1))

    def forward(self, x):
        return self.dec(self.enc(x))


class ResidualLN(nn.Module):
    """Pre-LN residual MLP blocks."""

    def __init__(self, d_in: int, d: int = 48, depth: int = 3, d_out: int = 1):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
            for _ in range(depth))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


class GRURegressor(nn.Module):
    def __init__(self, d_in: int = 3, hidden: int = 24):
        super().__init__()
        self.rnn = nn.GRU(d_in, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


class SmallCNN(nn.Module):
    """For 16x16 single-channel images."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))
