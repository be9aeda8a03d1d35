"""The spike rule's paths for noisy and quiet floors (fasthealth/monitor/rules/spike.py): a value
far beyond its window's largest at a noisy loss floor, a blip at a quiet floor (a notice) and a
bad batch there (an alarm), a long run's heavy-tailed noise (a spike within its own tail: a
notice), and the first steps after a warm restart; and the stall rule's matrices-only evidence
(rules/stall.py)."""

from __future__ import annotations

import math
import random
import statistics

import torch

import fasthealth as fh
from fasthealth.monitor.record import StepHost, StepRecord
from fasthealth.monitor.rules import Context
from fasthealth.monitor.rules.phase import RESTART_HIGH
from fasthealth.monitor.rules.spike import (
    FLOOR_RISE,
    LINEAR_RISE,
    RESTART_RISE,
    TAIL_MARGIN,
    TAIL_RISE,
    TAIL_STEPS,
    Spike,
)
from fasthealth.monitor.rules.stall import Stall


def _step(t, loss, grad_norm=1.0, per_norm=()):
    return StepRecord(t, {"loss": loss, "grad_norm": grad_norm, "grads_finite": 1.0,
                          "skipped": 0.0}, list(per_norm), [0.0] * len(per_norm), StepHost(t))


def _floor(n, seed=0):
    """Losses of a small-batch classifier that started at 2.3 and reached its floor:
    log-uniform over 0.02..0.8 (40x) from one batch to the next."""
    rng = random.Random(seed)
    return [2.3] * 5 + [math.exp(rng.uniform(math.log(0.02), math.log(0.8)))
                        for _ in range(n - 5)]


def _kinds(rule, losses, start=0):
    return [(start + t, f.kind) for t, v in enumerate(losses) for f in rule.observe(
        _step(start + t, v))]


def test_a_loss_far_beyond_the_windows_largest_is_a_spike_at_a_noisy_floor():
    rule = Spike()
    healthy = _floor(200)
    assert _kinds(rule, healthy) == []
    top = max(healthy[-128:])  # the window
    assert _kinds(rule, [6 * top], start=200) == [(200, "loss_spike")]
    assert top < 1  # the window's largest is the floor's tail, not the start
    # the log scale alone would not have said so: the path is what catches it
    rule = Spike()
    _kinds(rule, healthy)
    rule.config = type(rule.config)(above_max=math.inf)
    assert _kinds(rule, [6 * top], start=200) == []


def test_healthy_noisy_floors_raise_nothing_through_that_path():
    for seed in range(20):
        assert _kinds(Spike(), _floor(600, seed)) == [], seed


def test_at_a_quiet_floor_a_blip_is_a_notice_and_a_bad_batch_an_alarm():
    """A classifier under label smoothing converged at 0.52 from 2.3, its batches within 1% of
    each other: a batch 15% above the floor stands far more than 6 noise units out, yet rises
    3.5% of the loss the run started from (a notice); a batch of wrong labels (2.6) is an
    alarm."""
    rng = random.Random(0)
    floor = [2.3] * 5 + [0.52 + rng.gauss(0, 0.003) for _ in range(300)]
    rule = Spike()
    assert _kinds(rule, floor) == []
    (blip,) = rule.observe(_step(305, 0.60))
    assert blip.kind == "loss_spike" and blip.severity == "notice", blip
    assert blip.details["zscore"] > 6 and blip.details["rise_share"] < FLOOR_RISE
    assert "a blip at the loss's floor" in blip.message and "(2.3)" in blip.message
    (bad,) = rule.observe(_step(306, 2.6))
    assert bad.kind == "loss_spike" and bad.severity is None  # the kind's own: an alarm
    # a state saved before the start was kept: taken as the median of the first values
    ser = rule.series["loss"]
    old = {k: getattr(ser, k) for k in ("values", "first", "run", "restarted", "before")}
    assert type(ser).STATE_ADDED["start"](old) == 2.3  # what the state's decoder makes of it


def _heavy_tailed(n, seed=0):
    """A regression at its noise floor with heavy-tailed label noise: losses around 0.1, each
    batch's the sum of four squared Student's t draws (6 degrees of freedom): now and then a
    batch scores past 6 noise units, a few times per thousand steps."""
    rng = random.Random(seed)

    def t6():
        return rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(6)) / 6)

    return [1.0] * 5 + [0.1 + 0.002 * sum(t6() ** 2 for _ in range(4)) for _ in range(n - 5)]


