"""The level-shift rule (fasthealth/monitor/rules/level_shift.py): a stretch of bad data that
lifts every batch's loss a little and holds it there, under the spike rule's threshold at every
step, is a ``loss_shift`` alarm whose cause is the data; one garbage batch, a healthy noisy
descent, a small wobble at a floor and a warm restart's shaking are not."""

from __future__ import annotations

import math
import random

import torch
from torch import nn

import fasthealth as fh
from fasthealth.monitor.record import StepHost, StepRecord
from fasthealth.monitor.rules.level_shift import LevelShift
from fasthealth.monitor.rules.phase import RESTART_HIGH


def _step(t, loss, lr=None):
    return StepRecord(t, {"loss": loss, "grad_norm": 1.0, "grads_finite": 1.0, "skipped": 0.0},
                      [], [], StepHost(t, lr=lr))


def _noisy(n, level, sigma=0.35, seed=0, start=2.3):
    """A classifier's losses at batch 16: five at ``start``, then log-normal noise of
    ``sigma`` around ``level``."""
    rng = random.Random(seed)
    return [start] * 5 + [level * math.exp(rng.gauss(0, sigma)) for _ in range(n - 5)]


def _found(rule, losses, lr=None):
    return [(t, f) for t, v in enumerate(losses) for f in rule.observe(_step(t, v, lr))]


def test_a_level_that_steps_up_and_holds_is_an_alarm_within_the_recent_median():
    healthy = _noisy(200, 1.0)
    assert _found(LevelShift(), healthy) == []
    shifted = healthy[:120] + [x * 3 for x in healthy[120:140]] + healthy[140:]
    found = _found(LevelShift(), shifted)
    assert [(f.kind, f.severity) for _, f in found] == [("loss_shift", None)]
    t, f = found[0]
    assert 120 < t <= 128  # within the recent 8 losses
    assert f.details["rise_share"] >= LevelShift.Config.rise
    assert f.details["z"] > LevelShift.Config.zscore
    assert "Check first: the data" in f.message


def test_one_garbage_batch_moves_the_median_by_one_rank_not_by_its_size():
    losses = _noisy(200, 1.0)
    losses[120] = 1e4
    assert _found(LevelShift(), losses) == []


def test_a_shift_of_a_sliver_of_the_runs_loss_at_a_floor_is_not_an_alarm():
    """At a memorised floor (1e-3, from 2.3) a wobble to 3e-3 that holds is many noise units
    of a median on the log scale and 0.1% of the run's loss."""
    losses = _noisy(300, 1e-3, sigma=0.1)
    wobble = losses[:200] + [x * 3 for x in losses[200:230]] + losses[230:]
    assert _found(LevelShift(), wobble) == []
    # the same shift to a loss the run's size is an alarm
    big = losses[:200] + [x * 1000 for x in losses[200:230]] + losses[230:]
    assert [f.kind for _, f in _found(LevelShift(), big)] == ["loss_shift"]


def test_the_episode_ends_when_the_median_is_back_and_a_second_shift_is_seen_again():
    losses = _noisy(400, 1.0)
    for lo, hi in ((120, 150), (260, 290)):
        losses[lo:hi] = [x * 3 for x in losses[lo:hi]]
    found = _found(LevelShift(), losses)
    assert [f.kind for _, f in found] == ["loss_shift", "loss_shift"]
    assert 120 < found[0][0] <= 128 and 260 < found[1][0] <= 268


def test_in_a_warm_restarts_high_rate_phase_a_shift_is_a_notice():
    losses = _noisy(300, 1.0)
    losses[200:240] = [x * 3 for x in losses[200:240]]
    rule = LevelShift()
    found = []
    for t, v in enumerate(losses):
        lr = 0.001 if t < 150 else 0.1  # a return to the peak rate at 150 ...
        found += [(t, f) for f in rule.observe(_step(t, v, lr=0.1 if t < 100 else lr))]
        if t == 150:
            rule.rearm()  # ... as the analyser does after the restart's own step
    assert RESTART_HIGH * 0.1 <= 0.1 and rule.in_restart
    assert [(f.kind, f.severity) for _, f in found] == [("loss_shift", "notice")]
    assert found[0][1].details["restart"] is True


def _classifier_run(shuffle: bool, off: bool = False, seed: int = 0):
    """A small classifier (30% of its labels noisy: batch losses swing 2x) under Adam, in a
    plain loop under fh.Monitor at its defaults; with ``shuffle``, 20 batches of random labels
    from step 150."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    proj = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(seed)
    rules = {"level_shift": {"zscore": math.inf}} if off else None
    with fh.Monitor(model, opt, flush_every=5, rules=rules) as mon:
        for step in range(200):
            x = torch.randn(16, 8, generator=g)
            noisy = torch.rand(16, generator=g) < 0.3
            y = torch.where(noisy, torch.randint(0, 4, (16,), generator=g), (x @ proj).argmax(1))
            if shuffle and 150 <= step < 170:
                y = torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            mon.step(loss.detach(), batch=(x, y))
    return [i for i in mon.incidents if i.severity == "alarm"]


def test_shuffled_labels_in_a_real_loop_are_caught_early_and_named_the_data():
    """Under the spike threshold at every step: without the rule only ``divergence`` sees the
    stretch, later, and names the learning rate."""
    assert _classifier_run(shuffle=False) == []
    (inc,) = _classifier_run(shuffle=True)
    assert inc.trigger == "loss_shift" and inc.cause == "batch"
    assert 150 < inc.start <= 158
    without = _classifier_run(shuffle=True, off=True)
    assert [i.trigger for i in without] == ["divergence"]
    assert without[0].start > inc.start and without[0].cause == "learning_rate"
