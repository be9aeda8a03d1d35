"""The long runs of evaluation/detectors/long_runs.py at make test-eval's size: the corpus's
shape (no training), then three runs 8,000 steps long under fh.Monitor's defaults (about a
minute on 2 cores, marked ``corpus``): two healthy runs at a floor that raised 10-13 alarms each
before the spike rule judged a floor's blips by the loss the run started from (a classifier
converged under label smoothing; a small table memorised under dropout), and a mislabelled
batch planted at 85% of a run at that label-smoothing floor, which must still be an alarm at
its step. The full evaluation is ``evaluation/eval_long_runs.py``."""

import corpus
import eval_long_runs
import long_runs
import pytest
from families import FAMILIES


def test_the_long_runs_are_long_broad_and_keep_a_part_out():
    healthy = long_runs.HEALTHY
    assert all(r.steps >= long_runs.LONG for r in long_runs.RUNS)
    assert len({r.name for r in healthy}) >= 25
    assert sum(r.steps >= 30000 for r in healthy) >= 2
    made_for_long = {n for n, f in FAMILIES.items() if f.long}
    assert len(made_for_long) >= 4 and made_for_long.isdisjoint(corpus.HEALTHY)
    assert made_for_long.isdisjoint(corpus.HELD_OUT_HEALTHY)  # the short corpus never runs them
    held = [r for r in long_runs.RUNS if r.held_out]
    assert len({r.name for r in held if r.kind == "healthy"}) >= 6
    assert any(r.kind == "fault" for r in held)
    tuning_jobs = eval_long_runs.jobs(final=False, cache=None)
    assert not any(run.held_out for run, _, _ in tuning_jobs)
    assert {f.name for f in long_runs.FAULTS} == {n for n, f in corpus.FAULTS.items()
                                                  if f.onset > 0}
    spec = corpus.FAULTS["mislabelled_batch"]
    assert corpus.onset_of(spec, long_runs.LONG, 1000, long_runs.LATE) >= 0.85 * long_runs.LONG


def test_an_alarm_is_measured_by_how_far_the_level_rose_with_it():
    """A blip leaves the loss's level where it was; an episode raises it; with no loss before
    the alarm there is nothing to compare with."""
    floor = [1e-4, 2e-4] * 100
    blip = floor[:150] + [0.9] + floor[:49]
    episode = floor[:150] + [0.9] + [3e-3] * 49
    assert eval_long_runs._level_rise(blip, 150) == pytest.approx(1.0, rel=1.0)
    assert eval_long_runs._level_rise(blip, 150) < eval_long_runs.LEVEL_MOVED
    assert eval_long_runs._level_rise(episode, 150) >= eval_long_runs.LEVEL_MOVED
    assert eval_long_runs._level_rise(episode, 0) != eval_long_runs._level_rise(episode, 0)


@pytest.fixture(scope="module")
def res():
    only = {"digits_mlp_adamw_label_smoothing", "wine_mlp_adam_dropout", "mislabelled_batch"}
    jobs = [(run, seed, None) for run in long_runs.RUNS if run.name in only
            and run.steps == long_runs.LONG for seed in (1000 if run.kind == "fault" else 0,)]
    assert len(jobs) == 3
    return {r["key"] if r["kind"] == "healthy" else r["name"]: r
            for r in eval_long_runs.run_all(jobs, workers=2)}


@pytest.mark.corpus
@pytest.mark.parametrize("key", ["digits_mlp_adamw_label_smoothing@8000",
                                 "wine_mlp_adam_dropout@8000"])
def test_a_healthy_run_at_its_floor_raises_no_alarm_in_8000_steps(res, key):
    r = res[key]
    alarms = [e for e in r["events"] if e[2] == "alarm"]
    assert alarms == [], alarms
    # the floor's blips are still seen, as notices
    assert any(e[1] == "loss_spike" for e in r["events"]), r["events"][:5]


@pytest.mark.corpus
def test_a_late_bad_batch_at_a_quiet_floor_is_an_alarm_at_its_step(res):
    r = res["mislabelled_batch"]
    v = eval_long_runs.eval_detectors.verdict(r, 0)
    assert v["caught"] and v["delay"] == 0, v
    assert v["alarms"] == [], v["alarms"]  # nothing before it
