"""The zoo: fasthealth on the architectures and training loops people use, not only the ones
it was built with. Each model is built from config (random weights: nothing is downloaded),
trained tiny on CPU on real data (scikit-learn's digits: 8x8 images upsampled to 32x32 for the
vision models, their 64 pixels as a sequence of 17-level tokens for the language models), by
three ways of training:

- ``loop``: a hand-written loop as the README writes it (``mon.step`` where
  ``optimizer.step()`` was), with a torch scheduler passed as ``scheduler=``;
- ``hf``: ``transformers.Trainer`` with fasthealth's ``HealthCallback`` at its defaults, for
  the Hugging Face models (the model faults planted by a callback at their step, the data
  faults in the dataset's batches, taken in order);
- ``timm``: the shape of timm's ``train.py`` (``train_one_epoch``): timm's
  ``CosineLRScheduler`` with a one-epoch warm-up stepped per epoch (``step(epoch)``),
  ``--clip-grad 1.0``, ``ModelEmaV3``, SGD with momentum; run with and without ``scheduler=``.

Each (model, way) runs healthy, then with each fault planted at 60% of the run: ``nan_sample``
(one input value NaN), ``lr_burst`` (the rate x20 for ``STRETCH`` steps), ``weight_x1e4``
(the largest element of the first weight tensor x1e4), ``nan_buffer`` (a floating buffer's
first element NaN, where the model has one), ``labels_shuffled`` (``STRETCH`` steps of
shuffled labels), ``garbage_batch`` (one batch of noise of std 10). The verdicts
(``score``): a healthy run raises no alarm; a fault is caught by an alarm incident opened
within ``CATCH_WITHIN`` steps of its onset, its cause, whether replay of that incident's dump
runs, whether the run's buffers are finite at the end and ``safe_to_save()`` agrees with what
the model holds. How far a fault moved the loss (``onset_z``) is measured as the trainer
evaluation measures it: the largest loss of the fault's steps, in noise units above the up to
``EFFECT_WINDOW`` losses before its onset, the smaller of the linear and the log scale's score
(``robust.spike_scores``, the detector's own): a fault is visible from 6. The linear scale alone
is no yardstick at a small batch's floor, whose batches span a decade: healthy batches of the
detector corpus's logistic regression (batch 8) stand 7-24 linear units above its level.

Needs torchvision and timm, which need a torch build that matches them (the Makefile's
``zoo-env``). ``python -m evaluation.zoo.zoo --quick`` runs the quick tier (``QUICK``), the
whole without it; ``--out`` writes the JSON (``bench/results/zoo.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import fasthealth as fh
from fasthealth.monitor.robust import spike_scores

STEPS = 100
ONSET = 60  # 60% of the run
CATCH_WITHIN = 30
STRETCH = 20  # the steps of a stretch fault (the rate burst, the shuffled labels)
EFFECT_WINDOW = 128  # the losses before the onset a fault's effect is measured against
BATCH = 16
FAULTS = ("nan_sample", "lr_burst", "weight_x1e4", "nan_buffer", "labels_shuffled",
          "garbage_batch")


# ---- data: scikit-learn's digits ---------------------------------------------------------

def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)


def vision_batch(x: torch.Tensor) -> torch.Tensor:
    img = x.view(-1, 1, 8, 8).expand(-1, 3, 8, 8)
    return nn.functional.interpolate(img, size=32, mode="bilinear", align_corners=False)


# ---- models, built from config ------------------------------------------------------------

class LSTMLM(nn.Module):
    def __init__(self, vocab=17, d=64):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(vocab, d), nn.LSTM(d, d, batch_first=True), \
            nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


class UNet(nn.Module):
    """A two-level UNet with BatchNorm and in-place ReLU, classifying by its output's mean."""

    def __init__(self, c=16, classes=10):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o),
                                 nn.ReLU(inplace=True))
        self.down1, self.down2 = block(3, c), block(c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = block(2 * c, c)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(nn.functional.max_pool2d(a, 2))
        y = self.dec(torch.cat([self.up(b), a], 1))
        return self.head(y.mean((2, 3)))


def group_norm_cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(8, 32),
                         nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def batchnorm1d_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.BatchNorm1d(64),
                         nn.ReLU(inplace=True), nn.Linear(64, 10))


