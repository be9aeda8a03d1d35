"""fasthealth inside the trainers people use: one file per trainer.

- ``fasthealth.integrations.transformers.HealthCallback``: a Hugging Face ``TrainerCallback``;
- ``fasthealth.integrations.lightning.HealthCallback``: a Lightning ``Callback``;
- ``capture.py``: what they share: the loss and the batch of every micro-batch, kept until the
  optimizer step (the Hugging Face callback feeds it from the Trainer's ``training_step``, the
  Lightning one from ``on_before_backward``, ``fh.watch`` from a forward hook);
- ``watch.py``: ``fh.watch(model, optimizer)``, the same for a plain training loop.

Each runs ``Monitor.check`` right before the trainer's optimizer step, after gradient
accumulation and before the trainer's own clipping, which stays the trainer's (nothing it logs
changes), and makes that step skip on the device when the loss or a gradient is non-finite.
"""