def test_a_long_runs_own_tail_makes_its_heavy_tailed_batches_notices():
    """Over thousands of steps a heavy-tailed floor shows spikes past 6 units a few times per
    thousand steps; once the run has shown ``TAIL_STEPS`` scored losses, a spike within
    ``TAIL_MARGIN`` times its own tail (the score it exceeded once per thousand steps) is a
    notice, while a bad batch far beyond it is still an alarm. Before that many steps the tail
    plays no part (every run of the short corpus and the trainer set is shorter)."""
    losses = _heavy_tailed(12_000)
    rule = Spike()
    ser = rule.series["loss"]
    early, late = [], []  # loss spikes before the tail counts, and after
    for t, v in enumerate(losses):
        counts = ser.scored >= TAIL_STEPS
        for f in rule.observe(_step(t, v)):
            if f.kind == "loss_spike":
                (late if counts else early).append(f)
    assert ser.tail() > 6
    assert [f for f in early if f.severity is None], "before, such spikes were alarms"
    assert late and all(f.severity == "notice" for f in late), [
        f.message for f in late if f.severity is None]
    tail = [f for f in late if "rise_share" not in f.details]  # not a blip at the floor
    assert tail and all("heavy tails" in f.message and f.details["zscore"] < TAIL_MARGIN
                        * f.details["tail"] for f in tail)
    (bad,) = rule.observe(_step(len(losses), 5.0))  # a target x50, say
    assert bad.severity is None and bad.details["zscore"] > TAIL_MARGIN * ser.tail()


def _strip(v, fields):
    """A Monitor state with ``fields`` taken out of every spike series: as saved before them."""
    if isinstance(v, dict):
        if v.get("cls") == "_Series":
            v["state"] = {k: x for k, x in v["state"].items() if k not in fields}
        for x in v.values():
            _strip(x, fields)
    elif isinstance(v, list):
        for x in v:
            _strip(x, fields)
    return v


def test_the_runs_tail_is_state_and_a_state_saved_before_it_resumes():
    """The tail's scores are in the Monitor's state; a state saved before the tail (and the
    run's first loss) were kept loads, its series taking them from the saved fields."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = fh.Monitor(model, opt, flush_every=10)
    for _ in range(40):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        mon.step(loss)
        opt.step()
        opt.zero_grad()
    mon.flush()
    ser = next(r for r in mon.detectors if isinstance(r, Spike)).series["loss"]
    assert ser.scored > 0 and ser.top

    def resumed(sd):
        again = fh.Monitor(model, opt, flush_every=10)
        again.load_state_dict(sd)
        return next(r for r in again.detectors if isinstance(r, Spike)).series["loss"]

    warm = resumed(mon.state_dict())
    assert (warm.scored, warm.top, warm.start) == (ser.scored, ser.top, ser.start)
    old = resumed(_strip(mon.state_dict(), {"scored", "top", "start"}))
    assert (old.scored, old.top, old.start) == (0, [], ser.start)
    assert old.values == ser.values  # warm: its window kept
    mon.close()


def test_after_a_restart_the_early_ratio_is_against_the_level_before_it():
    base = [2.0 + 0.05 * math.sin(t) for t in range(60)]
    rule = Spike()
    assert _kinds(rule, base) == []
    rule.rearm()
    # the climb a restart causes (3x) is not a spike; a loss 100x is, at once
    assert _kinds(rule, [6.0, 5.5, 5.0], start=60) == []
    found = rule.observe(_step(63, 200.0))
    assert [f.kind for f in found] == ["loss_spike"]
    assert found[0].details["restart"] and "warm restart" in found[0].message


def test_stall_counts_only_matrices_as_vanished():
    """A flat loss with only a vector's gradient vanished (an attention key's bias, a bias
    before a normalisation) is not a stall; with a matrix's, it is."""
    params = [("w", torch.zeros(4, 4)), ("key_bias", torch.zeros(4)), ("w2", torch.zeros(4, 4))]
    ctx = Context(names=[n for n, _ in params], params=params)

    def run(per_norm):
        rule = Stall(None, ctx)
        return [f.kind for t in range(120)
                for f in rule.observe(_step(t, 2.30 + 0.001 * (t % 3), per_norm=per_norm))]

    assert run([1.0, 1e-9, 1.0]) == []
    assert run([1.0, 1e-9, 1e-9]) == ["stall"]


def _memorised(n, seed=0, top=3e-3):
    """A small set memorised under dropout: from 0.65, losses log-uniform over 1e-5..``top``
    (a confident net whose dropout masks now and then cost a sample more)."""
    rng = random.Random(seed)
    return [0.65] * 5 + [math.exp(rng.uniform(math.log(1e-5), math.log(top)))
                         for _ in range(n - 5)]


