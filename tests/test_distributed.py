"""docs/spec.md section 8 with Gloo on CPU, 2 and 4 processes: DDP and FSDP2 totals equal the
single-process statistics of the full gradients, two all-reduces per call (and one all-gather
at a process group's first call), a NaN on one rank is
seen by every rank, and the Monitor's skip decision agrees on all ranks; pipeline stages (plain
tensors that differ across ranks) are summed, stages of replicas counted once per stage,
hand-written tensor parallelism with `replica_group=False`; replicas that disagree are counted
and named (a `replica_divergence` event); a bad input on one rank raises there and leaves no rank
waiting."""

import math

import pytest
import ranks
import torch
import torch.distributed as dist
from tolerances import check_row, mean_abs_finite

import fasthealth as fh
from fasthealth.ops.reference import tensor_stats_row

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch without FSDP2
    fully_shard = None

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 3))


def batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :3] * 2


COLLECTIVES = ["all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce",
               "reduce_scatter_tensor", "broadcast", "gather", "all_to_all_single"]


def count_collectives(fn):
    """Runs fn counting every torch.distributed collective it calls."""
    calls = []
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name):
        def wrapped(*a, **k):
            calls.append(name)
            return real[name](*a, **k)
        return wrapped

    for name in real:
        setattr(dist, name, counting(name))
    try:
        out = fn()
    finally:
        for name, f in real.items():
            setattr(dist, name, f)
    return out, len(calls)


def check_total(got_row, full_grads, what):
    flat = torch.cat([g.detach().double().flatten() for g in full_grads])
    check_row(got_row, tensor_stats_row(flat), mean_abs_finite(flat), False, what)


def _ddp(rank, world):
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = batch(rank)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    s, n_coll = count_collectives(lambda: fh.check_grads(ddp, process_group=dist.group.WORLD))
    assert n_coll == 3  # the group's first call finds its replica sets: one all-gather
    s, n_coll = count_collectives(lambda: fh.check_grads(ddp, process_group=dist.group.WORLD))
    assert n_coll == 2  # then two all-reduces a call
    local = fh.check_grads(model)  # the replicated full gradients, counted once
    check_total(s.raw[-1], [p.grad for p in model.parameters()], f"ddp rank {rank}")
    assert s.total.numel.item() == local.total.numel.item()  # not world times
    assert s.ok
    # a NaN in one rank's copy (after the all-reduce) is seen by every rank
    if rank == world - 1:
        model[0].weight.grad[1, 1] = float("nan")
    s = fh.check_grads(ddp, process_group=dist.group.WORLD)
    assert not s.all_finite.item(), f"rank {rank} did not see the NaN"
    # ... and counted in the total, the bad replica's copy standing for its set
    assert s.total.nan_count.item() == 1
    # which replica went astray: the last one, when three others agree; both of two
    want = [world - 1] if world > 2 else [0, 1]
    assert s.mismatched_ranks() == want and s.replica_mismatch.item() == len(want), rank
    # silent corruption: a finite value off on one rank is found too
    model[0].weight.grad[1, 1] = 0.5
    if rank == world - 1:
        model[0].weight.grad[2, 2] += 1e-3
    s = fh.check_grads(ddp, process_group=dist.group.WORLD)
    assert s.ok and s.mismatched_ranks() == want, rank
    model[0].weight.grad[2, 2] = 0.25
    s = fh.check_grads(ddp, process_group=dist.group.WORLD)
    assert s.replica_mismatch.item() == 0 and s.mismatched_ranks() == []


