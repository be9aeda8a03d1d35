"""Logs and dumps that survive faults (docs/spec.md section 6, "Writing never stops training"): a
full disk (a real tmpfs), a log_dir removed mid-run, a process killed at random points (SIGKILL,
SIGTERM, SIGINT), Ctrl-C inside a save, a reopened log_dir (a new run); the report reads what is
left and escapes what it shows; duplicate names are refused."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import fasthealth as fh
from fasthealth import report

NAN = float("nan")


def model_and_opt(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)


def train(mon, m, opt, steps, nan_at=(), start=0):
    g = torch.Generator().manual_seed(start)
    for t in range(start, start + steps):
        x = torch.randn(32, 8, generator=g)
        if t in nan_at:
            x[1, 1] = NAN
        opt.zero_grad()
        loss = ((m(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        mon.step(loss, batch=(x,), sample_ids=torch.arange(32) + 100 * t)


def logged(run_dir):
    lines = (run_dir / "steps.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""  # whole lines only
    return [json.loads(s)["step"] for s in lines[:-1]]


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_warns_once_training_goes_on_and_writing_resumes(tmpfs):
    log_dir = tmpfs / "run"
    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5, warmup_steps=5)
    filler = tmpfs / "filler"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(mon, m, opt, 10)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # the disk fills up
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        os.close(fd)
        train(mon, m, opt, 20, nan_at=(15, 22), start=10)
        assert mon.write_errors, "the full disk went unnoticed"
        filler.unlink()  # space again
        train(mon, m, opt, 10, start=30)
        mon.close()
    ours = [w for w in caught if "cannot write to" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert logged(mon.run_dir) == list(range(40))  # every step once, in order
    assert {(e.step, e.kind) for e in mon.events} >= {(15, "nonfinite_loss"),
                                                     (22, "nonfinite_loss")}
    events = [json.loads(s) for s in (mon.run_dir / "events.jsonl").read_text().splitlines()]
    assert sorted((e["step"], e["kind"]) for e in events) == sorted(
        (e.step, e.kind) for e in mon.events)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert not list((mon.run_dir / "dumps").glob("*.tmp"))  # no half dump left behind


def test_log_dir_removed_mid_run(tmp_path):
    log_dir = tmp_path / "run"
    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
    train(mon, m, opt, 10)
    shutil.rmtree(log_dir)
    train(mon, m, opt, 10, nan_at=(14,), start=10)
    mon.close()
    assert logged(mon.run_dir) == list(range(10, 20))  # written again from where it was removed
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    assert ev.step == 14 and os.path.exists(ev.dump)


def test_ctrl_c_inside_a_save_loses_and_repeats_nothing(tmp_path, monkeypatch):
    log_dir = tmp_path / "run"
    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
    real_save, calls = torch.save, {"n": 0}

    def interrupted_save(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real_save(*a, **k)

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        train(mon, m, opt, 10, nan_at=(7,))
    train(mon, m, opt, 10, nan_at=(12,), start=10)  # the user goes on
    mon.close()
    assert logged(mon.run_dir) == list(range(20))
    kinds = [(e.step, e.kind) for e in mon.events if e.kind == "nonfinite_loss"]
    assert kinds == [(7, "nonfinite_loss"), (12, "nonfinite_loss")]
    assert all(e.dump and os.path.exists(e.dump) for e in mon.events)


def test_a_reopened_log_dir_gets_a_new_run_and_overwrites_nothing(tmp_path):
    """A Monitor that did not load a run's state starts a run of its own: numbered from 0
    again, its own files and dumps, the earlier runs' files left byte for byte."""
    m, opt = model_and_opt()
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=4) as mon:
        train(mon, m, opt, 10, nan_at=(5,))
    first = {p.relative_to(tmp_path): p.read_bytes() for p in mon.run_dir.rglob("*")
             if p.is_file()}
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=4) as mon2:
        train(mon2, m, opt, 6, nan_at=(2,))
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=4) as mon3:
        for t in (5, 6):  # the step numbers of the first run's dump
            x = torch.full((4, 8), NAN if t == 5 else 1.0)
            loss = m(x).sum()
            opt.zero_grad()
            loss.backward()
            mon3.step(loss, batch=(x,), step=t)
    assert [mon.run_id, mon2.run_id, mon3.run_id] == ["run-000", "run-001", "run-002"]
    assert (logged(mon.run_dir), logged(mon2.run_dir), logged(mon3.run_dir)) == (
        list(range(10)), list(range(6)), [5, 6])
    assert {e.step for e in mon2.events} == {2}
    for r in (mon, mon2, mon3):
        dumps = [p.name for p in (r.run_dir / "dumps").iterdir()]
        assert dumps == [f"step_{next(e.step for e in r.events):08d}.pt"], dumps
        meta = json.loads((r.run_dir / "meta.json").read_text())
        assert meta["run"] == r.run_id and "resumes" not in meta
    assert {p.relative_to(tmp_path): p.read_bytes() for p in mon.run_dir.rglob("*")
            if p.is_file()} == first
    assert sorted(os.listdir(tmp_path)) == ["run-000", "run-001", "run-002"]


