"""Loads the compiled kernels (fasthealth._C) and registers the ops' fake implementations.

A missing or mismatched build never crashes the import: it warns once and leaves the ``torch``
backend, so results stay right, only slower.
"""

from __future__ import annotations

import warnings

import torch

from .stats import TABLE_WIDTH

_C = None
load_error: str | None = None

try:
    from . import _C  # noqa: F811  (registers torch.ops.fasthealth.*)

    if not hasattr(torch.ops.fasthealth, "multi_tensor_stats"):
        raise ImportError("fasthealth._C loaded but did not register its ops")
except (ImportError, OSError) as exc:  # missing build, or built against another torch
    _C = None
    load_error = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        "fasthealth: the compiled kernels could not be loaded "
        f"({load_error}); using the slow 'torch' backend. Rebuild with "
        "`pip install --no-build-isolation .` in an environment with the same torch.",
        RuntimeWarning,
        stacklevel=2,
    )


def has_compiled() -> bool:
    return _C is not None


def has_compiled_cuda() -> bool:
    return _C is not None and bool(getattr(_C, "with_cuda", False))


if _C is not None:

    @torch.library.register_fake("fasthealth::multi_tensor_stats")
    def _fake_multi_tensor_stats(tensors: list[torch.Tensor], range_hi: float,
                                 range_lo: float) -> torch.Tensor:
        # The shape depends only on how many inputs there are: capturable and traceable.
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device != device:
                raise ValueError(f"fasthealth: input {i} is on {t.device}, input 0 on {device}")
        return tensors[0].new_empty((len(tensors) + 1, TABLE_WIDTH), dtype=torch.float64)
