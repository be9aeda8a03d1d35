"""The extension built ahead of time for a GPU machine (`make gpu-prebuilt`), and the check
that bench/gpu_check.sh runs before loading it there instead of compiling it.

fasthealth._C loads only under the CPython and the torch it was compiled against, and it holds
the kernels of csrc/ as they were when it was built. So the library travels with a manifest,
build/prebuilt/manifest.json:

  library         the file's name (_C.cpython-312-x86_64-linux-gnu.so) and its sha256
  python          the CPython it was built for: version, tag (cp312), extension suffix
  torch, cuda     torch.__version__ and torch.version.cuda of the build
  arch_list       TORCH_CUDA_ARCH_LIST of the build (9.0 by default: Hopper, sm_90)
  sources         sha256 of each file that goes into _C (csrc/**, setup.py) and of them all

and `check` refuses the library, saying why, when any of these differs from the tree, the
interpreter and the torch it runs in. torch matches on its release and CUDA version
(2.11.0+cu130 and 2.11.0 with CUDA 13.0 are the same), the rule fasthealth/ops/compiled.py
loads _C by; a build of the same release that is not binary compatible fails the import test
that bench/gpu_check.sh runs next.

    python bench/prebuilt.py write-manifest DIR [--root TREE] [--arch 9.0]
    python bench/prebuilt.py check DIR [--root TREE] [--arch 9.0]   exit 0: usable here
    python bench/prebuilt.py sources [--root TREE]                  the sources' hash

Standard library only, but for torch's version (see `running_torch`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
# What the build leaves behind or an editor keeps: never part of the sources
NOT_SOURCES = (".o", ".so", ".pyc", ".swp", "~")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_files(root: Path) -> list[str]:
    """The files that go into _C, relative to ``root``, sorted: everything under csrc/ (sources,
    headers, CUDA) and setup.py (flags, defines, which sources)."""
    found = ["setup.py"] if (root / "setup.py").is_file() else []
    for folder, dirs, files in os.walk(root / "csrc"):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in files:
            if not name.startswith(".") and not name.endswith(NOT_SOURCES):
                found.append((Path(folder) / name).relative_to(root).as_posix())
    return sorted(found)


def sources(root: Path) -> dict:
    """Each source file's sha256, and one over all of them (names and contents)."""
    files = {name: _sha256(root / name) for name in source_files(root)}
    total = hashlib.sha256("".join(f"{n}\0{h}\n" for n, h in files.items()).encode())
    return {"sha256": total.hexdigest(), "files": files}


def python_tag() -> dict:
    return {"version": ".".join(map(str, sys.version_info[:3])),
            "tag": f"cp{sys.version_info.major}{sys.version_info.minor}",
            "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX")}


def running_torch() -> dict:
    """torch's version and CUDA version here; why not, if torch does not import."""
    # imported here only: the sources' hash and the manifest's reading need no torch, and a
    # torch that fails to import must still give `check` a reason to print, not a traceback
    try:
        import torch
    except Exception as exc:  # a broken install can raise anything
        return {"error": f"torch does not import ({type(exc).__name__}: {exc})"}
    return {"version": torch.__version__, "cuda": torch.version.cuda}


def _release(version: str) -> str:
    """'2.11.0+cu130' -> '2.11.0' (as fasthealth/ops/compiled.py reads it)."""
    m = re.match(r"\d+\.\d+\.\d+", version)
    return m.group(0) if m else version


def _library(folder: Path) -> Path | None:
    libs = sorted(folder.glob("_C.*.so"))
    return libs[0] if len(libs) == 1 else None


