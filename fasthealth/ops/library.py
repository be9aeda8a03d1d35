"""The op's two registrations with torch.library, and their fakes.

- ``fasthealth::multi_tensor_stats``: schema in ``csrc/fasthealth.cpp``, kernels in ``csrc/cpu/``
  and ``csrc/cuda/``; its fake is registered here once ``_C`` has loaded.
- ``fasthealth::multi_tensor_stats_triton``: the Triton launcher as an opaque custom op, so that
  ``torch.compile`` keeps it in the graph as one call (its pointer tables need real data
  pointers, which tracing does not have). Eager calls skip the dispatcher (see ``run``).

Both fakes give the same answer: the output shape depends only on the number of inputs, which
keeps the op traceable and capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from . import compiled
from .layout import TABLE_WIDTH


def fake_table(tensors: list[torch.Tensor], range_hi: float, range_lo: float) -> torch.Tensor:
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"fasthealth: input {i} is on {t.device}, input 0 on {device}")
    return tensors[0].new_empty((len(tensors) + 1, TABLE_WIDTH), dtype=torch.float64)


if compiled.C is not None:
    torch.library.register_fake("fasthealth::multi_tensor_stats")(fake_table)


@torch.library.custom_op("fasthealth::multi_tensor_stats_triton", mutates_args=())
def triton_op(tensors: list[torch.Tensor], range_hi: float, range_lo: float) -> torch.Tensor:
    from fasthealth.triton_kernels import tensor_stats as triton_stats  # triton: on first use

    return triton_stats.multi_tensor_stats_triton(tensors, range_hi, range_lo)


triton_op.register_fake(fake_table)
