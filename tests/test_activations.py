"""fh.ActivationMonitor (docs/spec.md section 7): first-producer attribution, whitelisted -inf
masks, sampling and module selection, and the Monitor's activations option."""


import pytest
import torch
from cases import Overflowing

import fasthealth as fh

NAN, INF = float("nan"), float("inf")


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
    recorded, backward_seen = [], []
    for _ in range(6):
        # a recorded pass starts new lists and fills them; others leave them empty
        am._forward, am._backward = [], []
        m(x.requires_grad_()).sum().backward()
        recorded.append(len(am._forward) > 0)
        backward_seen.append(len(am._backward) > 0)
    assert recorded == [True, False, False, True, False, False]
    assert backward_seen == recorded  # gradients watched only on the recorded passes
    with pytest.raises(ValueError, match="no module"):
        fh.ActivationMonitor(m, modules=["nope"])
    with pytest.raises(ValueError, match="every"):
        fh.ActivationMonitor(m, every=0)


def test_monitor_with_activations_records_them():
    m = Overflowing()
    mon = fh.Monitor(m, None, activations=r"amp")
    m(torch.randn(2, 4)).sum().backward()
    mon.check(torch.tensor(1.0))
    assert mon.activations.names == ["amp"]
    assert "amp" in mon.activations.stats()
    mon.close()
