"""fasthealth inside a Lightning Trainer: one callback, no other change.

    python examples/lightning_loop.py

A small regression LightningModule trains for 30 steps on CPU; one sample (index 165, in step
20's batch) holds a NaN. The callback catches it, skips that optimizer step on the device (a
fused AdamW), leaves Lightning's gradient clipping to Lightning, and fh.replay names the
sample.
"""

import tempfile

import lightning.pytorch as pl
import torch

import fasthealth as fh
from fasthealth.integrations.lightning import HealthCallback


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))

    def loss(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


torch.manual_seed(0)
x = torch.randn(240, 8)
y = x.sum(1, keepdim=True) * 0.3
x[165, 4] = float("nan")
data = [{"x": x[i], "y": y[i], "idx": i} for i in range(len(x))]  # "idx": the sample ids
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

module, health = Regression(), HealthCallback()  # keywords are fh.Monitor's
with tempfile.TemporaryDirectory() as root:
    trainer = pl.Trainer(max_steps=30, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=1.0,
                         default_root_dir=root, callbacks=[health])
    trainer.fit(module, loader)
    mon = health.monitor  # logs in <default_root_dir>/fasthealth
    for e in mon.events:
        print(f"step {e.step}: {e.severity} {e.kind}: {e.message[:90]}...")
    inc = mon.incidents[0]  # the events of one fault, with one dump
    r = fh.replay(inc.dump, module, lambda m, b: m.loss(b))
    print(r.verdict)
    finite = all(torch.isfinite(p).all() for p in module.parameters())
    print(f"lightning_loop: {len(mon.incidents)} incident ({'+'.join(inc.kinds)} at step "
          f"{inc.start}, {inc.severity}), skipped={inc.events[0].details['skipped']}, "
          f"culprit_ids={r.culprit_ids}, weights finite={finite}")
