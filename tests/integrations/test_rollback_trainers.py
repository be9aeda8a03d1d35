"""Rolling back in process through the trainers (``rollback=``, docs/spec.md section 6), with
faults planted for real in a Hugging Face Trainer or Lightning run: a weight corrupted to NaN
between two steps (every later step broken), a learning-rate burst of three steps (the batches
are fine, the state they meet is not: the loss stays hurt long after), and a run of bad
batches (a corrupt shard). The callbacks' ``rollback=`` restores the weights, the optimizer and
the scheduler of the last snapshot before the fault, and the run ends where its healthy twin
does (within the seed gap), in the same process. The callbacks replay the incident's batch on
the restored state the trainer's way (the Trainer's ``compute_loss``; ``training_step``, its
logging silenced): fine there for the first two (the state was bad), still bad for the shard
(the data)."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_checkpoint_guard import LEN, VOCAB, Counting, Poison, hf_args, tiny_gpt2  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

import fasthealth as fh  # noqa: E402
from fasthealth.integrations.transformers import HealthCallback  # noqa: E402

STEPS, AT = 300, 150


class Burst(TrainerCallback):
    """The learning rate ``factor`` times the scheduler's for the ``n`` steps from ``at`` (the
    scheduler sets it again after each step)."""

    def __init__(self, at, n=3, factor=300.0):
        self.at, self.n, self.factor = at, n, factor

    def on_step_begin(self, args, state, control, optimizer=None, **kw):
        if self.at <= state.global_step < self.at + self.n:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor


def hf_run(out, fault=None, rollback=None, seed: int = 0):
    """A Trainer run of ``STEPS`` steps; ``fault``: "nan" (a NaN weight from step ``AT``) or
    "burst" (``Burst(AT)``)."""
    health = HealthCallback(rollback=rollback, flush_every=10)
    planted = {None: [], "nan": [Poison(AT)], "burst": [Burst(AT)]}[fault]
    trainer = Trainer(tiny_gpt2(), hf_args(out, max_steps=STEPS, seed=seed,
                                           save_total_limit=None),
                      train_dataset=Counting(), callbacks=[health, *planted])
    with pytest.warns(RuntimeWarning, match="rolled back") if fault and rollback else \
            contextlib.nullcontext():
        trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return health.monitor, trainer, losses


@pytest.fixture(scope="module")
def hf_twin(tmp_path_factory):
    """The healthy twin's final loss level and the seed gap (the largest distance of two other
    seeds' levels from it); the twin, with rollback on, never rolls back."""
    tmp = tmp_path_factory.mktemp("hf-twin")
    twin, _, healthy = hf_run(tmp / "healthy", rollback=True)
    assert not twin.rollbacks and not [i for i in twin.incidents if i.severity == "alarm"]
    level = _end(healthy)
    return level, max(abs(_end(hf_run(tmp / f"seed{k}", seed=k)[2]) - level) for k in (1, 2))


@pytest.mark.slow
def test_hf_a_nan_weight_is_rolled_back_and_the_run_ends_as_its_healthy_twin(tmp_path,
                                                                              hf_twin):
    left, _, _ = hf_run(tmp_path / "broken", "nan")
    (inc,) = left.incidents  # left alone: broken to the end (HF logs its NaN losses as 0)
    assert (inc.start, inc.end, inc.recovered) == (AT, STEPS - 1, False), inc
    level, gap = hf_twin
    mon, trainer, losses = hf_run(tmp_path / "rolled", "nan",
                                  rollback=fh.RollbackConfig(every=20))
    (rb,) = mon.rollbacks
    assert rb.to_step < AT <= rb.step < AT + 10, rb
    assert rb.replay == "state" and rb.replay_loss < 1.2 * rb.level, rb
    assert abs(_end(losses) - level) <= gap, (_end(losses), level, gap)
    inc = next(i for i in mon.incidents if i.id == rb.incident)
    assert inc.severity == "alarm" and not inc.open and inc.recovered, inc
    assert trainer.state.global_step == STEPS


