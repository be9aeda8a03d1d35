"""Builds fasthealth._C from csrc/: always the CPU kernels, plus the CUDA kernels when torch is a
CUDA build and nvcc is found (never decided by torch.cuda.is_available(), which is false on
build machines).

Environment: FASTHEALTH_SKIP_CUDA=1 (CPU only), FASTHEALTH_FORCE_CUDA=1 (fail rather than skip
CUDA), TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), MAX_JOBS (parallel compile jobs, via ninja).

A CUDA toolkit that cannot build (nvcc found but no CUDA runtime headers or libcudart, or a
CUDA compile that fails) never fails the install: the CPU kernels are built alone, with a
warning, unless FASTHEALTH_FORCE_CUDA=1.
"""

import glob
import os
import re
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _nvcc_major(cuda_home: str) -> int | None:
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"],
            capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def cuda_toolkit_problems(cuda_home: str) -> list[str]:
    """What a CUDA build would miss in ``cuda_home``: the runtime's header and library."""
    problems = []
    if not os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime.h")):
        problems.append(f"no cuda_runtime.h under {cuda_home}/include")
    libs = [os.path.join(cuda_home, d, "libcudart*") for d in ("lib64", "lib")]
    libs.append(os.path.join(cuda_home, "targets", "*", "lib", "libcudart*"))
    if not any(glob.glob(pattern) for pattern in libs):
        problems.append(f"no libcudart under {cuda_home}/lib64, lib or targets/*/lib")
    return problems


def _warn(message: str) -> None:
    print(f"fasthealth: WARNING: {message}", file=sys.stderr)


def _want_cuda() -> bool:
    force, skip = _flag("FASTHEALTH_FORCE_CUDA"), _flag("FASTHEALTH_SKIP_CUDA")
    if skip:
        print("fasthealth: FASTHEALTH_SKIP_CUDA=1, building the CPU kernels only")
        return False
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is not a CUDA build")
    elif cpp_extension.CUDA_HOME is None:
        reasons.append("nvcc not found (set CUDA_HOME)")
    elif not glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")):
        reasons.append("no CUDA sources in csrc/cuda")
    else:
        nvcc = _nvcc_major(cpp_extension.CUDA_HOME)
        torch_major = int(torch.version.cuda.split(".")[0])
        if nvcc != torch_major:
            reasons.append(f"nvcc's CUDA {nvcc} does not match torch's CUDA {torch.version.cuda}")
        reasons += cuda_toolkit_problems(cpp_extension.CUDA_HOME)
    if reasons:
        if force:
            sys.exit("fasthealth: FASTHEALTH_FORCE_CUDA=1 but " + "; ".join(reasons))
        if torch.version.cuda is not None:
            _warn("building the CPU kernels only (the CUDA kernels need a full CUDA toolkit): "
                  + "; ".join(reasons))
        else:
            print("fasthealth: building the CPU kernels only: " + "; ".join(reasons))
        return False
    return True


def _pip_cuda_includes() -> list[str]:
    """Headers of the CUDA libraries that pip's torch wheels bring (cuSPARSE, cuBLAS...), which
    torch's own headers include but a bare nvcc install may lack."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))


# No -std flag: torch.utils.cpp_extension picks the standard this torch needs (C++17 or 20).
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]


def _cpu_extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    return cpp_extension.CppExtension(
        "fasthealth._C", sources, extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=["-fopenmp"])


def _extension():
    cxx = CXX_FLAGS
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    if _want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        return cpp_extension.CUDAExtension(
            "fasthealth._C",
            sources,
            define_macros=[("FASTHEALTH_WITH_CUDA", "1")],
            include_dirs=_pip_cuda_includes(),
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=["-fopenmp"],
        )
    return _cpu_extension()


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's build, falling back to the CPU kernels alone when the CUDA build fails (a
    toolkit that compiles nothing, a missing library), unless FASTHEALTH_FORCE_CUDA=1."""

    def run(self):
        try:
            super().run()
        except Exception as exc:
            cuda = any(s.endswith(".cu") for e in self.extensions for s in e.sources)
            if not cuda or _flag("FASTHEALTH_FORCE_CUDA"):
                raise
            _warn(f"the CUDA build failed ({type(exc).__name__}: {exc}); building the CPU "
                  "kernels only. FASTHEALTH_FORCE_CUDA=1 makes this an error.")
            self.extensions = [_cpu_extension()]
            self.distribution.ext_modules = self.extensions
            super().run()


if __name__ == "__main__":
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExt})
