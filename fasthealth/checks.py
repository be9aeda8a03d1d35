"""The public checks of docs/spec.md section 3: tensor_stats, multi_tensor_stats, check_grads,
check_tensor_health.

One fused pass per device over all inputs; nothing here synchronizes with the device except
``check_tensor_health`` (it must print) and the explicit host accessors of the results.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from . import ops
from .distributed import global_table
from .ops.layout import range_thresholds
from .params import front_door, named_parameters, unique_names
from .stats import MultiTensorStats, TensorStats


def multi_tensor_stats(
    tensors: Sequence[torch.Tensor],
    *,
    names: Sequence[str] | None = None,
    backend: str | None = None,
    range_dtype: torch.dtype | None = None,
) -> MultiTensorStats:
    """Statistics of every tensor and of all of them together, in one fused pass.

    Inputs may mix dtypes (floating, integer, bool) and devices; non-contiguous views are read
    as they are. See docs/spec.md section 2 for each field's NaN/Inf semantics. No host sync.
    ``range_dtype`` (float16, bfloat16, float8_e4m3fn, ...) adds, in the same pass, how the
    values would fare cast to it: ``s.total.range.overflow_frac`` etc. (see RangeStats).
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            "fasthealth: multi_tensor_stats takes a sequence of tensors; "
            "for a single tensor use fasthealth.tensor_stats(t)"
        )
    tensors = list(tensors)
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != len(tensors):
            raise ValueError(
                f"fasthealth: got {len(names)} names for {len(tensors)} tensors"
            )
        unique_names(names)
    rng = range_thresholds(range_dtype)
    if not tensors:
        return MultiTensorStats(ops.empty_table(), [], [], range_dtype=range_dtype)
    table = ops.table(tensors, names, backend, rng)
    if names is None:
        names = index_names(len(tensors))
    return MultiTensorStats(table, names, tensors, range_dtype=range_dtype)


_INDEX_NAMES: list[str] = []


def index_names(n: int) -> list[str]:
    """``["0", "1", ..., str(n - 1)]``, sliced from a list built once: making 4000 strings each
    call cost more than the rest of the call's host work."""
    if len(_INDEX_NAMES) < n:
        _INDEX_NAMES.extend(str(i) for i in range(len(_INDEX_NAMES), n))
    return _INDEX_NAMES[:n]


def tensor_stats(t: torch.Tensor, *, backend: str | None = None,
                 range_dtype: torch.dtype | None = None) -> TensorStats:
    """Statistics of one tensor (docs/spec.md section 2): 0-dim tensors on ``t``'s device, no
    sync."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fasthealth: tensor_stats expects a torch.Tensor, got {type(t).__name__}")
    return multi_tensor_stats([t], names=["t"], backend=backend, range_dtype=range_dtype)[0]


def check_grads(
    model_or_params: Any,
    *,
    backend: str | None = None,
    process_group: Any = None,
    range_dtype: torch.dtype | None = None,
    replica_group: Any = None,
) -> MultiTensorStats:
    """Statistics of every parameter's ``.grad`` and of all gradients together.

    ``model_or_params``: an ``nn.Module`` (names from ``named_parameters()``), or an iterable of
    parameters or of ``(name, parameter)`` pairs. Parameters without a gradient are skipped and
    listed in ``.missing``; a parameter reached twice (tied weights) is counted once.
    ``total.norm`` is the global gradient norm, ``all_finite`` gates a step without a sync.
    With ``process_group``, totals are the whole model's across ranks from one collective, for
    every layout (FSDP2 shards combined, DDP replicas counted once, pipeline stages added; see
    ``fasthealth.distributed``; ``replica_group`` says which ranks hold copies when names and
    shapes cannot), ``all_finite`` is False on every rank when anything on any rank is
    non-finite, and replicas that disagree are counted in ``replica_mismatch``; per-tensor
    stats stay those of the local shards.

    Sparse gradients (``nn.Embedding(sparse=True)``) are checked through their stored values
    (``grad.coalesce().values()``), in the same fused pass: the norm is the dense gradient's,
    counts and moments are those of the stored values. With no gradient at all (called before
    ``backward()``, or everything frozen) the stats are empty and a warning says so.
    """
    if process_group is None and isinstance(model_or_params, torch.nn.Module):
        rng = range_thresholds(range_dtype)
        fast = front_door(model_or_params, backend, rng)
        if fast is not None:
            table, dtypes, absent, kept = fast
            if not absent:
                return MultiTensorStats(table, list(kept.names), dtypes, (), range_dtype)
            names, missing = kept.names_split(absent)
            return MultiTensorStats(table, names, dtypes, missing, range_dtype)
    pairs = named_parameters(model_or_params, "check_grads")
    all_grads = [p.grad for _, p in pairs]
    if any(g is None for g in all_grads):
        names = [n for (n, _), g in zip(pairs, all_grads) if g is not None]
        missing = [n for (n, _), g in zip(pairs, all_grads) if g is None]
        grads = [g for g in all_grads if g is not None]
    else:
        names, missing, grads = [n for n, _ in pairs], [], all_grads
    if not grads and missing:
        warnings.warn(f"fasthealth: check_grads found no gradient on any of {len(missing)} "
                      "parameters: call it after loss.backward()", RuntimeWarning, stacklevel=2)
    return grads_stats(grads, names, missing, backend=backend, process_group=process_group,
                       range_dtype=range_dtype, replica_group=replica_group)


def grad_values(g: torch.Tensor) -> torch.Tensor:
    """The values a gradient holds: the gradient itself, or a sparse one's stored values."""
    return g.coalesce().values() if g.is_sparse else g