def hf(kind):
    import transformers

    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=17, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64, num_labels=10)
        return transformers.BertForSequenceClassification(cfg)
    cfg = transformers.GPT2Config(vocab_size=17, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def build(name: str) -> tuple[nn.Module, str]:
    """(the model, its task: "image", "tokens" (sequence classification) or "lm")."""
    import timm
    import torchvision

    tv = torchvision.models
    table = {
        "resnet18": (lambda: tv.resnet18(num_classes=10), "image"),
        "mobilenet_v3_small": (lambda: tv.mobilenet_v3_small(num_classes=10), "image"),
        "timm_resnet": (lambda: timm.create_model("test_resnet", num_classes=10), "image"),
        "timm_efficientnet": (lambda: timm.create_model("test_efficientnet", num_classes=10),
                              "image"),
        "timm_convnext": (lambda: timm.create_model("test_convnext", num_classes=10), "image"),
        "vit": (lambda: timm.create_model("test_vit", num_classes=10, img_size=32), "image"),
        "unet": (UNet, "image"),
        "groupnorm_cnn": (group_norm_cnn, "image"),
        "batchnorm1d_mlp": (batchnorm1d_mlp, "image"),
        "bert": (lambda: hf("bert"), "tokens"),
        "gpt2": (lambda: hf("gpt2"), "lm"),
        "lstm_lm": (LSTMLM, "lm"),
    }
    make, task = table[name]
    return make(), task


MODELS = ("resnet18", "mobilenet_v3_small", "timm_resnet", "timm_efficientnet",
          "timm_convnext", "vit", "unet", "groupnorm_cnn", "batchnorm1d_mlp", "bert", "gpt2",
          "lstm_lm")
QUICK = [("resnet18", "loop"), ("timm_resnet", "timm"), ("gpt2", "loop")]
TIMM_LOOP = ("resnet18", "timm_resnet", "timm_efficientnet", "timm_convnext", "vit")
HF_TRAINER = ("bert", "gpt2")


def loss_fn_for(task: str):
    def loss_fn(model, batch):
        x, y = batch
        if task == "image":
            return nn.functional.cross_entropy(model(x), y)
        if task == "tokens":
            return nn.functional.cross_entropy(model(input_ids=x).logits, y)
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           x[:, 1:].reshape(-1))
    return loss_fn


def batches(task: str, seed: int):
    X, Y = digits()
    g = torch.Generator().manual_seed(seed)
    while True:
        i = torch.randint(0, len(X), (BATCH,), generator=g)
        x = vision_batch(X[i]) if task == "image" else (X[i] * 16).round().long()
        yield x, Y[i], i


# ---- one run --------------------------------------------------------------------------------

@dataclass
class Run:
    model: str
    way: str
    fault: str
    scheduler_given: bool
    alarms: list = field(default_factory=list)  # (step, trigger, cause) of alarm incidents
    caught: bool | None = None
    cause: str | None = None
    replay: str | None = None  # "ok", or why it failed
    recovered: str | None = None  # "recovered", "not back", or None (healthy)
    buffers_finite: bool = True
    safe_to_save: bool = True
    safe_agrees: bool = True  # safe_to_save() is False whenever the model holds NaN/Inf
    onset_z: float | None = None  # the fault's largest loss, in noise units (see train)
    end_loss: float | None = None  # the mean loss of the last 10 steps
    seconds: float = 0.0


_BURST: dict[int, float] = {}  # a parameter group's rate while the burst holds it


