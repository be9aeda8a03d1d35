import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# bench/'s harness, baselines and read probe: the tests check what the benchmarks run
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))

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


# FASTHEALTH_TEST_TIMEOUT=S (bench/gpu_check.sh): a test still running after S seconds dumps
# every thread's traceback to FASTHEALTH_HANG_LOG (pytest's capture would swallow stderr) and
# ends the process, so that a hang (an NCCL wait, a compiler) names itself and cannot eat the
# device's time; the tests before it have already reported.
_TIMEOUT = float(os.environ.get("FASTHEALTH_TEST_TIMEOUT", "0") or 0)
_HANG_LOG = (open(os.environ.get("FASTHEALTH_HANG_LOG", "hang-tracebacks.txt"), "a")
             if _TIMEOUT > 0 else None)


@pytest.fixture(autouse=True)
def _per_test_timeout():
    if _TIMEOUT <= 0:
        yield
        return
    import faulthandler

    faulthandler.dump_traceback_later(_TIMEOUT, exit=True, file=_HANG_LOG)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
