"""The silent-data-corruption evaluation's own parts: a run flips its bit at its step and reads
the alarms, and the judge counts a flip harmful against its healthy twin's seed gap."""

import math

import eval_sdc as E
import pytest


def test_a_flip_is_planted_at_its_step_and_a_harmful_one_judged_so():
    healthy = [E.run("sgd", s, None, None) for s in (0, 1)]
    flip = E.run("sgd", 0, "forward", 30)
    assert flip["flipped"][0] == E.AT and healthy[0]["flipped"] is None
    assert not healthy[0]["alarms"] and not healthy[1]["alarms"]
    res = E.judge([*healthy, flip])
    assert res["seed_gap"]["sgd"] == abs(healthy[0]["end"] - healthy[1]["end"])
    row = res["by_bit"]["forward bit 30"]
    assert row["flips"] == 1 and row["harmful"] == int(flip["harmful"])
    assert flip["harmful"] == (flip["effect_z"] >= 6 or not flip["end"] - healthy[0]["end"]
                               <= res["seed_gap"]["sgd"])
    assert row["harmful_caught"] == int(flip["harmful"] and flip["caught"])
    assert res["totals"]["healthy_alarms"] == 0


def test_the_judge_on_made_up_runs():
    def r(seed, site, bit, z, end, alarms, caught):
        return {"model": "m", "seed": seed, "site": site, "bit": bit, "effect_z": z, "end": end,
                "alarms": alarms, "caught": caught}
    runs = [r(0, None, None, 0.1, 1.0, [], False), r(1, None, None, 0.1, 1.1, [], False),
            r(0, "forward", 5, 0.2, 1.05, [], False),  # within the gap: benign
            r(0, "forward", 30, 9.0, 1.0, [(200, "loss_spike", "batch")], True),  # visible
            r(1, "forward", 30, 0.5, math.inf, [], False),  # broken: harmful, missed
            r(1, "forward", 6, 0.5, 1.1, [(240, "x", "y")], False)]  # benign with an alarm
    res = E.judge(runs)
    assert res["totals"] == {"flips": 4, "harmful": 2, "harmful_caught": 1, "benign_alarmed": 1,
                             "healthy_runs": 2, "healthy_alarms": 0}


def test_the_ranks_judge_on_made_up_runs():
    """eval_sdc_ranks: a flip is named by an sdc_suspect at its step naming the bad rank, or by
    the non-finite gradients' origin there; a naming of another rank or step is misnamed."""
    import eval_sdc_ranks as R

    def r(seed, site, bit, z, end, sdc=(), origin=()):
        return {"seed": seed, "site": site, "bit": bit, "effect_z": z, "end": end,
                "sdc": list(sdc), "origin": list(origin)}
    at, bad = R.AT, R.BAD
    runs = [r(0, None, None, 0.1, 1.0), r(1, None, None, 0.1, 1.1),
            r(0, "grad_input", 30, 0.3, 1.5, sdc=[(at, "notice", bad, 1e35)]),  # harmful, named
            r(0, "forward", 30, 1e9, 1.0, origin=[(at, bad)]),  # non-finite: named by its origin
            r(0, "forward", 22, 0.2, 1.05, sdc=[(at + 3, "notice", 0, 2e4)]),  # benign, misnamed
            r(0, "grad_input", 29, 0.2, 1.0, sdc=[(at, "notice", bad, 5e4)])]  # benign, named
    res = R.judge(runs)
    assert res["seed_gap"] == pytest.approx(0.1)
    assert res["totals"] == {"flips": 4, "harmful": 2, "harmful_named": 2, "benign_named": 1,
                             "misnamed": 1, "healthy_runs": 2, "healthy_sdc_events": 0}
