"""The planted faults users check their monitoring with (fasthealth/faults.py): a bit flipped
where the flip is asked for and nowhere else, at the call asked for; the other faults as they
say; errors that name the bad input; and a flipped exponent bit in a forward matmul caught by
the Monitor as an alarm at its step."""

import math
import struct

import pytest
import torch
from torch import nn

import fasthealth as fh
from fasthealth import faults


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@pytest.mark.parametrize("bit", [0, 10, 22, 23, 29, 30, 31])
def test_flip_bit_flips_that_bit_of_that_element_in_float32(bit):
    t = torch.tensor([0.75, -2.5, 3.0])
    raw = t.view(torch.int32).tolist()
    before, after = faults.flip_bit(t, 1, bit)
    assert before == -2.5
    # the stored bits, exactly (a NaN compares by its bits too)
    assert t.view(torch.int32)[1].item() & 0xFFFFFFFF == _bits(-2.5) ^ (1 << bit)
    assert t.view(torch.int32)[[0, 2]].tolist() == [raw[0], raw[2]]
    assert math.isnan(after) == math.isnan(t[1].item())


def test_flip_bit_in_bfloat16_and_the_top_exponent_bit():
    t = torch.tensor([1.0, 0.75], dtype=torch.bfloat16)
    assert faults.flip_bit(t, 0, 15) == (1.0, -1.0)  # the sign
    t = torch.tensor([0.75])
    assert faults.flip_bit(t, 0, 30)[1] == 0.75 * 2.0 ** 128  # 1.5 * 2^-1 -> 1.5 * 2^127


def test_flip_bit_errors_name_the_bad_input():
    with pytest.raises(TypeError, match="int64"):
        faults.flip_bit(torch.arange(3), 0, 1)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        faults.flip_bit(torch.zeros(2, dtype=torch.float16), 0, 16)
    with pytest.raises(IndexError, match="index 5"):
        faults.flip_bit(torch.zeros(2), 5, 1)
    with pytest.raises(ValueError, match="where must be one of"):
        faults.BitFlip(nn.Linear(2, 2), 0, 1, where="weights")


def _pair(where, at=1, bit=30):
    torch.manual_seed(0)
    ref, hit = nn.Linear(4, 3), nn.Linear(4, 3)
    hit.load_state_dict(ref.state_dict())
    return ref, hit, faults.BitFlip(hit, at=at, bit=bit, where=where)


def test_a_forward_flip_changes_one_output_element_at_its_call_only():
    ref, hit, flip = _pair("forward")
    x = torch.randn(5, 4)
    for call in range(3):
        a, b = ref(x), hit(x)
        diff = (a != b).nonzero()
        if call == 1:
            assert len(diff) == 1 and flip.flipped is not None
            i = flip.flipped[1]
            assert b.view(-1)[i].double() == a.view(-1)[i].double() * 2.0 ** 128  # |a| < 2
            g = torch.Generator().manual_seed(0)  # drawn with its seed by default
            assert i == int(torch.randint(a.numel(), (), generator=g))
        else:
            assert len(diff) == 0, call
    flip.remove()
    assert torch.equal(ref(x), hit(x))


@pytest.mark.parametrize("where", ["grad_input", "grad_weight"])
def test_a_backward_flip_changes_one_gradient_element(where):
    ref, hit, flip = _pair(where, at=0, bit=31)  # the sign: the value stays finite
    x = torch.randn(5, 4)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa).pow(2).sum().backward()
    hit(xb).pow(2).sum().backward()
    a, b = (xa.grad, xb.grad) if where == "grad_input" else (ref.weight.grad, hit.weight.grad)
    (i,) = (a != b).view(-1).nonzero().flatten().tolist()
    assert b.view(-1)[i] == -a.view(-1)[i] and flip.flipped[1] == i
    other = (ref.weight.grad, hit.weight.grad) if where == "grad_input" else (xa.grad, xb.grad)
    assert torch.equal(*other)  # the other gradient as it was


def test_the_other_planted_faults():
    x = faults.nan_sample(torch.ones(3, 2), 1)
    assert x[1, 0].isnan() and x.isnan().sum() == 1
    w = nn.Parameter(torch.tensor([0.1, -0.5, 0.2]))
    assert faults.corrupt_weight(w) == (1, -0.5) and w[1].item() == pytest.approx(-5000.0)
    opt = torch.optim.SGD([w], lr=0.1)
    with faults.scaled_lr(opt, 20):
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0)
    assert opt.param_groups[0]["lr"] == 0.1
    assert list(zip(range(6), faults.stuck(range(10), 2))) == [
        (0, 0), (1, 1), (2, 2), (3, 2), (4, 2), (5, 2)]


def test_a_flipped_exponent_bit_in_a_weight_gradient_is_an_alarm_at_its_step():
    """The top exponent bit of a gradient element below 2 in magnitude (bit 30 clear): the
    element 2^128 times itself. (Of a value of 2 or more, the same flip makes it tiny: the
    harm of a flip depends on the value it lands on.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    flip = faults.BitFlip(model[0], at=40, bit=30, where="grad_weight", seed=1)
    mon = fh.Monitor(model, opt, flush_every=10)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
        loss.backward()
        mon.step(loss)
        opt.zero_grad()
    mon.close()
    assert flip.flipped is not None and flip.flipped[0] == 40
    assert abs(flip.flipped[3]) > 1e30 > abs(flip.flipped[2])
    alarms = [i for i in mon.incidents if i.severity == "alarm"]
    assert alarms and alarms[0].start == 40, [(i.start, i.trigger) for i in alarms]
