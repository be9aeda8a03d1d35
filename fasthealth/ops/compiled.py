"""Loads the compiled kernels (``fasthealth._C``) once.

A missing build, one that fails to load, or one compiled against another torch never crashes the
import: it warns once and leaves the ``torch`` backend, so results stay right, only slower.
Loading registers the op's CPU (and CUDA) kernels under ``torch.ops.fasthealth``.
"""

from __future__ import annotations

import importlib
import re
import warnings

import torch

C = None
load_error: str | None = None


def _release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0'."""
    m = re.match(r"\d+\.\d+\.\d+", version)
    return m.group(0) if m else version


def _load():
    module = importlib.import_module("fasthealth._C")
    built, running = getattr(module, "torch_version", "unknown"), _release(torch.__version__)
    if built != running:
        raise ImportError(f"fasthealth._C was built against torch {built}, this is torch "
                          f"{running}")
    if not hasattr(torch.ops.fasthealth, "multi_tensor_stats"):
        raise ImportError("fasthealth._C loaded but did not register its ops")
    return module


try:
    C = _load()
except (ImportError, OSError) as exc:  # missing build, or built against another torch
    load_error = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        "fasthealth: the compiled kernels could not be loaded "
        f"({load_error}); using the slow 'torch' backend. Rebuild with "
        "`pip install --no-build-isolation .` in an environment with this torch.",
        RuntimeWarning,
        stacklevel=2,
    )


def has_cpu() -> bool:
    """The compiled CPU kernel is loaded."""
    return C is not None


def has_cuda() -> bool:
    """The compiled module carries the CUDA kernels."""
    return C is not None and bool(getattr(C, "with_cuda", False))


def cpu_isa() -> str | None:
    """The instruction-set variant of the CPU kernel ('avx' or 'base'), None without _C."""
    return C.cpu_isa() if C is not None else None