@pytest.mark.slow
def test_hf_a_learning_rate_burst_is_rolled_back_and_told_from_the_data(tmp_path, hf_twin):
    """Three steps at 300 times the rate: left alone the loss ends more than ten seed gaps
    above the twin's; rolled back to before the burst, the incident's batch replayed on the
    restored state is fine (the state, not the data: nothing quarantined), and the run ends
    within the seed gap of its twin, at most a snapshot interval and a flush lost."""
    level, gap = hf_twin
    _, _, left = hf_run(tmp_path / "burst", "burst")
    assert _end(left) - level > 10 * gap, (_end(left), level, gap)
    mon, trainer, losses = hf_run(tmp_path / "rolled", "burst",
                                  rollback=fh.RollbackConfig(every=20))
    (rb,) = mon.rollbacks
    assert rb.to_step < AT <= rb.step < AT + 10 and rb.step - rb.to_step <= 20 + 10, rb
    assert rb.replay == "state" and rb.replay_loss < 1.2 * rb.level, rb
    assert rb.quarantined == [], rb
    inc = next(i for i in mon.incidents if i.id == rb.incident)
    assert inc.cause == "learning_rate" and inc.recovered and not inc.open, inc
    assert abs(_end(losses) - level) <= gap, (_end(losses), level, gap)
    assert trainer.state.global_step == STEPS


class Stream(torch.utils.data.IterableDataset):
    """Counting sequences read once, in order (a pretraining stream: its start tokens drawn
    with ``seed``), with their sample ids; the samples ``bad`` hold random tokens (a corrupt
    shard)."""

    def __init__(self, bad=range(0), seed=0, n=STEPS * 8):
        self.bad, self.n = bad, n
        self.start = torch.randint(0, VOCAB, (n, 1),
                                   generator=torch.Generator().manual_seed(seed))

    def __iter__(self):
        for i in range(self.n):
            ids = (self.start[i] + torch.arange(LEN)) % VOCAB
            if i in self.bad:
                ids = torch.randint(0, VOCAB, (LEN,), generator=torch.Generator().manual_seed(i))
            yield {"input_ids": ids, "labels": ids, "sample_ids": torch.tensor(i)}


CORRUPT = range(AT * 8, (AT + 10) * 8)  # the samples of steps 150-159


def _shard_rolled_back(mon):
    """The one rollback of a run through the corrupt shard, and its incident: back to before
    step 150, the replay saying the batch is bad, the incident's batches bad as a whole on the
    restored state, so every sample of them quarantined: of the shard, and nothing else."""
    (rb,) = mon.rollbacks
    assert rb.to_step < AT <= rb.step < AT + 10 and rb.replay == "batch", rb
    inc = next(i for i in mon.incidents if i.id == rb.incident)
    assert inc.cause == "batch" and inc.rolled_back, inc
    assert set(rb.quarantined) <= set(CORRUPT) and len(rb.quarantined) >= 64
    return rb, inc