def _stages(rank, world):
    """Pipeline stages: rank r holds its own layers (plain tensors, names and shapes of its
    own); with 4 ranks, 2 stages of 2 replicas each."""
    stages = world if world == 2 else 2
    stage = rank % stages
    torch.manual_seed(10 + stage)
    layer = torch.nn.Linear(6 + 3 * stage, 5)
    g = torch.Generator().manual_seed(20 + stage)
    for p in layer.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    named = [(f"stage{stage}.{n}", p) for n, p in layer.named_parameters()]
    s, n_coll = count_collectives(lambda: fh.check_grads(named, process_group=dist.group.WORLD))
    assert n_coll == 3  # the sets found at the group's first call, then two all-reduces
    every = []
    for st in range(stages):  # every stage's gradients, as the reference sees them
        torch.manual_seed(10 + st)
        other = torch.nn.Linear(6 + 3 * st, 5)
        g = torch.Generator().manual_seed(20 + st)
        every += [torch.randn(p.shape, generator=g) for p in other.parameters()]
    check_total(s.raw[-1], every, f"stages rank {rank}")
    assert s.mismatched_ranks() == [] and s.ok
    # hand-written tensor parallelism: the same names and shapes, different values: only
    # replica_group=False (no two ranks hold the same tensors) adds them up
    w = torch.nn.Parameter(torch.zeros(4, 4))
    w.grad = torch.full((4, 4), float(rank + 1))
    s = fh.check_grads([("w", w)], process_group=dist.group.WORLD, replica_group=False)
    check_total(s.raw[-1], [torch.full((4, 4), float(r + 1)) for r in range(world)],
                f"tensor parallel rank {rank}")
    # a DP group given explicitly: ranks {0, 2} and {1, 3} hold the same shard
    if world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        w.grad = torch.full((4, 4), float(rank % 2 + 1))
        s = fh.check_grads([("w", w)], process_group=dist.group.WORLD,
                           replica_group=groups[rank % 2])
        check_total(s.raw[-1], [torch.full((4, 4), 1.0), torch.full((4, 4), 2.0)],
                    f"tp x dp rank {rank}")
        assert s.mismatched_ranks() == []


def _bad_input(rank, world):
    """One rank passes a complex gradient: it raises its own error; the others get a NaN total
    with all_finite False instead of waiting in the collective."""
    dtype = torch.complex64 if rank == 1 else torch.float32
    w = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    w.grad = torch.ones(3, dtype=dtype)
    if rank == 1:
        with pytest.raises(TypeError, match="complex"):
            fh.check_grads([("w", w)], process_group=dist.group.WORLD)
    else:
        s = fh.check_grads([("w", w)], process_group=dist.group.WORLD)
        assert not s.all_finite.item() and torch.isnan(s.total.norm).item()


def _monitor_divergence(rank, world):
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=3)
    for step in range(6):
        x, y = batch(rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if step == 4 and rank == world - 1:  # a bit flip on one replica after the all-reduce
            model[2].weight.grad[0, 0] += 1.0
        mon.step(loss)
    mon.close()
    ev = [e for e in mon.events if e.kind == "replica_divergence"]
    # the gradients at the step (the parameters that step made differ, found at the flush's
    # comparison of the weights, are a repeat within the same incident)
    assert [e.step for e in ev] == [4], [(e.step, e.kind) for e in mon.events]
    assert ev[0].details["ranks"] == ([world - 1] if world > 2 else [0, 1])


def _alike(rank, world):
    """Two of five replicas going astray alike (ranks 2 and 4): not named by the reductions
    (a side of two), named by the extra all-gather: ``mismatched_ranks(group)`` on every
    rank, and the Monitor's ``replica_divergence`` events, for the gradients at their step
    and for the parameters at the flush that compares them."""
    odd = rank in (2, 4)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = batch(rank)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    if odd:
        model[2].weight.grad[0, 0] += 1.0
    s = fh.check_grads(model, process_group=dist.group.WORLD)
    assert s.replica_mismatch.item() == 2 and s.mismatched_ranks() == []
    assert s.mismatched_ranks(dist.group.WORLD) == [2, 4]
    assert s.replica_odd.item() == odd

    for where in ("gradients", "parameters"):
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=3)
        for step in range(6):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            if odd and step == 3 and where == "gradients":
                model[2].weight.grad[0, 0] += 1.0
            mon.step(torch.tensor(1.0))
            if odd and step == 4 and where == "parameters":
                with torch.no_grad():
                    model[4].bias[0] += 1.0
        mon.close()
        ev = [e for e in mon.events if e.kind == "replica_divergence"]
        assert [(e.step, e.details["ranks"], e.details["count"]) for e in ev] == [
            (3 if where == "gradients" else 5, [2, 4], 2)], (where, [
                (e.step, e.kind, e.details) for e in mon.events])
        assert "ranks 2 and 4" in ev[0].message or "2, 4" in ev[0].message, ev[0].message
    # the DDP wrapper's names ("module.0.weight") were not those of the group's first call:
    # each rank is a set of its own, and no set is reported astray (all five were, before)
    s = fh.check_grads(ddp, process_group=dist.group.WORLD)
    assert s.replica_mismatch.item() == 0 and s.mismatched_ranks(dist.group.WORLD) == []


