"""The trainer evaluation of evaluation/trainers/ (evaluation/eval_trainers.py) checked at
--quick size: its scoring, and one healthy and one faulted run of one Hugging Face Trainer
family and one Lightning family, trained for real with HealthCallback() at its defaults.

What is checked is the harness, not the monitor's verdicts (other work changes those): that a
planted fault goes in at the step it declares, that ``caught`` / ``delay`` / the incident
count / ``right_cause`` / the null-loss count follow from what the monitor returned and what
steps.jsonl holds, and that the log comparison tells identical logs from different ones.
The runs are marked ``corpus`` (``make test-eval`` runs them, ``make test`` and
``make test-fast`` not).
"""

from types import SimpleNamespace

import eval_trainers  # evaluation/, put on the path by conftest.py
import pytest
import torch
from trainers import corpus, faults, figure, runner

HF_FAMILY = "hf_gpt2_chars_adamw_linear"
PL_FAMILY = "pl_wine_adagrad_multistep_accum2"  # accumulation: micro-batches != steps
STEPS = 60


def _event(step, kind, incident, severity="alarm"):
    return SimpleNamespace(step=step, kind=kind, incident=incident, severity=severity)


def _incident(id, start, end, kinds, cause, severity="alarm"):
    return SimpleNamespace(id=id, start=start, end=end, kinds=kinds, cause=cause,
                           severity=severity)


# ---- the scoring (no training) --------------------------------------------------------------

def test_score_reads_catch_delay_incidents_and_cause():
    mon = SimpleNamespace(
        events=[_event(10, "loss_spike", 0), _event(30, "grad_norm_spike", 1, "notice"),
                _event(36, "lr_jump", 1), _event(40, "divergence", 1)],
        incidents=[_incident(0, 10, 12, ["loss_spike"], "batch"),
                   _incident(1, 36, 50, ["lr_jump", "divergence"], "learning_rate")])
    rows = [{"step": i, "loss": 1.0, "loss_finite": True} for i in range(60)]
    rows[3]["loss"] = None  # the callback had no loss
    rows[40].update(loss=None, loss_finite=False)  # a NaN loss, written null too
    s = runner.score(mon, rows, "lr_x20", 36, 60)
    assert s["caught"] and s["delay"] == 0 and s["caught_by"] == "lr_jump"
    assert s["alarm_incidents"] == 2 and s["n_alarms"] == 3 and len(s["notices"]) == 1
    assert s["cause"] == "learning_rate" and s["right_cause"]
    assert s["null_loss_steps"] == 1 and s["nonfinite_loss_steps"] == 1
    s = runner.score(mon, rows, "bit_flip", 36, 60)  # the right time, the wrong cause
    assert s["caught"] and not s["right_cause"] and s["expected_cause"] == "weights"
    s = runner.score(mon, rows, "loss_x100", 20, 60)  # delay 1: 36 is too late
    assert not s["caught"] and s["delay"] is None and not s["right_cause"]
    # a cause that is a kind's name (the code before Incident.cause held causes) is wrong
    mon.incidents[1].cause = "lr_jump"
    assert not runner.score(mon, rows, "lr_x20", 36, 60)["right_cause"]
    healthy = runner.score(mon, rows, None, -1, 60)
    assert healthy["n_alarms"] == 3 and "caught" not in healthy