def hf_stream(out, bad, rollback=None, seed=0, resume=None, **args):
    """The Trainer over ``Stream`` (its ``bad`` samples corrupt); ``args``: more of its
    arguments (gradient accumulation, label smoothing)."""
    health = HealthCallback(rollback=rollback, flush_every=10)
    per_step = 8 * args.get("gradient_accumulation_steps", 1)
    trainer = Trainer(tiny_gpt2(), hf_args(out, max_steps=STEPS, seed=seed, save_steps=20,
                                           save_total_limit=None, remove_unused_columns=False,
                                           **args),
                      train_dataset=Stream(bad, seed, n=STEPS * per_step), callbacks=[health])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rollback's: asserted on below
        trainer.train(resume_from_checkpoint=resume)
    return health.monitor, [r["loss"] for r in trainer.state.log_history if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("accumulate, smoothing", [(2, 0.0), (1, 0.1), (2, 0.1)])
def test_hf_the_replay_is_the_trainers_own_loss(tmp_path, accumulate, smoothing):
    """With gradient accumulation (the replay averages the step's micro-batches) and the
    Trainer's label smoothing (a loss the model does not compute, whose floor is far above
    0): the corrupt shard's incident is rolled back and its batch, replayed through the
    Trainer's compute_loss on the restored state, is judged bad (the data), the shard's samples
    quarantined."""
    per_step = 8 * accumulate
    bad = range(AT * per_step, (AT + 10) * per_step)
    mon, _ = hf_stream(tmp_path, bad, rollback=fh.RollbackConfig(every=20),
                       gradient_accumulation_steps=accumulate, label_smoothing_factor=smoothing)
    (rb,) = mon.rollbacks
    assert rb.to_step < AT <= rb.step < AT + 10 and rb.replay == "batch", rb
    assert rb.replay_loss > 2 * rb.level, rb
    # its batches, bad as a whole on the restored state: the samples of the shard's steps up
    # to the rollback (the last step's own batch, under accumulation, may not have reached
    # it), and no other
    assert set(rb.quarantined) <= set(bad) and len(rb.quarantined) >= len(bad) - per_step, rb


@pytest.mark.slow
def test_hf_a_run_of_bad_batches_is_rolled_back_quarantined_and_skipped_after_a_resume(
        tmp_path):
    """Ten batches of a corrupt shard in a pretraining stream (steps 150-159) leave the loss
    hurt; the rollback restores step 149, the incident's batch replayed there is still bad
    (the data, not the state), its samples are quarantined, the run ends within the seed gap
    of its healthy twin, and the checkpoints the guard let through do not hold the damage. A
    resume from the checkpoint of step 140, older than the rollback (its Monitor state holds
    no quarantine: the run's rollbacks.jsonl does), is served the same shard again: every
    step whose batch holds a quarantined sample is skipped on the device."""
    level = _end(hf_stream(tmp_path / "healthy", range(0))[1])
    gap = max(abs(_end(hf_stream(tmp_path / f"seed{k}", range(0), seed=k)[1]) - level)
              for k in (1, 2))
    mon, losses = hf_stream(tmp_path / "rolled", CORRUPT, rollback=fh.RollbackConfig(every=20))
    rb, inc = _shard_rolled_back(mon)
    assert abs(_end(losses) - level) <= gap, (_end(losses), level, gap)
    saved = sorted(int(d.name.split("-")[1]) for d in (tmp_path / "rolled").glob("checkpoint-*"))
    assert 140 in saved and not [t for t in saved if AT <= t <= rb.step]
    resumed, _ = hf_stream(tmp_path / "rolled", CORRUPT, rollback=True,
                           resume=str(tmp_path / "rolled" / "checkpoint-140"))
    assert resumed.rollback.quarantine == rb.quarantined
    steps = {r["step"]: r for r in map(json.loads, (resumed.run_dir / "steps.jsonl").open())
             if r["step"] >= 140}
    held = {t for t in range(140, STEPS) if set(range(t * 8, t * 8 + 8)) & set(rb.quarantined)}
    assert set(range(inc.start, inc.end + 1)) <= held <= set(range(AT, AT + 10))
    assert {t for t, r in steps.items() if r["quarantine_skip"]} == held



def test_hf_a_quarantined_sample_leaves_its_batch_not_the_step(tmp_path):
    """The Trainer's sampler serves a quarantined sample again (a resumed run, a sampler that
    is the Trainer's own): its row is left out of the batch and the step trains on the rest;
    only a batch whose every row is quarantined is skipped, on the device, as before."""
    quarantined = [3, 17, 18, *range(40, 48)]  # one row of step 0, two of step 2, all of 5

    class Quarantine(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            health.monitor.rollback.quarantine = quarantined

    rows: dict[int, int] = {}
    health = HealthCallback(rollback=True, flush_every=5)
    trainer = Trainer(tiny_gpt2(), hf_args(tmp_path, max_steps=10, remove_unused_columns=False,
                                           save_strategy="no"),
                      train_dataset=Stream(n=80), callbacks=[health, Quarantine()])
    trainer.model.register_forward_pre_hook(
        lambda m, a, kw: rows.__setitem__(trainer.state.global_step, len(kw["input_ids"]))
        if m.training else None, with_kwargs=True)
    trainer.train()
    assert rows == {0: 7, 1: 8, 2: 6, 3: 8, 4: 8, 5: 8, 6: 8, 7: 8, 8: 8, 9: 8}, rows
    steps = [json.loads(line) for line in (health.monitor.run_dir / "steps.jsonl").open()]
    assert [r["step"] for r in steps if r["quarantine_skip"]] == [5]
    assert [r["step"] for r in steps if r["skipped"]] == [5]


def _end(losses: list[float]) -> float:
    """The mean of the last four logged losses (every 5 steps)."""
    return sum(losses[-4:]) / 4


def _last20(losses: list[float]) -> float:
    """The mean loss of the last 20 steps (Lightning's, step by step)."""
    return sum(losses[-20:]) / 20


lightning = pytest.importorskip("lightning")
pl = lightning.pytorch
from test_checkpoint_guard import Counter, PoisonPL  # noqa: E402


class Losses(pl.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class LoggingCounter(Counter):
    """``Counter`` that logs its loss with ``self.log`` and counts the calls."""

    def __init__(self):
        super().__init__()
        self.logged = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def log(self, *args, **kwargs):
        self.logged += 1
        super().log(*args, **kwargs)


class BurstPL(pl.Callback):
    """Lightning's ``Burst``: the rate ``factor`` times for the ``n`` steps from ``at``, put
    back after each (the module's AdamW has a constant rate)."""

    def __init__(self, at, n=3, factor=300.0):
        self.at, self.n, self.factor, self.saved = at, n, factor, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.at <= trainer.global_step < self.at + self.n:
            groups = trainer.optimizers[0].param_groups
            self.saved = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] *= self.factor

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.saved is not None:
            for g, lr in zip(trainer.optimizers[0].param_groups, self.saved):
                g["lr"] = lr
            self.saved = None


def pl_fit(root, fault=None, rollback=None, seed: int = 0):
    """A Lightning run of ``STEPS`` steps; ``fault``: "nan" or "burst", as ``hf_run``'s."""
    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    health, losses = PLHealth(rollback=rollback, flush_every=10), Losses()
    planted = {None: [], "nan": [PoisonPL(AT)], "burst": [BurstPL(AT)]}[fault]
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(root),
                         callbacks=[health, losses, *planted])
    loader = torch.utils.data.DataLoader(Counting(), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    with pytest.warns(RuntimeWarning, match="rolled back") if fault and rollback else \
            contextlib.nullcontext():
        trainer.fit(LoggingCounter(), loader)
    return health.monitor, trainer, losses.losses


@pytest.fixture(scope="module")
def pl_twin(tmp_path_factory):
    """The healthy twin's losses (it never rolls back, rollback on) and two other seeds'."""
    tmp = tmp_path_factory.mktemp("pl-twin")
    twin, _, healthy = pl_fit(tmp / "healthy", rollback=True)
    assert not twin.rollbacks and not [i for i in twin.incidents if i.severity == "alarm"]
    return healthy, [pl_fit(tmp / f"seed{k}", seed=k)[2] for k in (1, 2)]


def _within_the_seed_gap(losses, rb, twin) -> None:
    """At a constant rate the loss still falls at the end: the run that lost ``rb``'s steps
    is compared with its twin after as many trained steps, within the seed gap there."""
    healthy, seeds = twin
    trained = STEPS - (rb.step - rb.to_step)
    level = _last20(healthy[:trained])
    gap = max(abs(_last20(other[:trained]) - level) for other in seeds)
    assert abs(_last20(losses) - level) <= gap, (_last20(losses), level, gap)


@pytest.mark.slow
def test_lightning_a_nan_weight_is_rolled_back_and_the_run_ends_as_its_healthy_twin(tmp_path,
                                                                                     pl_twin):
    left, _, _ = pl_fit(tmp_path / "broken", "nan")
    (inc,) = left.incidents
    assert (inc.start, inc.recovered) == (AT, False), inc
    mon, trainer, losses = pl_fit(tmp_path / "rolled", "nan",
                                  rollback=fh.RollbackConfig(every=20))
    (rb,) = mon.rollbacks
    assert rb.to_step < AT <= rb.step < AT + 10, rb
    assert rb.replay == "state" and rb.replay_loss < 1.2 * rb.level, rb
    assert trainer.lightning_module.logged == STEPS  # one a step: the replay logged nothing
    inc = next(i for i in mon.incidents if i.id == rb.incident)
    assert inc.severity == "alarm" and not inc.open and inc.recovered, inc
    assert trainer.global_step == STEPS
    _within_the_seed_gap(losses, rb, pl_twin)


@pytest.mark.slow
def test_lightning_a_learning_rate_burst_is_rolled_back_and_told_from_the_data(tmp_path,
                                                                               pl_twin):
    """``test_hf_a_learning_rate_burst_...`` through Lightning: the burst left alone keeps the
    loss far above the twin's; rolled back, replayed through ``training_step`` ("state", nothing
    quarantined), the run ends within the seed gap of its twin."""
    healthy, seeds = pl_twin
    _, _, left = pl_fit(tmp_path / "burst", "burst")
    gap = max(abs(_last20(other) - _last20(healthy)) for other in seeds)
    assert _last20(left) - _last20(healthy) > 10 * gap, (_last20(left), _last20(healthy), gap)
    mon, trainer, losses = pl_fit(tmp_path / "rolled", "burst",
                                  rollback=fh.RollbackConfig(every=20))
    (rb,) = mon.rollbacks
    assert rb.to_step < AT <= rb.step < AT + 10 and rb.step - rb.to_step <= 20 + 10, rb
    assert rb.replay == "state" and rb.replay_loss < 1.2 * rb.level, rb
    assert rb.quarantined == [] and trainer.lightning_module.logged == STEPS, rb
    inc = next(i for i in mon.incidents if i.id == rb.incident)
    assert inc.cause == "learning_rate" and inc.recovered and not inc.open, inc
    _within_the_seed_gap(losses, rb, pl_twin)


def pl_stream(root, bad, rollback=None, seed: int = 0):
    """Lightning over ``Stream`` (read once, in order): the Monitor, the losses, the module
    (which counts its ``self.log`` calls)."""
    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    health, losses = PLHealth(rollback=rollback, flush_every=10), Losses()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(root),
                         callbacks=[health, losses])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rollback's: asserted on below
        module = LoggingCounter()
        trainer.fit(module, torch.utils.data.DataLoader(Stream(bad, seed), batch_size=8))
    return health.monitor, losses.losses, module


@pytest.mark.slow
def test_lightning_a_run_of_bad_batches_is_rolled_back_replayed_and_quarantined(tmp_path):
    """The corrupt shard of steps 150-159 through Lightning: rolled back to before it, the
    incident's batch replayed through ``training_step`` on the restored state is still bad
    (the data), its samples quarantined, the run ends within the seed gap of its twin (after
    as many trained steps), and the replay logged nothing."""
    mon, losses, module = pl_stream(tmp_path / "rolled", CORRUPT,
                                    rollback=fh.RollbackConfig(every=20))
    rb, _ = _shard_rolled_back(mon)
    assert module.logged == STEPS  # one a step: the replay logged nothing
    trained = STEPS - (rb.step - rb.to_step)
    level = _last20(pl_stream(tmp_path / "healthy", range(0))[1][:trained])
    gap = max(abs(_last20(pl_stream(tmp_path / f"seed{k}", range(0), seed=k)[1][:trained])
                  - level) for k in (1, 2))
    assert abs(_last20(losses) - level) <= gap, (_last20(losses), level, gap)


class CountingWithIds(Counting):
    """``Counting`` with each sample's index as its ``sample_ids`` column."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "sample_ids": torch.tensor(i)}


QUARANTINED = list(range(0, 512, 16))  # 32 samples of 512: most batches of 8 hold none


class Quarantine(TrainerCallback):
    """Puts QUARANTINED in the Monitor's quarantine at the end of step ``at``, as a rollback
    before the checkpoint would have; stops the job at step 10."""

    def __init__(self, health, at):
        self.health, self.at = health, at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            self.health.monitor.rollback.quarantine = list(QUARANTINED)
        control.should_training_stop = state.global_step == 10  # the job stops there


class Moved(TrainerCallback):
    """Whether the model's first weight changed at each step."""

    def __init__(self):
        self.moved: dict[int, bool] = {}

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.before = next(model.parameters()).detach().clone()

    def on_step_end(self, args, state, control, model=None, **kw):
        self.moved[state.global_step - 1] = not torch.equal(self.before,
                                                            next(model.parameters()))


def _cut_where_held(mon, given: list[list[int]], moved: dict[int, bool],
                    seen: list[int]) -> None:
    """Steps 10-29 of a run resumed at 10: the quarantine came back with the Monitor's state;
    the steps whose batch (``given``, each step's ids as served) held a quarantined sample
    trained on the rest of it: no quarantined sample reached the model (``seen``, the ids
    its training forwards were given), no step was skipped, the weights moved at every step."""
    assert mon.rollback.quarantine == QUARANTINED
    steps = {r["step"]: r for r in map(json.loads, (mon.run_dir / "steps.jsonl").open())
             if r["step"] >= 10}
    assert len(given) == 20 == len(steps)
    held = {10 + k for k, batch in enumerate(given) if set(batch) & set(QUARANTINED)}
    assert held and len(held) < 20
    served = [i for batch in given for i in batch]
    assert sorted(seen) == sorted(i for i in served if i not in QUARANTINED)
    assert not [t for t, r in steps.items() if r["quarantine_skip"] or r["skipped"]]
    assert all(moved[t] for t in range(10, 30))


def _seen(model) -> list[int]:
    """The sample ids ``model``'s training forwards are given (a ``sample_ids`` keyword)."""
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: seen.extend(kw["sample_ids"].tolist())
        if m.training and torch.is_grad_enabled() and "sample_ids" in kw else None,
        with_kwargs=True)
    return seen