def _fsdp(rank, world):
    model = make_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    x, y = batch(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    assert type(grads[0]).__name__ == "DTensor"
    s, n_coll = count_collectives(lambda: fh.check_grads(model, process_group=dist.group.WORLD))
    assert n_coll == 3  # the sets found at the group's first call, then two all-reduces
    full = [g.full_tensor() for g in grads]
    check_total(s.raw[-1], full, f"fsdp2 rank {rank}")
    assert s.total.numel.item() == sum(f.numel() for f in full)
    # per-tensor stats are the local shards', under the global names
    assert s.names == [n for n, _ in model.named_parameters()]
    assert s[0].numel.item() == grads[0].to_local().numel()
    # a NaN planted in one rank's shard is reported on every rank
    if rank == 1:
        grads[2].to_local().view(-1)[0] = float("nan")
    s = fh.check_grads(model, process_group=dist.group.WORLD)
    assert not s.all_finite.item() and s.total.nan_count.item() == 1, rank

    # Monitor: a NaN only in rank 1's shard at step 2 makes every rank skip that step
    model = make_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=2, warmup_steps=2)
    for step in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == 2 and rank == 1:
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
        before = [p.to_local().clone() for p in model.parameters()]
        obs = mon.step(loss)
        after = [p.to_local() for p in model.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        assert bool(obs.skip) == (step == 2), (rank, step)
        assert unchanged == (step == 2), (rank, step)
    mon.close()
    assert [(e.step, e.kind) for e in mon.events if e.kind == "nonfinite_grad"] == \
        [(2, "nonfinite_grad")]


def _spike_skip(rank, world):
    """on_spike="skip" under DDP: a bad batch on one rank only (its loss spikes there; the
    all-reduced gradient is every rank's) is skipped by every rank, and the replicas stay
    equal."""
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mon = fh.Monitor(ddp, opt, on_spike="skip", process_group=dist.group.WORLD,
                     flush_every=100)
    skips = []
    for step in range(60):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=g)
        y = x[:, :3] * 2
        if step == 50 and rank == 0:
            y = y * 50.0
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        skips.append(mon.step(loss).skip.item())
        opt.zero_grad()
    mon.close()
    assert skips[50] and sum(skips) == 1, (rank, [i for i, s in enumerate(skips) if s])
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered), "replicas diverged"


def _nan_origin(rank, world):
    """A NaN made on one rank (its batch) reaches every rank through DDP's all-reduce; the
    Monitor's DDP hook saw it in that rank's own gradients first, and every rank's event names
    it. The Monitor takes the DDP model itself, as a loop that steps the wrapped model."""
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(ddp, opt, process_group=dist.group.WORLD, flush_every=4)
    assert mon._origin is not None
    for step in range(4):
        x, y = batch(rank)
        if step == 2 and rank == world - 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        obs = mon.step(loss)
        assert bool(obs.skip) == (step == 2), (rank, step)
    mon.close()
    _origin_named(mon, 2, world - 1)