def plant(fault: str, t: int, model: nn.Module, opt, x, y, task: str):
    """The fault at step ``t`` (the onset, or within its stretch): the batch it gives back."""
    if fault == "nan_sample" and t == ONSET:
        x = x.clone().float() if task == "image" else x.clone()
        if task == "image":
            x[2, 0, 5, 5] = math.nan
        else:  # tokens cannot be NaN: the embedding's row of the first token is
            with torch.no_grad():
                emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
                emb.weight[int(x[2, 0])] = math.nan
    if fault == "lr_burst" and t in (ONSET, ONSET + STRETCH):
        for grp in opt.param_groups:  # at its end, back to the rate before it, unless the
            if t == ONSET:            # scheduler has set its own since (timm's, per epoch)
                grp["lr"] = _BURST[id(grp)] = grp["lr"] * 20
            elif grp["lr"] == _BURST.pop(id(grp), None):
                grp["lr"] /= 20
    if fault == "weight_x1e4" and t == ONSET:
        with torch.no_grad():  # its largest element: a jump of 1e4 over the tensor's level
            w = next(p for p in model.parameters() if p.dim() > 1).view(-1)
            w[w.abs().argmax()] *= 1e4
    if fault == "nan_buffer" and t == ONSET:
        with torch.no_grad():
            b = next(b for b in model.buffers() if b.is_floating_point())
            b.view(-1)[0] = math.nan
    if fault == "labels_shuffled" and ONSET <= t < ONSET + STRETCH:
        y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(t))]
        if task == "lm":  # the labels are the next tokens: shuffled across the batch
            x = torch.cat([x[:, :32], x[torch.randperm(len(x)), 32:]], 1)
    if fault == "garbage_batch" and t == ONSET:
        x = (torch.randn(x.shape) * 10 if task == "image"
             else torch.randint(0, 17, x.shape))
    return x, y