def test_at_a_memorised_floor_a_miss_is_a_notice_and_a_bad_batch_not():
    """At a floor spanning decades the log scale's unit is wide, and the ``above_max`` path
    judges a loss many times the window's largest by the linear scale alone: one sample missed
    under dropout (0.15: 50x the largest) is a spike there. Seen by the linear scale alone, it
    is a notice when it rose less than ``LINEAR_RISE`` times the loss the run started from,
    before the run's tail exists as after; a batch of wrong labels rising more (1.6, 3.0) is an
    alarm whatever its log score. (A spike the log scale sees too, within the run's tail:
    ``test_a_long_runs_own_tail_makes_its_heavy_tailed_batches_notices``.)"""
    losses = _memorised(4000)
    rule = Spike()
    assert _kinds(rule, losses[:1000]) == []
    (early,) = rule.observe(_step(1000, 0.15))
    assert early.kind == "loss_spike" and early.severity == "notice", early.message
    assert rule.series["loss"].tail() is None
    assert early.details["log_zscore"] < rule.config.zscore < early.details["zscore"]
    assert "on the log scale" in early.message and "the run started from (0.65)" in early.message
    (bad,) = rule.observe(_step(1001, 3.0))
    assert bad.severity is None, bad.message  # no tail yet, rising 4.6x the start: an alarm
    rule = Spike()
    assert not [k for k in _kinds(rule, losses) if k[1] == "loss_spike"]
    ser = rule.series["loss"]
    assert ser.tail() is not None
    (miss,) = rule.observe(_step(4000, 0.15))
    assert miss.severity == "notice", miss.message
    for t, v in enumerate((1.6, 3.0)):
        assert v - statistics.median(ser.values) > LINEAR_RISE * 0.65
        (bad,) = rule.observe(_step(4001 + t, v))
        assert bad.severity is None, bad.message

def test_in_a_warm_restarts_high_rate_phase_a_miss_within_the_tail_is_a_notice():
    """A set memorised under dropout, thrown back to a high rate by a warm restart, loses it
    for some steps: a batch at 2.0 from a floor of 1e-3 (a rise of 307% of the loss the run
    started from, 0.65) within the run's tail on the log scale. While the rate is at least
    ``RESTART_HIGH`` of the rate the restart set, that is the schedule's doing, a notice up to
    ``RESTART_RISE``; the same batch once the rate has decayed below it, or with no restart at
    all, is an alarm (beyond ``LINEAR_RISE``); a batch rising beyond ``RESTART_RISE`` is an
    alarm in the phase too."""
    losses = _memorised(5000, top=3e-2)

    def run(rates, restart=4000):
        rule = Spike()
        for t, (v, lr) in enumerate(zip(losses, rates)):
            rule.observe(StepRecord(t, {"loss": v, "grad_norm": 1.0, "grads_finite": 1.0,
                                        "skipped": 0.0}, [], [], StepHost(t, lr=lr)))
            if t == restart:
                rule.rearm()  # as the analyser does after the restart's own step
        return rule

    def judge(rule, v, lr):
        (f,) = rule.observe(StepRecord(5000, {"loss": v, "grad_norm": 1.0, "grads_finite": 1.0,
                                              "skipped": 0.0}, [], [], StepHost(5000, lr=lr)))
        return f

    cosine = [0.001 if t < 4000 else 0.05 * (1 + math.cos(math.pi * (t - 4000) / 4000)) / 2
              for t in range(5000)]  # a restart at 4000 to 0.05, 1,000 steps into its cycle
    rule = run(cosine)
    assert rule.restart_lr == 0.05 and rule.series["loss"].tail() is not None
    rise = 2.0 - statistics.median(rule.series["loss"].values)
    assert max(TAIL_RISE, LINEAR_RISE) * 0.65 < rise < RESTART_RISE * 0.65
    ser = rule.series["loss"]
    for v in (2.0, 3.0):  # both within the tail on the log scale, the scale it is made of
        assert ser.window.scores(v)[1] < TAIL_MARGIN * ser.tail()
    miss = judge(rule, 2.0, cosine[-1])
    assert miss.severity == "notice" and "warm restart's high-rate phase" in miss.message
    assert "on the log scale" in miss.message and f"{RESTART_RISE:.0%}" in miss.message
    assert judge(run(cosine), 3.0, cosine[-1]).severity is None  # beyond RESTART_RISE
    # the rate decayed below RESTART_HIGH of the restart's: the phase is over
    low = cosine[:4001] + [RESTART_HIGH * 0.05 * 0.9] * 999
    rule = run(low)
    assert rule.restart_lr is None
    assert judge(rule, 2.0, low[-1]).severity is None
    # no restart at all: an alarm, as before
    rule = Spike()
    for t, v in enumerate(losses):
        rule.observe(_step(t, v))
    assert rule.observe(_step(5000, 2.0))[0].severity is None
    # a restart before the run has a tail: the linear scale alone sees the batch, and the
    # phase's allowance holds there too
    early = [0.001 if t < 1000 else 0.05 for t in range(1200)]
    rule = run(early, restart=1000)
    assert rule.series["loss"].tail() is None and rule.in_restart
    miss = judge(rule, 2.0, 0.05)
    assert miss.severity == "notice" and miss.details["log_zscore"] < rule.config.zscore
    assert judge(run(early[:1000] + [0.001] * 200), 2.0, 0.001).severity is None


