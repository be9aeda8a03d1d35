"""What ``fh.replay`` says: the verdict's sentences (reproduced or not, where the first
non-finite value came from, the samples, the likely cause), and whether the replayed loss is so
far from the recorded one that the dump may not hold the batch trained on. ``replay.py`` finds
the facts; this module only words them."""

from __future__ import annotations

import math

LOSS_FAR_NOISE, LOSS_FAR_REL = 3.0, 0.05  # "far": beyond 3 noise units, else 5% of the loss
NOT_THE_BATCH = (
    "the dump may not hold the batch that was trained on (a prefetched next batch, the last "
    "micro-batch of an accumulation step, or a loss scaled differently, e.g. divided by the "
    "accumulation steps: pass the step's micro-batches and their summed scaled losses, see "
    "docs/guide/loops.md, 'Gradient accumulation and prefetching')")


def loss_far(d: dict, loss: float) -> str | None:
    """How far the replayed ``loss`` is from the recorded one, when it is far: beyond
    ``LOSS_FAR_NOISE`` noise units of the run's loss (known from a loss spike's details: its
    excess over the window's median divided by its score), else beyond ``LOSS_FAR_REL`` of
    the recorded loss. None when it is not, or either is not finite (nothing to compare)."""
    rec = d.get("record", {}).get("loss")
    if not isinstance(rec, (int, float)) or not math.isfinite(rec) or not math.isfinite(loss):
        return None
    gap = abs(loss - rec)
    for e in d.get("events", []):
        det = e.get("details") or {}
        got = [v for v in (det.get(k) for k in ("zscore", "value", "window_median"))
               if isinstance(v, (int, float)) and math.isfinite(v)]
        if e.get("kind") != "loss_spike" or len(got) < 3:
            continue
        z, value, median = (float(v) for v in got)
        if z > 0 and value > median:
            noise = (value - median) / z
            return (f"{gap / noise:.1f} noise units of the run's loss"
                    if gap > LOSS_FAR_NOISE * noise else None)
    return f"{gap / abs(rec):.0%} of it" if gap > LOSS_FAR_REL * abs(rec) else None


def verdict_text(d: dict, kinds: list[str], reproduced: bool, source: str | None, loss: float,
                 first: str | None, culprits: list | None, replays: int, exact: bool) -> str:
    """The verdict on the replayed step: ``loss`` and ``first`` (the module that made the
    first non-finite value) from the replay; ``culprits`` the samples that alone reproduce."""
    what = ", ".join(dict.fromkeys(kinds)) or "the step"
    far = None if reproduced else loss_far(d, loss)
    if far is not None:
        text = (f"{what} does not reproduce on replay of step {d['step']}, and the replayed "
                f"loss {loss:.4g} is far from the recorded {d['record']['loss']:.4g} ({far}): "
                f"{NOT_THE_BATCH}. If it does hold that batch: the loss code (a loss computed "
                "differently at that step: a scaling, a mask, a division), then a transient "
                "fault (hardware, communication, a race)")
    elif not reproduced:
        rec = d.get("record", {}).get("loss")
        # a non-finite recorded loss cannot be compared: the dump's batch stays in question
        unsure = not (isinstance(rec, (int, float)) and math.isfinite(rec))
        text = (f"{what} does not reproduce on replay of step {d['step']}: not this batch nor "
                "the model state; the loss code first (a loss computed differently at that "
                "step: a scaling, a mask, a division"
                + (f"; or {NOT_THE_BATCH}" if unsure else "") + "), then a transient fault "
                "(hardware, communication, a race)")
    else:
        text = f"{what} reproduces on replay of step {d['step']}"
        if source == "batch":
            text += ": the batch itself holds NaN/Inf"
        elif source and first:
            text += (f": module {first} made the first non-finite value in "
                     f"the {source} pass (its inputs were finite)")
        elif source:
            text += (f": the first non-finite value was made in the {source} pass outside the "
                     "model's modules (the loss function?)")
        if culprits is not None:
            text += (f"; samples {culprits[:10]}{' ...' if len(culprits) > 10 else ''} alone "
                     f"reproduce it ({len(culprits)} samples, {replays} replays)")
    if not exact:
        text += " [parameters were not captured: replayed with the model's current ones]"
    return text


def cause_text(cause: str, singles: list | None, smallest: list, n: int, capped: int,
                control: bool | None, d: dict) -> str:
    """What the verdict adds about the samples and the likely cause."""
    text = ""
    if capped:
        text += (f"; the search stopped at its cap of {capped} replays" + (
            ": more samples may reproduce it" if singles else
            f" before reaching single samples: samples {smallest[:10]}"
            f"{' ...' if len(smallest) > 10 else ''} reproduce it together, the smallest part "
            "found"))
    elif singles is not None and not singles:
        text += (f"; no single sample alone reproduces it: samples {smallest[:10]}"
                 f"{' ...' if len(smallest) > 10 else ''} do together, the smallest part found")
    elif singles is not None and len(singles) == n:
        text += "; every sample alone reproduces it"
    if control is not None and cause == ("weights" if control else "batch"):  # it decided
        step = (d.get("control") or {}).get("step")
        text += (f"; the batch of step {step}, replayed on the same weights, reproduces it too: "
                 "not this batch but the model state" if control else
                 f"; the batch of step {step}, replayed on the same weights, does not: this "
                 "batch causes it")
    elif cause == "batch" and singles is None:
        text += "; the batch itself (or the model state) causes it"
    if cause == "learning_rate":
        text += "; the learning rate of the last steps is 3x or more its earlier level"
    return text + f". Likely cause: {cause}"
