"""Gradient accumulation and a prefetched next batch (nanoGPT's train.py loop): what the README's
recipe passes to ``mon.step`` is the step's own batch and loss, and a dump that does not hold
the batch trained on is named as such by ``fh.replay`` before a transient fault."""

import torch

import fasthealth as fh
from fasthealth import report

VOCAB, BLOCK, MICRO, ACCUM, STEPS, BAD = 32, 16, 8, 2, 50, 40


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, 32)
        self.lm_head = torch.nn.Linear(32, VOCAB)

    def forward(self, idx, targets):
        logits = self.lm_head(self.wte(idx))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, VOCAB),
                                                         targets.view(-1))


def _loss_fn(m, batch):
    """The step's loss from the dumped list of micro-batches: the mean of their losses."""
    return sum(m(x, y)[1] for x, y in batch) / len(batch)


def _train(log_dir, recipe: bool):
    """nanoGPT's loop; the last micro-batch of step BAD has garbage targets. ``recipe``: the step's
    micro-batches and summed scaled losses go to mon.step; else the README's plain loop taken
    literally: the prefetched ``X, Y`` and the last micro-batch's scaled loss."""
    torch.manual_seed(0)
    data = torch.randint(VOCAB, (4096,))
    data[1::2] = (data[::2] + 1) % VOCAB
    draws = [0]

    def get_batch():
        ix = torch.randint(len(data) - BLOCK - 1, (MICRO,))
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
        if draws[0] == BAD * ACCUM + ACCUM - 1:  # its last micro-batch
            y = torch.randint(VOCAB, y.shape)
        draws[0] += 1
        return x, y, ix

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    trained = {}
    mon = fh.Monitor(model, opt, log_dir=log_dir, max_grad_norm=1.0, flush_every=20)
    X, Y, ids = get_batch()
    for step in range(STEPS):
        micro, micro_ids, step_loss = [], [], torch.zeros(())
        for _ in range(ACCUM):
            _, loss = model(X, Y)
            loss = loss / ACCUM
            micro.append((X, Y))
            micro_ids.append(ids)
            step_loss += loss.detach()
            X, Y, ids = get_batch()
            loss.backward()
        trained[step] = (micro, step_loss.item())
        if recipe:
            mon.step(step_loss, batch=micro, sample_ids=torch.cat(micro_ids))
        else:
            mon.step(loss, batch=(X, Y), sample_ids=ids)
        opt.zero_grad(set_to_none=True)
    mon.close()
    return model, mon, trained


def test_the_recipe_dumps_the_steps_micro_batches_and_its_loss_and_replay_reproduces(tmp_path):
    model, mon, trained = _train(tmp_path, recipe=True)
    inc = mon.incidents[0]
    assert (inc.trigger, inc.start) == ("loss_spike", BAD)
    d = torch.load(inc.dump, weights_only=True)
    micro, loss = trained[BAD]
    assert len(d["batch"]) == ACCUM
    for (x, y), (dx, dy) in zip(micro, d["batch"]):
        assert torch.equal(x, dx) and torch.equal(y, dy)
    assert abs(d["record"]["loss"] - loss) < 1e-6  # the mean over the micro-batches
    r = fh.replay(inc.dump, model, _loss_fn)
    assert r.reproduced and r.cause == "batch" and not r.loss_far
    assert abs(r.loss - loss) < 1e-5


def test_a_dump_of_the_prefetched_batch_is_named_before_a_transient_fault(tmp_path):
    """The loop passing the prefetched next batch and the last micro-batch's scaled loss: the
    spike's dump holds the wrong batch, the replay is far from the recorded loss, and the
    verdict says first that the dump may not hold the batch trained on."""
    model, mon, _ = _train(tmp_path, recipe=False)
    inc = next(i for i in mon.incidents if i.trigger == "loss_spike")
    assert inc.start == BAD
    r = fh.replay(inc.dump, model, lambda m, b: m(*b)[1] / ACCUM)
    assert not r.reproduced and r.cause == "outside" and r.loss_far
    v = r.verdict
    assert "far from the recorded" in v
    assert "may not hold the batch that was trained on" in v
    assert "prefetched next batch" in v and "last micro-batch of an accumulation step" in v
    assert v.index("may not hold the batch") < v.index("transient fault")
    # the report says so too, not "a transient fault"
    text = report.write(mon.run_dir)[1]
    assert "the dump may not hold the batch trained on" in text
