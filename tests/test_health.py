"""Activations with first-producer attribution, mixed-precision range, optimizer health
(SPEC section 7 and its issue)."""

import math

import pytest
import torch
from tolerances import check_multi

import fasthealth as fh

NAN, INF = float("nan"), float("inf")


class Overflowing(torch.nn.Module):
    """Linear -> Scale (overflows in float16 terms when x is large) -> ReLU -> Linear."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.amp = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 2)
        self.norm = torch.nn.LayerNorm(2)

    def forward(self, x):
        return self.norm(self.out(self.act(self.amp(self.inp(x)))))


def test_first_producer_is_the_module_that_overflowed_not_those_passing_it_on():
    torch.manual_seed(0)
    m = Overflowing()
    with torch.no_grad():
        m.inp.weight.fill_(1.0)
        m.amp.weight[0] = 1e38  # amp's output overflows to inf; act, out, norm pass it on
    am = fh.ActivationMonitor(m)
    x = torch.ones(3, 4)
    y = m(x)
    assert not torch.isfinite(y).all()
    assert am.first_nonfinite == "amp"
    assert am.source == "forward"
    st = am.stats()
    assert st["inp"]["output"]["all_finite"] == 1.0
    assert st["amp"]["output"]["inf_count"] > 0
    assert st["out"]["output"]["all_finite"] == 0.0  # it carries the value, but is not blamed
    report = am.report()
    assert "!amp" in report and "first non-finite producer: amp" in report
    am.remove()
    m(x)
    assert am.first_nonfinite == "amp"  # hooks gone: the last recorded pass stays


def test_backward_producer_and_clean_pass():
    torch.manual_seed(0)

    class SqrtNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.root = Root()

        def forward(self, x):
            return self.root(self.lin(x)).sum()

    class Root(torch.nn.Module):
        def forward(self, x):
            return (x.abs() + 0.0).sqrt()

    m = SqrtNet()
    am = fh.ActivationMonitor(m)
    x = torch.randn(2, 3)
    m(x).backward()
    assert am.first_nonfinite is None and am.source is None
    with torch.no_grad():  # make one pre-activation exactly 0: sqrt' is inf there
        m.lin.weight.zero_()
        m.lin.bias.zero_()
    m.zero_grad()
    m(x).backward()
    assert am.source == "backward"
    assert am.first_nonfinite == "root"
    am.remove()


def test_nonfinite_input_is_attributed_to_the_data():
    m = Overflowing()
    am = fh.ActivationMonitor(m)
    x = torch.ones(2, 4)
    x[0, 0] = NAN
    m(x)
    assert am.first_nonfinite is None
    assert am.source == "input" and am.nonfinite_input == "inp"


class MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.k = torch.nn.Linear(8, 8)
        self.mask = CausalMask()
        self.softmax = torch.nn.Softmax(dim=-1)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.softmax(self.mask(scores))


class CausalMask(torch.nn.Module):
    def forward(self, s):
        t = s.shape[-1]
        return s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))


def test_masked_attention_minus_inf_is_not_reported_when_whitelisted():
    torch.manual_seed(0)
    m = MaskedAttention()
    x = torch.randn(2, 5, 8)
    am = fh.ActivationMonitor(m)
    m(x)
    assert am.first_nonfinite == "mask"  # without the whitelist the -inf fill is reported
    am.remove()
    am = fh.ActivationMonitor(m, allow_inf="mask")
    out = m(x)
    assert torch.isfinite(out).all()
    assert am.first_nonfinite is None and am.source is None
    # a real fault after the mask is still found: a fully masked row makes softmax NaN
    with torch.no_grad():
        full = torch.full((2, 5, 5), float("-inf"))

    class AllMasked(CausalMask):
        def forward(self, s):
            return full

    m.mask.forward = AllMasked().forward
    m(x)
    assert am.first_nonfinite == "softmax"


def test_every_samples_and_regex_selection():
    m = Overflowing()
    am = fh.ActivationMonitor(m, modules=r"^(amp|out)$", every=3)
    assert am.names == ["amp", "out"]
    x = torch.randn(2, 4)
    recorded, backward_hooked = [], []
    for _ in range(6):
        am._forward = []  # a recorded pass starts a new list and fills it; others leave it empty
        m(x).sum().backward()
        recorded.append(len(am._forward) > 0)
        backward_hooked.append(len(am._backward_handles) > 0)
    assert recorded == [True, False, False, True, False, False]
    assert backward_hooked == recorded  # backward hooks only on the recorded passes
    with pytest.raises(ValueError, match="no module"):
        fh.ActivationMonitor(m, modules=["nope"])
    with pytest.raises(ValueError, match="every"):
        fh.ActivationMonitor(m, every=0)


def test_monitor_with_activations_records_them():
    m = Overflowing()
    mon = fh.Monitor(m, None, activations=r"amp")
    m(torch.randn(2, 4)).sum().backward()
    mon.step(torch.tensor(1.0))
    assert mon.activations.names == ["amp"]
    assert "amp" in mon.activations.stats()
    mon.close()


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


def _adam_state(opt_cls, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    opt = opt_cls(m.parameters(), **kw)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    return m, opt


def test_check_optimizer_adam():
    m, opt = _adam_state(torch.optim.AdamW, lr=1e-3, eps=1e-8)
    names = {id(p): n for n, p in m.named_parameters()}
    h = fh.check_optimizer(opt, names)
    assert h.nonfinite_count.item() == 0
    assert h.params == ["0.weight", "0.bias", "1.weight", "1.bias"]
    # update ratio against a direct computation for the first parameter
    p = m[0].weight
    st = opt.state[p]
    t = float(st["step"])
    b1, b2 = opt.param_groups[0]["betas"]
    upd = 1e-3 * (st["exp_avg"] / (1 - b1**t)) / ((st["exp_avg_sq"] / (1 - b2**t)).sqrt() + 1e-8)
    want = upd.pow(2).mean().sqrt() / p.detach().pow(2).mean().sqrt()
    assert h.update_ratio[0].item() == pytest.approx(want.item(), rel=1e-5)
    # eps regime: make part of v tiny
    st["exp_avg_sq"][0, :3] = 1e-20
    st["exp_avg_sq"][1, 0] = 0.0
    h = fh.check_optimizer(opt, names)
    assert h.eps_fraction[0].item() == pytest.approx(4 / 30)
    assert h.eps_fraction[1].item() == 0
    st["exp_avg"][2, 2] = NAN
    h = fh.check_optimizer(opt, names)
    assert h.nonfinite_count.item() == 1 and h.state.nonfinite() == ["0.weight.exp_avg"]
    assert "0.weight.exp_avg" in h.summary()


def test_check_optimizer_sgd_and_errors():
    m, opt = _adam_state(torch.optim.SGD, lr=0.1, momentum=0.9)
    h = fh.check_optimizer(opt)
    assert h.eps_fraction is None and h.update_ratio.shape == (4,)
    buf = opt.state[m[0].weight]["momentum_buffer"]
    want = (0.1 * buf).pow(2).mean().sqrt() / m[0].weight.detach().pow(2).mean().sqrt()
    assert h.update_ratio[0].item() == pytest.approx(want.item(), rel=1e-5)
    with pytest.raises(TypeError, match="Optimizer"):
        fh.check_optimizer(m)
    assert math.isfinite(h.update_ratio.sum().item())
