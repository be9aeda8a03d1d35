"""fh.check_optimizer: non-finite optimizer state, Adam's eps-dominated fraction and the
update-to-parameter ratio, for Adam-family optimizers and SGD."""

import math

import pytest
import torch

import fasthealth as fh

NAN, INF = float("nan"), float("inf")


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