@pytest.mark.parametrize("accumulate, smoothing", [(1, 0.0), (2, 0.0), (1, 0.1)])
def test_hf_a_resumed_run_leaves_the_quarantined_samples_out_of_its_batches(
        tmp_path, accumulate, smoothing):
    """The quarantine a checkpoint's Monitor state holds is applied through the Trainer's own
    data loading: after resume_from_checkpoint, each batch (each micro-batch, with gradient
    accumulation) that holds a quarantined sample trains without it, and no step is skipped;
    also with the Trainer's label smoothing, which computes the loss outside the model."""
    out = tmp_path / "out"
    args = dict(save_steps=10, save_total_limit=None, remove_unused_columns=False,
                gradient_accumulation_steps=accumulate, label_smoothing_factor=smoothing)
    health = HealthCallback(rollback=True, flush_every=5)
    Trainer(tiny_gpt2(), hf_args(out, max_steps=30, **args), train_dataset=CountingWithIds(),
            callbacks=[health, Quarantine(health, 3)]).train()
    assert (out / "checkpoint-10").is_dir() and not (out / "checkpoint-20").exists()
    given: list[list[int]] = []  # each step's sample ids, as the callback reads them

    def ids(batch):
        given.append(batch["sample_ids"].tolist())
        return batch["sample_ids"]

    health, moved = HealthCallback(rollback=True, flush_every=5, sample_ids=ids), Moved()
    model = tiny_gpt2()
    seen = _seen(model)
    Trainer(model, hf_args(out, max_steps=30, **args), train_dataset=CountingWithIds(),
            callbacks=[health, moved]).train(resume_from_checkpoint=str(out / "checkpoint-10"))
    steps = [sum(given[k:k + accumulate], []) for k in range(0, len(given), accumulate)]
    _cut_where_held(health.monitor, steps, moved.moved, seen)