def test_harm_compares_a_fault_with_its_healthy_twin(tmp_path):
    twin = [2.0] * 40
    runs = [
        {"family": "f", "fault": None, "seed": 0, "losses": list(twin)},
        {"family": "f", "fault": None, "seed": 1, "losses": [2.2] * 40},
        {"family": "f", "fault": "shuffled_labels", "seed": 0, "fault_step": 10, "caught": False,
         "effect_z": 1.0, "losses": twin[:10] + [9.0] + [3.0] * 9 + [2.02] * 20},
        {"family": "f", "fault": "bit_flip", "seed": 0, "fault_step": 5, "caught": True,
         "losses": [1.0] * 5 + [None] * 35},  # differs before the fault; no loss after it
        {"family": "g", "fault": "bit_flip", "seed": 0, "fault_step": 5, "caught": False,
         "losses": [1.0] * 40},  # no healthy twin
    ]
    eval_trainers.harm(runs)
    shuffled, flipped, lone = runs[2:]
    assert shuffled["twin_identical_before"] and shuffled["harm_next"] == 0.451  # 2.902 / 2
    assert shuffled["harm_end"] == 0.01 and shuffled["seed_gap_end"] == pytest.approx(1 / 11,
                                                                                     abs=1e-5)
    assert not flipped["twin_identical_before"] and flipped["harm_end"] is None
    assert "harm_next" not in lone and all("losses" not in r for r in runs)
    assert [m["fault"] for m in eval_trainers.missed(runs)] == ["shuffled_labels", "bit_flip"]
    assert eval_trainers.missed(runs)[0]["harm_next"] == 0.451
    # the harm figure takes these runs as they are (a harm of None, a run without a twin)
    out = tmp_path / "harm.png"
    figure.draw_harm(runs, out, title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_logs_tells_identical_from_different():
    a = [{"loss": 2.5, "grad_norm": 1.9, "step": 10}, {"loss": 2.1, "step": 20},
         {"train_runtime": 3.0, "train_loss": 2.3, "step": 30}]
    b = [dict(r) for r in a]
    b[2]["train_runtime"] = 9.0  # timing is not compared
    assert runner.compare_logs(a, b) == {"identical": True, "exact": True, "rows": 3,
                                         "first_difference": None, "max_rel_diff": 0.0}
    b[0]["grad_norm"] = 1.0
    c = runner.compare_logs(a, b)
    assert not c["identical"] and "grad_norm" in c["first_difference"]
    assert runner.compare_logs(a, b, before=10)["identical"]  # up to the first skipped step
    b[0]["grad_norm"] = 1.9
    del b[1]["loss"]
    assert "keys" in runner.compare_logs(a, b, before=25)["first_difference"]


def test_planted_collator_counts_micro_batches_as_steps():
    plan = faults.Plan(faults.FAULTS["shuffled_labels"], 10, 0)  # step 6
    seen = []
    planted = faults.Planted(lambda s: {"labels": torch.arange(8)}, plan, accum=2)
    for _ in range(20):
        seen.append(planted([None]))
    changed = [i for i, b in enumerate(seen) if not torch.equal(b["labels"], torch.arange(8))]
    assert changed == [12, 13] and plan.planted == [6]  # micro-batches 12, 13: step 6
    plan = faults.Plan(faults.FAULTS["stuck_loader"], 10, 0)
    planted = faults.Planted(lambda s: {"x": torch.randn(4)}, plan, accum=1)
    out = [planted([None])["x"] for _ in range(10)]
    assert all(torch.equal(out[6], o) for o in out[7:]) and not torch.equal(out[5], out[6])


def test_weight_faults_hit_one_element():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3))
    before = model[1].weight.detach().clone()
    plan = faults.Plan(faults.FAULTS["bit_flip"], 10, 0)
    plan.before_step(model, None, 5)
    assert torch.equal(model[1].weight, before)  # not yet
    plan.before_step(model, None, 6)
    diff = (model[1].weight != before).nonzero().tolist()
    assert diff == [[0, 0]] and abs(float(model[1].weight[0, 0].detach())) > 1e30
    plan = faults.Plan(faults.FAULTS["nan_embedding"], 10, 0, frequent_id=2)
    plan.before_step(model, None, 6)
    assert torch.isnan(model[0].weight).nonzero().tolist() == [[2, 0]]


def test_lr_fault_lasts_until_the_optimizer_step():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    plan = faults.Plan(faults.FAULTS["lr_x20"], 10, 0)
    handle = plan.hook(opt)
    plan.before_step(None, opt, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0)
    p.grad = torch.ones(2)
    opt.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert torch.allclose(p.detach(), torch.full((2,), -1.0))  # the step took lr 2.0
    handle.remove()


# held out until the first held-out scoring, tuning families since
FORMER_HELD_OUT = ("hf_gpt2_chars_fused_cosine_smoothing", "hf_mlp_cancer_rmsprop_linear",
                   "hf_bert_digits_adafactor_bf16", "pl_digits_rmsprop_one_cycle",
                   "pl_pydoc_bytes_manual_adamw")