CHILD = textwrap.dedent("""
    import signal, sys, time, torch, fasthealth as fh
    # Ctrl-C raises KeyboardInterrupt even when this test runs in the background, where a
    # shell starts its children with SIGINT ignored and Python then installs no handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_dir = sys.argv[1]
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=3, per_tensor_every=1)
    for t in range(100000):
        x = torch.randn(16, 64)
        if t % 7 == 3:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        mon.step(loss, batch=(x,))
        print(t, flush=True)
        time.sleep(0.002)
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_process_leaves_a_readable_log(tmp_path, sig):
    rnd = random.Random(int(sig))
    for trial in range(3):
        log_dir = tmp_path / f"run{trial}"
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(log_dir)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = child.stdout.readline()  # training has started
        assert first.strip() == "0", child.stderr.read()
        time.sleep(rnd.uniform(0.05, 0.6))
        child.send_signal(sig)
        out, err = child.communicate(timeout=60)
        done = [int(s) for s in (first + out).split()]
        run_dir = log_dir / "run-000"
        if not (run_dir / "steps.jsonl").exists() and sig != signal.SIGINT:
            # killed before the first flush (every 3 steps) wrote anything: nothing to read,
            # and nothing lost beyond the unflushed steps
            assert done[-1] < 3 + 1, (done[-1], err[-500:])
            continue
        raw = (run_dir / "steps.jsonl").read_bytes()
        lines = raw.split(b"\n")
        whole = [json.loads(s) for s in lines[:-1]]  # every line but the last is whole
        if lines[-1]:
            with pytest.raises(ValueError):
                json.loads(lines[-1])
        steps = [r["step"] for r in whole]
        assert steps == list(range(len(steps)))  # in order, none twice
        rows = report.read_log(run_dir).steps
        assert [r["step"] for r in rows] == steps
        if sig == signal.SIGINT:  # KeyboardInterrupt: the exit flush writes every step done
            assert steps[-1] >= done[-1], (steps[-1], done[-1], err[-500:])
        else:  # killed: at most the unflushed steps are missing
            assert steps[-1] >= done[-1] - 3 - 1


def test_a_flush_interrupted_while_it_copies_the_record_loses_no_step(tmp_path, monkeypatch):
    """Ctrl-C while a flush converts the record's rows (as the SIGINT test above once hit):
    the rows stay in the record, and the exit flush writes every step."""
    from fasthealth.monitor import record

    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=tmp_path, flush_every=1000)
    train(mon, m, opt, 7)
    real, calls = record.StepRecord, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(record, "StepRecord", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mon.flush()
    monkeypatch.setattr(record, "StepRecord", real)
    assert mon.record.fill == 7
    mon.close()
    steps = [json.loads(s)["step"] for s in (mon.run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(7))


def test_report_skips_a_partial_last_line_and_escapes_what_it_shows(tmp_path):
    m, opt = model_and_opt()
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
        train(mon, m, opt, 12, nan_at=(4,))
    with open(mon.run_dir / "steps.jsonl", "ab") as f:
        f.write(b'{"step": 12, "loss": 0.')  # what a kill mid-write leaves
    with open(mon.run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": "<script>alert(1)</script>", "kind": "<b>x</b>",
                            "message": "<img src=x onerror=alert(2)>", "dump": None}) + "\n")
    with pytest.warns(RuntimeWarning, match="skipped 1 unreadable line"):
        path, text = report.write(tmp_path)
    page = path.read_text()
    assert "<script>alert" not in page and "&lt;script&gt;" in page
    assert "<img src=x" not in page and "<b>x</b>" not in page
    assert "steps 0..11" in text


def test_duplicate_names_are_refused():
    a, b = torch.ones(3), torch.full((3,), NAN)
    with pytest.raises(ValueError, match="'w' is given to inputs 0 and 1"):
        fh.multi_tensor_stats([a, b], names=["w", "w"])
    pa, pb = torch.nn.Parameter(a), torch.nn.Parameter(b)
    pa.grad, pb.grad = a.clone(), b.clone()
    with pytest.raises(ValueError, match="names must be unique"):
        fh.check_grads([("w", pa), ("w", pb)])


def test_every_sink_gets_each_step_once_in_order_with_what_was_found(tmp_path):
    """The journal writes through the sink protocol (write, flush, close): a sink of one's own
    among the Monitor's gets every step once, in step order, with the filing whose events the
    JSONL sink wrote; a flush after each flush's steps; one close."""
    class Recording:
        def __init__(self):
            self.steps, self.found, self.flushes, self.closed = [], {}, 0, 0

        def write(self, s, filing):
            self.steps.append(s.step)
            if filing.found:
                self.found[s.step] = [e.kind for e in filing.found]

        def flush(self):
            self.flushes += 1

        def close(self):
            self.closed += 1

    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=tmp_path, flush_every=10)
    sink = Recording()
    mon.journal.sinks.append(sink)
    train(mon, m, opt, 35, nan_at=(12,))
    mon.close()
    assert sink.steps == list(range(35)) and (sink.flushes, sink.closed) == (4, 1)
    assert sink.found == {12: ["nonfinite_loss", "nonfinite_grad"]}
    lines = [json.loads(s) for s in (mon.run_dir / "steps.jsonl").read_text().splitlines()]
    assert {r["step"]: r["events"] for r in lines if "events" in r} == sink.found


