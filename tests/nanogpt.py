"""nanoGPT's model at a CPU size, written from its config (nothing downloaded), and its data:
the characters of a standard-library module's source. Shared by the tests that train it."""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
D, HEADS, LAYERS, CTX, MICRO, ACCUM = 64, 4, 2, 64, 8, 2
WARM, LR = 50, 1e-3  # train.py's warm-up steps and peak rate, at this size
VOCAB = len(CHARS) + 1  # the characters, and one id for any other


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
        self.wte = torch.nn.Embedding(VOCAB, D)
        self.wpe = torch.nn.Parameter(torch.randn(CTX, D) * 0.02)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(D)
        self.lm_head = torch.nn.Linear(D, VOCAB)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def text() -> torch.Tensor:
    """Character ids of a standard-library module's source (nothing downloaded)."""
    index = {ch: i for i, ch in enumerate(CHARS)}
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    return torch.tensor([index.get(ch, len(CHARS)) for ch in text])


def batch(data: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of ``MICRO`` sequences at random places, and their next characters."""
    ix = torch.randint(len(data) - CTX - 1, (MICRO,), generator=g)
    return (torch.stack([data[i:i + CTX] for i in ix]),
            torch.stack([data[i + 1:i + 1 + CTX] for i in ix]))
