"""The benchmark's baselines compute what they claim, and agree with fasthealth."""

import baselines
import pytest
import torch

import fasthealth as fh


def test_baselines_agree_with_fasthealth():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g) for s in [(50, 20), (20,), (3, 3, 3)]]
    s = fh.multi_tensor_stats(ts)
    naive = baselines.naive_loop(ts)
    assert naive == {"any_nan": False, "any_inf": False,
                     "total_norm": pytest.approx(s.total.norm.item(), rel=1e-5)}
    full = baselines.naive_full_loop(ts)
    for i, row in enumerate(full):
        assert row["std"] == pytest.approx(s[i].std.item(), rel=1e-4)
        assert row["amax"] == pytest.approx(s[i].amax.item())
    total, nonfinite = baselines.foreach_norm_isfinite(ts)
    assert total.item() == pytest.approx(s.total.norm.item(), rel=1e-5)
    assert nonfinite.item() == 0
    assert baselines.total_norm_isfinite(ts).item() is True
    ts[1][3] = float("nan")
    assert baselines.total_norm_isfinite(ts).item() is False
    assert baselines.naive_loop(ts)["any_nan"] is True
    assert baselines.foreach_norm_isfinite(ts)[1].item() == 1
    flat = torch.cat([t.flatten() for t in ts])
    assert baselines.read_limit(flat).isnan().item()
