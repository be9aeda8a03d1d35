"""A run stopped at step k and resumed from ``mon.state_dict()`` raises the same events after k
as the run uninterrupted (docs/spec.md section 11), in a plain loop: the model, the optimizer
and the Monitor saved with ``torch.save`` and loaded with ``weights_only=True`` into new
objects. The trainers' resumes are in tests/integrations/test_resume_trainers.py."""

from __future__ import annotations

import io
import math

import pytest
import torch

import fasthealth as fh

STEPS = 200


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the data of a step, whatever process
    x = torch.randn(32, 10, generator=g)
    return x, x[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3)


def _train(mon: fh.Monitor, m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
           faults: dict[int, str]) -> None:
    for t in steps:
        x, y = _batch(t)
        loss = torch.nn.functional.mse_loss(m(x), y)
        if faults.get(t) == "nan":
            loss = loss * math.nan
        elif faults.get(t) == "spike":
            loss = loss * 1e4
        loss.backward()
        mon.step(loss, batch=(x, y))
        opt.zero_grad()


FAULTS = {60: "nan", 61: "nan", 140: "spike"}
OPTIONS = dict(flush_every=25, on_spike="skip")


def _key(events: list[fh.Event], after: int) -> list[tuple]:
    return [(e.step, e.kind, e.severity) for e in events if e.step > after]


def _continuous(faults: dict[int, str]) -> fh.Monitor:
    m, opt = _model()
    mon = fh.Monitor(m, opt, **OPTIONS)
    _train(mon, m, opt, range(STEPS), faults)
    mon.close()
    return mon


def _resumed(k: int, faults: dict[int, str], *, load: bool = True) -> tuple[fh.Monitor, int]:
    """Runs to step k, saves model, optimizer and Monitor in one file, loads them into new
    objects and runs on; returns the second Monitor and the state's size in bytes."""
    m, opt = _model()
    mon = fh.Monitor(m, opt, **OPTIONS)
    _train(mon, m, opt, range(k + 1), faults)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(),
                "monitor": mon.state_dict()}, buf)
    size = len(buf.getvalue())
    mon.close()
    del mon
    ck = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    m2, opt2 = _model()
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    mon2 = fh.Monitor(m2, opt2, **OPTIONS)
    if load:
        mon2.load_state_dict(ck["monitor"])
    _train(mon2, m2, opt2, range(k + 1, STEPS), faults)
    mon2.close()
    return mon2, size


def test_the_continuous_run_has_the_planted_faults():
    kinds = {(e.step, e.kind) for e in _continuous(FAULTS).events}
    assert (60, "nonfinite_loss") in kinds and (140, "loss_spike") in kinds


@pytest.mark.parametrize("k", [30, 87, 99, 149])
def test_resumed_at_k_raises_the_same_events_after_k(k):
    whole = _continuous(FAULTS)
    mon, _ = _resumed(k, FAULTS)
    assert _key(mon.events, k) == _key(whole.events, k)
    before = [(e.to_json(), e.repeats, e.last_step) for e in whole.events if e.step <= k]
    # the events before k came with the state
    assert [(e.to_json(), e.repeats, e.last_step) for e in mon.events[: len(before)]] == before
    inc = [(i.start, i.cause, i.kinds) for i in mon.incidents if i.start > k]
    assert inc == [(i.start, i.cause, i.kinds) for i in whole.incidents if i.start > k]


def test_a_fault_two_steps_after_the_resume_is_caught_at_the_same_step():
    faults = {112: "spike"}
    whole = _continuous(faults)
    assert (112, "loss_spike") in {(e.step, e.kind) for e in whole.events}
    mon, _ = _resumed(110, faults)
    assert _key(mon.events, 110) == _key(whole.events, 110)
    # the test can fail: resumed cold (no state), the rules warm up again and miss it
    cold, _ = _resumed(110, faults, load=False)
    assert (112, "loss_spike") not in {(e.step, e.kind) for e in cold.events}


def test_an_incident_open_at_the_stop_goes_on_after_the_resume():
    whole = _continuous(FAULTS)
    mon, _ = _resumed(61, FAULTS)  # stopped inside the NaN incident
    first = [i for i in whole.incidents if i.start == 60][0]
    again = [i for i in mon.incidents if i.start == 60][0]
    assert (again.id, again.end, again.kinds) == (first.id, first.end, first.kinds)
    assert [i.id for i in mon.incidents] == [i.id for i in whole.incidents]


