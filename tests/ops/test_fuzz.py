"""Property-based: random values (NaN, +-inf, zeros, subnormals, huge and tiny magnitudes),
random sizes and dtypes, the compiled CPU kernel against the reference."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from tolerances import check_multi, check_tensor

import fasthealth as fh

pytestmark = pytest.mark.skipif(
    "cpu" not in fh.available_backends(),
    reason=f"needs the compiled CPU kernel ({fh.ops.compiled.load_error})")
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

float32_arrays = arrays(
    np.float32,
    st.integers(0, 5000),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)
# float64 magnitudes where torch's own reference neither overflows nor underflows
float64_arrays = arrays(
    np.float64,
    st.integers(0, 3000),
    elements=st.one_of(
        st.floats(-1e150, 1e150).filter(lambda x: x == 0 or abs(x) > 1e-150),
        st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0]),
    ),
)


@SETTINGS
@given(float32_arrays, st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_fuzz_float32_family(a, dtype):
    t = torch.from_numpy(a).to(dtype)
    check_tensor(fh.multi_tensor_stats([t], backend="cpu").raw[0], t, str(dtype))


@pytest.mark.slow
@SETTINGS
@given(float64_arrays)
def test_fuzz_float64(a):
    t = torch.from_numpy(a)
    check_tensor(fh.multi_tensor_stats([t], backend="cpu").raw[0], t)


@SETTINGS
@given(
    st.lists(
        st.tuples(float32_arrays, st.sampled_from([torch.float32, torch.bfloat16,
                                                   torch.float64, torch.int32])),
        min_size=1, max_size=12,
    ),
    st.one_of(st.just(0.0), st.floats(-1e4, 1e4).filter(lambda x: abs(x) > 1e-3)),
)
def test_fuzz_many_tensors_with_offset(items, offset):
    tensors = []
    for a, dt in items:
        t = torch.from_numpy(a).double()
        t = torch.where(torch.isfinite(t), t.clamp(-1e6, 1e6) + offset, t)
        if not dt.is_floating_point:
            t = torch.nan_to_num(t, nan=0.0, posinf=1e6, neginf=-1e6)
        tensors.append(t.to(dt))
    check_multi(fh.multi_tensor_stats(tensors, backend="cpu").raw, tensors)