def _sdc(rank, world, skip=False):
    """Silent data corruption on one rank: the top exponent bit of one element of the
    gradient its second linear layer hands back (the backward's matmul output, below 1: 2^128
    times it stays finite) flipped at steps 10, 20 and 30 (``fasthealth.faults.BitFlip``, as a
    GPU's faulty multiply would). The loss does not see it; the first layer's gradients are
    finite and wrong, averaged into every replica by
    DDP. Every rank's Monitor names that rank at each of those steps (its own gradients before
    the reduction, against the others'), a notice twice and then an alarm; no other step
    names a rank (the ranks' batches differ). With ``on_spike="skip"`` those steps are
    skipped on every rank (at step 10 the device spike rule's window is not armed yet: the
    skip is the own-gradient test's), and the replicas stay equal."""
    from fasthealth.faults import BitFlip

    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(ddp, opt, process_group=dist.group.WORLD, flush_every=10,
                     max_grad_norm=1.0, on_spike="skip" if skip else "warn")
    bad = world - 1
    flips = [BitFlip(model[2], at=t, bit=30, where="grad_input", seed=t)
             for t in (10, 20, 30)] if rank == bad \
        else []
    g = torch.Generator().manual_seed(100 + rank)
    skipped = []
    for t in range(40):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), x[:, :3] * 2)
        loss.backward()
        if mon.step(loss).skip.item():
            skipped.append(t)
    mon.close()
    assert skipped == ([10, 20, 30] if skip else []), (rank, skipped)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered), "replicas diverged"
    assert bool(torch.isfinite(flat).all()) and float(flat.abs().max()) < (10 if skip else 1e30)
    assert all(f.flipped is not None and 1e30 < abs(f.flipped[3]) < math.inf for f in flips), \
        [f.flipped for f in flips]
    ev = [e for e in mon.events if e.kind == "sdc_suspect"]
    # the second naming, in the incident the first opened, is counted on the first's event
    assert [(e.step, e.severity, e.details["rank"], e.details["times"], e.repeats, e.last_step)
            for e in ev] == [(10, "notice", bad, 1, 1, 20), (30, "alarm", bad, 3, 0, None)], \
        [(e.step, e.severity, e.details["rank"], e.details["times"], e.repeats, e.last_step)
         for e in ev]
    assert all(e.details["ratio"] > 1e20 for e in ev), [e.details for e in ev]
    assert "take its GPU out of the job" in ev[-1].message
    assert ("skipped on every rank" in ev[0].message) == skip


def _origin_named(mon, step, rank):
    """The Monitor's one ``nonfinite_grad`` event is at ``step`` and names ``rank``."""
    ev = [e for e in mon.events if e.kind == "nonfinite_grad"]
    assert [e.step for e in ev] == [step], [(e.step, e.kind) for e in mon.events]
    assert ev[0].details["origin_rank"] == rank, ev[0].details
    assert f"made on rank {rank} before the gradients were reduced" in ev[0].message


def _rollback(rank, world):
    """nanoGPT's loop under DDP with rollback: one rank's weights corrupted after a step (as
    its memory could be); the ranks' incidents differ (that rank's weights, the others' loss
    and replicas), and every rank rolls back at the same flush to the same snapshot, after
    which the replicas are equal again and train on."""
    from nanogpt import GPT, batch, text

    torch.manual_seed(0)
    model = GPT()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    mon = fh.Monitor(ddp, opt, max_grad_norm=1.0, process_group=dist.group.WORLD,
                     rollback=fh.RollbackConfig(every=100))
    data, g = text(), torch.Generator().manual_seed(rank)
    losses = []
    for step in range(400):
        x, y = batch(data, g)
        loss = ddp(x, y)
        loss.backward()
        mon.step(loss.detach(), sample_ids=torch.arange(len(x)) + (step * world + rank) * 8)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 280 and rank == world - 1:
            with torch.no_grad():
                model.blocks[0].mlp[0].weight[:, 5] = 1e3
    mon.close()
    (rb,) = mon.rollbacks
    assert rb.to_step < 280 <= rb.step < 280 + 50, rb
    back = torch.tensor([rb.step, rb.to_step], dtype=torch.float64)
    every = [torch.empty_like(back) for _ in range(world)]
    dist.all_gather(every, back)
    assert all(torch.equal(b, back) for b in every), every  # the same rollback everywhere
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered), "replicas differ after it"
    assert max(losses[-20:]) < losses[270] * 1.5, (losses[270], losses[-20:])


