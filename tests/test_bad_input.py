"""Bad input at the front door (docs/spec.md, sections 6 and 9): every loss shape and type
``mon.step`` may be given, every Monitor argument checked before anything is written, and
``fasthealth report`` / ``--version`` / ``bench`` on whatever they meet. Each test asserts the
message a user sees."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fasthealth as fh
from fasthealth import cli, report

NAN, INF = float("nan"), float("inf")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def per_sample_loss(model, n=8):
    """A loss with reduction='none' (one element a sample), its mean backpropagated."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    per = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True),
                                       reduction="none").squeeze(1)
    model.zero_grad()
    per.mean().backward()
    return per


# ---- the loss ------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_scalar_loss_every_element_is_checked(fused, bad):
    """A NaN (or Inf) in element 3 of 8 makes the step non-finite: it is skipped, parameters and
    optimizer state unchanged (the gradients are finite: only the loss check can catch it)."""
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
    mon = fh.Monitor(m, opt, on_nonfinite="skip", flush_every=4)
    per = per_sample_loss(m)
    mon.step(per)  # a healthy step first: the optimizer has state to keep
    state = {k: v.clone() for k, v in opt.state[next(m.parameters())].items()}
    before = [p.detach().clone() for p in m.parameters()]
    loss = per_sample_loss(m).detach().clone()
    loss[3] = bad
    obs = mon.step(loss)
    assert bool(obs.skip)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    after = opt.state[next(m.parameters())]
    assert all(torch.equal(v, after[k]) for k, v in state.items())
    mon.close()
    assert [(e.step, e.kind) for e in mon.events] == [(1, "nonfinite_loss")]
    assert obs.loss.dtype == torch.float64 and not math.isfinite(obs.loss.item())


def test_non_scalar_loss_records_the_float64_mean():
    m = make_model()
    mon = fh.Monitor(m, None)  # measures only: check, not step (nothing to step)
    per = per_sample_loss(m)
    obs = mon.check(per)
    assert obs.loss.dtype == torch.float64 and obs.loss.shape == ()
    assert obs.loss.item() == pytest.approx(per.detach().double().mean().item(), rel=1e-12)
    assert not bool(obs.skip)
    obs = mon.check(per.detach().reshape(2, 4))  # any shape
    assert obs.loss.item() == pytest.approx(per.detach().double().mean().item(), rel=1e-12)


def test_python_number_loss_is_taken_as_it_is():
    """A Python float (already on the host: the caller synced to get it) is checked and recorded
    in float64, not rounded to float32."""
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = fh.Monitor(m, opt, flush_every=2)
    per_sample_loss(m)
    obs = mon.step(0.1)
    assert obs.loss.dtype == torch.float64 and obs.loss.item() == 0.1 and not bool(obs.skip)
    per_sample_loss(m)
    before = [p.detach().clone() for p in m.parameters()]
    assert bool(mon.step(NAN).skip)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    mon.close()
    assert [(e.step, e.kind) for e in mon.events] == [(1, "nonfinite_loss")]


@pytest.mark.parametrize("loss, exc, message", [
    ("0.5", TypeError, "fasthealth: loss must be a floating-point tensor, a Python number or "
                       "None, got '0.5'"),
    (True, TypeError, "fasthealth: loss must be a floating-point tensor, a Python number or "
                      "None, got True"),
    ([0.1, 0.2], TypeError, "fasthealth: loss must be a floating-point tensor, a Python number "
                            "or None, got [0.1, 0.2] (a list)"),
    (torch.tensor(3), TypeError, "fasthealth: loss must be a dense floating-point tensor, got "
                                 "a torch.int64 tensor of shape []"),
    (torch.ones(2, dtype=torch.complex64), TypeError,
     "fasthealth: loss must be a dense floating-point tensor, got a torch.complex64 tensor of "
     "shape [2]"),
    (torch.tensor([True, False]), TypeError,
     "fasthealth: loss must be a dense floating-point tensor, got a torch.bool tensor"),
    (torch.zeros(0, 3), ValueError, "fasthealth: loss is empty (shape [0, 3]): nothing to check"),
])
def test_a_bad_loss_raises_naming_it_and_changes_nothing(loss, exc, message):
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = fh.Monitor(m, opt)
    per_sample_loss(m)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(exc) as info:
        mon.step(loss)
    assert str(info.value).startswith(message), str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert mon.step(torch.tensor(0.5)).step == 0  # the bad call counted no step


