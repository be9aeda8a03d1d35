"""docs/spec.md section 8 in a simulated world larger than a test machine can spawn: every rank
a thread of this process, the collectives torch.distributed's own calls computed across the
threads (a real MAX, SUM and all-gather over every rank's tensor), the process group torch's
fake one. What real processes check with Gloo (test_distributed.py) holds here at 64 and 96
ranks: a replica that went astray on a rank above 51 (beyond a float64 bit mask) is named, a
NaN on one rank is seen and counted by every rank, the totals are the statistics of every
rank's data, counted once per replica set, and one bit flipped in one replica's weights is an
alarm naming the tensor and the rank."""

import threading

import pytest
import torch
import torch.distributed as dist
from tolerances import check_row, mean_abs_finite

import fasthealth as fh
from fasthealth import distributed as fdist
from fasthealth.ops.reference import tensor_stats_row

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")


class World:
    """``world`` threads, each a rank: ``run(fn)`` calls ``fn(rank)`` on every thread, and the
    collectives they call meet at a barrier and combine every rank's tensor."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.local = threading.local()
        self.barrier = threading.Barrier(world)
        self.inputs: list[torch.Tensor | None] = [None] * world
        self.result: torch.Tensor | None = None

    def rank(self, group=None) -> int:
        return self.local.rank

    def size(self, group=None) -> int:
        return self.world

    def _meet(self, tensor: torch.Tensor, combine) -> torch.Tensor:
        r = self.local.rank
        self.inputs[r] = tensor.clone()
        if self.barrier.wait() == 0:
            self.result = combine(torch.stack(self.inputs))
        self.barrier.wait()
        out = self.result
        self.barrier.wait()  # everyone has read it before the next collective
        return out

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        combine = {dist.ReduceOp.SUM: lambda t: t.sum(0), dist.ReduceOp.MAX: lambda t: t.amax(0),
                   dist.ReduceOp.MIN: lambda t: t.amin(0)}[op]
        tensor.copy_(self._meet(tensor, combine))

    def all_gather_into_tensor(self, out, tensor, group=None, async_op=False):
        out.copy_(self._meet(tensor, lambda t: t.reshape(-1)).reshape(out.shape))

    def run(self, fn) -> list:
        results: list = [None] * self.world
        errors: list = []

        def body(r: int) -> None:
            self.local.rank = r
            try:
                results[r] = fn(r)
            except BaseException as exc:  # reported below, on the test's thread
                errors.append((r, exc))
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0][1]
        return results


@pytest.fixture
def world(monkeypatch, request):
    n = request.param
    w = World(n)
    fdist._SETS.clear()
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=n)
    monkeypatch.setattr(dist, "get_rank", w.rank)
    monkeypatch.setattr(dist, "get_world_size", w.size)
    monkeypatch.setattr(dist, "all_reduce", w.all_reduce)
    monkeypatch.setattr(dist, "all_gather_into_tensor", w.all_gather_into_tensor)
    if hasattr(dist, "all_gather_single"):
        monkeypatch.setattr(dist, "all_gather_single", w.all_gather_into_tensor)
    torch.set_num_threads(1)
    yield w
    dist.destroy_process_group()
    fdist._SETS.clear()


def replica_grads(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in (("a.weight", (8, 5)), ("a.bias", (8,)), ("b.weight", (3, 8))):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g)
        out.append((name, p))
    return out


@pytest.mark.parametrize("world", [64, 96], indirect=True)
def test_a_replica_astray_above_rank_51_is_named_and_a_nan_counted_once(world):
    bad = world.world - 3  # above the bit mask's 52 ranks

    def step(rank):
        params = replica_grads()
        first = fh.check_grads(params, process_group=dist.group.WORLD)
        if rank == bad:  # silent corruption: one bit of one value
            g = params[0][1].grad.view(-1)
            g[7] = (g[7:8].view(torch.int32) ^ 1).view(torch.float32)[0]
        astray = fh.check_grads(params, process_group=dist.group.WORLD)
        if rank == bad:
            params[2][1].grad[1, 1] = float("nan")
        nan = fh.check_grads(params, process_group=dist.group.WORLD)
        return first, astray, nan

    results = world.run(step)
    full = [p.grad for _, p in replica_grads()]
    for rank, (first, astray, nan) in enumerate(results):
        flat = torch.cat([g.double().flatten() for g in full])
        check_row(first.raw[-1], tensor_stats_row(flat), mean_abs_finite(flat), False,
                  f"rank {rank}")  # the replicas counted once
        assert first.mismatched_ranks() == [] and first.replica_mismatch.item() == 0
        assert astray.mismatched_ranks() == [bad], rank
        assert astray.replica_mismatch.item() == 1 and astray.ok
        assert not nan.all_finite.item() and nan.total.nan_count.item() == 1, rank
        assert nan.mismatched_ranks() == [bad]


@pytest.mark.parametrize("world", [64], indirect=True)
def test_pipeline_stages_of_replicas_sum_each_stage_once(world):
    """8 stages (their own tensors) of 8 replicas each: the total is the 8 stages' data; a bad
    replica in one stage is named, the others' sets agree."""

    def stage_params(stage):
        g = torch.Generator().manual_seed(100 + stage)
        p = torch.nn.Parameter(torch.zeros(4 + stage, 3))
        p.grad = torch.randn(p.shape, generator=g) * (stage + 1)
        return [(f"stage{stage}.w", p)]

    def step(rank):
        params = stage_params(rank % 8)
        fh.check_grads(params, process_group=dist.group.WORLD)
        if rank == 61:
            params[0][1].grad[0, 0] += 1.0
        return fh.check_grads(params, process_group=dist.group.WORLD)

    results = world.run(step)
    # each stage's set counted through its lowest rank (no NaN/Inf anywhere: ties), whose
    # copy is the one not corrupted
    flat = torch.cat([stage_params(s)[0][1].grad.double().flatten() for s in range(8)])
    for rank, s in enumerate(results):
        assert s.mismatched_ranks() == [61], rank
        check_row(s.raw[-1], tensor_stats_row(flat), mean_abs_finite(flat), False,
                  f"rank {rank}")


