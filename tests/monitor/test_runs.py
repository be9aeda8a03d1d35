"""Runs in a log directory (docs/spec.md section 11), with real processes: two live Monitors on
one log_dir, a rerun into it, a writer killed with SIGKILL in the middle of a write and its run
continued from an earlier step (nothing lost, the records after that step an abandoned branch
left out of the report), a second live writer of one run refused with the holder named,
``fasthealth report --run``, and one rank writing under a 2-rank gloo group."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fasthealth as fh
from fasthealth import report

NAN = float("nan")

# A training script: python SCRIPT LOG_DIR STEPS NAN_AT [WAIT_FILE]; with WAIT_FILE it waits
# for that file after its first flush (so that two copies are live together) and, when
# WAIT_FILE is "hold", it prints "holding" after its steps and waits for stdin to close.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import fasthealth as fh
    log_dir, steps, nan_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    wait = sys.argv[4] if len(sys.argv) > 4 else None
    torch.manual_seed(os.getpid())
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
    if os.environ.get("FH_KILL_IN_WRITE"):  # the process dies in the middle of a line's write
        kill_at, real_write = int(os.environ["FH_KILL_IN_WRITE"]), os.write
        def write(fd, data):
            if b'"step": %d,' % kill_at in data and b'"kind"' not in data:
                real_write(fd, data[: len(data) // 2])
                os.kill(os.getpid(), 9)
            return real_write(fd, data)
        os.write = write
    for t in range(steps):
        x = torch.randn(16, 8)
        if t == nan_at:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = ((m(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        mon.step(loss, batch=(x,))
        if t == int(os.environ.get("FH_SAVE_AT", -1)):  # a checkpoint of the Monitor's state
            torch.save(mon.state_dict(), os.environ["FH_STATE"])
        if wait and wait != "hold" and t == 4:
            print(mon.run_id, flush=True)
            while not os.path.exists(wait):
                time.sleep(0.01)
    mon.flush()
    print(mon.run_id, flush=True)
    if wait == "hold":
        print("holding", flush=True)
        sys.stdin.read()
    mon.close()
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def start(script, log_dir, steps, nan_at=-1, wait=None, env=None, **kw):
    args = [sys.executable, str(script), str(log_dir), str(steps), str(nan_at)]
    return subprocess.Popen(args + ([wait] if wait else []), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            **kw)


def records(path):
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} does not end in a whole line"
    return [json.loads(s) for s in data.splitlines()]


def model_and_opt(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


def train(mon, m, opt, steps, nan_at=(), start=0):
    for t in range(start, start + steps):
        x = torch.randn(16, 8)
        if t in nan_at:
            x[0, 0] = NAN
        opt.zero_grad()
        loss = ((m(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        mon.step(loss, batch=(x,))


@pytest.mark.slow  # processes of their own (torch's import each)
def test_two_live_monitors_on_one_log_dir_write_two_runs(tmp_path, script):
    log_dir, go = tmp_path / "logs", tmp_path / "go"
    procs = [start(script, log_dir, 20, nan_at=12 + i, wait=str(go)) for i in range(2)]
    ids = [p.stdout.readline().strip() for p in procs]  # both have flushed, both are live
    assert sorted(ids) == ["run-000", "run-001"]
    go.touch()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    for i, (p, run) in enumerate(zip(procs, ids)):
        d = log_dir / run
        steps = records(d / "steps.jsonl")
        assert [r["step"] for r in steps] == list(range(20))  # no other run's rows
        assert {r["run"] for r in steps} == {run}
        events = records(d / "events.jsonl")
        assert events and {r["run"] for r in events} == {run}
        assert {e["step"] for e in events if e["kind"] == "nonfinite_loss"} == {12 + i}
        assert {r["run"] for r in records(d / "incidents.jsonl")} == {run}
        meta = json.loads((d / "meta.json").read_text())
        assert (meta["run"], meta["pid"], meta["host"]) == (run, p.pid, socket.gethostname())
        assert all(Path(e["dump"]).parent == d / "dumps" for e in events if e["dump"])
    assert sorted(os.listdir(log_dir)) == ["run-000", "run-001"]  # nothing at the top


@pytest.mark.slow  # processes of their own (torch's import each)
def test_a_rerun_starts_a_new_run_and_the_report_shows_the_latest(tmp_path, script, capsys):
    log_dir = tmp_path / "logs"
    for nan_at in (7, 13):
        p = start(script, log_dir, 20, nan_at=nan_at)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    assert sorted(os.listdir(log_dir)) == ["run-000", "run-001"]
    assert [r["step"] for r in records(log_dir / "run-000" / "steps.jsonl")] == list(range(20))
    assert report.main([str(log_dir)]) == 0
    out = capsys.readouterr().out
    assert "run run-001" in out and "the latest of 2 runs" in out
    assert "first at step 13" in out and "first at step 7" not in out
    listed = [s for s in out.splitlines() if s.strip().startswith("run-000")]
    assert len(listed) == 1 and "steps 0..19 (20 logged)" in listed[0]
    assert "incidents 1" in listed[0]
    assert (log_dir / "run-001" / "report.html").exists()
    assert not (log_dir / "report.html").exists() and not (log_dir / "run-000" / "report.html"
                                                           ).exists()
    # --run picks the other one, by id or number; the report goes into its directory
    assert report.main([str(log_dir), "--run", "run-000"]) == 0
    out = capsys.readouterr().out
    assert "run run-000" in out and "first at step 7" in out and "first at step 13" not in out
    assert (log_dir / "run-000" / "report.html").exists()
    assert report.main([str(log_dir), "--run", "1"]) == 0
    assert "first at step 13" in capsys.readouterr().out
    assert report.main([str(log_dir), "--run", "run-009"]) == 2
    assert "no run 'run-009'" in capsys.readouterr().err
    # a run directory given itself, and the old layout (steps.jsonl in LOG_DIR), are one run
    assert report.main([str(log_dir / "run-000")]) == 0
    out = capsys.readouterr().out
    assert "first at step 7" in out and "other runs" not in out
    old = tmp_path / "old"
    old.mkdir()
    for name in ("steps.jsonl", "events.jsonl", "incidents.jsonl"):
        lines = (log_dir / "run-000" / name).read_text().splitlines()
        (old / name).write_text("".join(json.dumps({k: v for k, v in json.loads(s).items()
                                                    if k != "run"}) + "\n" for s in lines))
    assert report.main([str(old)]) == 0
    out = capsys.readouterr().out
    assert "steps 0..19 (20 logged)" in out and "first at step 7" in out
    assert "run " not in out.splitlines()[0]
    assert (old / "report.html").exists()


@pytest.mark.slow  # processes of their own (torch's import each)
def test_a_killed_writer_is_taken_over_and_its_branch_after_the_resume_abandoned(
        tmp_path, script, capsys):
    log_dir = tmp_path / "logs"
    state = tmp_path / "state.pt"
    p = start(script, log_dir, 100, nan_at=33, env={"FH_KILL_IN_WRITE": "42", "FH_SAVE_AT": "29",
                                                     "FH_STATE": str(state)})
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err
    d = log_dir / "run-000"
    before = {n: (d / n).read_bytes() for n in ("steps.jsonl", "events.jsonl",
                                                "incidents.jsonl")}
    assert not before["steps.jsonl"].endswith(b"\n")  # the kill cut a line in two
    whole = before["steps.jsonl"][: before["steps.jsonl"].rfind(b"\n") + 1]
    assert [json.loads(s)["step"] for s in whole.splitlines()] == list(range(42))

    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
    sd = torch.load(state, weights_only=True)
    assert sd["run"] == {"id": "run-000", "step": 29}
    mon.load_state_dict(sd)  # the run goes on in run-000, from step 30
    assert (mon.run_id, mon.run_dir) == ("run-000", d)
    train(mon, m, opt, 20, nan_at=(37,), start=30)
    mon.close()

    after = {n: (d / n).read_bytes() for n in before}
    assert after["steps.jsonl"].startswith(whole)  # every whole line kept, byte for byte
    for n in ("events.jsonl", "incidents.jsonl"):
        assert after[n].startswith(before[n])
    steps = records(d / "steps.jsonl")  # one JSON object a line again
    assert [r["step"] for r in steps] == list(range(42)) + list(range(30, 50))
    meta = json.loads((d / "meta.json").read_text())
    (resume,) = meta["resumes"]
    assert (resume["step"], resume["reached"], resume["abandons"]) == (29, 41, True)
    assert resume["offsets"]["steps.jsonl"] == len(whole)
    assert resume["pid"] == os.getpid()
    (cut,) = resume["cut"]
    assert cut["file"] == "steps.jsonl" and cut["offset"] == len(whole)
    assert cut["text"] == before["steps.jsonl"][len(whole):].decode()  # shown, in meta
    saved = (d / cut["saved"]).read_bytes()  # and kept whole beside the file
    assert saved == before["steps.jsonl"][len(whole):] and len(saved) == cut["bytes"]

    assert report.main([str(log_dir)]) == 0
    out = capsys.readouterr().out
    assert "steps 0..49 (50 logged)" in out  # the abandoned 30..41 left out
    # steps 30..41, the NaN at 33: its 2 events and its incident opened and closed
    assert "abandoned branch: 16 record(s) left out" in out
    assert "first at step 37" in out and "first at step 33" not in out
    assert "resumed from step 29" in out and "partial last line" in out
    page = (d / "report.html").read_text()
    assert "abandoned branch" in page
    log = report.read_run(log_dir)[1]
    assert [r["step"] for r in log.steps] == list(range(50))
    assert [e["step"] for e in log.events if e["kind"] == "nonfinite_loss"] == [37]


@pytest.mark.slow  # processes of their own (torch's import each)
def test_a_second_live_writer_of_a_run_is_refused_naming_the_holder(tmp_path, script):
    log_dir, state = tmp_path / "logs", tmp_path / "state.pt"
    p = start(script, log_dir, 10, wait="hold", stdin=subprocess.PIPE,
              env={"FH_SAVE_AT": "9", "FH_STATE": str(state)})
    try:
        assert p.stdout.readline().strip() == "run-000"
        assert p.stdout.readline().strip() == "holding"
        sd = torch.load(state, weights_only=True)  # the live writer's own checkpoint
        m, opt = model_and_opt()
        mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
        with pytest.raises(RuntimeError) as exc:
            mon.load_state_dict(sd)
        msg = str(exc.value)
        assert f"pid {p.pid}" in msg and socket.gethostname() in msg and str(script) in msg
        assert mon.run_id is None
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert p.returncode == 0, p.stderr.read()
    assert [r["step"] for r in records(log_dir / "run-000" / "steps.jsonl")] == list(range(10))
    assert "resumes" not in json.loads((log_dir / "run-000" / "meta.json").read_text())
    # the holder gone, the run is taken over; two Monitors of one process resuming the same
    # state: the second is refused until the first is closed
    m, opt = model_and_opt()
    first = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
    first.load_state_dict(sd)
    second = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5)
    with pytest.raises(RuntimeError, match=f"pid {os.getpid()}"):
        second._continue_run("run-000", 9)
    train(first, m, opt, 3, start=10)
    first.close()
    second._continue_run("run-000", 12)  # released at close()
    second._next_step = 13
    train(second, m, opt, 2, start=13)
    second.close()
    steps = records(log_dir / "run-000" / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(15))
    meta = json.loads((log_dir / "run-000" / "meta.json").read_text())
    assert [(r["step"], r["abandons"]) for r in meta["resumes"]] == [(9, False), (12, False)]
    with pytest.raises(ValueError, match="not a run's name"):
        fh.Monitor(m, opt, log_dir=log_dir)._continue_run("../elsewhere", 3)


def test_the_latest_run_is_the_one_resumed_last(tmp_path, capsys):
    """run-000 resumed after run-001 started: the report shows run-000 and lists run-001."""
    m, opt = model_and_opt()
    states = []
    for nan_at in (3, 6):
        with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
            train(mon, m, opt, 10, nan_at=(nan_at,))
            states.append(mon.state_dict())
    sd = states[0]  # run-000's, at its step 9
    time.sleep(0.01)
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
        mon.load_state_dict(sd)
        train(mon, m, opt, 4, start=10)
    assert mon.run_id == "run-000"
    chosen, log = report.read_run(tmp_path)
    assert chosen.id == "run-000" and [r["step"] for r in log.steps] == list(range(14))
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run run-000" in out and "first at step 3" in out and "abandoned" not in out
    (listed,) = [s for s in out.splitlines() if s.strip().startswith("run-001")]
    assert "steps 0..9 (10 logged)" in listed and "incidents 1" in listed


def test_the_list_of_other_runs_leaves_out_their_abandoned_branches(tmp_path, capsys):
    """run-000 resumed from step 9 after it had reached 19 (a NaN at 15 on the abandoned
    branch), then run-001 started: run-000's line in the list agrees with its own report."""
    m, opt = model_and_opt()
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
        train(mon, m, opt, 10)
        sd = mon.state_dict()  # at step 9
        train(mon, m, opt, 10, nan_at=(15,), start=10)
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
        mon.load_state_dict(sd)
        train(mon, m, opt, 4, start=10)
    time.sleep(0.01)
    with fh.Monitor(m, opt, log_dir=tmp_path, flush_every=5) as mon:
        train(mon, m, opt, 6)
    assert mon.run_id == "run-001"
    own = report.read_run(tmp_path, "run-000")[1]
    assert [r["step"] for r in own.steps] == list(range(14)) and own.incidents == []
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run run-001" in out
    (listed,) = [s for s in out.splitlines() if s.strip().startswith("run-000")]
    assert "steps 0..13 (14 logged)" in listed and "incidents 0" in listed, listed
    assert "resumed 1x" in listed