def train(name: str, way: str, fault: str, scheduler_given: bool = True, seed: int = 0,
          log_dir: str | None = None) -> tuple[Run, fh.Monitor, nn.Module]:
    torch.manual_seed(seed)
    model, task = build(name)
    model.train()
    loss_fn = loss_fn_for(task)
    lr = 0.05 if task == "image" else 0.01
    if way == "timm":
        from timm.scheduler import CosineLRScheduler
        from timm.utils import ModelEmaV3

        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        epoch = 20
        sched = CosineLRScheduler(opt, t_initial=STEPS // epoch, warmup_t=1,
                                  warmup_lr_init=1e-5)
        ema = ModelEmaV3(model, decay=0.99)
        mon = fh.Monitor(model, opt, scheduler=sched if scheduler_given else None,
                         max_grad_norm=1.0, log_dir=log_dir, flush_every=10)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr / 10)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
        ema, epoch = None, 0
        mon = fh.Monitor(model, opt, scheduler=sched, log_dir=log_dir, flush_every=10)
    run = Run(name, way, fault, scheduler_given)
    data = batches(task, seed)
    t0 = time.perf_counter()
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(STEPS):
            x, y, ids = next(data)
            x, y = plant(fault, t, model, opt, x, y, task)
            loss = loss_fn(model, (x, y))
            losses.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            mon.step(loss, batch=(x, y), sample_ids=ids)
            if ema is not None:
                ema.update(model, step=t)
            if way == "timm" and (t + 1) % epoch == 0:
                sched.step((t + 1) // epoch)
            elif way == "loop":
                sched.step()
        mon.close()
    run.seconds = time.perf_counter() - t0
    before = [x for x in losses[max(0, ONSET - EFFECT_WINDOW):ONSET] if math.isfinite(x)]
    hit = [min(spike_scores(before, x)) if math.isfinite(x) else math.inf
           for x in losses[ONSET:ONSET + STRETCH]]
    run.onset_z = round(min(max(hit), 1e9), 2)
    tail = [x for x in losses[-10:] if math.isfinite(x)]
    run.end_loss = round(sum(tail) / len(tail), 4) if tail else None
    return run, mon, model


class _Stream(torch.utils.data.Dataset):
    """The Trainer's data: ``STEPS`` batches of ``batches(task)`` in step order (the Trainer
    takes them with ``train_sampling_strategy="sequential"`` in batches of ``BATCH``), the
    data faults planted in the batches of their steps."""

    def __init__(self, task: str, fault: str, seed: int) -> None:
        data, self.rows = batches(task, seed), []
        for t in range(STEPS):
            x, y, _ = next(data)
            if fault in ("labels_shuffled", "garbage_batch"):
                x, y = plant(fault, t, nn.Identity(), None, x, y, task)
            for i in range(BATCH):
                self.rows.append({"input_ids": x[i], "labels": y[i] if task == "tokens"
                                  else x[i]})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def train_hf(name: str, fault: str, seed: int, log_dir: str
             ) -> tuple[Run, fh.Monitor, nn.Module]:
    """A Hugging Face model through ``transformers.Trainer`` with fasthealth's
    ``HealthCallback`` at its defaults; the model faults planted by a callback at the step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fasthealth.integrations.transformers import HealthCallback

    torch.manual_seed(seed)
    model, task = build(name)
    if fault == "nan_buffer" and not any(b.is_floating_point() for b in model.buffers()):
        raise StopIteration  # nothing to plant it in, as in train()

    class Plant(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            t = state.global_step
            if fault in ("nan_sample", "weight_x1e4", "nan_buffer") and t == ONSET:
                plant(fault, t, model, optimizer, torch.zeros(BATCH, 2, dtype=torch.long),
                      None, task)
            if fault == "lr_burst" and ONSET <= t < ONSET + STRETCH:
                for grp in optimizer.param_groups:  # the scheduler sets it again each step
                    grp["lr"] *= 20
    health = HealthCallback(log_dir=log_dir, flush_every=10)
    args = TrainingArguments(log_dir, per_device_train_batch_size=BATCH, max_steps=STEPS,
                             report_to=[], use_cpu=True, save_strategy="no", seed=seed,
                             learning_rate=1e-3, logging_steps=10, disable_tqdm=True,
                             train_sampling_strategy="sequential", lr_scheduler_type="cosine")
    trainer = Trainer(model, args, train_dataset=_Stream(task, fault, seed),
                      callbacks=[health, Plant()])
    run = Run(name, "hf", fault, True)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    run.seconds = time.perf_counter() - t0
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    run.end_loss = losses[-1] if losses else None
    assert health.monitor is not None
    return run, health.monitor, model


def score(name: str, way: str, fault: str, scheduler_given: bool = True) -> Run:
    with tempfile.TemporaryDirectory() as d:
        if way == "hf":
            run, mon, model = train_hf(name, fault, 0, d)
        else:
            run, mon, model = train(name, way, fault, scheduler_given, log_dir=d)
        alarms = [i for i in mon.incidents if i.severity == "alarm"]
        run.alarms = [(i.start, i.trigger, i.cause) for i in alarms]
        bufs = [b for b in model.buffers() if b.is_floating_point()]
        run.buffers_finite = all(bool(b.isfinite().all()) for b in bufs)
        held = not run.buffers_finite or not all(bool(p.isfinite().all())
                                                 for p in model.parameters())
        run.safe_to_save = mon.safe_to_save()
        run.safe_agrees = not (held and run.safe_to_save)
        if fault != "healthy":
            hit = next((i for i in alarms if ONSET <= i.start <= ONSET + CATCH_WITHIN
                        or i.start <= ONSET <= i.end), None)
            run.caught = hit is not None
            if hit is not None:
                run.cause = hit.cause
                run.recovered = "recovered" if hit.recovered else "not back"
                dump = next((e.dump for e in hit.events if e.dump), None)
                if dump is None:
                    run.replay = "no dump"
                else:
                    try:
                        fh.replay(dump, model, (lambda m, b: m(**b).loss) if way == "hf"
                                  else loss_fn_for(build_task(name)))
                        run.replay = "ok"
                    except Exception as e:  # what a user would see
                        run.replay = f"{type(e).__name__}: {e}"[:200]
    return run


def build_task(name: str) -> str:
    return "image" if name not in ("bert", "gpt2", "lstm_lm") else (
        "tokens" if name == "bert" else "lm")


def plan(quick: bool) -> list[tuple[str, str, str, bool]]:
    pairs = QUICK if quick else [(m, w) for m in MODELS for w in ("loop", "timm", "hf")
                                 if w == "loop" or (w == "timm" and m in TIMM_LOOP)
                                 or (w == "hf" and m in HF_TRAINER)]
    out = []
    for m, w in pairs:
        out.append((m, w, "healthy", True))
        if w == "timm":
            out.append((m, w, "healthy", False))
        for f in FAULTS:
            out.append((m, w, f, True))
    return out


def table(entry: dict) -> str:
    """The Markdown table of a zoo.json entry: a row per (model, way), a column per fault.
    A cell: the alarm's cause and whether the run came back ("batch, back"), "missed" with
    how far the fault moved the loss (z: noise units at its largest) and the end loss against
    the healthy twin's; "+r" where replay ran, "R!" where it failed, "NaN!" where
    safe_to_save() said True with NaN in the model. Healthy: the alarms (0 is the goal)."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    healthy_end: dict[tuple[str, str], float] = {}
    for r in entry["runs"]:
        if r["fault"] == "healthy" and r["scheduler_given"]:
            healthy_end[(r["model"], r["way"])] = r["end_loss"]
    for r in entry["runs"]:
        key = (r["model"], r["way"])
        cells = rows.setdefault(key, {})
        if r["fault"] == "healthy":
            col = "healthy" if r["scheduler_given"] else "healthy, no scheduler="
            cells[col] = f"{len(r['alarms'])} alarms"
            continue
        if r["caught"]:
            back = {"recovered": "back", "not back": "not back"}.get(r["recovered"], "?")
            cell = f"{r['cause']}, {back}" + (" +r" if r["replay"] == "ok" else " R!")
        else:
            twin = healthy_end.get(key)
            gap = (f", end {r['end_loss']:.3g} vs {twin:.3g}"
                   if twin is not None and r["end_loss"] is not None else "")
            cell = f"missed (z {r['onset_z']}{gap})"
        if not r["safe_agrees"]:
            cell += " NaN!"
        cells[r["fault"]] = cell
    cols = ["healthy", "healthy, no scheduler=", *FAULTS]
    lines = ["| model | way | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for (model, way), cells in sorted(rows.items(), key=lambda kv: (MODELS.index(kv[0][0]),
                                                                      kv[0][1])):
        lines.append(f"| {model} | {way} | " + " | ".join(cells.get(c, "") for c in cols)
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quick tier only")
    ap.add_argument("--out", type=Path, help="write the results here (JSON)")
    ap.add_argument("--table", type=Path, help="print the Markdown table of a results file")
    ap.add_argument("--models", nargs="+", choices=MODELS,
                    help="only these models; with --out, their rows replace those in the file")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads(a.table.read_text())))
        return 0
    runs = []
    todo = [x for x in plan(a.quick) if a.models is None or x[0] in a.models]
    for k, (m, w, f, given) in enumerate(todo):
        try:
            r = score(m, w, f, given)
        except StopIteration:  # a fault the model has nothing for (no floating buffer)
            continue
        runs.append(r)
        print(f"[{k + 1}/{len(todo)}] {m:<20} {w:<5} {f:<16} sched={'y' if given else 'n'} "
              f"alarms={r.alarms} caught={r.caught} cause={r.cause} replay={r.replay} "
              f"{r.recovered} buffers_finite={r.buffers_finite} safe={r.safe_to_save} "
              f"z={r.onset_z} end={r.end_loss} "
              f"({r.seconds:.0f} s)", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        entry = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                 "python": sys.version.split()[0], "torch": torch.__version__,
                 "tier": "quick" if a.quick else "whole", "steps": STEPS, "onset": ONSET,
                 "runs": [asdict(r) for r in runs]}
        if a.models and a.out.exists():  # the other models' rows as they were, and when
            old = json.loads(a.out.read_text())
            kept = [r for r in old["runs"] if r["model"] not in a.models]
            entry["runs"] = kept + entry["runs"]
            entry["rerun"] = {**old.get("rerun", {}),
                              **{m: entry["date"] for m in a.models}}
            entry["date"] = old["date"]
        a.out.write_text(json.dumps(entry, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
