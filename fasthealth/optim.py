"""Optimizer state: the tensors behind a torch.optim optimizer, named after their parameters."""

from __future__ import annotations

import math

import torch

from . import ops
from .checks import multi_tensor_stats
from .ops.layout import COL


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, param_names: dict[int, str] | None = None
) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of every floating state tensor, e.g. ``"fc.weight.exp_avg_sq"``."""
    names, tensors = [], []
    k = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            pname = (param_names or {}).get(id(p), f"param{k}")
            k += 1
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    names.append(f"{pname}.{key}")
                    tensors.append(value)
    return names, tensors


ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


class OptimizerHealth:
    """What ``check_optimizer`` found; every field is a tensor on the device (no sync).

    - ``state``: MultiTensorStats over every floating state tensor (names like
      ``"fc.weight.exp_avg_sq"``): ``state.total.all_finite``, ``state.nonfinite()``...
    - ``nonfinite_count``: 0-dim int64, NaN/Inf values across all state tensors.
    - ``params``: the parameter names (in optimizer order) of the per-parameter tensors below.
    - ``eps_fraction``: Adam family: per parameter, the fraction of elements whose sqrt(v) is
      below eps, where eps dominates the denominator and the update is lr * m / eps (the regime
      Molybog et al., 2023 tie to loss spikes). None for other optimizers.
    - ``update_ratio``: per parameter, RMS of the update this state implies over RMS of the
      parameter (lr * bias-corrected m / (sqrt(v) + eps) for Adam; lr * momentum buffer for
      SGD). Typical healthy values are around 1e-3.
    """

    def __init__(self, state, params, eps_fraction, update_ratio):
        self.state = state
        self.params = params
        self.eps_fraction = eps_fraction
        self.update_ratio = update_ratio

    @property
    def nonfinite_count(self) -> torch.Tensor:
        return self.state.total.nan_count + self.state.total.inf_count

    def summary(self, k: int = 10) -> str:
        lines = [f"optimizer state: {len(self.state)} tensors, "
                 f"{int(self.nonfinite_count)} NaN/Inf values"]
        bad = self.state.nonfinite()
        if bad:
            lines.append("  non-finite: " + ", ".join(bad[:k]) + (" ..." if len(bad) > k else ""))
        if self.update_ratio is not None and len(self.params):
            ratio = self.update_ratio.cpu().tolist()
            frac = self.eps_fraction.cpu().tolist() if self.eps_fraction is not None else None
            order = sorted(range(len(ratio)), key=lambda i: -(ratio[i] if ratio[i] == ratio[i]
                                                               else float("inf")))[:k]
            lines.append(f"  {'parameter':<40} {'update/param RMS':>16}"
                         + (f" {'sqrt(v)<eps':>12}" if frac else ""))
            for i in order:
                lines.append(f"  {self.params[i]:<40} {ratio[i]:>16.3g}"
                             + (f" {frac[i]:>12.1%}" if frac else ""))
        return "\n".join(lines)


def _rms(ts: list[torch.Tensor]) -> torch.Tensor:
    s = multi_tensor_stats(ts)
    return s.per_tensor.norm.double() / s.per_tensor.numel.double().clamp(min=1).sqrt()


def _eps_fraction(parts: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """Per tensor, the fraction of v with sqrt(v) < eps, i.e. v < eps^2: the underflow count of
    the fused pass with range_lo = eps^2, plus the zeros (one pass per distinct eps)."""
    out: dict[int, torch.Tensor] = {}
    for eps in dict.fromkeys(e for _, e in parts):
        idx = [i for i, (_, e) in enumerate(parts) if e == eps]
        table = ops.table([parts[i][0] for i in idx], None, None, (math.inf, eps * eps))[:-1]
        frac = (table[:, COL["underflow_count"]] + table[:, COL["zero_count"]]) / table[
            :, COL["numel"]].clamp(min=1)
        for j, i in enumerate(idx):
            out[i] = frac[j]
    return torch.stack([out[i] for i in range(len(parts))])


def check_optimizer(
    optimizer: torch.optim.Optimizer, param_names: dict[int, str] | None = None
) -> OptimizerHealth:
    """Health of a torch.optim optimizer's state, without a host sync. ``param_names`` maps
    ``id(param)`` to a name (e.g. ``{id(p): n for n, p in model.named_parameters()}``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fasthealth: check_optimizer expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    names, tensors = optimizer_state_tensors(optimizer, param_names)
    state = multi_tensor_stats(tensors, names=names)
    kind = type(optimizer).__name__
    pnames, params, updates, eps_parts = [], [], [], []
    k = 0
    for group in optimizer.param_groups:
        lr = group.get("lr", 0.0)
        lr = float(lr) if not torch.is_tensor(lr) else lr
        for p in group["params"]:
            pname = (param_names or {}).get(id(p), f"param{k}")
            k += 1
            st = optimizer.state.get(p, {})
            if kind in ADAM_FAMILY and "exp_avg" in st and "exp_avg_sq" in st:
                b1, b2 = group["betas"]
                eps = group["eps"]
                step = st.get("step", 1)
                step = step.to(torch.float64) if torch.is_tensor(step) else float(step)
                c1 = 1 - b1 ** step
                c2 = 1 - b2 ** step
                v = st["exp_avg_sq"]
                denom = (v / c2).sqrt() + eps
                updates.append((st["exp_avg"] / c1) / denom * lr)
                eps_parts.append((v, eps))
            elif "momentum_buffer" in st and st["momentum_buffer"] is not None:
                updates.append(st["momentum_buffer"] * lr)
            else:
                continue
            pnames.append(pname)
            params.append(p.detach())
    ratio = _rms(updates) / _rms(params) if updates else None
    eps_fraction = _eps_fraction(eps_parts) if eps_parts else None
    return OptimizerHealth(state, pnames, eps_fraction, ratio)
