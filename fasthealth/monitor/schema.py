"""The per-step record, declared once: what each field of a step holds, its type, when it is
there (docs/spec.md section 6).

The device record (``record.py``) keeps one float64 column per ``DEVICE`` field; the JSONL sink
(``sinks.step_json``) casts each by its type; the report reads and checks each by its type.
A field is added here and nowhere else.

Types, as steps.jsonl has them: ``float`` (a number, null when not finite or not measured),
``count`` (an integer, null when not measured), ``flag`` (true or false), ``maybe_flag`` (true,
false, or null when the part that sets it is off).
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT, COUNT, FLAG, MAYBE_FLAG = "float", "count", "flag", "maybe_flag"


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    doc: str
    when: str = "every step"
    device: bool = True  # recorded on the device each step (else: taken on the host)


FIELDS: tuple[Field, ...] = (
    Field("loss", FLOAT, "the step's loss (the float64 mean of its elements)",
          "every step; null when the trainer's loss is unknown or not finite"),
    Field("grad_norm", FLOAT, "the global gradient norm before clipping (NaN/Inf propagate)"),
    Field("grad_finite_norm", FLOAT, "the norm of the finite gradient elements"),
    Field("grad_amax", FLOAT, "the largest finite |gradient element|"),
    Field("nan_count", COUNT, "NaN gradient elements"),
    Field("inf_count", COUNT, "Inf gradient elements"),
    Field("grads_finite", FLAG, "no NaN/Inf in any gradient"),
    Field("loss_finite", FLAG, "no NaN/Inf in the loss"),
    Field("skipped", FLAG, "the optimizer step was skipped (non-finite, a spike under "
          "on_spike='skip', or a batch holding a quarantined sample)"),
    Field("loss_scale", FLOAT, "a GradScaler's scale", "with a scaler"),
    Field("optimizer_nonfinite", COUNT, "NaN + Inf values in the optimizer's state",
          "at optimizer scans (every optimizer_check_every steps)"),
    Field("replica_mismatch", COUNT, "ranks whose replicated gradients differ",
          "with a process_group"),
    Field("replica_mismatch_mask", COUNT, "those named below rank 52, as a bit mask",
          "with a process_group"),
    Field("replica_mismatch_rank", FLOAT, "the lowest rank named among them, at any world "
          "size (NaN: none named)", "with a process_group"),
    Field("replica_odd", MAYBE_FLAG, "this rank is one of those (its own, not the same on "
          "every rank)", "with a process_group"),
    Field("nonfinite_origin_rank", FLOAT, "the lowest rank whose own gradients held NaN/Inf "
          "before they were reduced (NaN: none)", "with a process_group and a DDP or FSDP2 "
          "model"),
    Field("nonfinite_origins", COUNT, "how many ranks' own gradients did",
          "with a process_group and a DDP or FSDP2 model"),
    Field("own_grad_ratio", FLOAT, "the largest norm of a rank's own gradients before they "
          "were reduced over the mean of the other ranks' (NaN: not measured)",
          "with a process_group and a DDP or FSDP2 model"),
    Field("own_grad_rank", FLOAT, "the rank whose own gradients had that norm (NaN: none "
          "alone)", "with a process_group and a DDP or FSDP2 model"),
    Field("weight_replica_mismatch", COUNT, "ranks whose parameters differ from their "
          "replicas' after the step", "with a process_group, once per flush"),
    Field("weight_replica_rank", FLOAT, "the lowest rank named among them (NaN: none named)",
          "with a process_group, once per flush"),
    Field("weight_replica_odd", MAYBE_FLAG, "this rank is one of those (its own)",
          "with a process_group, once per flush"),
    Field("weight_replica_tensor", FLOAT, "the index of the first parameter whose replicas "
          "differ (NaN: not known)", "with a process_group under DDP, once per flush"),
    Field("spike_skip", MAYBE_FLAG, "the device spike rule skipped this step",
          "with on_spike='skip'"),
    Field("quarantine_skip", MAYBE_FLAG, "the step's batch held a sample a rollback "
          "quarantined, and the step was skipped", "with rollback="),
    Field("skip_z_loss", FLOAT, "the device spike rule's score of the loss",
          "with on_spike='skip', once its window is armed"),
    Field("skip_z_grad_norm", FLOAT, "the device spike rule's score of the gradient norm",
          "with on_spike='skip', once its window is armed"),
    Field("update_ratio_max", FLOAT, "the largest update-to-weight ratio of a weight matrix",
          "with precursors, every few steps"),
    Field("update_ratio_arg", FLOAT, "the index of that matrix", "with precursors"),
    Field("logit_max", FLOAT, "the LM head's largest |logit|", "with precursors and an LM head"),
    Field("log_z", FLOAT, "the LM head's mean log-sum-exp", "with precursors and an LM head"),
    Field("attention_logit_max", FLOAT, "the largest attention logit of the watched modules",
          "with attention="),
    Field("weight_nonfinite", COUNT, "NaN + Inf values in the parameters themselves",
          "at weight scans (the weight_corruption rule: once per flush_every steps)"),
    Field("weight_amax", FLOAT, "the largest finite |parameter or buffer value|",
          "at weight scans"),
    Field("batch_fingerprint", FLOAT, "a fingerprint of the step's batch, the same for the "
          "same batch (the repeated_batch rule)", "with a batch and no sample ids on the host"),
    Field("lr", FLOAT, "the learning rate of the optimizer's first group", "with an optimizer",
          device=False),
)

BY_NAME = {f.name: f for f in FIELDS}
DEVICE: tuple[str, ...] = tuple(f.name for f in FIELDS if f.device)
# what steps.jsonl holds beside the fields: the step number, the kinds of its events, and
# every few steps each tensor's gradient norm
EXTRA = ("step", "events", "per_tensor_norms")


def of_type(*types: str) -> tuple[str, ...]:
    return tuple(f.name for f in FIELDS if f.type in types)


def cast(name: str, v: float | None) -> float | int | bool | None:
    """A recorded value as steps.jsonl holds it (a float64 NaN is 'not measured')."""
    t = BY_NAME[name].type
    if v is None or v != v:
        return False if t == FLAG else None
    if t == COUNT:
        return int(v)
    if t in (FLAG, MAYBE_FLAG):
        return bool(v)
    return float(v)
