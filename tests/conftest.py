import os
import sys

import pytest

# The shared helpers (cases, tolerances, runlog, nanogpt, sass_loops, ...) are imported by their
# bare names from the tests in every folder under tests/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fasthealth  # noqa: E402

# The compiled backends that run on CPU tensors. The "torch" backend is the reference itself:
# the kernel suites compare against it, so they do not run it against itself.
COMPILED_CPU = ["cpu"]


@pytest.fixture(params=COMPILED_CPU)
def backend(request):
    """Every compiled backend that runs on CPU tensors; a missing one is a skip."""
    if request.param not in fasthealth.available_backends():
        pytest.skip(f"backend {request.param!r} is not available here "
                    f"(fasthealth._C: {fasthealth.ops.compiled.load_error})")
    return request.param
