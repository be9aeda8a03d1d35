"""Small Triton kernels that run one device function of triton_kernels/ on its own, for tests
(imported inside tests: this module needs triton)."""

import triton
import triton.language as tl
from fasthealth.triton_kernels import tensor_stats as ts


@triton.jit
def in_flight_kernel(src, dst, end, BLOCK: tl.constexpr, WAIT_ALL: tl.constexpr):
    """dst[:4 BLOCK] = ts._in_flight of src's four tiles, dst[4 BLOCK:] = the same tiles
    converted to float32 without it."""
    lane = tl.arange(0, BLOCK)
    opaque = -(end < 0).to(tl.int32)
    r0 = tl.load(src + lane)
    r1 = tl.load(src + BLOCK + lane)
    r2 = tl.load(src + 2 * BLOCK + lane)
    r3 = tl.load(src + 3 * BLOCK + lane)
    x0, x1, x2, x3 = ts._in_flight(r0, r1, r2, r3, opaque, WAIT_ALL)
    tl.store(dst + lane, x0)
    tl.store(dst + BLOCK + lane, x1)
    tl.store(dst + 2 * BLOCK + lane, x2)
    tl.store(dst + 3 * BLOCK + lane, x3)
    tl.store(dst + 4 * BLOCK + lane, r0.to(tl.float32))
    tl.store(dst + 5 * BLOCK + lane, r1.to(tl.float32))
    tl.store(dst + 6 * BLOCK + lane, r2.to(tl.float32))
    tl.store(dst + 7 * BLOCK + lane, r3.to(tl.float32))
