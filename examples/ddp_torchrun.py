"""fasthealth under torchrun with DistributedDataParallel (Gloo on CPU; NCCL works the same).

    torchrun --nproc_per_node=2 examples/ddp_torchrun.py

Each rank trains the same small model on its own data. At step 12 rank 1's batch holds a NaN:
the loss is NaN on rank 1 only, and the all-reduce spreads the NaN to both ranks' gradients.
With process_group= the check's totals are the whole model's (one all-gather per step, each
element counted once) and every rank takes the same skip decision, so the replicas stay equal.
"""

import json
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fasthealth as fh

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
ddp = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
g = torch.Generator().manual_seed(100 + rank)  # different data on every rank

with tempfile.TemporaryDirectory() as tmp:
    # under a process group rank 0 alone writes logs, unless all_ranks=True: then rank k
    # writes its own runs, LOG_DIR/rank-k/run-NNN/ (here each rank has a temp dir of its own)
    mon = fh.Monitor(model, opt, log_dir=tmp, flush_every=10, process_group=dist.group.WORLD,
                     all_ranks=True)
    for step in range(30):
        x = torch.randn(32, 16, generator=g)
        y = x[:, :4].sum(1, keepdim=True)
        if step == 12 and rank == 1:
            x[5, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        obs = mon.step(loss, batch=(x, y))
        opt.zero_grad()
    mon.close()
    norm = obs.stats.total.norm.item()  # the last step's check: the whole model's grad norm
    with open(mon.run_dir / "steps.jsonl") as f:
        skipped = [r["step"] for r in map(json.loads, f) if r["skipped"]]

    # the replicas must still agree: compare every rank's weights with rank 0's
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    kinds = "+".join(sorted({f"{e.kind}@{e.step}" for e in mon.events}))
    everyone = [None] * world
    dist.all_gather_object(everyone, (kinds, skipped, torch.equal(flat, ref)))
    if rank == 0:  # one process prints: the ranks' lines would interleave
        for r, (seen, _, _) in enumerate(everyone):
            print(f"rank {r}: {seen}")
        print(f"ddp_torchrun: {world} ranks, skipped steps {[s for _, s, _ in everyone]}, "
              f"replicas equal={all(e for _, _, e in everyone)}, last grad norm {norm:.4f}")
dist.destroy_process_group()
