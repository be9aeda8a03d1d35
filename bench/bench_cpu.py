"""CPU benchmark: `python bench/bench_cpu.py` (same as `fasthealth bench`). See
fasthealth/benchmark.py for the method; results land in bench/results/cpu.{json,png}."""

from fasthealth.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