# ---- the Monitor's arguments ---------------------------------------------------------------

def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


BAD_ARGUMENTS = [
    # (arguments after the model, exception, message)
    (dict(optimizer="model"), TypeError,
     "fasthealth: optimizer must be a torch.optim.Optimizer or None, got a Sequential "
     "(Monitor(model, optimizer): the second argument is the optimizer, or None)"),
    (dict(optimizer="adam"), TypeError,
     "fasthealth: optimizer must be a torch.optim.Optimizer or None, got 'adam'"),
    (dict(optimizer="other"), ValueError,
     "fasthealth: optimizer (SGD) updates none of model's parameters: was it made for another "
     "model?"),
    (dict(spike_zscore=-3), ValueError,
     "fasthealth: spike_zscore must be a finite number > 0, got -3"),
    (dict(spike_zscore=0), ValueError, "fasthealth: spike_zscore must be a finite number > 0, "
                                       "got 0"),
    (dict(spike_zscore=NAN), ValueError, "fasthealth: spike_zscore must be a finite number > 0, "
                                         "got nan"),
    (dict(spike_zscore="6"), TypeError, "fasthealth: spike_zscore must be a finite number > 0, "
                                        "got '6'"),
    (dict(spike_window=2), ValueError, "fasthealth: spike_window must be >= 3, got 2"),
    (dict(spike_window=64.0), TypeError,
     "fasthealth: spike_window must be an integer >= 3, got 64.0"),
    (dict(warmup_steps=0), ValueError, "fasthealth: warmup_steps must be >= 1, got 0"),
    (dict(warmup_steps=200), ValueError,
     "fasthealth: warmup_steps=200 is more than spike_window=128: the window would never hold "
     "warmup_steps values, so no spike would ever be scored"),
    (dict(flush_every=0), ValueError, "fasthealth: flush_every must be >= 1, got 0"),
    (dict(flush_every=True), TypeError, "fasthealth: flush_every must be an integer >= 1, got "
                                        "True"),
    (dict(max_grad_norm=0), ValueError,
     "fasthealth: max_grad_norm must be a number > 0 or None, got 0"),
    (dict(max_grad_norm="1.0"), TypeError,
     "fasthealth: max_grad_norm must be a number > 0 or None, got '1.0'"),
    (dict(on_nonfinite="ignore"), ValueError,
     "fasthealth: on_nonfinite must be one of 'skip', 'raise', 'warn', got 'ignore'"),
    (dict(on_spike="explode"), ValueError,
     "fasthealth: on_spike must be one of 'warn'"),
    (dict(log_dir=3), TypeError,
     "fasthealth: log_dir must be a path (str or os.PathLike) or None, got 3"),
    (dict(log_dir=""), ValueError, "fasthealth: log_dir is an empty path"),
    (dict(tensorboard=True), ValueError,
     "fasthealth: tensorboard=True needs log_dir= (TensorBoard's files go to "
     "the run's tensorboard/), got log_dir=None"),
    (dict(tensorboard="yes"), TypeError,
     "fasthealth: tensorboard must be True or False, got 'yes'"),
    (dict(min_loss_scale=-1), ValueError,
     "fasthealth: min_loss_scale must be a finite number >= 0, got -1"),
    (dict(per_tensor_every=0), ValueError, "fasthealth: per_tensor_every must be >= 1, got 0"),
    (dict(optimizer_check_every=-1), ValueError,
     "fasthealth: optimizer_check_every must be >= 0, got -1"),
    (dict(snapshot_max_bytes=-1), ValueError,
     "fasthealth: snapshot_max_bytes must be >= 0, got -1"),
    (dict(vanishing_threshold=-1e-8), ValueError,
     "fasthealth: vanishing_threshold must be a finite number >= 0, got -1e-08"),
    (dict(activations=3), TypeError,
     "fasthealth: activations must be None, True (every leaf module), a regex over module "
     "names or a list of module names, got 3"),
    (dict(activations="(["), ValueError,
     "fasthealth: activations='([' is not a valid regular expression"),
    (dict(activations="nomatch"), ValueError, "fasthealth: no module matches 'nomatch'"),
    (dict(process_group="world"), TypeError,
     "fasthealth: process_group must be a torch.distributed ProcessGroup (e.g. "
     "dist.group.WORLD) or None, got 'world'"),
    (dict(replica_group="dp"), ValueError,
     "fasthealth: replica_group= needs process_group= (it says which of its ranks hold copies), "
     "got replica_group='dp' and process_group=None"),
    (dict(scaler="amp"), TypeError,
     "fasthealth: scaler must be a torch.amp.GradScaler or None, got 'amp'"),
    (dict(backend="gpu"), ValueError,
     "fasthealth: backend must be one of torch, cpu, cuda, triton, 'auto' or None, got 'gpu'"),
    (dict(backend="cuda"), ValueError,
     "fasthealth: backend='cuda' cannot run on model's device (cpu): the 'cuda' backend runs on "
     "CUDA tensors only"),
    (dict(detectors="all"), TypeError,
     "fasthealth: detectors must be a list of Rule (see fasthealth.monitor.rules) or "
     "None, got 'all'"),
    (dict(detectors=[print]), TypeError,
     "fasthealth: detectors[0] must be a Rule (an object with observe(step)), got"),
]


