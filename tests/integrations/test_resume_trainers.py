"""The Monitor's state through the trainers' own checkpoints (docs/spec.md section 11): a run
stopped at step K and resumed from its checkpoint (HF ``train(resume_from_checkpoint=...)``,
Lightning ``fit(ckpt_path=...)``) raises the same events after K as the run uninterrupted, and a
loss spike planted two steps after K, which a cold Monitor (still in its warm-up) would miss,
is caught at the same step in both. A checkpoint written without the state resumes cold, with
one log line."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_checkpoint_guard import Counting, hf_args, tiny_gpt2  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from fasthealth import report  # noqa: E402
from fasthealth.integrations.transformers import HealthCallback  # noqa: E402

K, STEPS = 25, 40  # the resume point; the run's length
FAULT = K + 2  # the loss x100 there: past the warm-up of a Monitor that kept its state


class Spike(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 100 if self.state.global_step == FAULT else loss


class StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == K:
            control.should_training_stop = True  # after the save at K (save_steps=5)


def hf_run(out, callbacks=(), resume=None):
    health = HealthCallback()
    trainer = Spike(tiny_gpt2(), hf_args(out, max_steps=STEPS, save_total_limit=None),
                    train_dataset=Counting(), callbacks=[health, *callbacks])
    trainer.train(resume_from_checkpoint=resume)
    return health.monitor


def after(mon, k=K):
    return [(e.step, e.kind) for e in mon.events if e.step >= k]


def hf_pair(tmp_path):
    whole = hf_run(tmp_path / "whole")
    first = hf_run(tmp_path / "split", [StopAt()])
    assert first.steps_seen == K
    return whole, first


def test_hf_resume_goes_on_where_it_stopped(tmp_path):
    whole, _ = hf_pair(tmp_path)
    folder = tmp_path / "split" / f"checkpoint-{K}"
    assert (folder / "fasthealth_monitor.pt").is_file()
    assert torch.load(folder / "fasthealth_monitor.pt", weights_only=True)["run"]["step"] \
        == K - 1
    resumed = hf_run(tmp_path / "split", resume=str(folder))
    assert (FAULT, "loss_spike") in after(whole)
    assert after(resumed) == after(whole)
    # a bad batch the run came back from holds no save back (cause batch: weights intact)
    assert {p.name for p in (tmp_path / "whole").glob("checkpoint-*")} == {
        f"checkpoint-{s}" for s in range(5, STEPS + 1, 5)}
    # True: the last checkpoint of output_dir, as the Trainer finds it
    again = hf_run(tmp_path / "split2", [StopAt()])
    assert again.steps_seen == K
    assert after(hf_run(tmp_path / "split2", resume=True)) == after(whole)


def test_hf_checkpoint_without_state_resumes_cold(tmp_path, caplog):
    whole, _ = hf_pair(tmp_path)
    folder = tmp_path / "split" / f"checkpoint-{K}"
    (folder / "fasthealth_monitor.pt").unlink()  # as if saved without fasthealth
    with caplog.at_level(logging.WARNING, logger="fasthealth"):
        cold = hf_run(tmp_path / "split", resume=str(folder))
    lines = [r.getMessage() for r in caplog.records if "resumes cold" in r.getMessage()]
    assert len(lines) == 1 and str(folder) in lines[0]
    assert (FAULT, "loss_spike") in after(whole)
    assert (FAULT, "loss_spike") not in after(cold)  # a second warm-up: what the state avoids


lightning = pytest.importorskip("lightning")
pl = lightning.pytorch

EPOCH = 25  # batches per epoch: the Lightning run resumes at an epoch's end (the loader's order)


class Counter(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_gpt2()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        return loss * 100 if self.trainer.global_step == FAULT else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class StopPL(pl.Callback):
    def on_train_epoch_end(self, trainer, module):
        if trainer.global_step == K:
            trainer.should_stop = True


def pl_run(root, callbacks=(), ckpt_path=None):
    from fasthealth.integrations.lightning import HealthCallback as PLHealth

    health = PLHealth()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_epochs=1,
                                        save_top_k=-1, save_on_train_epoch_end=True,
                                        filename="{step}")
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root), callbacks=[health, *callbacks, ckpt])
    loader = torch.utils.data.DataLoader(Counting(n=8 * EPOCH), batch_size=8)
    trainer.fit(Counter(), loader, ckpt_path=ckpt_path)
    return health.monitor


def test_lightning_resume_goes_on_where_it_stopped(tmp_path, caplog):
    whole = pl_run(tmp_path / "whole")
    first = pl_run(tmp_path / "split", [StopPL()])
    assert first.steps_seen == K
    path = tmp_path / "split" / "ckpt" / f"step={K}.ckpt"
    state = torch.load(path, map_location="cpu", weights_only=True)["callbacks"]
    assert "fasthealth_monitor" in state["HealthCallback"]
    resumed = pl_run(tmp_path / "split", ckpt_path=str(path))
    assert (FAULT, "loss_spike") in after(whole)
    assert after(resumed) == after(whole)

    # the same checkpoint without the callback's state: cold, one line
    ck = torch.load(path, map_location="cpu", weights_only=True)
    del ck["callbacks"]["HealthCallback"]
    bare = tmp_path / "bare.ckpt"
    torch.save(ck, bare)
    with caplog.at_level(logging.WARNING, logger="fasthealth"):
        cold = pl_run(tmp_path / "cold", ckpt_path=str(bare))
    assert len([r for r in caplog.records if "resumes cold" in r.getMessage()]) == 1
    assert (FAULT, "loss_spike") not in after(cold)


@pytest.mark.slow  # two Trainer runs
def test_hf_resume_from_an_older_checkpoint_abandons_the_steps_after_it(tmp_path, capsys):
    """The Trainer ran to its end (checkpoints every 5 steps); resumed from checkpoint-25 with
    HealthCallback's defaults, the Monitor continues the same run (output_dir/fasthealth/
    run-000), and the steps 25.. of the first pass are an abandoned branch."""
    out, k = tmp_path / "out", 25
    first = hf_run(out)
    assert first.run_id == "run-000" and first.steps_seen == STEPS
    d = first.run_dir
    before = (d / "steps.jsonl").read_bytes()
    resumed = hf_run(out, resume=str(out / f"checkpoint-{k}"))
    assert (resumed.run_id, resumed.run_dir) == ("run-000", d)
    assert sorted(os.listdir(out / "fasthealth")) == ["run-000"]
    after = (d / "steps.jsonl").read_bytes()
    assert after.startswith(before)  # the first pass kept whole
    assert [r["step"] for r in _records(d / "steps.jsonl")] == \
        list(range(STEPS)) + list(range(k, STEPS))
    (resume,) = json.loads((d / "meta.json").read_text())["resumes"]
    assert (resume["step"], resume["reached"], resume["abandons"]) == (k - 1, STEPS - 1, True)
    chosen, log = report.read_run(out / "fasthealth")
    assert [r["step"] for r in log.steps] == list(range(STEPS))
    spikes = [e for e in log.events if e["kind"] == "loss_spike"]
    assert [e["step"] for e in spikes] == [FAULT]  # the first pass's one left out
    assert len([i for i in log.incidents if i["start"] == FAULT]) == 1
    assert any("abandoned branch" in line for line in log.footer)



def _records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} does not end in a whole line"
    return [json.loads(s) for s in data.splitlines()]
