"""The data sets of the trainer families: map-style torch ``Dataset`` s of dicts, as the Hugging
Face Trainer and Lightning's ``DataLoader`` take them, over the real data of
``evaluation/detectors/data.py`` (nothing is downloaded).

Every set is a function of its seed and holds exactly ``steps * batch * accum`` samples: one
epoch is the whole run, so the trainers' loops never end an epoch with a short accumulation
(whose step would count differently) and micro-batch ``i`` belongs to optimizer step
``i // accum``, which the fault collator relies on (``faults.Planted``).

- ``TokenWindows``: causal-LM windows (``input_ids``, ``labels`` = the same ids; the models
  shift them) of the standard library's source or the pydoc topics, tokenised by characters
  (``chars``: evaluation/detectors' 98 symbols) or by bytes (``bytes``: 256 ids);
- ``Rows``: a scikit-learn table (iris, wine, breast_cancer, digits flattened; diabetes, a
  regression), standardised, as ``x`` (float32) and ``labels`` (class ids; for a regression
  table the standardised targets, float32 of shape (targets,), and ``classes`` 0);
- ``DigitTokens``: the digits' pixels (0..16) as 64 tokens after a [CLS] id (17), for a
  sequence classifier.
"""

from __future__ import annotations

import functools

import torch
from detectors import data as ddata


@functools.cache
def _stream(source: str, tokens: str) -> torch.Tensor:
    """``source``: "stdlib" (evaluation/detectors' tuning modules' source) or "pydoc" (help topics);
    ``tokens``: "chars" or "bytes"."""
    if tokens == "chars" and source == "stdlib":
        return ddata.char_ids()
    text = ddata.python_source() if source == "stdlib" else ddata.doc_text("pydoc")
    if tokens == "bytes":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    index = {ch: i for i, ch in enumerate(ddata.CHARS)}
    return torch.tensor([index.get(ch, len(ddata.CHARS)) for ch in text], dtype=torch.long)


def vocab(tokens: str) -> int:
    return ddata.CHAR_VOCAB if tokens == "chars" else 256


class TokenWindows(torch.utils.data.Dataset):
    def __init__(self, seed: int, n: int, source: str = "stdlib", tokens: str = "chars",
                 ctx: int = 32):
        self.ids = _stream(source, tokens)
        g = torch.Generator().manual_seed(1000 + seed)
        self.start = torch.randint(0, len(self.ids) - ctx - 1, (n,), generator=g)
        self.ctx = ctx
        self.vocab = vocab(tokens)
        self.frequent_id = int(torch.bincount(self.ids).argmax())  # the space, in practice

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: int) -> dict:
        s = int(self.start[i])
        x = self.ids[s:s + self.ctx]
        return {"input_ids": x, "labels": x.clone()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, seed: int, n: int, name: str = "wine"):
        x, y = ddata.table(name)
        x = x.reshape(len(x), -1)
        if name == "digits":  # pixels / 16: centred and scaled like the other tables
            x = ddata.standardize(x)
        self.x, self.y = x, y
        g = torch.Generator().manual_seed(2000 + seed)
        reps = -(-n // len(x))
        self.order = torch.cat([torch.randperm(len(x), generator=g) for _ in range(reps)])[:n]
        self.features = x.shape[1]
        self.regression = y.is_floating_point()  # data.table standardises these: (n, targets)
        self.classes = 0 if self.regression else int(y.max()) + 1
        self.targets = y.shape[1] if self.regression else 1

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        j = int(self.order[i])
        return {"x": self.x[j], "labels": self.y[j]}


class DigitTokens(torch.utils.data.Dataset):
    CLS = 17

    def __init__(self, seed: int, n: int):
        x, y = ddata.table("digits", raw=True)
        self.ids = torch.cat([torch.full((len(x), 1), self.CLS),
                              x.reshape(len(x), -1).long()], 1)
        self.y = y
        g = torch.Generator().manual_seed(3000 + seed)
        reps = -(-n // len(x))
        self.order = torch.cat([torch.randperm(len(x), generator=g) for _ in range(reps)])[:n]
        self.vocab, self.classes = self.CLS + 1, 10
        self.frequent_id = 0  # a blank pixel

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        j = int(self.order[i])
        return {"input_ids": self.ids[j], "labels": self.y[j]}
