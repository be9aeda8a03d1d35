"""Builds fasthealth._C from csrc/: always the CPU kernels, plus the CUDA kernels when torch is a
CUDA build and nvcc is found (never decided by torch.cuda.is_available(), which is false on
build machines).

Environment: FASTHEALTH_SKIP_CUDA=1 (CPU only), FASTHEALTH_FORCE_CUDA=1 (fail rather than skip
CUDA), TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), MAX_JOBS (parallel compile jobs, via ninja).

A CUDA toolkit that cannot build (nvcc found but no CUDA runtime headers or libcudart, or an
nvcc that cannot compile and link a small CUDA program) never fails the install: the CPU
kernels are built alone, with a warning, unless FASTHEALTH_FORCE_CUDA=1.

The extension is compiled against the torch it finds here, and loads only under that same torch.
So the build uses the torch already installed: torch is not in pyproject.toml's
build-system.requires, and a plain `pip install .` (which builds in an isolated environment that
hides the installed torch) stops here with a message that says what to run instead.
"""

import glob
import os
import re
import subprocess
import sys
import tempfile

from setuptools import setup

HOW_TO_INSTALL = """fasthealth: cannot build: {why}.

fasthealth's compiled kernels load only under the torch they were compiled against, so the build
uses the torch installed in your environment. A plain `pip install .` builds in an isolated
environment that hides it. Install with:

    pip install torch                    # first, if torch is not installed
    pip install --no-build-isolation .   # add -e for an editable install

(Wheels likewise: `pip wheel --no-build-isolation .` or `python -m build --no-isolation`.)
"""


def _isolated_torch(path: str) -> bool:
    """torch comes from pip's isolated build environment, not the one fasthealth installs into."""
    return "pip-build-env-" in path


try:
    import torch
except ImportError as exc:
    sys.exit(HOW_TO_INSTALL.format(why=f"torch cannot be imported ({exc})"))
if _isolated_torch(torch.__file__):
    sys.exit(HOW_TO_INSTALL.format(
        why=f"the torch found, {torch.__version__}, is pip's isolated build environment's "
            f"({os.path.dirname(torch.__file__)}), not yours"))

from torch.utils import cpp_extension  # noqa: E402

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


PROBE = """#include <cuda_runtime.h>
__global__ void probe(int* x) { *x = 1; }
int main() { int n = 0; return cudaGetDeviceCount(&n) == cudaSuccess ? 0 : 0; }
"""


def nvcc_probe(cuda_home: str) -> str | None:
    """None if nvcc compiles and links a small CUDA program against libcudart, else why not."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.cu")
        with open(src, "w") as f:
            f.write(PROBE)
        try:
            out = subprocess.run([nvcc, src, "-o", os.path.join(d, "probe"), "-lcudart"],
                                 capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"nvcc could not run ({exc})"
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"nvcc cannot build a small CUDA program ({tail[0]})"
    return None


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
        if not reasons:
            probe = nvcc_probe(cpp_extension.CUDA_HOME)
            reasons += [probe] if probe else []
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


def _depends() -> list[str]:
    """The headers and CUDA sources under csrc/, whichever kernels this build compiles: setuptools
    puts an extension's depends into the sdist, so an sdist made anywhere builds anywhere."""
    return sorted(glob.glob("csrc/**/*.h", recursive=True)
                  + glob.glob("csrc/**/*.cuh", recursive=True) + glob.glob("csrc/cuda/*.cu"))


def _cpu_extension():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    return cpp_extension.CppExtension(
        "fasthealth._C", sources, depends=_depends(), extra_compile_args={"cxx": CXX_FLAGS},
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
            depends=_depends(),
            define_macros=[("FASTHEALTH_WITH_CUDA", "1")],
            # the toolkit's own headers first: pip's copies of the CUDA libraries' headers only
            # fill in what a bare toolkit lacks
            include_dirs=[os.path.join(cpp_extension.CUDA_HOME, "include"),
                          *_pip_cuda_includes()],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=["-fopenmp"],
        )
    return _cpu_extension()


def announce(ext) -> str:
    """The line printed before compiling: what is built, and that it takes minutes (ninja's
    "[k/N]" lines follow, one per source). pip shows both only with -v."""
    names = [os.path.basename(s) for s in ext.sources]
    kind = "CUDA and CPU" if any(n.endswith(".cu") for n in names) else "CPU"
    line = (f"fasthealth: compiling the {kind} kernels, {len(names)} sources "
            f"({', '.join(names)}): this takes a few minutes (about 4 on 2 cores; MAX_JOBS "
            "sets the parallel jobs)")
    print(line, file=sys.stderr, flush=True)
    return line


BUILDS = ("build_ext", "build", "bdist_wheel", "install", "develop", "editable_wheel")


if __name__ == "__main__":
    _ext = _extension()
    if any(a in BUILDS for a in sys.argv[1:]):  # not for pip's metadata steps (egg_info)
        announce(_ext)
    setup(ext_modules=[_ext],
          cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)})