def test_the_splits_differ_in_kind():
    assert not set(corpus.TUNING) & set(corpus.HELD_OUT)
    assert set(FORMER_HELD_OUT) <= set(corpus.TUNING)
    assert len(corpus.HELD_OUT) >= 5
    assert 0.2 <= len(corpus.HELD_OUT) / (len(corpus.TUNING) + len(corpus.HELD_OUT)) <= 0.45
    held = [runner.FAMILIES[f] for f in corpus.HELD_OUT]
    tuning = [runner.FAMILIES[f] for f in corpus.TUNING]
    for trainer in ("hf", "lightning"):
        assert sum(f.trainer == trainer for f in held) >= 2
    scheds = {f.args.get("lr_scheduler_type") for f in held if f.trainer == "hf"} - {None}
    assert {"warmup_stable_decay", "inverse_sqrt"} <= scheds
    assert not scheds & {f.args.get("lr_scheduler_type") for f in tuning if f.trainer == "hf"}
    assert any(f.trainer == "hf" and f.loss_func for f in held)
    assert not any(f.trainer == "hf" and f.loss_func for f in tuning)
    assert any(f.trainer == "lightning" and f.net == "regression" for f in held)
    assert any(f.trainer == "lightning" and f.gradient_clip_val for f in held)
    assert not any(f.trainer == "lightning" and (f.net == "regression" or f.gradient_clip_val)
                   for f in tuning)
    runs, checks = corpus.jobs(corpus.TUNING, corpus.FULL)
    assert {r["family"] for r in runs} == set(corpus.TUNING)
    assert {c["family"] for c in checks} == set(corpus.TUNING)


# ---- real runs, --quick size ----------------------------------------------------------------

@pytest.fixture(scope="module")
def quick():
    cfg = dict(corpus.QUICK, steps=STEPS)
    jobs = [{"family": fam, "fault": fault, "seed": 0, "steps": cfg["steps"]}
            for fam, fault in ((HF_FAMILY, None), (HF_FAMILY, "bit_flip"),
                               (PL_FAMILY, None), (PL_FAMILY, "garbage_batch"))]
    return {(j["family"], j["fault"]): runner.run(j) for j in jobs}


def _consistent(r):
    """caught follows from the alarms the run recorded, whatever the monitor said."""
    window = [a for a in r["alarms"]
              if r["fault_step"] <= a["step"] <= r["fault_step"] + r["max_delay"]]
    assert r["caught"] == bool(window)
    assert r["delay"] == (window[0]["step"] - r["fault_step"] if window else None)
    assert r["alarm_incidents"] == len(r["incidents"])
    assert r["right_cause"] == (r["cause"] == r["expected_cause"] and r["caught"])


@pytest.mark.corpus
@pytest.mark.parametrize("family", [HF_FAMILY, PL_FAMILY])
def test_quick_runs_are_scored(quick, family):
    healthy, fault = quick[(family, None)], next(v for (f, x), v in quick.items()
                                                   if f == family and x)
    for r in (healthy, fault):
        assert "error" not in r, r.get("traceback")
        assert r["trained_steps"] == STEPS and r["recorded_steps"] == STEPS
    assert "caught" not in healthy and healthy["planted"] == []
    k = round(faults.FAULTS[fault["fault"]].at * STEPS)
    assert fault["fault_step"] == k and fault["planted"] == [k]  # planted where it says
    _consistent(fault)
    # the healthy run is the faulted one's twin: the same losses up to the fault's step
    runs = [dict(healthy), dict(fault)]
    eval_trainers.harm(runs)
    assert runs[1]["twin_identical_before"] is True
    assert runs[1]["harm_next"] is not None and all("losses" not in r for r in runs)


@pytest.mark.corpus
def test_quick_bit_flip_really_flipped(quick):
    hit = quick[(HF_FAMILY, "bit_flip")]["hit"]
    before, after = (float(x) for x in hit.split(": ")[1].split(" -> "))
    assert abs(after) > 1e30 * abs(before)


@pytest.mark.corpus
def test_log_check_tells_same_runs_from_changed_ones():
    same = runner.log_check({"family": HF_FAMILY, "seed": 0, "steps": 30,
                             "callbacks": (False, False)})
    assert "error" not in same, same.get("traceback")
    assert same["identical"] and same["exact"] and same["rows"] >= 3  # logging_steps 10
    real = runner.log_check({"family": PL_FAMILY, "seed": 0, "steps": 30})
    assert "error" not in real, real.get("traceback")
    assert real["rows"] == 30 * 2  # Lightning: one row a micro-batch (accumulation 2)
    assert real["with_callback"] and {"loss", "lr", "train_loss"} <= set(real["with_callback"][0])