def test_in_a_restarts_high_rate_phase_a_climb_at_a_floor_is_judged_by_its_outcome():
    """Divergence is judged on the log-loss: at a floor of 1e-3 (from 2.3) a climb x100 is a
    sliver of the way the run has come. In a warm restart's high-rate phase a climb is a
    notice, once per episode, and past ``FLOOR_RISE`` of the loss the run started from its
    verdict waits for the phase's end: none if the loss came back to its level, an alarm if it
    did not; a climb to ``RESTART_LIMIT`` of it is an alarm at once. Outside the phase (the
    rate decayed below ``RESTART_HIGH`` of the restart's, or no restart) the same climb is an
    alarm at once, as before."""
    from fasthealth.monitor.rules.divergence import RESTART_LIMIT, Divergence

    rng = random.Random(0)
    start = [2.3] * 5
    floor = [1e-3 * math.exp(rng.gauss(0, 0.3)) for _ in range(300)]
    up = [1e-3 * 1.05 ** k for k in range(1, 135)]  # to 0.7: 30% of the start
    assert FLOOR_RISE < up[-1] / 2.3 < RESTART_LIMIT

    def run(losses, rate_after, phase_end=10**9):
        rule = Divergence()
        found = []
        for t, v in enumerate(losses):
            lr = 0.001 if t < 100 else 0.05 if t == 100 else (
                rate_after if t < phase_end else 0.01)
            found += [(t, f) for f in rule.observe(StepRecord(
                t, {"loss": v, "grad_norm": 1.0, "grads_finite": 1.0, "skipped": 0.0}, [], [],
                StepHost(t, lr=lr)))]
            if t == 100:
                rule.rearm()  # as the analyser does after the restart's own step
        return rule, found

    def severities(found):
        return [f.severity for _, f in found]

    # the climb comes back within the phase: a notice, and no alarm when the phase ends
    back = start + floor + up + up[::-1] + floor[:100]
    end = len(back) - 50
    rule, found = run(back, 0.04, phase_end=end)
    assert not rule.in_restart and rule.first == start
    assert severities(found) == ["notice"], [(t, f.severity) for t, f in found]
    notice = found[0][1]
    assert "(2.3)" in notice.message and "high-rate phase" in notice.message
    # the loss stays up at 30% of the start: the alarm comes when the phase ends
    stays = start + floor + up + [0.7 * math.exp(rng.gauss(0, 0.05)) for _ in range(200)]
    end = len(stays) - 50
    rule, found = run(stays, 0.04, phase_end=end)
    assert severities(found)[-1] is None and "notice" in severities(found)
    (t_alarm, alarm), = [(t, f) for t, f in found if f.severity is None]
    assert t_alarm == end and "had not come back" in alarm.message
    assert alarm.details["rise_share"] > FLOOR_RISE
    # climbing on to 17x the start: an alarm once past RESTART_LIMIT, in the phase
    on = start + floor + [1e-3 * 1.05 ** k for k in range(1, 200)]
    rule, found = run(on, 0.04)
    assert rule.in_restart and severities(found) == ["notice", None]
    t_alarm = found[-1][0]
    recent = statistics.median(on[t_alarm - 9:t_alarm + 1])
    assert RESTART_LIMIT <= (recent - 1e-3) / 2.3 < 1.5 * RESTART_LIMIT
    # outside the phase: an alarm at once, where the phase gave its first notice
    first_alarm_outside = [t for t, f in run(on, RESTART_HIGH * 0.05 * 0.9)[1]
                           if f.severity is None]
    assert first_alarm_outside and first_alarm_outside[0] == found[0][0]