def _fsdp_nan_origin(rank, world, hsdp=False):
    """FSDP2 (each Linear and the root sharded), or HSDP (2 replicas x 2 shards): a NaN made on
    one rank's batch reaches every rank's shards through the reduce-scatter; the Monitor's
    watching reduce-scatter saw it in that rank's own unsharded gradients first, and every
    rank's event names it. Two micro-batches per step, the first without gradient sync: the
    NaN is in the first, so it is seen in the accumulated gradients at the second."""
    model = make_model()
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=4)
    assert mon._origin is not None
    bad = world - 2
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(rank + 10 * micro)
            if step == 2 and micro == 0 and rank == bad:
                x[0, 0] = float("nan")
            model.set_requires_gradient_sync(micro == 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        obs = mon.step(loss)
        assert bool(obs.skip) == (step == 2), (rank, step)
    mon.close()
    _origin_named(mon, 2, bad)


def _fsdp_sdc(rank, world, hsdp=False):
    """FSDP2, or HSDP (2 replicas x 2 shards): the top exponent bit of one element of the
    gradient the second linear layer hands back flipped on one rank at step 6; the watching
    reduce-scatter measured that rank's own unsharded gradients, and every rank names it."""
    from fasthealth.faults import BitFlip

    model = make_model()
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flip = BitFlip(model[2], at=6, bit=30, where="grad_input", seed=6) if rank == 1 else None
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=4,
                     max_grad_norm=1.0)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(12):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x[:, :3] * 2)
        loss.backward()
        mon.step(loss)
    mon.close()
    assert flip is None or (flip.flipped is not None and abs(flip.flipped[3]) > 1e30), flip
    ev = [(e.step, e.details["rank"]) for e in mon.events if e.kind == "sdc_suspect"]
    assert ev == [(6, 1)], [(e.step, e.kind, e.details) for e in mon.events]


