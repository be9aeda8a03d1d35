"""Real data for the detector corpus, from what is installed: nothing is downloaded.

- Tables and images that ship inside the scikit-learn wheel (``sklearn.datasets.load_*``):
  iris, wine, breast_cancer, digits (8x8 images), diabetes, linnerud, and the two sample
  photographs (``load_sample_images``: patches for the autoencoders).
- Text: the Python standard library's own source (char-level language models) and English
  documentation: ``pydoc_data.topics`` (the interpreter's help texts, word level) and the
  data-set descriptions scikit-learn ships (``sklearn/datasets/descr/*.rst``).

Every loader is deterministic given its ``torch.Generator``: a run is a function of its seed.
Data sets are read once per process (``functools.cache``).
"""

from __future__ import annotations

import collections
import functools
import importlib
import re
from pathlib import Path

import numpy
import torch

# ---- tables ---------------------------------------------------------------------------------

TABLES = ("iris", "wine", "breast_cancer", "digits", "diabetes", "linnerud")


@functools.cache
def _raw(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn import datasets

    if name == "diabetes":
        b = datasets.load_diabetes(scaled=False)  # the raw units: age in years, bp in mm Hg...
    else:
        b = getattr(datasets, f"load_{name}")()
    x = torch.tensor(b.data, dtype=torch.float32)
    y = torch.tensor(b.target)
    return x, (y.float() if name in ("diabetes", "linnerud") else y.long())


def standardize(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / x.std(0).clamp(min=1e-6)


@functools.cache
def table(name: str, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, targets) of a scikit-learn table. Features standardized per column (digits:
    pixels / 16, shaped as 1x8x8 images) unless ``raw``; regression targets standardized."""
    x, y = _raw(name)
    if name == "digits":
        x = (x / 16.0).view(-1, 1, 8, 8) if not raw else x.view(-1, 1, 8, 8)
    elif not raw:
        x = standardize(x)
    if y.is_floating_point():
        y = standardize(y.view(len(y), -1))
    return x, y


class Loader:
    """Minibatches of ``batch`` rows over ``tensors`` (one first dimension), reshuffled every
    epoch, the last short batch dropped: ``DataLoader(shuffle=True, drop_last=True)``.
    Call with the step number; steps are taken in order."""

    def __init__(self, g: torch.Generator, tensors: tuple[torch.Tensor, ...], batch: int):
        self.g, self.tensors = g, tensors
        self.n = len(tensors[0])
        self.batch = min(batch, self.n)
        self.order = torch.empty(0, dtype=torch.long)
        self.pos = 0
        self.epoch = 0

    def __call__(self, step: int):
        if self.pos + self.batch > len(self.order):
            self.order = torch.randperm(self.n, generator=self.g)
            self.pos = 0
            self.epoch += 1
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return tuple(t[idx] for t in self.tensors)


def table_loader(g: torch.Generator, name: str, batch: int, raw: bool = False) -> Loader:
    return Loader(g, table(name, raw), batch)


# ---- images ---------------------------------------------------------------------------------

@functools.cache
def photos_gray() -> torch.Tensor:
    """The two sample photographs scikit-learn ships (a temple in China, a flower), gray,
    scaled to [0, 1]: 2 x 427 x 640."""
    from sklearn.datasets import load_sample_images

    imgs = torch.from_numpy(numpy.stack(load_sample_images().images)).float() / 255.0
    return imgs.mean(-1)


class Patches:
    """Random ``size`` x ``size`` patches of the sample photographs, each centred on its own
    mean (a denoising or compression autoencoder's input)."""

    def __init__(self, g: torch.Generator, batch: int = 32, size: int = 16):
        self.g, self.batch, self.size = g, batch, size
        self.imgs = photos_gray()

    def __call__(self, step: int):
        k, h, w = self.imgs.shape
        s = self.size
        which = torch.randint(0, k, (self.batch,), generator=self.g)
        r = torch.randint(0, h - s, (self.batch,), generator=self.g)
        c = torch.randint(0, w - s, (self.batch,), generator=self.g)
        out = torch.stack([self.imgs[i, a:a + s, b:b + s]
                           for i, a, b in zip(which.tolist(), r.tolist(), c.tolist())])
        out = out - out.mean((1, 2), keepdim=True)
        return (out[:, None] * 4.0,)  # patches' std is ~0.1-0.25: scaled to about unit size


# ---- text -----------------------------------------------------------------------------------

# Standard-library modules whose source is the tuning families' text, and other modules whose
# source is the held-out families' (never read while tuning).
SOURCE_MODULES = ("argparse", "textwrap", "difflib", "inspect", "dataclasses", "pathlib",
                  "shutil", "collections")
HELD_OUT_SOURCE_MODULES = ("logging", "http.client", "email.message", "tarfile", "zipfile")


@functools.cache
def python_source(modules: tuple[str, ...] = SOURCE_MODULES) -> str:
    parts = []
    for m in modules:
        path = importlib.import_module(m).__file__
        parts.append(Path(path).read_text(encoding="utf-8"))
    return "\n".join(parts)


CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))  # 97 symbols, then one for the rest


@functools.cache
def char_ids(modules: tuple[str, ...] = SOURCE_MODULES) -> torch.Tensor:
    """The source of ``modules`` as character ids (printable ASCII, tab, newline; anything else
    is id len(CHARS))."""
    index = {ch: i for i, ch in enumerate(CHARS)}
    text = python_source(modules)
    return torch.tensor([index.get(ch, len(CHARS)) for ch in text], dtype=torch.long)


CHAR_VOCAB = len(CHARS) + 1


@functools.cache
def doc_text(which: str = "pydoc") -> str:
    """English documentation: ``pydoc`` = the interpreter's help topics (pydoc_data.topics);
    ``sklearn`` = the descriptions of scikit-learn's data sets (its descr/*.rst)."""
    if which == "pydoc":
        from pydoc_data.topics import topics

        return "\n".join(topics[k] for k in sorted(topics))
    import sklearn.datasets

    folder = Path(sklearn.datasets.__file__).parent / "descr"
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.rst")))


@functools.cache
def word_ids(which: str = "pydoc", vocab: int = 512) -> torch.Tensor:
    """``doc_text(which)`` as word ids: lower-case words and single punctuation marks; the
    ``vocab - 1`` commonest, the rest one unknown id (vocab - 1)."""
    words = re.findall(r"[a-z]+|[^\sa-z]", doc_text(which).lower())
    common = [w for w, _ in collections.Counter(words).most_common(vocab - 1)]
    index = {w: i for i, w in enumerate(common)}
    return torch.tensor([index.get(w, vocab - 1) for w in words], dtype=torch.long)


class Windows:
    """Language-model batches: ``batch`` windows of ``ctx + 1`` tokens at random offsets of a
    token stream (as nanoGPT samples them); (inputs, next-token targets)."""

    def __init__(self, g: torch.Generator, ids: torch.Tensor, batch: int = 16, ctx: int = 32):
        self.g, self.ids, self.batch, self.ctx = g, ids, batch, ctx

    def __call__(self, step: int):
        start = torch.randint(0, len(self.ids) - self.ctx - 1, (self.batch,), generator=self.g)
        rows = torch.stack([self.ids[s:s + self.ctx + 1] for s in start.tolist()])
        return rows[:, :-1], rows[:, 1:]
