"""`fasthealth` / `python -m fasthealth`: bench, demo, report, selftest (SPEC section 9)."""

from __future__ import annotations

import sys

COMMANDS = {
    "bench": "the CPU benchmark against the naive loop (fasthealth/benchmark.py)",
    "demo": "a small GPT-like training run with planted faults that shows every detector",
    "report": "plots and a summary from a Monitor's log directory: fasthealth report LOG_DIR",
    "selftest": "validate the fused GPU backends on this machine and enable the fastest",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fasthealth COMMAND [ARGS]\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:<8} {what}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .benchmark import main as bench_main

        return bench_main(rest)
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "report":
        from .report import main as report_main

        return report_main(rest)
    if cmd == "selftest":
        from .selftest import main as selftest_main

        return selftest_main(rest)
    print(f"fasthealth: unknown command {cmd!r}; try `fasthealth --help`", file=sys.stderr)
    return 2
