"""The benchmark's read floor (csrc/cpu/stats_kernel.h: chunk_touch, built by read_probe.py).

`fasthealth bench` splits check_grads' time with a pass that only reads; it must read every
byte, or its floor is too low. It reports the lowest bit of the OR of each chunk's bytes in the
table's zero_count column (summed over the chunks): one byte set to 1 anywhere shows as 1.

`make test-eval` runs this once per CPU kernel variant the processor runs, as the kernel tests.
"""

import pytest
import torch
from read_probe import read_floor

import fasthealth as fh
from fasthealth.ops.layout import COL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("n", [1, 33, 4097, 65536 + 77])
def test_read_floor_reads_every_byte(dtype, n):
    if fh.ops.compiled.C is None:
        pytest.skip("the read floor is the compiled CPU kernel's")
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    m.w.grad = torch.zeros(n, dtype=dtype)
    raw = m.w.grad.view(torch.uint8)
    floor = read_floor(m)
    assert floor is not None
    assert floor()[0][0, COL["zero_count"]] == 0
    nbytes = raw.numel()
    for pos in sorted(p for p in {0, 1, nbytes // 2, nbytes - 65, nbytes - 2, nbytes - 1}
                      if 0 <= p < nbytes):
        raw.zero_()
        raw[pos] = 1
        assert floor()[0][0, COL["zero_count"]] == 1, f"byte {pos} of {nbytes} not read"