def write_manifest(folder: Path, root: Path, arch: str) -> dict:
    lib = _library(folder)
    if lib is None:
        raise SystemExit(f"prebuilt: expected one _C.*.so in {folder}, found "
                         f"{sorted(p.name for p in folder.glob('_C.*.so'))}")
    t = running_torch()
    if "error" in t:
        raise SystemExit(f"prebuilt: {t['error']}")
    manifest = {"library": {"name": lib.name, "sha256": _sha256(lib),
                            "bytes": lib.stat().st_size},
                "python": python_tag(), "torch": t["version"], "cuda": t["cuda"],
                "arch_list": arch, "sources": sources(root),
                "built": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _changed(built: dict, now: dict) -> str:
    names = sorted(set(built) | set(now))
    diff = [f"{n} ({'new' if n not in built else 'gone' if n not in now else 'changed'})"
            for n in names if built.get(n) != now.get(n)]
    return ", ".join(diff[:5]) + (f" and {len(diff) - 5} more" if len(diff) > 5 else "")


def problems(folder: Path, root: Path, arch: str | None = None,
             torch_here: dict | None = None) -> list[str]:
    """Why the library in ``folder`` cannot be used with the tree ``root`` under this Python
    and torch (``torch_here``: running_torch(), read when not given); [] when it can."""
    try:
        m = json.loads((folder / MANIFEST).read_text())
        lib_name, lib_sha = m["library"]["name"], m["library"]["sha256"]
        py, built_sources = m["python"], m["sources"]
        built_torch, built_cuda, built_arch = m["torch"], m["cuda"], m["arch_list"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"no readable manifest in {folder} ({type(exc).__name__}: {exc})"]
    why = []
    lib, libs = folder / lib_name, sorted(p.name for p in folder.glob("_C.*.so"))
    if len(libs) > 1:
        why.append(f"more than one library in {folder}: {', '.join(libs)}")
    if not lib.is_file():
        why.append(f"the manifest's library {lib_name} is not in {folder}")
    elif _sha256(lib) != lib_sha:
        why.append(f"{lib_name} is not the library the manifest describes (sha256 differs)")
    here = python_tag()
    if py.get("ext_suffix") != here["ext_suffix"] or not lib_name.endswith(here["ext_suffix"]):
        why.append(f"built for Python {py.get('version')} ({py.get('ext_suffix')}), this is "
                   f"{here['version']} ({here['ext_suffix']})")
    now = sources(root)
    if built_sources.get("sha256") != now["sha256"]:
        why.append("the sources changed since the build: "
                   + _changed(built_sources.get("files", {}), now["files"]))
    t = running_torch() if torch_here is None else torch_here
    if "error" in t:
        why.append(t["error"])
    elif (_release(built_torch), built_cuda) != (_release(t["version"]), t["cuda"]):
        why.append(f"built against torch {built_torch} (CUDA {built_cuda}), this is torch "
                   f"{t['version']} (CUDA {t['cuda']})")
    missing = [a for a in (arch or "").replace(",", ";").split(";")
               if a.strip() and a.strip() not in built_arch.split(";")]
    if missing:
        why.append(f"built for TORCH_CUDA_ARCH_LIST={built_arch}, not for {';'.join(missing)}")
    return why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, doc in (("write-manifest", "describe DIR's library (after the build)"),
                      ("check", "exit 0 when DIR's library can be used here, else say why")):
        p = sub.add_parser(name, help=doc)
        p.add_argument("dir", type=Path)
        p.add_argument("--root", type=Path, default=ROOT, help="the tree (the repo root)")
        p.add_argument("--arch", default=os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
                       help="architectures it must hold, ';'-separated "
                            "(TORCH_CUDA_ARCH_LIST)")
    sub.add_parser("sources", help="the sources' hash").add_argument(
        "--root", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    if args.cmd == "sources":
        print(sources(args.root)["sha256"])
    elif args.cmd == "write-manifest":
        m = write_manifest(args.dir, args.root, args.arch)
        print(f"prebuilt: {m['library']['name']} ({m['library']['bytes']} bytes), Python "
              f"{m['python']['version']}, torch {m['torch']} (CUDA {m['cuda']}), arch "
              f"{m['arch_list']}, sources {m['sources']['sha256'][:12]}")
    else:
        why = problems(args.dir, args.root, args.arch)
        for reason in why:
            print(f"prebuilt refused: {reason}")
        if why:
            return 1
        print(f"prebuilt: {args.dir} matches this tree, Python and torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
