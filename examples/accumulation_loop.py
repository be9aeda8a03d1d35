"""fasthealth in a loop shaped like nanoGPT's train.py: gradient accumulation and a prefetched
next batch.

    python examples/accumulation_loop.py

nanoGPT divides each micro-batch's loss by the accumulation steps and fetches the next batch
right after the forward, before the backward, so that at the end of a step ``X, Y`` already
hold the *next* step's batch and ``loss`` only the last micro-batch's share. The Monitor must
get the step's own batch and the step's whole loss: keep the micro-batches (and their sample
ids) as they are trained on, add up the scaled micro-losses, and pass those. Here one
micro-batch of step 40 has garbage targets; the Monitor raises a loss spike at that step, its
dump holds that step's two micro-batches, and fh.replay reproduces the spike from them.
"""

import tempfile

import torch

import fasthealth as fh

torch.manual_seed(0)
VOCAB, BLOCK, MICRO, ACCUM, STEPS = 32, 16, 8, 2, 60


class TinyLM(torch.nn.Module):
    """nanoGPT's interface: ``model(idx, targets) -> (logits, loss)``."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, 32)
        self.lm_head = torch.nn.Linear(32, VOCAB)

    def forward(self, idx, targets):
        logits = self.lm_head(self.wte(idx))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


data = torch.randint(VOCAB, (4096,))
data[1::2] = (data[::2] + 1) % VOCAB  # every other token follows from the one before
draws = 0


def get_batch():
    """nanoGPT's get_batch, returning the offsets it drew too: they are the sample ids."""
    global draws
    ix = torch.randint(len(data) - BLOCK - 1, (MICRO,))
    x = torch.stack([data[i:i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
    if draws == 40 * ACCUM:  # the first micro-batch of step 40: garbage targets
        y = torch.randint(VOCAB, y.shape)
    draws += 1
    return x, y, ix


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16

with tempfile.TemporaryDirectory() as log_dir:
    mon = fh.Monitor(model, optimizer, log_dir=log_dir, max_grad_norm=1.0, scaler=scaler,
                     flush_every=20)
    X, Y, ids = get_batch()  # fetch the very first batch
    for _step in range(STEPS):
        micro, micro_ids, step_loss = [], [], torch.zeros(())
        for _ in range(ACCUM):
            logits, loss = model(X, Y)
            loss = loss / ACCUM  # scale to account for gradient accumulation
            micro.append((X, Y))  # the batch this step trains on...
            micro_ids.append(ids)
            step_loss += loss.detach()  # ... and its loss: the mean over the micro-batches
            X, Y, ids = get_batch()  # prefetch: from here on X, Y are the NEXT step's batch
            scaler.scale(loss).backward()
        # replaces clip_grad_norm_, scaler.step(optimizer) and scaler.update()
        mon.step(step_loss, batch=micro, sample_ids=torch.cat(micro_ids))
        optimizer.zero_grad(set_to_none=True)
    mon.close()

    inc = mon.incidents[0]
    dump = torch.load(inc.dump, weights_only=True)

    def loss_fn(m, batch):  # the dumped batch is the list of micro-batches
        return sum(m(x, y)[1] for x, y in batch) / len(batch)

    r = fh.replay(inc.dump, model, loss_fn)
    print(r.verdict)
    print(f"accumulation_loop: {len(mon.incidents)} incident ({inc.trigger} at step "
          f"{inc.start}), dump holds {len(dump['batch'])} micro-batches, recorded loss "
          f"{dump['record']['loss']:.4f}, replayed {r.loss:.4f}, reproduced={r.reproduced}, "
          f"cause {r.cause}")
