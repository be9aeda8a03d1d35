import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fasthealth  # noqa: E402


def _cpu_backends():
    names = [b for b in fasthealth.available_backends() if b in ("cpu", "torch")]
    return names


CPU_BACKENDS = _cpu_backends()


@pytest.fixture(params=["cpu", "torch"])
def backend(request):
    """Every backend that runs on CPU tensors in this process; a missing one is a skip."""
    if request.param not in CPU_BACKENDS:
        pytest.skip(f"backend {request.param!r} is not available here "
                    f"(fasthealth._C: {fasthealth._ops.load_error})")
    return request.param