def test_the_state_is_small_and_holds_no_weights():
    _, size = _resumed(99, {})
    m, opt = _model()
    mon = fh.Monitor(m, opt, **OPTIONS)
    _train(mon, m, opt, range(100), {})
    sd = mon.state_dict()
    one = io.BytesIO()
    torch.save(sd, one)
    assert len(one.getvalue()) < 200_000, len(one.getvalue())
    weights = {p.data_ptr() for p in m.parameters()}

    def tensors(v):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            for x in v.values():
                yield from tensors(x)
        elif isinstance(v, list):
            for x in v:
                yield from tensors(x)
    for t in tensors(sd):
        assert t.device.type == "cpu" and t.data_ptr() not in weights
        assert t.numel() <= 4 * 128  # windows and per-tensor levels, never a weight
    mon.close()


def test_misuse_is_refused_with_a_message():
    m, opt = _model()
    mon = fh.Monitor(m, opt, **OPTIONS)
    _train(mon, m, opt, range(3), {})
    sd = mon.state_dict()
    with pytest.raises(RuntimeError, match="before the Monitor's first step"):
        mon.load_state_dict(sd)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="other parameters"):
        fh.Monitor(other, torch.optim.SGD(other.parameters(), 0.1)).load_state_dict(sd)
    with pytest.raises(ValueError, match="expects what Monitor.state_dict"):
        fh.Monitor(m, opt).load_state_dict({"rules": {}})
    mon.close()


def test_a_changed_setting_starts_that_rule_cold_with_a_warning():
    m, opt = _model()
    mon = fh.Monitor(m, opt, **OPTIONS)
    _train(mon, m, opt, range(30), {})
    sd = mon.state_dict()
    mon.close()
    mon2 = fh.Monitor(m, opt, **dict(OPTIONS, spike_zscore=9.0))
    with pytest.warns(RuntimeWarning, match="start cold.*spike"):
        mon2.load_state_dict(sd)
    mon2.close()


class _Counting:
    """A user's rule of its own class: counts the steps it saw, raises nothing."""

    name = "counting"

    def __init__(self):
        self.seen = 0

    def observe(self, s):
        self.seen += 1
        return []


class _CountingWithState(_Counting):
    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, sd):
        self.seen = sd["seen"]


def test_a_users_rule_keeps_its_state_through_its_own_methods_else_starts_cold():
    m, opt = _model()
    rules = [_CountingWithState(), _Counting()]
    mon = fh.Monitor(m, opt, detectors=rules, **OPTIONS)
    _train(mon, m, opt, range(40), {})
    sd = mon.state_dict()
    mon.close()
    torch.save(sd, io.BytesIO())  # a user's rule's state is saved as it is
    again = [_CountingWithState(), _Counting()]
    mon2 = fh.Monitor(m, opt, detectors=again, **OPTIONS)
    with pytest.warns(RuntimeWarning, match="start cold.*counting"):
        mon2.load_state_dict(sd)
    assert (again[0].seen, again[1].seen) == (40, 0)
    mon2.close()


_CHILD = """
import sys, warnings, torch
sys.path.insert(0, {tests!r})
import test_resume as t
import fasthealth as fh
warnings.simplefilter("error")  # a rule or the tracker starting cold would be a warning
if sys.argv[1] == "save":
    m, opt = t._model()
    mon = fh.Monitor(m, opt, **t.OPTIONS)
    t._train(mon, m, opt, range(62), t.FAULTS)  # stopped inside the NaN incident
    torch.save({{"model": m.state_dict(), "opt": opt.state_dict(), "monitor": mon.state_dict()}},
               sys.argv[2])
else:
    ck = torch.load(sys.argv[2], weights_only=True)
    m, opt = t._model()
    m.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
    mon = fh.Monitor(m, opt, **t.OPTIONS)
    mon.load_state_dict(ck["monitor"])
    t._train(mon, m, opt, range(62, t.STEPS), t.FAULTS)
    mon.close()
    whole = t._continuous(t.FAULTS)
    assert t._key(mon.events, 61) == t._key(whole.events, 61)
    assert [(i.id, i.start, i.end) for i in mon.incidents] == [
        (i.id, i.start, i.end) for i in whole.incidents]
    print("same")
"""


