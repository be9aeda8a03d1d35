"""fasthealth inside a Hugging Face Trainer: one callback, no other change.

    python examples/hf_trainer.py

A tiny GPT-2 (built from a config, nothing downloaded) trains for 10 steps on CPU. The callback
takes the loss the Trainer logs (from its training_step), checks every gradient once per
optimizer step, before the Trainer's clipping (which stays the Trainer's: what it logs does not
change), skips a non-finite step, and logs to <output_dir>/fasthealth/run-000/steps.jsonl.
"""

import json
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from fasthealth.integrations.transformers import HealthCallback


class Counting(torch.utils.data.Dataset):
    """Token sequences that count up by one: learnable in a few steps."""

    def __init__(self, n=160, seq=16, vocab=64):
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (start + torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                   n_positions=16, bos_token_id=0, eos_token_id=0))
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=10, per_device_train_batch_size=8,
                             learning_rate=5e-3, optim="adamw_torch_fused", report_to=[],
                             save_strategy="no", logging_steps=1000, disable_tqdm=True,
                             use_cpu=True, seed=0)
    health = HealthCallback()  # keywords are fh.Monitor's, e.g. warmup_steps=, on_nonfinite=
    Trainer(model=model, args=args, train_dataset=Counting(), callbacks=[health]).train()

    mon = health.monitor
    for e in mon.events:
        print(f"step {e.step}: {e.severity} {e.kind}: {e.message}")
    with open(mon.run_dir / "steps.jsonl") as f:  # <output_dir>/fasthealth/run-NNN/
        steps = [json.loads(line) for line in f]
    last = steps[-1]
    alarms = sum(e.severity == "alarm" for e in mon.events)
    print(f"hf_trainer: {len(steps)} steps logged, {alarms} alarms, "
          f"{sum(r['skipped'] for r in steps)} skipped, clip at {args.max_grad_norm}, "
          f"last loss {last['loss']:.3f}, grad norm {last['grad_norm']:.3f}")
