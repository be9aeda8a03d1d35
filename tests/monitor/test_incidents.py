"""Severity and incidents (docs/spec.md section 6): every event is an alarm or a notice, the
events of one fault form one incident, one dump per incident, incidents.jsonl records, and the
stall rule for a run that does not learn from the start."""

import json

import pytest
import torch
from test_monitor import data, loss_fn, make_model, nan_batch_at, train

import fasthealth as fh
from fasthealth.monitor.events import ALARM, NOTICE, Event, severity_of
from fasthealth.monitor.incidents import IncidentTracker, dump_due


def ev(step, kind, **details):
    return Event(step, kind, kind, details)


def test_severity_is_by_consequence():
    for kind in ("nonfinite_loss", "nonfinite_grad", "loss_spike", "divergence", "stall",
                 "oscillation", "lr_jump", "vanishing_grad", "optimizer_state_nonfinite",
                 "loss_scale_collapse", "replica_divergence"):
        assert severity_of(kind) == ALARM, kind
    for kind in ("grad_norm_spike", "exploding_grad", "precursor_update_ratio"):
        assert severity_of(kind) == NOTICE, kind
    assert ev(0, "grad_norm_spike").severity == NOTICE


def test_aftermath_joins_the_fault_and_a_quiet_period_closes_it():
    t = IncidentTracker(quiet=50, notice_quiet=10)
    inc, opened, alarmed = t.add(100, [ev(100, "loss_spike"), ev(100, "grad_norm_spike")])
    assert opened and alarmed and inc.trigger == "loss_spike" and inc.severity == ALARM
    for step in (110, 130, 170):  # the damaged model recovering: each within 50 of the last
        assert t.advance(step) is None
        again, opened, alarmed = t.add(step, [ev(step, "loss_spike")])
        assert again is inc and not opened and not alarmed
    closed = t.advance(221)
    assert closed is inc and not inc.open and (inc.start, inc.end) == (100, 170)
    other, opened, _ = t.add(221, [ev(221, "divergence")])
    assert opened and other.id == 1 and [e.incident for e in inc.events] == [0] * 2
    # the repeated loss spikes are counted on the incident's first one, not recorded apart
    spike = inc.events[0]
    assert (spike.kind, spike.repeats, spike.last_step) == ("loss_spike", 3, 170)
    assert inc.counts == {"loss_spike": 4, "grad_norm_spike": 1}


def test_repeats_are_counted_on_the_first_event_of_their_kind_and_severity():
    t = IncidentTracker()
    _, _, _, kept = t.file(10, [ev(10, "nonfinite_loss"), ev(10, "nonfinite_grad")])
    assert [e.kind for e in kept] == ["nonfinite_loss", "nonfinite_grad"]
    for s in range(11, 40):
        inc, opened, _, kept = t.file(s, [ev(s, "nonfinite_loss"), ev(s, "nonfinite_grad")])
        assert not opened and kept == []
    notice = Event(40, "exploding_grad", "", {})
    confirmed = Event(41, "exploding_grad", "", {"severity": ALARM}, severity=ALARM)
    assert t.file(40, [notice])[3] == [notice]
    assert t.file(41, [confirmed])[3] == [confirmed]  # an alarm is not a notice's repeat
    assert [(e.kind, e.repeats, e.last_step) for e in inc.events[:2]] == [
        ("nonfinite_loss", 29, 39), ("nonfinite_grad", 29, 39)]
    assert inc.counts == {"nonfinite_loss": 30, "nonfinite_grad": 30, "exploding_grad": 2}
    assert inc.to_json("closed")["counts"] == inc.counts
    assert inc.to_json("closed")["events"] == 4
    t.advance(200)
    assert t.file(200, [ev(200, "nonfinite_loss")])[3][0].repeats == 0  # a new incident