class QuarantinePL(pl.Callback):
    def __init__(self, health, at):
        self.health, self.at = health, at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            self.health.monitor.rollback.quarantine = list(QUARANTINED)


class MovedPL(pl.Callback):
    def __init__(self):
        self.moved: dict[int, bool] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = next(module.parameters()).detach().clone()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.moved[trainer.global_step - 1] = not torch.equal(self.before,
                                                              next(module.parameters()))


def test_lightning_a_resumed_run_leaves_the_quarantined_samples_out_of_its_batches(tmp_path):
    """As for Hugging Face: the quarantine in the Lightning checkpoint's callback state is
    applied after fit(ckpt_path=...), through Lightning's own data loading."""
    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    def fit(steps, callbacks, ckpt_path=None):
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"),
                                            every_n_train_steps=10, save_top_k=-1,
                                            filename="{step}")
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path), callbacks=[*callbacks, ckpt])
        loader = torch.utils.data.DataLoader(CountingWithIds(), batch_size=8, shuffle=True,
                                             generator=torch.Generator().manual_seed(0))
        trainer.fit(Counter(), loader, ckpt_path=ckpt_path)

    health = PLHealth(rollback=True, flush_every=5)
    fit(10, [health, QuarantinePL(health, 3)])
    given: list[list[int]] = []

    def ids(batch):
        given.append(batch["sample_ids"].tolist())
        return batch["sample_ids"]

    health, moved = PLHealth(rollback=True, flush_every=5, sample_ids=ids), MovedPL()

    class Seen(pl.Callback):  # the module is made in fit: its model watched from the start
        held: list[int] = []

        def on_train_start(self, trainer, module):
            self.held = _seen(module.model)

    watch = Seen()
    fit(30, [health, moved, watch], ckpt_path=str(tmp_path / "ckpt" / "step=10.ckpt"))
    _cut_where_held(health.monitor, given, moved.moved, watch.held)


