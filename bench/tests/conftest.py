import os
import sys

# The benchmarks' modules (bench/: harness, baselines, read_probe, prebuilt, gpu_results, ...),
# imported by their bare names as the benchmarks import one another
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
