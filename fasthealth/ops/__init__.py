"""The one op: statistics of many tensors in one fused pass, as one float64 table.

========  ===========================================  ======================================
backend   runs on                                      implementation
========  ===========================================  ======================================
torch     any device                                   ``ops/reference.py`` (the contract)
cpu       CPU tensors                                  ``csrc/cpu/`` (C++, threads + SIMD)
cuda      CUDA tensors                                 ``csrc/cuda/`` (CUDA C++)
triton    CUDA tensors (CPU under TRITON_INTERPRET=1)  ``triton_kernels/tensor_stats.py``
========  ===========================================  ======================================

``table()`` is the way in: it chooses the backend (``backends.py``), calls the op once per
device, and returns the table of ``layout.py``. Nothing here synchronizes with the device except
the copies between devices when the inputs sit on several.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import backends, compiled, layout, library, reference
from .backends import available_backends, resolve
from .inputs import local_shards, validate
from .layout import TABLE_WIDTH

__all__ = [
    "available_backends", "backends", "compiled", "empty_table", "layout", "library",
    "reference", "resolve", "run", "table",
]


def run(backend: str, tensors: Sequence[torch.Tensor], range_hi: float = math.inf,
        range_lo: float = 0.0) -> torch.Tensor:
    """The table ``[len(tensors) + 1, TABLE_WIDTH]`` of tensors on one device, by ``backend``
    (a resolved name)."""
    if backend == "torch":
        return reference.multi_tensor_stats(tensors, range_hi, range_lo)
    if backend == "triton":
        if torch.compiler.is_compiling():
            return library.triton_op(list(tensors), range_hi, range_lo)
        # imported on first use: importing triton takes seconds and most processes never
        # need it; the direct call skips the custom op's dispatch
        from fasthealth.triton_kernels import tensor_stats as triton_stats

        return triton_stats.multi_tensor_stats_triton(list(tensors), range_hi, range_lo)
    tensors = tensors if type(tensors) is list else list(tensors)
    if backend == "cuda" and not torch.compiler.is_compiling():
        # eager calls skip the dispatcher too: its conversion of a long tensor list costs more
        # than the launch's own host work (bench/bench_host.py); None: not plain CUDA tensors
        assert compiled.C is not None  # the cuda backend exists only with _C loaded
        table = compiled.C.cuda_table(tensors, range_hi, range_lo)
        if table is not None:
            return table
    return torch.ops.fasthealth.multi_tensor_stats(tensors, range_hi, range_lo)


def empty_table() -> torch.Tensor:
    """The table of no tensors: just the total row of no elements."""
    return reference.tensor_stats_row(torch.empty(0, dtype=torch.float64))[None]


def table(tensors: list[torch.Tensor], names: Sequence[str] | None = None,
          backend: str | None = None, rng: tuple[float, float] = (math.inf, 0.0)
          ) -> torch.Tensor:
    """The table of ``tensors`` (at least one), which may sit on several devices.

    The common case (one device, plain tensors) is one op call and no Python loop over the
    inputs. Only when it fails does Python look at each input: to unwrap DTensors (this rank's
    shards), to split the call over devices, or to raise an error naming the bad input.
    """
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.is_meta:
        validate(tensors, names)
    with torch.no_grad():
        try:
            return run(resolve(backend, first.device), tensors, *rng)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            shards = local_shards(tensors)
            if shards is None:
                validate(tensors, names)  # raises, naming the input, if one is at fault
                if all(t.device == first.device for t in tensors):
                    raise
            else:
                tensors = shards
        return _table_per_device(tensors, backend, rng)


def _table_per_device(tensors: list[torch.Tensor], backend: str | None,
                      rng: tuple[float, float]) -> torch.Tensor:
    """One fused pass per device, rows gathered on the first input's device."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    home = tensors[0].device
    if len(groups) == 1:
        return run(resolve(backend, home), tensors, *rng)
    out = torch.empty((len(tensors) + 1, TABLE_WIDTH), dtype=torch.float64, device=home)
    totals = []
    for device, idx in groups.items():
        part = run(resolve(backend, device), [tensors[i] for i in idx], *rng).to(home)
        out[torch.tensor(idx, device=home)] = part[:-1]
        totals.append(part[-1])
    out[-1] = reference.merge_rows(torch.stack(totals))
    return out

