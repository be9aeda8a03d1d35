"""The benchmark's read floor: check_grads' CPU front door with a kernel that only reads.

The production extension has no such kernel. This module builds a second one from the same
sources with ``-DFASTHEALTH_READ_PROBE`` (csrc/cpu/tensor_stats.cpp swaps every ISA variant's
statistics kernel for ``chunk_touch``, a loop of the fast path's shape that only ORs what it
reads): the same gather, chunks, prefetches and merge, so that the benchmark can split
fasthealth's time into reading memory and computing the statistics. It registers no op and
loads beside ``fasthealth._C``. The build (about a minute) is cached under ``build/read-probe``.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

import fasthealth as fh
from fasthealth import params

ROOT = Path(__file__).resolve().parents[1]
_module: ModuleType | None = None


def load() -> ModuleType:
    """The probe extension, built on first use (``torch.utils.cpp_extension.load``)."""
    global _module
    if _module is None:
        from torch.utils import cpp_extension  # only the benchmark builds: keep it off import

        sources = sorted(glob.glob(str(ROOT / "csrc" / "*.cpp"))
                         + glob.glob(str(ROOT / "csrc" / "cpu" / "*.cpp")))
        build = ROOT / "build" / "read-probe"
        build.mkdir(parents=True, exist_ok=True)
        _module = cpp_extension.load(
            name="fasthealth_read_probe", sources=sources, build_directory=str(build),
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi",
                          "-DFASTHEALTH_READ_PROBE"],
            extra_ldflags=["-fopenmp"], verbose=bool(os.environ.get("VERBOSE")))
    return _module


def read_floor(model: torch.nn.Module) -> Callable[[], object] | None:
    """A call that reads every byte of ``model``'s gradients through check_grads' front door
    (gather, chunks, prefetches, merge) and computes nothing; None where the front door does not
    serve this model (no compiled kernel, gradients it leaves to the general path)."""
    if fh.ops.compiled.C is None:
        return None
    fh.check_grads(model)  # keeps the parameter list
    entry = params.kept(model)
    if entry is None:
        return None
    probe = load()

    def run():
        return probe.param_grads_table(entry.params, entry.dicts, entry.keys, math.inf, 0.0)

    return run if run() is not None else None
