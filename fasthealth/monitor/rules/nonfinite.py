"""``nonfinite_loss`` and ``nonfinite_grad``: a NaN or Inf at the step itself, no threshold.

Under a GradScaler an overflow step (a finite loss, Inf but no NaN in the gradients, skipped by
the scaler) is the scaler at work, not an event: ``loss_scale.py`` judges the scale. A NaN is
always reported.
"""

from __future__ import annotations

import math

from ..record import StepRecord
from .base import Finding, NoConfig, Rule, listed, skipped


class NonFiniteLoss(Rule[NoConfig]):
    name = "nonfinite_loss"
    kinds = ("nonfinite_loss",)

    def observe(self, s: StepRecord) -> list[Finding]:
        v = s.values
        if v["loss_finite"]:
            return []
        action = " (step skipped)" if skipped(s) else ""
        return [Finding("nonfinite_loss",
                        f"loss is {v['loss']}{action}. Check first: the batch (fh.replay on "
                        "this event's dump says whether it reproduces and which module made the "
                        "first NaN/Inf), then the loss function's logs, divisions and masks",
                        {"loss": v["loss"], "skipped": skipped(s)})]


class NonFiniteGrad(Rule[NoConfig]):
    """Names the tensors whose gradients hold NaN/Inf (the first five in the message)."""

    name = "nonfinite_grad"
    kinds = ("nonfinite_grad",)

    def observe(self, s: StepRecord) -> list[Finding]:
        v = s.values
        overflow = self.ctx.scaler and v["loss_finite"] and v["nan_count"] == 0 and skipped(s)
        if v["grads_finite"] or overflow:
            return []
        names = self.ctx.names
        bad = {names[i]: int(c) for i, c in enumerate(s.per_bad) if c == c and c > 0}
        action = " (step skipped)" if skipped(s) else ""
        origin = v.get("nonfinite_origin_rank", math.nan)
        made = ""
        if math.isfinite(origin):  # under DDP/FSDP2: where it was made, before the reduction
            others = int(v.get("nonfinite_origins", 1)) - 1
            also = f" and {others} other rank(s)" if others else ""
            made = f", made on rank {int(origin)}{also} before the gradients were reduced"
        return [Finding("nonfinite_grad",
                        f"{int(v['nan_count'])} NaN and {int(v['inf_count'])} Inf gradient "
                        f"values in {len(bad)} tensor(s): {listed(bad)}{made}{action}. Check "
                        "first: whether the loss was finite (if so, the backward pass of the "
                        "first tensor named made it: fh.replay names the module), then fp16 "
                        "ranges", {"tensors": bad, "nan_count": int(v["nan_count"]),
                                   "inf_count": int(v["inf_count"]), "skipped": skipped(s),
                                   "origin_rank": int(origin) if made else None})]
