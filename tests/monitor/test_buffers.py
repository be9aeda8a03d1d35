"""A model's buffers as model state (docs/spec.md section 6, "Buffers"): a skipped step leaves
BatchNorm's running statistics as they were before its forward; a NaN that reaches a buffer
anyway is named by the weight scan and by safe_to_save(); replay runs models with in-place
activations and residual adds."""

import pytest
import torch
from torch import nn

import fasthealth as fh

NAN = float("nan")


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def bad_buffers(model):
    return [n for n, b in model.named_buffers() if b.is_floating_point()
            and not b.isfinite().all()]


def train(model, mon, opt, steps, plant=None, micro=1):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for _ in range(micro):
            x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            if plant is not None and step in plant:
                x[2, 0, 1, 1] = NAN
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        mon.step(loss, batch=(x, y), sample_ids=torch.arange(8) + 8 * step)
        opt.zero_grad()


def test_a_skipped_nan_step_leaves_batchnorm_statistics_as_before_its_forward():
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = fh.Monitor(model, opt, flush_every=10)
    bn = model[1]
    train(model, mon, opt, 25)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    train(model, mon, opt, 1, plant={0})
    after = bn.state_dict()
    for k, v in before.items():  # exactly as before the skipped step's forward
        assert torch.equal(after[k], v), k
    train(model, mon, opt, 10)
    mon.close()
    assert not bad_buffers(model)
    assert [i.trigger for i in mon.incidents] == ["nonfinite_loss"]
    assert mon.safe_to_save()
    model.eval()
    assert model(torch.randn(4, 3, 8, 8)).isfinite().all()


def test_the_shadow_is_taken_before_the_first_micro_batch_of_a_step():
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = fh.Monitor(model, opt, flush_every=5)
    train(model, mon, opt, 3, micro=3)
    before = model[1].running_mean.clone()
    train(model, mon, opt, 1, plant={0}, micro=3)  # every micro-batch of the step holds a NaN
    assert torch.equal(model[1].running_mean, before)
    mon.close()


def test_healthy_steps_update_the_buffers_as_without_the_monitor():
    torch.manual_seed(0)
    a, b = cnn(), cnn()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    with fh.Monitor(a, opt_a, flush_every=5) as mon:
        train(a, mon, opt_a, 7)

    class Plain:
        def step(self, loss, **kw):
            opt_b.step()
    train(b, Plain(), opt_b, 7)
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k


def test_a_nan_written_into_a_buffer_is_named_by_the_scan_and_by_safe_to_save():
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = fh.Monitor(model, opt, flush_every=5)
    train(model, mon, opt, 12)
    model[1].running_var[3] = NAN  # outside any step: a bad load, a stray write
    train(model, mon, opt, 5)  # train mode: BatchNorm uses the batch's statistics, loss finite
    ev = [e for e in mon.events if e.kind == "weight_corruption"]
    assert ev and "1.running_var" in ev[0].message, [e.message for e in mon.events]
    v = mon.save_verdict()
    assert not v.safe and "1.running_var" in v.reason + str(v.incident and v.incident.why), v
    mon.close()
    assert not mon.safe_to_save()


def test_the_rollback_snapshot_holds_the_buffers():
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = fh.Monitor(model, opt, flush_every=5, rollback=fh.RollbackConfig(every=5))
    train(model, mon, opt, 30)
    model[1].running_mean.fill_(NAN)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, mon, opt, 10)
    mon.close()
    assert mon.rollbacks, [e.kind for e in mon.events]
    assert not bad_buffers(model)


class Block(nn.Module):
    """torchvision's BasicBlock: in-place ReLU and an in-place residual add."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def resnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.ReLU(inplace=True), Block(8), Block(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def test_replay_runs_in_place_relu_and_residual_adds_and_leaves_the_model_alone(tmp_path):
    torch.manual_seed(0)
    model = resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=5) as mon:
        train(model, mon, opt, 12, plant={9})
    ev = next(e for e in mon.events if e.kind == "nonfinite_loss")
    assert ev.step == 9 and ev.dump
    state = {k: v.clone() for k, v in model.state_dict().items()}
    r = fh.replay(ev.dump, model, loss_fn)
    assert r.reproduced and r.source == "batch", r.verdict
    assert r.culprit_ids == [9 * 8 + 2], r.verdict
    for k, v in model.state_dict().items():  # the real model's statistics did not move
        assert torch.equal(v, state[k]), k
    assert not bad_buffers(model)


def test_replay_names_a_module_that_makes_nan_after_in_place_ops(tmp_path):
    class Log(nn.Module):
        def forward(self, x):
            return (x - 0.5).log()  # NaN for inputs under 0.5

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                          nn.ReLU(inplace=True), Block(8), Log(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=2) as mon:
        train(model, mon, opt, 2)
    ev = next(e for e in mon.events if e.kind in ("nonfinite_loss", "nonfinite_grad"))
    r = fh.replay(ev.dump, model, loss_fn)
    assert r.reproduced and r.source == "forward" and r.first_nonfinite == "4", r.verdict


def test_an_averaged_model_is_rolled_back_and_checked_with_the_model():
    """torch's AveragedModel as an EMA (timm's ModelEmaV3 is the same to the Monitor): a
    weight x1e4 at step 30 reaches the EMA through its update; the rollback restores both, and
    a NaN in the EMA's BatchNorm statistics is named by safe_to_save()."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = cnn()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = fh.Monitor(model, opt, flush_every=5, averaged=ema,
                     rollback=fh.RollbackConfig(every=5))
    g = torch.Generator().manual_seed(1)
    snap = after = None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(45):
            if t == 30:
                with torch.no_grad():
                    model[5].weight.mul_(1e4)
            x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            mon.step(loss, batch=(x, y))
            if mon.rollbacks and after is None:  # the EMA as the rollback left it
                after = {k: v.clone() for k, v in ema.state_dict().items()}
            ema.update_parameters(model)
            if t == 28:  # the snapshot at the flush of step 29 is taken before its update
                snap = {k: v.clone() for k, v in ema.state_dict().items()}
    assert mon.rollbacks and mon.rollbacks[0].to_step < 30 <= mon.rollbacks[0].step
    assert ema.module[5].weight.abs().max() < 100  # the EMA came back with the model
    assert snap is not None and after is not None and mon.rollbacks[0].to_step == 29
    for k, v in after.items():  # as it was when the snapshot was taken
        assert torch.equal(v, snap[k]), k
    mon.close()
    mon = fh.Monitor(model, opt, flush_every=5, averaged=[ema])  # the same, on a fresh run
    train(model, mon, opt, 3)
    assert mon.safe_to_save()
    ema.module[1].running_var[0] = NAN
    v = mon.save_verdict()
    assert not v.safe and "averaged[0].module.1.running_var" in v.reason, v
    mon.close()
    with pytest.raises(TypeError, match="averaged must be"):
        fh.Monitor(model, opt, averaged="ema")
