"""accelerate's loop (transformers' run_clm_no_trainer.py shape): ``Accelerator(
gradient_accumulation_steps=2)``, ``prepare``, ``with accelerator.accumulate(model):``,
``accelerator.backward(loss)``, and ``mon.step(loss)`` where ``optimizer.step()`` was. The
Monitor steps the optimizer exactly as often as accelerate would: the same weights as the loop
without it, and a NaN micro-batch skips its whole step."""

import pytest
import torch

import fasthealth as fh

accelerate = pytest.importorskip("accelerate")  # the Makefile's TRAINERS install it


def _loop(monitor, steps=12, accumulate=2, nan_at=None, sync_only=False):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    acc = Accelerator(gradient_accumulation_steps=accumulate, cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(steps * accumulate * 4, 6),
                                          torch.randn(steps * accumulate * 4, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    mon = fh.Monitor(model, opt, scheduler=sched, flush_every=4) if monitor else None
    taken = []
    inner = opt.optimizer
    inner.register_step_post_hook(lambda *a: taken.append(1))
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            if nan_at is not None and i == nan_at:
                x = x.clone()
                x[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if mon is None:
                opt.step()
            elif not sync_only or acc.sync_gradients:
                mon.step(loss, batch=(x, y))
            sched.step()
            opt.zero_grad()
    if mon is not None:
        mon.close()
    return model, len(taken), mon


@pytest.mark.parametrize("sync_only", [False, True])
def test_the_monitor_steps_as_often_as_accelerate_and_the_weights_are_the_same(sync_only):
    plain, plain_steps, _ = _loop(monitor=False)
    watched, steps, mon = _loop(monitor=True, sync_only=sync_only)
    assert plain_steps == steps == 12
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)
    assert not mon.events, [e.message for e in mon.events]
    assert mon.steps_seen == 12  # one record per optimizer step, not per micro-batch


def test_a_nan_micro_batch_skips_its_whole_step():
    _, steps, mon = _loop(monitor=True, nan_at=5)  # step 2's second micro-batch
    assert steps == 11
    assert [(e.step, e.kind) for e in mon.events][:1] == [(2, "nonfinite_loss")] or \
        [(e.step, e.kind) for e in mon.events][:1] == [(2, "nonfinite_grad")], mon.events