def test_continue_run_makes_a_missing_run(tmp_path):
    """A checkpoint moved to a new log_dir: its run is made there."""
    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=tmp_path / "new", flush_every=5)
    mon._continue_run("run-004", 99)
    mon._next_step = 100
    train(mon, m, opt, 5, start=100)
    mon.close()
    d = tmp_path / "new" / "run-004"
    assert [(r["step"], r["run"]) for r in records(d / "steps.jsonl")] == [
        (s, "run-004") for s in range(100, 105)]
    meta = json.loads((d / "meta.json").read_text())
    assert meta["run"] == "run-004" and meta["resumes"][0]["step"] == 99


def test_no_run_is_opened_before_the_first_step(tmp_path):
    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=tmp_path / "logs")
    assert mon.run_id is None and mon.run_dir is None
    mon.close()
    assert not (tmp_path / "logs").exists() or not os.listdir(tmp_path / "logs")
    with pytest.raises(TypeError, match="all_ranks"):
        fh.Monitor(m, opt, log_dir=tmp_path, all_ranks="yes")


def _ranks(rank, world, log_dir, all_ranks):
    m, opt = model_and_opt()
    mon = fh.Monitor(m, opt, log_dir=log_dir, flush_every=5, all_ranks=all_ranks,
                     process_group=dist.group.WORLD)
    train(mon, m, opt, 12, nan_at=(7,) if rank == 1 else ())
    mon.close()
    kinds = sorted({(e.step, e.kind) for e in mon.events})
    assert (7, "nonfinite_grad") in kinds, kinds  # every rank has its events
    assert mon.run_dir is None if rank and not all_ranks else mon.run_id == "run-000"


@pytest.mark.slow  # two gloo ranks
@pytest.mark.parametrize("all_ranks", [False, True])
def test_one_rank_writes_under_a_process_group(tmp_path, all_ranks):
    import ranks

    log_dir = tmp_path / "logs"
    t0 = time.time()
    ranks.spawn(_ranks, 2, str(log_dir), all_ranks)
    assert time.time() - t0 < 60
    want = ["rank-1", "run-000"] if all_ranks else ["run-000"]
    assert sorted(os.listdir(log_dir)) == want
    steps = records(log_dir / "run-000" / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(12))
    events = records(log_dir / "run-000" / "events.jsonl")
    assert (7, "nonfinite_grad") in {(e["step"], e["kind"]) for e in events}
    assert os.listdir(log_dir / "run-000" / "dumps")  # rank 0's dump of the NaN step
    if all_ranks:
        other = log_dir / "rank-1" / "run-000"
        assert [r["step"] for r in records(other / "steps.jsonl")] == list(range(12))
