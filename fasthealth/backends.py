"""Choosing a backend per device, and running it.

========  ===========================================  ======================================
name      runs on                                      implementation
========  ===========================================  ======================================
torch     any device                                   fasthealth/reference.py (the spec)
cpu       CPU tensors                                  csrc/cpu/ (C++, threads + SIMD)
cuda      CUDA tensors                                 csrc/cuda/ (CUDA C++)
triton    CUDA tensors (CPU under TRITON_INTERPRET=1)  triton_kernels/tensor_stats.py
========  ===========================================  ======================================

``backend=None`` or ``"auto"`` takes ``FASTHEALTH_BACKEND`` if set, else the fastest available
for the device: cuda > triton > torch on GPUs, cpu > torch on CPUs.

Until the GPU kernels have passed tests/test_gpu.py on a real device (``GPU_KERNELS_VALIDATED``),
the automatic choice on CUDA tensors is the ``torch`` reference: right and sync-free, only
slower. ``backend="cuda"``/``"triton"`` or ``FASTHEALTH_BACKEND`` select them explicitly.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence

import torch

from . import _ops, reference
from .stats import TABLE_WIDTH

BACKENDS = ("torch", "cpu", "cuda", "triton")
# Set to True once bench/gpu_check.sh has run tests/test_gpu.py green on a GPU.
GPU_KERNELS_VALIDATED = False


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_backends() -> list[str]:
    """Backends usable in this process, fastest first within each device."""
    out = []
    cuda_ok = torch.cuda.is_available()
    if _ops.has_compiled_cuda() and cuda_ok:
        out.append("cuda")
    if _triton_importable() and (cuda_ok or _triton_interpret()):
        out.append("triton")
    if _ops.has_compiled():
        out.append("cpu")
    out.append("torch")
    return out


def _supports(backend: str, device: torch.device) -> str | None:
    """None if ``backend`` can run on ``device``, else the reason it cannot."""
    if backend == "torch":
        return None
    if backend == "cpu":
        if device.type != "cpu":
            return "the 'cpu' backend runs on CPU tensors only"
        if not _ops.has_compiled():
            return f"fasthealth._C is not available ({_ops.load_error})"
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return "the 'cuda' backend runs on CUDA tensors only"
        if not _ops.has_compiled_cuda():
            return "fasthealth._C was built without CUDA kernels"
        return None
    if backend == "triton":
        if not _triton_importable():
            return "triton is not installed"
        if device.type == "cuda" or (device.type == "cpu" and _triton_interpret()):
            return None
        return "the 'triton' backend runs on CUDA tensors (CPU tensors need TRITON_INTERPRET=1)"
    return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'"


def resolve(backend: str | None, device: torch.device) -> str:
    """The backend to use for tensors on ``device``; raises ValueError naming the problem."""
    source = "backend="
    if backend is None or backend == "auto":
        env = os.environ.get("FASTHEALTH_BACKEND", "").strip()
        if env and env != "auto":
            backend, source = env, "FASTHEALTH_BACKEND="
        else:
            if device.type == "cuda":
                order = ("cuda", "triton") if GPU_KERNELS_VALIDATED else ()
            else:
                order = ("cpu",)
            for name in order:
                if _supports(name, device) is None:
                    return name
            return "torch"
    why = _supports(backend, device)
    if why is not None:
        raise ValueError(f"fasthealth: {source}{backend!r} cannot run on {device}: {why}")
    return backend


@torch.library.custom_op("fasthealth::multi_tensor_stats_triton", mutates_args=())
def _triton_op(tensors: list[torch.Tensor], range_hi: float, range_lo: float) -> torch.Tensor:
    """The Triton launcher as an op, so that torch.compile keeps it in the graph as one opaque
    call (its pointer tables need real data pointers, which tracing does not have)."""
    from .triton_kernels import tensor_stats as triton_stats

    return triton_stats.multi_tensor_stats_triton(tensors, range_hi, range_lo)


@_triton_op.register_fake
def _(tensors, range_hi, range_lo):
    return tensors[0].new_empty((len(tensors) + 1, TABLE_WIDTH), dtype=torch.float64)


def run(backend: str, tensors: Sequence[torch.Tensor], range_hi: float = math.inf,
        range_lo: float = 0.0) -> torch.Tensor:
    """The table ``[len(tensors) + 1, TABLE_WIDTH]`` of tensors on one device."""
    if backend == "torch":
        return reference.multi_tensor_stats(tensors, range_hi, range_lo)
    if backend == "triton":
        if torch.compiler.is_compiling():
            return _triton_op(list(tensors), range_hi, range_lo)
        from .triton_kernels import tensor_stats as triton_stats  # eager: no dispatch cost

        return triton_stats.multi_tensor_stats_triton(list(tensors), range_hi, range_lo)
    return torch.ops.fasthealth.multi_tensor_stats(list(tensors), range_hi, range_lo)