@pytest.mark.parametrize("kwargs, exc, message", BAD_ARGUMENTS,
                         ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))[:20]
                              for k, _, _ in BAD_ARGUMENTS])
def test_a_bad_argument_raises_before_anything_is_written(tmp_path, kwargs, exc, message):
    m = make_model()
    kwargs = dict(kwargs)
    opt = kwargs.pop("optimizer", None)
    opt = {"model": m, "other": _sgd(make_model(1))}.get(opt, opt)
    if "log_dir" not in kwargs and "tensorboard" not in kwargs:
        kwargs["log_dir"] = tmp_path / "run"
    with pytest.raises(exc) as info:
        fh.Monitor(m, opt, **kwargs)
    assert str(info.value).startswith(message), str(info.value)
    assert not (tmp_path / "run").exists()
    assert not any(h for mod in m.modules() for h in mod._forward_hooks.values())


def test_the_model_must_be_a_module():
    with pytest.raises(TypeError, match=r"^fasthealth: model must be a torch.nn.Module, got "
                                        r"\[1, 2\] \(a list\)$"):
        fh.Monitor([1, 2])
    frozen = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="^fasthealth: model has no trainable parameters"):
        fh.Monitor(frozen)


def test_edge_values_that_are_fine_are_accepted(tmp_path):
    m = make_model()
    mon = fh.Monitor(m, _sgd(m), spike_window=3, warmup_steps=1, flush_every=1,
                     max_grad_norm=INF, optimizer_check_every=0, snapshot_max_bytes=0,
                     min_loss_scale=0, vanishing_threshold=0, activations=False,
                     replica_group=False, backend="auto", log_dir=str(tmp_path / "a"))
    per_sample_loss(m)
    mon.step(per_sample_loss(m))
    mon.close()
    assert (mon.run_dir / "steps.jsonl").exists()


def test_tensorboard_missing_is_said_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import fails
    m = make_model()
    with pytest.raises(ImportError) as info:
        fh.Monitor(m, _sgd(m), log_dir=tmp_path / "run", tensorboard=True)
    msg = str(info.value)
    assert msg.startswith("fasthealth: tensorboard=True needs the tensorboard package"), msg
    assert "pip install tensorboard" in msg
    assert not (tmp_path / "run").exists()


def test_log_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "run"
    f.write_text("notes")
    m = make_model()
    with pytest.raises(ValueError, match=r"^fasthealth: log_dir '.*run' exists and is not a "
                                         r"directory$"):
        fh.Monitor(m, log_dir=f)
    assert f.read_text() == "notes"


def test_unreadable_meta_json_of_a_continued_run_is_moved_aside(tmp_path):
    run = tmp_path / "run-000"
    run.mkdir()
    (run / "meta.json").write_bytes(b"\x00\xff not json")
    m = make_model()
    mon = fh.Monitor(m, _sgd(m), log_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=r"meta.json could not be read \(not JSON.*moved to "
                                            r"meta.json.unreadable"):
        mon._continue_run("run-000", 4)  # as load_state_dict does
    assert (run / "meta.json.unreadable").read_bytes() == b"\x00\xff not json"
    meta = json.loads((run / "meta.json").read_text())
    assert meta["names"] and meta["resumes"][0]["step"] == 4
    mon.close()


# ---- misuse of the Monitor -----------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda m: fh.Monitor(m), lambda m: fh.Monitor(m, None)],
                         ids=["Monitor(model)", "Monitor(model, None)"])