@pytest.mark.slow
def test_a_state_saved_in_one_process_resumes_in_another(tmp_path):
    """Another process, another hash seed (the order of a frozenset in a config): nothing
    starts cold, and the events and incidents after the stop are the uninterrupted run's."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(Path(__file__).parent)))
    ck = tmp_path / "ck.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for mode, seed in (("save", "1"), ("load", "5")):  # these two order a set apart
        p = subprocess.run([sys.executable, str(script), mode, str(ck)], capture_output=True,
                           text=True, env=dict(env, PYTHONHASHSEED=seed), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("same")


@pytest.mark.slow
def test_a_long_noisy_run_keeps_a_bounded_state_and_resumes_the_same():
    """A NaN loss every 10 steps for 3000 steps: ~600 events and ~300 incidents, while the
    state keeps the last events and incidents only (events.jsonl has them all); its size stops
    growing past that tail, and a run resumed from it raises the same events and incidents."""
    n, k = 3000, 2004
    faults = {t: "nan" for t in range(9, n, 10)}

    def size(mon):
        buf = io.BytesIO()
        torch.save(mon.state_dict(), buf)
        return len(buf.getvalue())

    m, opt = _model()
    whole = fh.Monitor(m, opt, **OPTIONS)
    _train(whole, m, opt, range(1500), faults)
    half = size(whole)
    _train(whole, m, opt, range(1500, k + 1), faults)
    saved = _saved({"model": m.state_dict(), "opt": opt.state_dict(),
                    "monitor": whole.state_dict()})
    _train(whole, m, opt, range(k + 1, n), faults)
    full = size(whole)
    whole.close()
    assert len(whole.events) > 500 and len(whole.incidents) > 250
    assert full < 200_000 and full < 1.05 * half, (half, full)

    ck = torch.load(io.BytesIO(saved), weights_only=True)
    m2, opt2 = _model()
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    mon = fh.Monitor(m2, opt2, **OPTIONS)
    mon.load_state_dict(ck["monitor"])
    # what came with the state: the last events, every incident in its place
    assert len(mon.incidents) == len([i for i in whole.incidents if i.start <= k])
    assert [i.id for i in mon.incidents] == list(range(len(mon.incidents)))
    kept = [(e.to_json(), e.repeats, e.last_step) for e in mon.events]
    assert 200 <= len(kept) <= 300
    assert kept == [(e.to_json(), e.repeats, e.last_step) for e in whole.events
                    if e.step <= k][-len(kept):]
    old = mon.incidents[0]
    assert not old.open and old.id == 0 and "incidents.jsonl" in old.message
    _train(mon, m2, opt2, range(k + 1, n), faults)
    mon.close()
    assert _key(mon.events, k) == _key(whole.events, k)
    assert [(i.id, i.start, i.end, i.kinds, i.counts) for i in mon.incidents[-80:]] == [
        (i.id, i.start, i.end, i.kinds, i.counts) for i in whole.incidents[-80:]]
    assert size(mon) < 1.05 * half


def _saved(sd) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _tamper(v):
    """Renames the first object's class in an encoded state to one outside fasthealth."""
    if isinstance(v, dict):
        if v.get("__t") == "obj":
            v["cls"] = "collections:OrderedDict"
            return True
        return any(_tamper(x) for x in v.values())
    return isinstance(v, list) and any(_tamper(x) for x in v)


def test_a_refused_state_leaves_the_run_and_the_monitor_as_they_were(tmp_path):
    """A state refused while decoding (a class named outside fasthealth) continues no run: the
    run's meta.json is unchanged byte for byte (no resume record hiding steps nobody resumed),
    its writer lock is free, and the Monitor starts a run of its own. A refused writer (the
    run held by a live Monitor) leaves the Monitor as it was too."""
    import copy
    faults = {12: "nan"}
    m, opt = _model()
    with fh.Monitor(m, opt, log_dir=tmp_path, **OPTIONS) as mon:
        _train(mon, m, opt, range(30), faults)
        sd = mon.state_dict()  # at step 29, the run going on to 39: a resume would abandon
        _train(mon, m, opt, range(30, 40), faults)
    meta = (tmp_path / "run-000" / "meta.json").read_bytes()
    bad = copy.deepcopy(sd)
    assert _tamper(bad["objects"])
    refused = fh.Monitor(m, opt, log_dir=tmp_path, **OPTIONS)
    with pytest.raises(ValueError, match="not a type of fasthealth.s: refused"):
        refused.load_state_dict(bad)
    assert (tmp_path / "run-000" / "meta.json").read_bytes() == meta
    assert refused.run_id is None and refused.events == [] and refused.incidents == []
    holder = fh.Monitor(m, opt, log_dir=tmp_path, **OPTIONS)
    holder.load_state_dict(sd)  # the lock is free: run-000 goes on here
    assert holder.run_id == "run-000"
    _train(refused, m, opt, range(5), {})  # the refused Monitor: a run of its own
    assert refused.run_id == "run-001" and refused.steps_seen == 5
    refused.close()
    second = fh.Monitor(m, opt, log_dir=tmp_path, **OPTIONS)
    with pytest.raises(RuntimeError, match="being written by another Monitor"):
        second.load_state_dict(sd)
    assert second.run_id is None and second.events == [] and second.steps_seen == 0
    assert second.analyser.tracker.current is None and second.incidents == []
    holder.close()
    second.close()