@pytest.mark.parametrize("world", [64], indirect=True)
def test_a_monitor_step_skips_on_every_rank_and_names_the_rank(world):
    def run(rank):
        model = torch.nn.Linear(6, 2)
        with torch.no_grad():  # the same weights on every rank (the threads share torch's RNG)
            model.weight.copy_(torch.randn(2, 6, generator=torch.Generator().manual_seed(0)))
            model.bias.zero_()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=4)
        skipped = []
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
        for step in range(4):
            opt.zero_grad()
            model(x).square().mean().backward()
            if step == 2 and rank == 57:
                model.weight.grad[0, 0] = float("nan")
            skipped.append(bool(mon.step(torch.tensor(1.0)).skip))
        mon.close()
        return skipped, [(e.step, e.kind, e.details.get("ranks")) for e in mon.events
                         if e.kind == "replica_divergence"]

    for skipped, events in world.run(run):
        assert skipped == [False, False, True, False]
        assert events == [(2, "replica_divergence", [57])]


@pytest.mark.parametrize("world", [64], indirect=True)
def test_a_bit_flipped_in_one_replicas_weights_is_named_with_the_tensor_and_rank(world):
    """DDP's gradients are averaged (here by the simulated all-reduce), so a weight that went
    astray on one rank leaves the gradients equal: the comparison of the parameters after the
    step, once per flush, finds it, and names the tensor and the rank."""

    def run(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 2))
        with torch.no_grad():  # the same weights on every rank (the threads share torch's RNG)
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = fh.Monitor(model, opt, process_group=dist.group.WORLD, flush_every=4)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
        for step in range(8):
            opt.zero_grad()
            model(x).square().mean().backward()
            for p in model.parameters():  # DDP's all-reduce of the gradients
                dist.all_reduce(p.grad)
                p.grad /= world.world
            if step == 5 and rank == 58:  # one bit of one weight, before the step
                w = model[2].weight.data.view(-1)
                w[3] = (w[3:4].view(torch.int32) ^ (1 << 4)).view(torch.float32)[0]
            mon.step(torch.tensor(1.0))
        mon.close()
        return [(e.step, e.details) for e in mon.events if e.kind == "replica_divergence"]

    for events in world.run(run):
        assert len(events) == 1, events
        step, details = events[0]
        assert step == 7 and details["ranks"] == [58] and details["tensor"] == "2.weight"