def test_the_callbacks_replay_is_the_trainers_loss_and_never_the_users_own(tmp_path):
    """``with_replay`` fills in the replay only where rollback is on and names none; the
    Hugging Face replay is the Trainer's compute_loss (its label smoothing) over the step's
    micro-batches, or without a Trainer the model's own loss, keys its forward does not take
    (a ``sample_ids`` column) left out; Lightning under manual optimization gets none."""
    from fasthealth.integrations.replay import hf_replay, lightning_replay, with_replay

    def mine(model, batch):
        return torch.zeros(())

    def ours(model, batch):
        return torch.ones(())

    assert with_replay({"rollback": True}, ours)["rollback"].replay is ours
    assert with_replay({"rollback": fh.RollbackConfig(every=7)}, ours)["rollback"].every == 7
    assert with_replay({"rollback": fh.RollbackConfig(replay=mine)}, ours)[
        "rollback"].replay is mine
    act = with_replay({"act": fh.ActOptions(rollback=True)}, ours)["act"]
    assert act.rollback.replay is ours
    assert with_replay({"max_grad_norm": 1.0}, ours) == {"max_grad_norm": 1.0}
    assert with_replay({"act": fh.ActOptions()}, ours)["act"].rollback is None

    model, data = tiny_gpt2(), CountingWithIds()
    micro = [{k: v[None] for k, v in data[i].items()} for i in (0, 1)]
    with torch.no_grad():
        want = [float(model(input_ids=b["input_ids"], labels=b["labels"]).loss) for b in micro]
        assert float(hf_replay(2)(model, micro)) == pytest.approx(sum(want) / 2)
        assert float(hf_replay(1)(model, micro[0])) == pytest.approx(want[0])
        # with the Trainer: its compute_loss, label smoothing included (the model's own loss
        # is unsmoothed), and the inputs left as they were
        trainer = Trainer(model, hf_args(tmp_path, label_smoothing_factor=0.2,
                                         remove_unused_columns=False))
        smoothed = float(trainer.compute_loss(model, dict(micro[0])))
        assert abs(smoothed - want[0]) > 1e-3
        assert float(hf_replay(1, trainer)(model, micro[0])) == pytest.approx(smoothed)
        assert "labels" in micro[0]

    class Manual(Counter):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    assert lightning_replay(Manual(), 1) is None and lightning_replay(Counter(), 1) is not None


