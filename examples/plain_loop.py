"""fasthealth in a hand-written training loop: the one-call check, then the Monitor.

    python examples/plain_loop.py

A small regression model trains for 60 steps; one sample of step 40 holds a NaN. The Monitor
catches it on the device, skips that optimizer step (the weights stay finite), saves the batch,
and fh.replay says the batch itself is the cause and which sample it was.
"""

import tempfile

import torch

import fasthealth as fh

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # fused: skips with no sync
x_all = torch.randn(60 * 32, 16)
y_all = x_all[:, :4].sum(1, keepdim=True)
x_all[40 * 32 + 7, 3] = float("nan")  # sample 1287, in step 40's batch

def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)

# 1. The one-call check, after backward: one fused pass, nothing copied to the host yet.
loss_fn(model, (x_all[:32], y_all[:32])).backward()
s = fh.check_grads(model)
print(f"check_grads: ok={s.ok} total norm={s.total.norm.item():.4f} nonfinite={s.nonfinite()}")
print(s.summary(k=3))
opt.zero_grad()

# 2. The Monitor: checks, clips with the norm it computed, steps or skips, logs.
with tempfile.TemporaryDirectory() as log_dir:
    mon = fh.Monitor(model, opt, log_dir=log_dir, max_grad_norm=1.0, flush_every=20)
    for step in range(60):
        ids = torch.arange(step * 32, (step + 1) * 32)
        batch = (x_all[ids], y_all[ids])
        loss = loss_fn(model, batch)
        loss.backward()
        obs = mon.step(loss, batch=batch, sample_ids=ids)  # replaces opt.step()
        opt.zero_grad()
    mon.close()  # the final flush
    for e in mon.events:  # severity: "alarm" (the run is in trouble) or "notice"
        print(f"step {e.step}: {e.severity} {e.kind}: {e.message[:90]}...")
    inc = mon.incidents[0]  # the events of one fault, with one dump
    r = fh.replay(inc.dump, model, loss_fn)
    print(r.verdict)
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    alarms = sum(e.severity == "alarm" for e in mon.events)
    print(f"plain_loop: {len(mon.incidents)} incident ({inc.trigger} at step {inc.start}, "
          f"{alarms} alarms, likely cause {inc.cause}: {r.cause} on replay), "
          f"skipped={inc.events[0].details['skipped']}, replay "
          f"source={r.source} culprit_ids={r.culprit_ids}, weights finite={finite}, "
          f"last loss {obs.loss.item():.4f}")