def grads_stats(
    grads: list[torch.Tensor],
    names: list[str],
    missing: list[str],
    *,
    backend: str | None = None,
    process_group: Any = None,
    range_dtype: torch.dtype | None = None,
    extra_bad: torch.Tensor | None = None,
    replica_group: Any = None,
    extra_loss: torch.Tensor | None = None,
    origin: torch.Tensor | None = None,
    extra_skip: torch.Tensor | None = None,
) -> MultiTensorStats:
    """check_grads on collected gradients; with a process group, the total is the whole
    model's (two all-reduces), ``extra_bad`` joins the cross-rank non-finite flag, the mean
    of every rank's ``extra_loss`` comes back as ``loss_mean``, and the ranks whose ``origin``
    flag is set (``NonFiniteOrigin``) as ``origin_rank`` and ``origin_count``, the rank whose own
    gradients stood largest before the reduction and by how many times the others' mean as
    ``own_rank`` and ``own_ratio``, and whether any
    rank's ``extra_skip`` is set as ``skip_any``, in the same collectives."""
    rng = range_thresholds(range_dtype)
    check = None
    if process_group is not None:
        grads = [grad_values(g) for g in grads]
        table, check = global_table(grads, names, backend, rng, process_group, extra_bad,
                                    replica_group, extra_loss, origin, extra_skip)
    elif grads:
        try:
            table = ops.table(grads, names, backend, rng)
        except TypeError:  # a sparse gradient: its stored values, in the same fused pass
            if not any(g.is_sparse for g in grads):
                raise
            grads = [grad_values(g) for g in grads]
            table = ops.table(grads, names, backend, rng)
    else:
        table = ops.empty_table()
    s = MultiTensorStats(table, names, grads, missing, range_dtype)
    if check is not None:
        s.replica_mismatch = check["replica_mismatch"]
        s.replica_mismatch_mask = check["replica_mismatch_mask"]
        s.replica_named = check["replica_named"]
        s.replica_odd = check["replica_odd"]
        s.loss_mean = check["loss_mean"]
        s.origin_rank, s.origin_count = check["origin_rank"], check["origin_count"]
        s.own_ratio, s.own_rank = check["own_ratio"], check["own_rank"]
        s.skip_any = check["skip_any"]
    return s


class GradPass:
    """``grads_stats`` for a loop that calls it every step on gradients of one device (the
    Monitor): the backend is resolved and the range thresholds taken once, when it is made, so
    that a call is the op and the table's view. Anything else (a process group, gradients on
    several devices, sparse or DTensor gradients, an input the op refuses) goes through
    ``grads_stats`` as it is, which handles it or raises naming the input."""

    def __init__(self, backend: str | None, device: torch.device) -> None:
        self.backend = ops.backends.resolve(backend, device)
        self.rng = range_thresholds(None)

    def __call__(self, grads: list[torch.Tensor], names: list[str], *,
                 process_group: Any = None, extra_bad: torch.Tensor | None = None,
                 replica_group: Any = None, extra_loss: torch.Tensor | None = None,
                 origin: torch.Tensor | None = None, extra_skip: torch.Tensor | None = None
                 ) -> MultiTensorStats:
        if process_group is None and grads:
            try:
                with torch.no_grad():
                    table = ops.run(self.backend, grads, *self.rng)
                return MultiTensorStats(table, names, grads, [], None)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                pass  # the general path handles it, or raises naming the input at fault
        return grads_stats([grad_values(g) for g in grads], names, [], backend=self.backend,
                           process_group=process_group, extra_bad=extra_bad,
                           replica_group=replica_group, extra_loss=extra_loss, origin=origin,
                           extra_skip=extra_skip)


def check_params(
    model_or_params: Any,
    *,
    backend: str | None = None,
    range_dtype: torch.dtype | None = None,
) -> MultiTensorStats:
    """Statistics of the parameters themselves (not their gradients), e.g. before casting a
    model to float16 or float8: ``check_params(model, range_dtype=torch.float16).total.range``.
    """
    pairs = named_parameters(model_or_params, "check_params")
    names, tensors = [n for n, _ in pairs], [p.detach() for _, p in pairs]
    return multi_tensor_stats(tensors, names=names, backend=backend, range_dtype=range_dtype)


def check_tensor_health(tensor: torch.Tensor, name: str = "tensor") -> bool:
    """Drop-in for the hand-written helper: prints what is wrong and returns False, else True.

    Prints exactly ``Problem detected in tensor '<name>':`` then, when present, the NaN pair
    (``  - Contains NaN values!`` / ``  - NaN count: <n>``) and the Inf pair. One host sync.
    """
    s = tensor_stats(tensor)
    nan_count, inf_count = torch.stack([s.nan_count, s.inf_count]).tolist()
    if nan_count == 0 and inf_count == 0:
        return True
    print(f"Problem detected in tensor '{name}':")
    if nan_count:
        print("  - Contains NaN values!")
        print(f"  - NaN count: {nan_count}")
    if inf_count:
        print("  - Contains Inf values!")
        print(f"  - Inf count: {inf_count}")
    return False