def test_a_norm_climb_begun_in_a_restarts_high_rate_phase_is_confirmed_as_divergence_judges():
    """A set memorised to 1e-6 (from 2.3), thrown back to a high rate: the gradient norm climbs
    30x and the loss with it, x1000, a sliver of the way the run has come. For a climb begun in
    the restart's high-rate phase the loss confirms it (``exploding_grad`` an alarm) as
    ``divergence`` judges a climb there: in the phase once it rises ``RESTART_LIMIT`` of the
    loss the run started from; when the phase is over with the episode still on, once it stands
    ``FLOOR_RISE`` of it above (a loss x1000 at 1e-6 is not). Without a restart the same climb
    is an alarm when the loss rises 10% above its own level."""
    from fasthealth.monitor.rules.divergence import RESTART_LIMIT
    from fasthealth.monitor.rules.grad_trend import GradNormTrend

    rng = random.Random(0)
    calm = 300
    losses = [2.3] * 5 + [1e-6 * math.exp(rng.gauss(0, 0.3)) for _ in range(calm - 5)]
    norms = [math.exp(rng.gauss(0, 0.2)) for _ in range(calm)]
    # the climb begins 40 steps after the restart, past the window where the rate's own rise
    # is the schedule's doing (``lr_rise``, never confirmed)
    up = [math.exp(rng.gauss(0, 0.2)) for _ in range(40)] + [
        min(1.08 ** k, 30.0) * math.exp(rng.gauss(0, 0.05)) for k in range(1, 150)]

    def run(top, rates, restart=calm):
        rule = GradNormTrend()
        climb = [1e-6] * 40 + [1e-6 * min(1.12 ** k, top / 1e-6) for k in range(1, 150)]
        found = []
        for t, (v, g, lr) in enumerate(zip(losses + climb, norms + up, rates)):
            found += [(t, f.severity) for f in rule.observe(StepRecord(
                t, {"loss": v, "grad_norm": g, "grads_finite": 1.0, "skipped": 0.0}, [], [],
                StepHost(t, lr=lr)))]
            if t == restart:
                rule.rearm()  # as the analyser does after the restart's own step
        return rule, found

    def alarms(found):
        return [t for t, sev in found if sev == "alarm"]

    n = calm + len(up)
    phase = [1e-5] * calm + [3e-3] * (n - calm)
    for top in (1e-3, 0.5):  # x1000, and 22% of the start: within the phase, notices
        rule, found = run(top, phase)
        assert rule.in_restart and found and not alarms(found), (top, found)
    # beyond RESTART_LIMIT of the start: an alarm in the phase too
    assert alarms(run((RESTART_LIMIT + 0.2) * 2.3, phase)[1])
    # the phase ends (the rate below half the restart's) with the norm still up: an alarm then
    # for a loss standing FLOOR_RISE of the start above its level, none for one x1000 at 1e-6
    ends = phase[:calm + 170] + [1e-3] * (n - calm - 170)
    rule, found = run(0.5, ends)
    assert not rule.in_restart and alarms(found) == [calm + 170], found
    assert not alarms(run(1e-3, ends)[1])
    # no restart at all (a constant rate): the climb x1000 is an alarm
    found = run(1e-3, [3e-3] * n, restart=-1)[1]
    assert alarms(found) and alarms(found)[0] < calm + 170, found


def test_a_warm_ups_first_step_begins_no_restart_phase():
    """A warm-up from a rate of 0: its first step multiplies the rate past any ratio and is a
    restart of the schedule (the windows start again), but it throws back no fitted model; were
    it a high-rate phase, the phase would last while the rate stays above half the warm-up's
    first, smallest rate: the whole run. Only a return to ``RESTART_HIGH`` of the highest rate
    before begins one, for every rule that keeps it."""
    from fasthealth.monitor.rules.divergence import Divergence
    from fasthealth.monitor.rules.grad_trend import GradNormTrend

    def run(rule, rates, restarts):
        for t, lr in enumerate(rates):
            rule.observe(StepRecord(t, {"loss": 1.0, "grad_norm": 1.0, "grads_finite": 1.0,
                                        "skipped": 0.0}, [], [], StepHost(t, lr=lr)))
            if t in restarts:
                rule.rearm()  # as the analyser does after the restart's own step
        return rule

    warmup = [0.0] + [1e-3 * min(1.0, t / 100) for t in range(1, 400)]
    sgdr = [1e-3 * (1 + math.cos(math.pi * t / 200)) / 2 for t in range(200)] + [1e-3] * 20
    for make in (Spike, Divergence, GradNormTrend):
        assert not run(make(), warmup, {1}).in_restart, make
        assert run(make(), sgdr, {200}).in_restart, make
        # a return to less than half the old peak begins none either
        low = sgdr[:200] + [RESTART_HIGH * 1e-3 * 0.8] * 20
        assert not run(make(), low, {200}).in_restart, make