def _hsdp_weights(rank, world):
    """HSDP (2 replicas x 2 shards): a bit flipped in one rank's shard of a weight leaves the
    reduced gradients alike, and the comparison of the parameters across the replicate
    dimension, at the flush, names the tensor and the two ranks that hold that shard (a set of
    two that disagrees: both named, by the extra all-gather)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=3)
    x, y = batch(rank)
    for step in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 4 and rank == 3:  # one bit of rank 3's shard of the second weight
            with torch.no_grad():
                w = model[2].weight.to_local().view(-1)
                w[1] = (w[1:2].view(torch.int32) ^ (1 << 3)).view(torch.float32)[0]
        mon.step(torch.tensor(1.0))
    mon.close()
    ev = [e for e in mon.events if e.kind == "replica_divergence"]
    assert [(e.step, e.details["tensor"], e.details["count"]) for e in ev] == \
        [(5, "2.weight", 2)], [(e.step, e.kind, e.details) for e in mon.events]
    assert ev[0].details["ranks"] == [1, 3]  # that shard's two replicas: which one is bad?


def _scenario(rank, world, scenario):
    {"ddp": _ddp, "fsdp": _fsdp, "stages": _stages, "bad_input": _bad_input,
     "monitor_divergence": _monitor_divergence, "spike_skip": _spike_skip,
     "nan_origin": _nan_origin, "rollback": _rollback, "sdc": _sdc,
     "sdc_skip": lambda r, w: _sdc(r, w, skip=True), "fsdp_sdc": _fsdp_sdc,
     "hsdp_sdc": lambda r, w: _fsdp_sdc(r, w, hsdp=True),
     "hsdp_weights": _hsdp_weights, "fsdp_nan_origin": _fsdp_nan_origin, "alike": _alike,
     "hsdp_nan_origin": lambda r, w: _fsdp_nan_origin(r, w, hsdp=True)}[scenario](rank, world)


def run(world, scenario):
    ranks.spawn(_scenario, world, scenario)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ddp(world):
    run(world, "ddp")


@pytest.mark.slow
@pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)")
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2(world):
    run(world, "fsdp")


@pytest.mark.slow
@pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)")
def test_hsdp_weights_compared_across_the_replicate_dimension():
    run(4, "hsdp_weights")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_whose_own_gradients_a_flipped_bit_corrupted_is_named(world):
    run(world, "sdc")


@pytest.mark.slow
def test_the_step_a_flipped_bit_corrupted_is_skipped_on_every_rank():
    run(4, "sdc_skip")


@pytest.mark.slow
@pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)")
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_a_flipped_bits_rank_is_named_under_fsdp2(layout):
    run(4, f"{layout}_sdc")


def test_the_largest_rank_over_the_others_mean_from_the_two_reductions():
    """``own_ratio``, ``own_rank`` from the MAX and SUM vectors: the others' mean is summed
    without the largest (no cancellation at 1e38), no rank is named on a tie or with fewer
    than two ranks measured, and a zero mean of the others names none."""
    from fasthealth import distributed as D

    def reduced(norms):
        top = torch.full((D.M_HEAD,), float("-inf"), dtype=torch.float64)
        add = torch.zeros(D.S_HEAD, dtype=torch.float64)
        top[D.M_OWN] = max(norms)
        at_top = [r for r, v in enumerate(norms) if v == max(norms)]
        add[D.S_OWN] = sum(v for v in norms if v != max(norms))
        add[D.S_OWNS], add[D.S_TOP], add[D.S_TOP_RANK] = len(norms), len(at_top), sum(at_top)
        return [float(v) for v in D._own(top, add)]

    assert reduced([1.0, 2.0, 1.5e38, 3.0]) == [1.5e38 / 2.0, 2.0]
    assert reduced([1.0, 4.0]) == [4.0, 1.0]
    ratio, rank = reduced([4.0, 1.0, 4.0])
    assert ratio == 4.0 and math.isnan(rank)  # a tie: measured, no rank named
    assert all(math.isnan(v) for v in reduced([5.0]))
    assert all(math.isnan(v) for v in reduced([0.0, 0.0, 7.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_ranks_own_norm_is_measured_where_its_square_overflows(dtype):
    """``NonFiniteOrigin.note``: the buckets' squared norms add up in float64; a bucket whose
    sum of squares overflows its dtype (an element of 1.5e36) counts its largest element as its
    norm (a lower bound), and a bucket with NaN is flagged and leaves the norm NaN."""
    from fasthealth.replicas import NonFiniteOrigin

    o = NonFiniteOrigin()
    big = torch.ones(1000, dtype=dtype)
    big[3] = 1.5e36
    o.note(big)
    o.note(torch.full((4,), 2.0, dtype=dtype))
    flag, squares = o.take().tolist()
    assert flag == 0 and squares == pytest.approx(float(big[3]) ** 2 + 16, rel=1e-6)
    assert o.take() is None  # taken: starts again
    o.note(torch.tensor([float("nan"), 1.0], dtype=dtype))
    flag, squares = o.take().tolist()
    assert flag == 1 and math.isnan(squares)


@pytest.mark.slow
def test_several_ranks_differing_alike_are_named():
    run(5, "alike")


@pytest.mark.slow
@pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)")
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_nan_named_with_its_rank_under_fsdp2(layout):
    run(4, f"{layout}_nan_origin")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["stages", "bad_input", "monitor_divergence",
                                      "spike_skip", "nan_origin", "rollback"])
def test_layouts_replicas_and_errors(world, scenario):
    run(world, scenario)
