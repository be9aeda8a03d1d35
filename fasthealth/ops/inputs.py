"""What the op accepts, and the error that names a bad input.

The kernels check their inputs themselves, so the common call pays no Python loop over the
tensors; these run only when a call fails, to say which input was at fault, or when inputs need
unwrapping (DTensors) or splitting (several devices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def describe(i: int, names: Sequence[str] | None) -> str:
    return f"input {i}" + (f" ({names[i]!r})" if names is not None else "")


def validate(tensors: Sequence[Any], names: Sequence[str] | None) -> None:
    """Raises TypeError/ValueError naming the first input the op cannot take."""
    for i, t in enumerate(tensors):
        what = describe(i, names)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fasthealth: {what} is a {type(t).__name__}, not a torch.Tensor")
        if t.is_complex():
            raise TypeError(f"fasthealth: {what} is complex ({t.dtype}); check t.real and "
                            "t.imag separately")
        if t.layout != torch.strided:
            raise TypeError(f"fasthealth: {what} has layout {t.layout}; only dense (strided) "
                            "tensors are supported, use .to_dense()")
        if t.is_meta:
            raise ValueError(f"fasthealth: {what} is a meta tensor and has no values to check")


def dtensor_cls() -> type[DTensor] | None:
    """torch.distributed's DTensor class, None where this torch lacks it."""
    try:  # here, not at import: torch.distributed is not built on every platform
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def local_shards(tensors: list[Any]) -> list[Any] | None:
    """The inputs with every DTensor replaced by this rank's shard; None when there is none."""
    dtensor = dtensor_cls()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return None
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]