def test_the_callbacks_replays_give_each_samples_pull():
    """The trainers' replays keep the loss's graph: the culprit search's pulls (each sample's
    gradient norm, ``culprits.sample_pulls``) need it, and without them the search runs on the
    losses alone (through the trainers it found a third fewer of the planted bad samples)."""
    from fasthealth.integrations.replay import hf_replay, lightning_replay
    from fasthealth.monitor.culprits import sample_pulls

    model, data = tiny_gpt2(), CountingWithIds()
    batch = {k: torch.stack([data[i][k] for i in range(3)]) for k in data[0]}
    pulls = sample_pulls(model, hf_replay(1), batch, 3)
    assert pulls is not None and len(pulls) == 3 and all(p > 0 for p in pulls)
    module = Counter()
    pulls = sample_pulls(module, lightning_replay(module, 1), batch, 3)
    assert pulls is not None and all(p > 0 for p in pulls)


def test_lightning_a_quarantined_sample_leaves_its_batch_not_the_step(tmp_path):
    """Lightning's loader serves a quarantined sample again: its row leaves the batch (a
    mapping) before ``training_step`` and the step trains on the rest; a batch whose every row
    is quarantined is skipped on the device."""
    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    quarantined = [3, 17, 18, *range(40, 48)]

    class Quarantine(pl.Callback):
        def on_train_start(self, trainer, module):
            health.monitor.rollback.quarantine = quarantined

    class Rows(LoggingCounter):
        def __init__(self):
            super().__init__()
            self.rows: dict[int, int] = {}

        def training_step(self, batch, batch_idx):
            self.rows[self.trainer.global_step] = len(batch["input_ids"])
            return super().training_step(batch, batch_idx)

    health = PLHealth(rollback=True, flush_every=5)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path),
                         callbacks=[health, Quarantine()])
    module = Rows()
    trainer.fit(module, torch.utils.data.DataLoader(Stream(n=80), batch_size=8))
    assert module.rows == {0: 7, 1: 8, 2: 6, 3: 8, 4: 8, 5: 8, 6: 8, 7: 8, 8: 8, 9: 8}
    steps = [json.loads(line) for line in (health.monitor.run_dir / "steps.jsonl").open()]
    assert [r["step"] for r in steps if r["quarantine_skip"]] == [5]
