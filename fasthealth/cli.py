"""`fasthealth` / `python -m fasthealth`: bench, demo, report, selftest, --version
(docs/spec.md, section 9)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from . import __version__

COMMANDS = {
    "bench": "the CPU benchmark against the naive loop (a source checkout's bench/harness.py)",
    "demo": "a small GPT-like training run with planted faults that shows every detector",
    "report": "plots and a summary from a Monitor's log directory: fasthealth report LOG_DIR",
    "selftest": "validate the fused GPU backends on this machine and enable the fastest",
}


def bench_harness() -> Path:
    """Where a source checkout keeps the benchmark: ``bench/harness.py`` beside the package
    (an installed package has no ``bench/``)."""
    return Path(__file__).resolve().parents[1] / "bench" / "harness.py"


def bench(argv: list[str]) -> int:
    """``fasthealth bench``: runs the checkout's ``bench/harness.py`` ``main(argv)``."""
    path = bench_harness()
    if not path.is_file():
        print(f"fasthealth bench: needs a source checkout of fasthealth: the benchmark is in "
              f"the repository's bench/ folder, which an installed package does not carry "
              f"(looked for {path}). Clone the repository, then run `make bench` in it.",
              file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("fasthealth_bench_harness", path)
    if spec is None or spec.loader is None:
        print(f"fasthealth bench: cannot load {path} as a Python module", file=sys.stderr)
        return 2
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before it runs: dataclasses and pickling look it up
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


def _usage() -> None:
    print("usage: fasthealth COMMAND [ARGS]  (or: fasthealth --version)\n\ncommands:")
    for name, what in COMMANDS.items():
        print(f"  {name:<8} {what}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _usage()
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        print(f"fasthealth {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        return bench(rest)
    # each command imports what it needs only when it runs: `fasthealth report` must not load
    # the demo's model, nor `fasthealth --help` any of them
    if cmd == "demo":
        from .demo import main as demo_main  # on demand, as said above

        return demo_main(rest)
    if cmd == "report":
        from .report import main as report_main  # on demand

        return report_main(rest)
    if cmd == "selftest":
        from .selftest import main as selftest_main  # on demand

        return selftest_main(rest)
    print(f"fasthealth: unknown command {cmd!r}; try `fasthealth --help`", file=sys.stderr)
    return 2
