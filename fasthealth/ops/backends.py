"""Which backend runs the op for tensors on a device.

``backend=None`` or ``"auto"`` takes ``FASTHEALTH_BACKEND`` if set, else the fastest available
for the device: ``cpu`` on CPU tensors; on CUDA tensors the fastest fused backend that
``fasthealth selftest`` validated on this machine (its record, keyed by GPU, driver, torch,
triton and fasthealth build), else the ``torch`` reference, which is right and sync-free, only
slower, with a warning, once, that says how to enable the fused kernels.
``backend="cuda"``/``"triton"`` or ``FASTHEALTH_BACKEND`` select them explicitly.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from . import compiled, validation

BACKENDS = ("torch", "cpu", "cuda", "triton")
_validated: dict[int, list[str]] = {}  # per CUDA device index: selftest's record, read once
_told = False


# Looked up once, at import: torch.compile traces resolve() on every call, and some torch
# versions (2.11) refuse to trace importlib's find_spec, which broke fullgraph capture of the
# Triton backend.
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def _triton_importable() -> bool:
    return _TRITON_FOUND


def triton_interpret() -> bool:
    """TRITON_INTERPRET is set: Triton kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_backends() -> list[str]:
    """Backends usable in this process, fastest first within each device."""
    out = []
    cuda_ok = torch.cuda.is_available()
    if compiled.has_cuda() and cuda_ok:
        out.append("cuda")
    if _triton_importable() and compiled.has_cpu() and (cuda_ok or triton_interpret()):
        out.append("triton")
    if compiled.has_cpu():
        out.append("cpu")
    out.append("torch")
    return out


def unsupported(backend: str, device: torch.device) -> str | None:
    """None if ``backend`` can run on ``device``, else the reason it cannot."""
    if backend == "torch":
        return None
    if backend == "cpu":
        if device.type != "cpu":
            return "the 'cpu' backend runs on CPU tensors only"
        if not compiled.has_cpu():
            return f"fasthealth._C is not available ({compiled.load_error})"
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return "the 'cuda' backend runs on CUDA tensors only"
        if not compiled.has_cuda():
            return "fasthealth._C was built without CUDA kernels"
        return None
    if backend == "triton":
        if not _triton_importable():
            return "triton is not installed"
        if not compiled.has_cpu():  # the work list and its cache are the CUDA backend's own
            return (f"fasthealth._C, where it plans its work, is not available "
                    f"({compiled.load_error})")
        if device.type == "cuda" or (device.type == "cpu" and triton_interpret()):
            return None
        return "the 'triton' backend runs on CUDA tensors (CPU tensors need TRITON_INTERPRET=1)"
    return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'"


def resolve(backend: str | None, device: torch.device) -> str:
    """The backend to use for tensors on ``device``; raises ValueError naming the problem."""
    source = "backend="
    if backend is None or backend == "auto":
        env = os.environ.get("FASTHEALTH_BACKEND", "").strip()
        if not env or env == "auto":
            return _automatic(device)
        backend, source = env, "FASTHEALTH_BACKEND="
    why = unsupported(backend, device)
    if why is not None:
        raise ValueError(f"fasthealth: {source}{backend!r} cannot run on {device}: {why}")
    return backend


def _automatic(device: torch.device) -> str:
    order = validated_gpu_backends(device) if device.type == "cuda" else ("cpu",)
    for name in order:
        if unsupported(name, device) is None:
            return name
    if device.type == "cuda":
        _tell_once()
    return "torch"


def validated_gpu_backends(device: torch.device) -> list[str]:
    """The fused backends ``fasthealth selftest`` validated for this machine, fastest first."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _validated:
        try:
            _validated[index] = validation.validated(validation.machine_key(index))
        except (OSError, RuntimeError):
            _validated[index] = []
    return _validated[index]


def _tell_once() -> None:
    global _told
    if _told or not (compiled.has_cuda() or _triton_importable()):
        return
    _told = True
    warnings.warn("fasthealth: the fused GPU kernels are not validated on this machine, so "
                  "CUDA tensors use the (slower) torch reference: run `fasthealth selftest` "
                  "once to validate and enable them, or set FASTHEALTH_BACKEND=cuda",
                  RuntimeWarning, stacklevel=4)