def test_a_runs_log_is_judged_again_as_it_was_live(tmp_path):
    """``steps_from_log`` reads a run's steps.jsonl back as step records; an analyser made for
    the same model (``analyser_for``) finds from them the events the live Monitor found from
    the loss and the global norms (a gradient-norm spike, a NaN step), and with another
    threshold finds what that threshold finds."""
    from fasthealth.monitor import analyser_for, steps_from_log

    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=tmp_path, flush_every=25)
    g = torch.Generator().manual_seed(0)
    for t in range(300):
        x = torch.randn(32, 8, generator=g)
        if t == 220:
            x[0, 0] = NAN
        opt.zero_grad()
        loss = ((m(x) - x.sum(1, keepdim=True)) ** 2).mean() * (30.0 if t == 150 else 1.0)
        loss.backward()
        mon.step(loss)
    mon.close()
    live = [(e.step, e.kind) for e in mon.events]
    assert {(150, "grad_norm_spike"), (220, "nonfinite_loss")} <= set(live), live

    steps = steps_from_log(mon.run_dir)
    assert [s.step for s in steps] == list(range(300))
    assert steps[0].per_norm == [pytest.approx(v) for v in
                                 json.loads((mon.run_dir / "steps.jsonl").open().readline())[
                                     "per_tensor_norms"].values()]
    again = analyser_for(m, opt)
    for s in steps:
        again.analyse(s)
    kinds = {"loss_spike", "nonfinite_loss", "divergence", "grad_norm_spike"}
    assert [(e.step, e.kind) for e in again.events if e.kind in kinds] == [
        f for f in live if f[1] in kinds]
    loose = analyser_for(m, opt, spike_zscore=1000.0)
    assert not [s for s in steps for e in loose.analyse(s).found if e.kind == "grad_norm_spike"]
