"""Mixed-precision range counts (range_dtype=): every compiled backend against the reference,
known values, and the range of gradients, parameters and activations."""


import pytest
import torch
from cases import Overflowing, rounded_threshold_cases
from tolerances import check_multi

import fasthealth as fh
from fasthealth.ops import run
from fasthealth.ops.reference import tensor_stats_row

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                    torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_range_counts_match_reference(backend, target, dtype):
    fi = torch.finfo(target)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70_001, generator=g, dtype=torch.float64)
    x = x * torch.exp(torch.randn(70_001, generator=g, dtype=torch.float64) * 20)
    x[::97] = 0.0
    x[5] = fi.max * 2
    x[6] = -fi.tiny / 2
    x[7] = NAN
    x[8] = INF
    t = x.to(dtype)
    s = fh.multi_tensor_stats([t, t[:100]], backend=backend, range_dtype=target)
    check_multi(s.raw, [t, t[:100]], f"range {target}", range_dtype=target)
    r = s[0].range
    d = t.double()
    f = d[torch.isfinite(d)]
    hi, lo = float(fi.max), float(fi.tiny)
    if dtype.itemsize <= 4:
        hi, lo = float(torch.tensor(hi).float()), float(torch.tensor(lo).float())
    over = int(((f.abs() > hi)).sum())
    under = int(((f.abs() < lo) & (f != 0)).sum())
    assert r.overflow_count.item() == over and r.underflow_count.item() == under
    assert r.overflow_frac.item() == pytest.approx(over / f.numel())
    assert r.underflow_frac.item() == pytest.approx(under / int((f != 0).sum()))
    assert r.headroom.item() == pytest.approx(f.abs().max().item() / float(fi.max), rel=1e-6)


def test_thresholds_rounded_as_the_reference(backend):
    """Inputs of 32 bits or fewer count against the thresholds rounded to float32, 64-bit ones
    against the doubles, integers included (docs/spec.md section 2)."""
    for tensors, hi, lo in rounded_threshold_cases(4096):
        got = run(backend, tensors, hi, lo)[:-1, -2:]
        want = torch.stack([tensor_stats_row(t, hi, lo)[-2:] for t in tensors])
        assert got.tolist() == want.tolist(), (hi, lo)


def test_range_semantics_on_known_values():
    t = torch.tensor([1e5, -7e4, 100.0, 1e-6, 0.0, NAN, INF, -3e-8])
    r = fh.tensor_stats(t, range_dtype=torch.float16).range
    assert r.overflow_count.item() == 2  # 1e5 and -7e4; inf is not counted, it is already inf
    assert r.underflow_count.item() == 2  # 1e-6 and -3e-8; zero is not counted
    assert r.overflow_frac.item() == pytest.approx(2 / 6)
    assert r.underflow_frac.item() == pytest.approx(2 / 5)
    assert r.headroom.item() == pytest.approx(1e5 / 65504)
    with pytest.raises(ValueError, match="range_dtype"):
        _ = fh.tensor_stats(t).range
    with pytest.raises(TypeError, match="range_dtype"):
        fh.tensor_stats(t, range_dtype=torch.int8)


def test_range_for_grads_params_and_activations():
    torch.manual_seed(0)
    m = Overflowing()
    with torch.no_grad():
        m.amp.weight.mul_(1e6)
    am = fh.ActivationMonitor(m, range_dtype=torch.float16)
    m(torch.ones(2, 4)).sum().backward()
    st = am.stats()
    assert st["amp"]["output"]["overflow_frac"] > 0 and st["amp"]["output"]["headroom"] > 1
    assert st["inp"]["output"]["overflow_frac"] == 0
    p = fh.check_params(m, range_dtype=torch.float16)
    assert p["amp.weight"].range.overflow_count.item() > 0
    assert p["amp.weight"].range.headroom.item() > 1
    assert p["inp.weight"].range.overflow_count.item() == 0
    g = fh.check_grads(m, range_dtype=torch.bfloat16)
    assert g.total.range.overflow_count.item() == 0
