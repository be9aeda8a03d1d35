"""The GPU validation record: which fused backends ``fasthealth selftest`` validated on this
machine. It sits at the bottom, beside the backend choice that reads it (``backends.py``);
``selftest.py`` writes it. A validation holds for one machine key only: GPU model and
capability, driver, torch, triton and the fasthealth build, so that an upgrade of any of them
sends CUDA tensors back to the reference until selftest runs again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
from pathlib import Path

import torch

from . import compiled

INF = math.inf


def record_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fasthealth" / "selftest.json"


def _build_id() -> str:
    """What the kernels were built from: the compiled module's bytes and the Triton source."""
    h = hashlib.sha256()
    files = [getattr(compiled.C, "__file__", None)]
    files.append(str(Path(__file__).resolve().parents[2] / "triton_kernels" / "tensor_stats.py"))
    spec = importlib.util.find_spec("fasthealth.triton_kernels.tensor_stats")
    if spec is not None and spec.origin:
        files.append(spec.origin)  # found, not imported: importing it would import triton
    for f in files:
        if f and os.path.exists(f):
            h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def machine_key(device: int = 0) -> str:
    """GPU model and capability, driver, torch, triton and fasthealth build: a validation holds
    for this key only."""
    props = torch.cuda.get_device_properties(device)
    try:
        # in CUDA builds only, and missing from torch's stubs
        driver = str(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        driver = "unknown"
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "none"
    return (f"{props.name}|sm{props.major}{props.minor}|driver {driver}|torch "
            f"{torch.__version__}|triton {triton_version}|fasthealth {_build_id()}")


def read_record() -> dict:
    try:
        return json.loads(record_path().read_text())
    except (OSError, ValueError):
        return {}


def validated(key: str) -> list[str]:
    """The backends validated for ``key``, fastest first."""
    entry = read_record().get(key, {})
    return [b for b in entry.get("fastest_first", []) if entry.get("passed", {}).get(b)]


def write_record(key: str, results: dict[str, dict]) -> None:
    record = read_record()
    passed = {b: r["passed"] for b, r in results.items()}
    timed = sorted((r["timings"].get("gpt2-small bfloat16", {}).get(b, INF), b)
                   for b, r in results.items() if r["passed"])
    record[key] = {"passed": passed, "fastest_first": [b for _, b in timed],
                   "results": results}
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)