def test_step_without_an_optimizer_is_refused_and_names_the_way_out(make):
    """No optimizer: nothing to step, the model would silently never train. mon.step raises
    before it records anything; mon.check (the trainer steps) measures as before."""
    m = make_model()
    mon = make(m)
    per_sample_loss(m)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError) as info:
        mon.step(torch.tensor(1.0))
    msg = str(info.value)
    assert msg.startswith("fasthealth: mon.step() on a Monitor made without an optimizer: "
                          "there is nothing to step"), msg
    assert "Pass the optimizer (fh.Monitor(model, optimizer))" in msg
    assert "call mon.check(loss) where the trainer steps the optimizer itself" in msg
    assert mon.steps_seen == 0 and all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    obs = mon.check(per_sample_loss(m) * NAN)
    assert obs.step == 0 and bool(obs.skip)
    mon.close()
    assert [(e.step, e.kind) for e in mon.events][:1] == [(0, "nonfinite_loss")]


@pytest.mark.parametrize("call", ["step", "check", "flush"])
def test_a_closed_monitor_refuses_step_check_and_flush(call, tmp_path):
    m = make_model()
    mon = fh.Monitor(m, _sgd(m), log_dir=tmp_path, flush_every=4)
    per_sample_loss(m)
    mon.step(per_sample_loss(m))
    mon.close()
    rd = getattr(mon, "run_dir", None) or tmp_path
    logged = (rd / "steps.jsonl").read_bytes()
    args = () if call == "flush" else (per_sample_loss(m),)
    with pytest.raises(RuntimeError, match=rf"^fasthealth: mon.{call}\(\) after mon.close\(\): "
                                           "this Monitor is closed"):
        getattr(mon, call)(*args)
    mon.close()  # twice: harmless, as is the exit of a with block after an explicit close
    with mon:
        pass
    if hasattr(mon, "state_dict"):  # the last state and verdict stay readable after close
        assert mon.state_dict()["run"]["step"] == 0
        assert mon.safe_to_save()
    assert (rd / "steps.jsonl").read_bytes() == logged and mon.steps_seen == 1


def test_a_forgotten_backward_under_a_grad_scaler_is_no_grad_not_a_crash():
    """No gradient at all under a GradScaler: scaler.step would raise ("No inf checks were
    recorded"); mon.step steps nothing, keeps the scale, and the no_grad alarm comes."""
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    mon = fh.Monitor(m, opt, scaler=scaler, flush_every=5, warmup_steps=2)
    x = torch.randn(8, 4)
    for t in range(12):
        opt.zero_grad(set_to_none=True)
        loss = m(x).pow(2).mean()
        if t not in (5, 6):  # backward forgotten twice
            scaler.scale(loss).backward()
        before = [p.detach().clone() for p in m.parameters()]
        mon.step(loss)
        if t in (5, 6):
            assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
            assert scaler.get_scale() == 2.0**10
    mon.close()
    assert [(e.step, e.kind) for e in mon.events] == [(6, "no_grad")]
    assert not any(p.isnan().any() for p in m.parameters())


# ---- fasthealth report ---------------------------------------------------------------------

def run_cli(*args):
    out = subprocess.run([sys.executable, "-m", "fasthealth", *map(str, args)],
                         capture_output=True, text=True, timeout=300)
    assert "Traceback" not in out.stderr, out.stderr
    return out


@pytest.fixture
def log(tmp_path):
    """A real Monitor log of 12 steps (a NaN at step 4)."""
    d = tmp_path / "run"
    m = make_model()
    opt = _sgd(m)
    with fh.Monitor(m, opt, log_dir=d, flush_every=5, per_tensor_every=3) as mon:
        for t in range(12):
            per = per_sample_loss(m)
            mon.step(per.mean() * (NAN if t == 4 else 1.0))
    return mon.run_dir


def _edit_lines(path, edits):
    lines = path.read_text().splitlines()
    for i, text in edits.items():
        lines[i - 1] = text
    path.write_text("\n".join(lines) + "\n")


