"""The recovery evaluation's own parts: a run plants its fault and reads the rollback's outcome,
and the judge measures a run against its healthy twin in seed gaps."""

import eval_recovery as E


def test_a_weight_fault_is_rolled_back_and_judged_against_its_twin():
    runs = [E.run("digits_mlp_sgd", "healthy", s) for s in (0, 1)]
    runs.append(E.run("digits_mlp_sgd", "weight", 0))
    faulted = runs[-1]
    assert len(faulted.rollbacks) == 1 and faulted.rollbacks[0][2] == "weights"
    assert faulted.quarantined == 0 and faulted.stopped is None
    rows = {r["fault"]: r for r in E.judge(runs)}
    assert rows["healthy"]["verdict"] == "ok"
    gap = rows["weight"]["gap"]
    assert gap > 0 and rows["weight"]["end_in_gaps"] == round(
        (faulted.eval_loss - runs[0].eval_loss) / gap, 2)
    assert "| digits_mlp_sgd | weight | 0 | " in E.table(E.judge(runs))


def test_recurring_samples_are_planted_and_scored():
    r = E.run("digits_mlp_sgd", "recurring", 1)
    assert r.planted == 60 and r.quarantined_bad <= r.quarantined
    assert r.rollbacks and r.quarantined_bad >= 30


def test_through_the_trainer_recurring_samples_leave_their_batches_not_the_steps():
    """The Hugging Face family: the Trainer's sampler serves the quarantined samples again
    every epoch; the callback trains on the rest of their batches (a handful of steps skipped,
    where the watch found a culprit in the step's own batch), not a step lost per batch."""
    r = E.run("hf_digits_mlp_adamw", "recurring", 0)
    assert r.planted == 60 and r.rollbacks and r.rollbacks[0][2] == "batch", r
    assert r.quarantined_bad == r.quarantined >= 50, r  # the pulls find the culprits
    # a step skipped where the watch finds a culprit in its own batch (11 here: the watch
    # finds more with the pulls), not one per batch that holds a quarantined sample (330)
    assert r.quarantine_skips <= 20, r