def test_an_alarm_incident_stays_open_while_the_loss_has_not_come_back():
    """A persistent fault (the features' scale changed for good) spikes again long after its
    first alarms: while the loss stays above where it was before, that is its aftermath."""
    t = IncidentTracker(quiet=50)
    for _ in range(100):
        t.observe(1.0, float("nan"))
    inc, opened, _ = t.add(100, [ev(100, "loss_spike")])
    for s in range(100, 300):
        t.observe(3.0, float("nan"))  # the loss stays 3x up
        assert t.advance(s + 1) is None
    again, opened, _ = t.add(300, [ev(300, "divergence")])
    assert again is inc and not opened
    for _ in range(300, 320):
        t.observe(1.01, float("nan"))  # back: within 2% of a loss without noise
    assert t.advance(351) is inc


def noisy(t, level, steps, g, share=0.05):
    """``steps`` losses about ``level`` with a step-to-step noise of ``share`` of it."""
    for _ in range(steps):
        t.observe(level * (1 + share * float(torch.randn((), generator=g))), float("nan"))


def test_a_loss_left_up_beyond_its_noise_keeps_its_incident_open_within_20_percent():
    """A learning-rate burst that leaves a nanoGPT-shaped run's loss 18% up (each step's loss
    moves ~5%, a median of 10 about 2%): damaged, not recovered, however quiet the steps after;
    back at its level, it closes after its quiet period. A one-step spike on the same noisy
    loss closes as before."""
    g = torch.Generator().manual_seed(0)
    t = IncidentTracker(quiet=50)
    noisy(t, 2.0, 100, g)
    inc, _, _ = t.add(100, [ev(100, "lr_jump")])
    noisy(t, 2.36, 1, g)
    t.add(101, [ev(101, "loss_spike")])
    for s in range(101, 500):
        noisy(t, 2.36, 1, g)  # 18% up for good
        assert t.advance(s + 1) is None, s
    assert t.harmed and t._unrecovered()
    noisy(t, 2.0, 20, g)
    assert t.advance(560) is inc and not inc.open

    g = torch.Generator().manual_seed(1)
    t = IncidentTracker(quiet=50)
    noisy(t, 2.0, 100, g)
    spike, _, _ = t.add(100, [ev(100, "loss_spike")])
    t.observe(6.0, float("nan"))
    noisy(t, 2.0, 60, g)
    assert not t._unrecovered() and t.advance(151) is spike


def test_a_collapsed_loss_scale_keeps_its_incident_open_until_it_recovers():
    t = IncidentTracker(quiet=50)
    for _ in range(50):
        t.observe(1.0, 65536.0)
    inc, _, _ = t.add(50, [ev(50, "loss_scale_collapse")])
    for _ in range(50, 200):
        t.observe(1.0, 2048.0)  # 32x below: gradients underflow from here on
    assert t.advance(200) is None
    assert t.add(200, [ev(200, "vanishing_grad")])[0] is inc
    t.observe(1.0, 16384.0)  # within 8x again
    assert t.advance(251) is inc


def test_a_notice_incident_and_skipped_steps_close_by_their_quiet_periods_whatever_the_loss():
    t = IncidentTracker(notice_quiet=10, skipped_quiet=3)
    for _ in range(50):
        t.observe(1.0, float("nan"))
    t.add(50, [ev(50, "grad_norm_spike")])
    for _ in range(50, 70):
        t.observe(5.0, float("nan"))
    assert t.advance(61) is not None
    t.add(70, [ev(70, "nonfinite_loss", skipped=True)])
    assert t.advance(74) is not None


def test_a_notice_that_the_loss_confirms_becomes_an_alarm_incident():
    t = IncidentTracker()
    inc, opened, alarmed = t.add(5, [ev(5, "grad_norm_spike")])
    assert opened and not alarmed and inc.severity == NOTICE
    same, opened, alarmed = t.add(7, [ev(7, "loss_spike")])
    assert same is inc and alarmed and inc.severity == ALARM and inc.trigger == "loss_spike"
    assert inc.kinds == ["grad_norm_spike", "loss_spike"]