def test_report_marks_values_of_the_wrong_kind_with_their_line(log):
    steps = log / "steps.jsonl"
    rec = json.loads(steps.read_text().splitlines()[2])
    _edit_lines(steps, {
        3: json.dumps({**rec, "loss": "abc"}),
        6: json.dumps({**rec, "step": 5, "loss": None, "grad_norm": [1, 2]}),
        7: json.dumps({**rec, "step": 6, "skipped": "no", "per_tensor_norms": "big"}),
        8: json.dumps({**rec, "step": "seven"}),
    })
    with open(log / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": None, "kind": 5, "message": ["x"], "dump": 1}) + "\n")
    out = run_cli("report", log)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert "fasthealth report: skipped 1 unreadable line(s) in" in err
    assert "steps.jsonl line 8: 'step' is \"seven\", not a step number" in err
    assert "fasthealth report: 8 value(s) in" in err
    assert "steps.jsonl line 3: 'loss' is \"abc\", not a number: shown as missing" in err
    assert "steps.jsonl line 6: 'grad_norm' is [1, 2], not a number: shown as missing" in err
    assert "steps.jsonl line 7: 'skipped' is \"no\", not true or false: shown as missing" in err
    assert ("steps.jsonl line 7: 'per_tensor_norms' is \"big\", not an object of numbers: shown "
            "as missing") in err
    assert "events.jsonl line 2: the event's 'step' is null, not a step number: listed, not " \
           "plotted" in err
    assert "events.jsonl line 2: the event's 'kind' is 5, not a string" in err
    assert "events.jsonl line 2: the event's 'message' is [\"x\"], not a string" in err
    assert "events.jsonl line 2: the event's 'dump' is 1, not a path: shown as missing" in err
    assert "line 5:" not in err  # a null loss is what a Monitor writes for an unknown loss
    assert "steps 0..11 (11 logged)" in out.stdout and "wrote" in out.stdout
    assert (log / "report.html").exists()


def test_report_names_a_bad_line_mid_file_and_a_partial_last_line(log):
    steps = log / "steps.jsonl"
    _edit_lines(steps, {4: '{"step": 3, "loss": 0.5, "grad_norm"', 9: "\x00\x01garbage"})
    with open(steps, "ab") as f:
        f.write(b'{"step": 12, "loss": 0.')  # what a process killed mid-write leaves
    out = run_cli("report", log)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert "fasthealth report: skipped 3 unreadable line(s) in" in err
    assert "steps.jsonl line 4: not JSON (Expecting ':' delimiter, column 37)" in err
    assert "steps.jsonl line 9: not UTF-8 text (binary data?)" in err
    assert ("steps.jsonl line 13: a partial last line, as a process killed mid-write leaves: "
            "not JSON (Expecting ',' delimiter, column 23)") in err
    assert err.count("partial") == 1  # only the last line is called partial
    assert "steps 0..11 (10 logged)" in out.stdout


@pytest.mark.parametrize("content, message", [
    (b"", "is empty: no step was logged"),
    (b"\n\n  \n", "is empty: no step was logged"),
    (random.Random(0).randbytes(4000), "no line of"),
    (b'[1, 2]\n"text"\n{"loss": 1.0}\n', "no line of"),
])
def test_report_with_nothing_readable_says_why_and_exits_2(tmp_path, content, message):
    (tmp_path / "steps.jsonl").write_bytes(content)
    out = run_cli("report", tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    first = out.stderr.splitlines()[0]
    assert first.startswith("fasthealth report: ") and message in first, out.stderr
    assert "no report written" in out.stdout
    assert not (tmp_path / "report.html").exists()
    if content[:1] == b"[":
        assert "steps.jsonl line 1: an array in JSON, not a record (a JSON object)" in out.stderr
        assert "steps.jsonl line 3: a record with no 'step'" in out.stderr
    elif content and content.strip():
        assert "steps.jsonl line 1: not " in out.stderr  # binary: not UTF-8, or not JSON


@pytest.mark.slow
def test_report_on_missing_and_wrong_directories(tmp_path):
    out = run_cli("report", tmp_path / "nope")
    assert out.returncode == 2
    assert out.stderr.strip() == f"fasthealth report: {tmp_path / 'nope'} not found (no such " \
                                 "directory)"
    out = run_cli("report", tmp_path)  # a directory with no logs
    assert out.returncode == 2
    assert out.stderr.startswith(f"fasthealth report: no run with a steps.jsonl in {tmp_path}: "
                                 f"is {tmp_path} a Monitor's log_dir?")
    f = tmp_path / "file.txt"
    f.write_text("x")
    out = run_cli("report", f)
    assert out.returncode == 2
    assert out.stderr.startswith(f"fasthealth report: {f} is not a directory")


def test_report_with_binary_events_and_meta_still_reports_the_steps(log):
    (log / "events.jsonl").write_bytes(random.Random(1).randbytes(3000))
    (log / "meta.json").write_text('{"names": 5, "per_tensor_every": -1, "max_grad_norm": "x"}')
    out = run_cli("report", log)
    assert out.returncode == 0, out.stderr
    assert "events.jsonl line 1: not" in out.stderr
    assert "meta.json: 'names' is 5: ignored" in out.stderr
    assert "meta.json: 'per_tensor_every' is -1: ignored" in out.stderr
    assert "steps 0..11 (12 logged)" in out.stdout


def test_report_survives_random_values_in_every_field(log):
    """Every field of every record replaced, at random, by a JSON value of another kind: the
    report reads, summarizes and draws without raising."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rnd = random.Random(2)
    junk = [None, "abc", [], [1, 2], {}, {"a": 1}, True, -1, 0, 1e308, -1e308, 10**400, 2**70,
            "NaN", 1.5, -0.0]
    base = [json.loads(s) for s in (log / "steps.jsonl").read_text().splitlines()]
    events = (log / "events.jsonl").read_text().splitlines()
    for _ in range(int(os.environ.get("FUZZ_TRIALS", 6))):
        rows = []
        for r in base:
            r = dict(r)
            for k in list(r):
                if rnd.random() < 0.3:
                    r[k] = rnd.choice(junk)
            if isinstance(r.get("per_tensor_norms"), dict):
                r["per_tensor_norms"] = {k: rnd.choice(junk) for k in r["per_tensor_norms"]}
            rows.append(json.dumps(r))
        (log / "steps.jsonl").write_text("\n".join(rows) + "\n")
        ev = [dict(json.loads(e), **{rnd.choice(["step", "kind", "message", "dump"]):
                                     rnd.choice(junk)}) for e in events]
        for e in ev:  # a field left out altogether, not only of the wrong kind
            if rnd.random() < 0.3:
                del e[rnd.choice(["step", "kind", "message", "dump", "severity", "incident"])]
        (log / "events.jsonl").write_text("\n".join(json.dumps(e) for e in ev) + "\n")
        try:
            got = report.read_log(log)
        except report.LogError as exc:  # no step number survived: said, not raised raw
            assert "no line of" in str(exc)
            continue
        report.summary(got.meta, got.steps, got.events, got.incidents, log)
        fig = report.figure(got.meta, got.steps, got.events, got.incidents)
        fig.canvas.draw()
        plt.close(fig)


# ---- fasthealth --version, --help, bench ---------------------------------------------------

def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout == f"fasthealth {fh.__version__}\n"
    script = Path(sys.executable).parent / "fasthealth"
    if script.exists():  # the console script of the installed package
        out = subprocess.run([str(script), "--version"], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout == f"fasthealth {fh.__version__}\n"


def test_help_lists_every_command():
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("bench", "demo", "report", "selftest", "--version"):
        assert cmd in out.stdout, out.stdout


def test_bench_without_a_source_checkout_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "bench_harness", lambda: tmp_path / "bench" / "harness.py")
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fasthealth bench: needs a source checkout of fasthealth"), err
    assert "Clone the repository, then run `make bench` in it." in err


def test_bench_runs_the_checkouts_harness(tmp_path, monkeypatch):
    harness = tmp_path / "bench" / "harness.py"
    harness.parent.mkdir()
    harness.write_text("import dataclasses, json, sys\n"
                       "@dataclasses.dataclass\nclass Row:\n    x: int = 0\n"
                       "def main(argv):\n"
                       f"    open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(argv))\n"
                       "    return 3\n")
    monkeypatch.setattr(cli, "bench_harness", lambda: harness)
    assert cli.main(["bench", "--quick", "--rounds", "1"]) == 3
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--quick", "--rounds", "1"]


def test_bench_finds_the_harness_beside_the_package():
    root = Path(fh.__file__).resolve().parents[1]
    assert cli.bench_harness() == root / "bench" / "harness.py"
    if (root / "bench" / "harness.py").exists():  # a source checkout: --help is the harness's
        out = run_cli("bench", "--help")
        assert out.returncode == 0 and "usage: fasthealth bench" in out.stdout
    assert os.path.basename(cli.bench_harness()) == "harness.py"
