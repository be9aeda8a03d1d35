"""fasthealth inside the trainers people use: one file per trainer.

- ``fasthealth.integrations.transformers.HealthCallback``: a Hugging Face ``TrainerCallback``;
- ``fasthealth.integrations.lightning.HealthCallback``: a Lightning ``Callback``;
- ``capture.py``: what both share: the loss and the batch of every micro-batch, taken by a
  forward hook, until the optimizer step;
- ``watch.py``: ``fh.watch(model, optimizer)``, the same for a plain training loop.

Each runs ``Monitor.check`` right before the trainer's optimizer step, after gradient
accumulation and before any clipping (the trainer's own clipping is taken over, with the norm
the check computed), and makes that step skip on the device when the loss or a gradient is
non-finite.
"""