def test_an_unconfirmed_notice_does_not_absorb_a_later_alarm():
    t = IncidentTracker(notice_quiet=10)
    t.add(5, [ev(5, "grad_norm_spike")])
    assert t.advance(40) is not None
    inc, opened, _ = t.add(40, [ev(40, "loss_spike")])
    assert opened and inc.id == 1


def test_skipped_steps_have_no_aftermath():
    """A skipped step never reached the weights: a NaN ten steps later is another fault, a NaN
    at every step is one."""
    t = IncidentTracker(skipped_quiet=3)
    first, _, _ = t.add(10, [ev(10, "nonfinite_loss", skipped=True)])
    for s in (11, 12, 13):
        t.advance(s)
        assert t.add(s, [ev(s, "nonfinite_loss", skipped=True)])[0] is first
    assert t.advance(20) is first
    assert t.add(20, [ev(20, "nonfinite_grad", skipped=True)])[1]  # opened anew


def test_dump_policy():
    alarm, notice = [ev(0, "loss_spike")], [ev(0, "grad_norm_spike")]
    assert dump_due("incident", alarm, True) and not dump_due("incident", alarm, False)
    assert dump_due("alarm", alarm, False) and not dump_due("alarm", notice, False)
    assert dump_due("event", notice, False) and not dump_due("none", alarm, True)


def _bad_batch_then_recovery(step, batch, model, opt):
    """A 50x-target batch: it damages the model, whose loss spikes again while it recovers."""
    if step == 60:
        x, y, w = batch
        return (x, y * 50.0, w)
    return None


def test_one_fault_is_one_incident_with_one_dump(tmp_path):
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    mon = train(m, opt, 140, plant=_bad_batch_then_recovery, log_dir=tmp_path)
    assert mon.events and all(e.step >= 60 for e in mon.events), [(e.step, e.kind)
                                                                  for e in mon.events]
    assert len(mon.incidents) == 1, [(i.start, i.kinds) for i in mon.incidents]
    inc = mon.incidents[0]
    assert inc.start == 60 and inc.severity == ALARM and not inc.open
    assert all(e.incident == inc.id for e in mon.events)
    dumps = list((mon.run_dir / "dumps").iterdir())
    assert len(dumps) == 1 and inc.dump == str(dumps[0])
    records = [json.loads(line)
               for line in (mon.run_dir / "incidents.jsonl").read_text().splitlines()]
    assert [r["state"] for r in records] == ["opened", "closed"]
    assert records[0]["id"] == records[1]["id"] == 0 and records[1]["end"] == inc.end
    logged = [json.loads(line) for line in (mon.run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["incident"] for e in logged} == {0} and all("severity" in e for e in logged)


def test_every_event_mode_keeps_the_old_dumps(tmp_path):
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    mon = train(m, opt, 140, plant=_bad_batch_then_recovery, log_dir=tmp_path, dumps="event")
    # every step a rule fired at: the steps of the recorded events and of their repeats
    lines = [json.loads(x) for x in (mon.run_dir / "steps.jsonl").read_text().splitlines()]
    found = {r["step"] for r in lines if r.get("events")}
    assert found >= {e.step for e in mon.events} | {e.last_step for e in mon.events
                                                    if e.repeats}
    assert sorted(p.name for p in (mon.run_dir / "dumps").iterdir()) == [
        f"step_{s:08d}.pt" for s in sorted(found)]
    assert sum(inc.counts[k] for inc in mon.incidents for k in inc.counts) == sum(
        len(r["events"]) for r in lines if r.get("events"))


def test_two_nans_apart_are_two_incidents():
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)

    def plant(step, batch, model, opt):
        return nan_batch_at(20)(step, batch, model, opt) or nan_batch_at(35)(step, batch,
                                                                            model, opt)

    mon = train(m, opt, 60, plant=plant)
    assert [(i.start, i.trigger) for i in mon.incidents] == [(20, "nonfinite_loss"),
                                                           (35, "nonfinite_loss")]


def test_dumps_option_is_checked():
    with pytest.raises(ValueError, match="dumps must be one of"):
        fh.Monitor(make_model(), dumps="all")


class Sigmoids(torch.nn.Module):
    """A 12-layer sigmoid stack: the gradients of its first layers vanish from step 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*[m for _ in range(12) for m in
                                            (torch.nn.Linear(16, 16), torch.nn.Sigmoid())])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.layers(x))


def test_a_stack_that_never_learns_is_a_stall_alarm_naming_the_vanishing_layers():
    m = Sigmoids()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = torch.randn(64, 1, generator=g)  # noise targets: no signal to learn quickly either
    mon = fh.Monitor(m, opt, flush_every=25)
    for _ in range(150):
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        mon.step(loss)
    mon.close()
    stalls = [e for e in mon.events if e.kind == "stall"]
    assert len(stalls) == 1 and stalls[0].severity == ALARM and stalls[0].step <= 110
    assert "layers.0.weight" in stalls[0].details["vanished"]
    assert "head.weight" not in stalls[0].details["vanished"]


def test_a_run_that_learns_does_not_stall():
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    mon = train(m, opt, 150)
    assert not [e for e in mon.events if e.kind == "stall"]
    x, y = data()
    assert loss_fn(m, (x, y, torch.ones(64, 1))) < 0.1


def test_a_cause_opens_its_own_incident():
    """An LR jump is a change of configuration, never the aftermath of an earlier fault; broken
    optimizer state is the aftermath only of non-finite values."""
    t = IncidentTracker()
    spike, _, _ = t.add(10, [ev(10, "loss_spike")])
    jump, opened, _ = t.add(20, [ev(20, "lr_jump"), ev(20, "loss_spike")])
    assert opened and jump.id == 1 and not spike.open and t.take_closed() == [spike]
    assert t.add(25, [ev(25, "lr_jump")])[0] is jump  # the same kind: the same fault
    state, opened, _ = t.add(30, [ev(30, "optimizer_state_nonfinite")])
    assert opened and state.id == 2
    t2 = IncidentTracker()
    nan, _, _ = t2.add(5, [ev(5, "nonfinite_grad")])
    assert t2.add(10, [ev(10, "optimizer_state_nonfinite")]) == (nan, False, False)


def test_a_fault_from_the_first_steps_is_one_incident_until_the_run_learns():
    """An LR far too high from step 0 spikes at step 6, then at 200 and 300 while the loss sits
    at chance level: one fault. Its incident opened before the loss had a level, so it stays
    open until the loss falls 20% below its first value."""
    t = IncidentTracker(quiet=50)
    for _ in range(6):
        t.observe(1.6, float("nan"))
    inc, _, _ = t.add(6, [ev(6, "loss_spike")])
    for s in range(7, 300):
        t.observe(1.7, float("nan"))  # never learns
        assert t.advance(s) is None
    assert t.add(300, [ev(300, "loss_spike")])[0] is inc
    for _ in range(10):
        t.observe(1.0, float("nan"))  # 37% below its first loss: it learned
    assert t.advance(351) is inc


def steady(loss, steps=40, grad_norm=float("nan")):
    """A tracker that has seen ``steps`` losses at ``loss`` (no loss scale)."""
    t = IncidentTracker(quiet=50)
    feed(t, loss, steps, grad_norm)
    return t


def feed(t, loss, steps, grad_norm=float("nan")):
    for _ in range(steps):
        t.observe(loss, float("nan"), grad_norm)


def test_a_new_kind_of_alarm_after_the_run_got_over_its_incident_is_a_new_fault():
    """The demo's broken optimizer state (the loss never moved) and, 30 steps later, an
    oscillation: two faults. Repeats of the first keep its incident open but explain nothing
    new."""
    t = steady(1.0)
    first, _, _ = t.add(40, [ev(40, "optimizer_state_nonfinite")])
    for s in range(41, 70):
        t.observe(1.0, float("nan"))
        if s % 10 == 0:
            assert t.add(s, [ev(s, "optimizer_state_nonfinite")])[0] is first
    other, opened, _ = t.add(70, [ev(70, "oscillation")])
    assert opened and other is not first and not first.open
    # within `settle` steps of the incident's last new finding, a new kind still joins it
    t.observe(1.0, float("nan"))
    assert t.add(75, [ev(75, "loss_spike")])[0] is other


def corrupted(step, since, several):
    return ev(step, "weight_corruption", scanned_since=since, several_tensors=several)


def test_a_weight_scan_finding_dates_from_the_scan_before():
    """A weight that jumped between the scans of steps 35 and 60 may have jumped at the
    gradient spike of step 40: the spike's aftermath, though step 60 is past ``settle``. Found
    by scans of steps 50 and 60, it jumped after the run got over the spike: a new fault."""
    def spiked():
        t = steady(1.0, grad_norm=1.0)
        inc, _, _ = t.add(40, [ev(40, "loss_spike"), ev(40, "grad_norm_spike", value=9.0)])
        feed(t, 1.0, 19, grad_norm=1.0)  # recovered
        return t, inc

    t, inc = spiked()
    assert t.add(60, [corrupted(60, 35, False)])[0] is inc
    t, inc = spiked()
    other, opened, _ = t.add(60, [corrupted(60, 50, False)])
    assert opened and other is not inc


def test_several_tensors_that_jumped_are_explained_by_any_alarm_incident():
    """An LR far too high: loss spikes from the first steps, and the weight scan finds every
    layer 1000x up; one tensor jumping (a flipped bit) is a cause that a loss spike cannot
    explain."""
    def spiked():
        t = steady(1.0)
        inc, _, _ = t.add(40, [ev(40, "loss_spike")])
        feed(t, 1.0, 5)
        return t, inc

    t, inc = spiked()
    assert t.add(46, [corrupted(46, 0, True)])[0] is inc
    t, inc = spiked()
    assert t.add(46, [corrupted(46, 0, False)])[1]


def test_a_loss_spike_back_to_the_level_before_is_the_run_coming_back():
    t = steady(1.6)
    inc, _, _ = t.add(40, [ev(40, "vanishing_grad")])
    feed(t, 0.0, 14)  # a loss weighted 0: no gradient
    # the loss returns to 1.6 from 0: a spike against the zeros, not a new fault
    assert t.add(55, [ev(55, "loss_spike", value=1.6)])[0] is inc
    feed(t, 1.6, 10)
    assert t.add(66, [ev(66, "divergence")])[1]  # another kind, 10 steps on: a new incident


def test_a_learning_rate_jump_keeps_explaining_until_its_harm_came_and_went():
    t = steady(0.1)
    inc, _, _ = t.add(40, [ev(40, "lr_jump")])
    feed(t, 0.1, 19)  # the loss has not moved yet
    assert t.add(60, [ev(60, "loss_spike", value=0.5)])[0] is inc
    feed(t, 0.5, 19)  # harmed
    assert t.add(80, [ev(80, "divergence")])[0] is inc
    feed(t, 0.1, 19)  # and back
    assert t.add(100, [ev(100, "oscillation")])[1]


def test_broken_optimizer_state_is_explained_only_by_an_overflowing_gradient():
    """A garbage batch's gradient spike (norm 3) cannot put Inf in Adam's second moment; a norm
    whose square overflows float32 can."""
    t = steady(1.0, grad_norm=1.0)
    spike, _, _ = t.add(40, [ev(40, "loss_spike"), ev(40, "grad_norm_spike", value=3.0)])
    t.observe(2.0, float("nan"), 3.0)
    assert t.add(45, [ev(45, "optimizer_state_nonfinite")])[1]  # its own incident
    t = steady(1.0, grad_norm=1.0)
    spike, _, _ = t.add(40, [ev(40, "loss_spike"), ev(40, "grad_norm_spike", value=3.0)])
    t.observe(1e30, float("nan"), 4e19)  # later steps of the same incident overflow
    assert t.add(45, [ev(45, "optimizer_state_nonfinite")])[0] is spike
