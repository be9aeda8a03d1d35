"""The public checks of SPEC section 3: tensor_stats, multi_tensor_stats, check_grads,
check_tensor_health.

One fused pass per device over all inputs; nothing here synchronizes with the device except
``check_tensor_health`` (it must print) and the explicit host accessors of the results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import backends, reference
from .stats import TABLE_WIDTH, MultiTensorStats, TensorStats, range_thresholds


def _describe(i: int, name: str | None) -> str:
    return f"input {i}" + (f" ({name!r})" if name is not None else "")


def _validate(tensors: Sequence[Any], names: Sequence[str] | None) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fasthealth: {_describe(i, names[i] if names else None)} is a "
                f"{type(t).__name__}, not a torch.Tensor"
            )
        if t.is_complex():
            raise TypeError(
                f"fasthealth: {_describe(i, names[i] if names else None)} is complex "
                f"({t.dtype}); check t.real and t.imag separately"
            )
        if t.layout != torch.strided:
            raise TypeError(
                f"fasthealth: {_describe(i, names[i] if names else None)} has layout "
                f"{t.layout}; only dense (strided) tensors are supported, use .to_dense()"
            )
        if t.is_meta:
            raise ValueError(
                f"fasthealth: {_describe(i, names[i] if names else None)} is a meta tensor "
                "and has no values to check"
            )


def _table(
    tensors: list[torch.Tensor], names: list[str] | None, backend: str | None,
    rng: tuple[float, float] = (math.inf, 0.0),
) -> torch.Tensor:
    """The FIELDS table of tensors that may sit on several devices.

    The common case (one device) costs one kernel call and no Python loop over the inputs: the
    kernels validate every input themselves. Only when that fails does Python look at each input,
    to name the bad one, or to split a call over several devices.
    """
    device = tensors[0].device if isinstance(tensors[0], torch.Tensor) else None
    if device is None or device.type == "meta":
        _validate(tensors, names)
    name = backends.resolve(backend, device)
    with torch.no_grad():
        try:
            return backends.run(name, tensors, *rng)
        except Exception:
            local = _dtensors_to_local(tensors)
            if local is not None:  # DTensors: the statistics of this rank's shards
                return _table(local, names, backend, rng)
            _validate(tensors, names)  # raises TypeError/ValueError naming the bad input
            if all(t.device == device for t in tensors):
                raise
        return _table_mixed(tensors, backend, rng)


def _dtensors_to_local(tensors: list[Any]) -> list[torch.Tensor] | None:
    """The local shards when some inputs are DTensors (None when none is)."""
    from .distributed import _dtensor_cls

    dtensor = _dtensor_cls()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return None
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def _table_mixed(tensors: list[torch.Tensor], backend: str | None,
                 rng: tuple[float, float]) -> torch.Tensor:
    """One fused pass per device, rows gathered on the first input's device; the copies between
    devices are the one place a call may synchronize."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    home = tensors[0].device
    table = torch.empty((len(tensors) + 1, TABLE_WIDTH), dtype=torch.float64, device=home)
    totals = []
    for device, idx in groups.items():
        part = backends.run(backends.resolve(backend, device), [tensors[i] for i in idx], *rng)
        part = part.to(home)
        table[torch.tensor(idx, device=home)] = part[:-1]
        totals.append(part[-1])
    table[-1] = reference.merge_rows(torch.stack(totals))
    return table


def _empty_table() -> torch.Tensor:
    return reference.tensor_stats_row(torch.empty(0, dtype=torch.float64))[None]


def multi_tensor_stats(
    tensors: Sequence[torch.Tensor],
    *,
    names: Sequence[str] | None = None,
    backend: str | None = None,
    range_dtype: torch.dtype | None = None,
) -> MultiTensorStats:
    """Statistics of every tensor and of all of them together, in one fused pass.

    Inputs may mix dtypes (floating, integer, bool) and devices; non-contiguous views are read
    as they are. See SPEC section 2 for each field's NaN/Inf semantics. No host sync.
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
    rng = range_thresholds(range_dtype)
    if not tensors:
        return MultiTensorStats(_empty_table(), [], [], range_dtype=range_dtype)
    table = _table(tensors, names, backend, rng)
    if names is None:
        names = [str(i) for i in range(len(tensors))]
    return MultiTensorStats(table, names, [t.dtype for t in tensors], range_dtype=range_dtype)


def tensor_stats(t: torch.Tensor, *, backend: str | None = None,
                 range_dtype: torch.dtype | None = None) -> TensorStats:
    """Statistics of one tensor (SPEC section 2): 0-dim tensors on ``t``'s device, no sync."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fasthealth: tensor_stats expects a torch.Tensor, got {type(t).__name__}")
    return multi_tensor_stats([t], names=["t"], backend=backend, range_dtype=range_dtype)[0]


def _named_parameters(model_or_params: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(model_or_params, torch.nn.Module):
        return model_or_params.named_parameters()  # tied parameters appear once
    if isinstance(model_or_params, torch.Tensor):
        return [("0", model_or_params)]
    try:
        items = list(model_or_params)
    except TypeError:
        raise TypeError(
            "fasthealth: check_grads expects an nn.Module or an iterable of parameters or of "
            f"(name, parameter) pairs, got {type(model_or_params).__name__}"
        ) from None
    pairs = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            pairs.append((str(i), item))
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            pairs.append(item)
        else:
            raise TypeError(
                f"fasthealth: check_grads item {i} is a {type(item).__name__}; expected a "
                "parameter or a (name, parameter) pair"
            )
    return pairs


def check_grads(
    model_or_params: Any,
    *,
    backend: str | None = None,
    process_group: Any = None,
    range_dtype: torch.dtype | None = None,
) -> MultiTensorStats:
    """Statistics of every parameter's ``.grad`` and of all gradients together.

    ``model_or_params``: an ``nn.Module`` (names from ``named_parameters()``), or an iterable of
    parameters or of ``(name, parameter)`` pairs. Parameters without a gradient are skipped and
    listed in ``.missing``; a parameter reached twice (tied weights) is counted once.
    ``total.norm`` is the global gradient norm, ``all_finite`` gates a step without a sync.
    With ``process_group``, totals are the whole model's across ranks (FSDP2 shards combined,
    DDP replicas counted once) from one collective, and ``all_finite`` is False on every rank
    when anything on any rank is non-finite; per-tensor stats stay those of the local shards.
    """
    grads: list[torch.Tensor] = []
    names: list[str] = []
    missing: list[str] = []
    seen: set[int] = set()
    unique = isinstance(model_or_params, torch.nn.Module)  # named_parameters() dedups already
    for name, p in _named_parameters(model_or_params):
        if not unique:
            if id(p) in seen:
                continue
            seen.add(id(p))
        g = p.grad
        if g is None:
            missing.append(name)
        else:
            grads.append(g)
            names.append(name)
    return grads_stats(grads, names, missing, backend=backend, process_group=process_group,
                       range_dtype=range_dtype)


def grads_stats(
    grads: list[torch.Tensor],
    names: list[str],
    missing: list[str],
    *,
    backend: str | None = None,
    process_group: Any = None,
    range_dtype: torch.dtype | None = None,
    extra_bad: torch.Tensor | None = None,
) -> MultiTensorStats:
    """check_grads on collected gradients; with a process group, the total is the whole
    model's (one collective) and ``extra_bad`` joins the cross-rank non-finite flag."""
    rng = range_thresholds(range_dtype)
    if process_group is None:
        if not grads:
            return MultiTensorStats(_empty_table(), [], [], missing, range_dtype)
        table = _table(grads, names, backend, rng)
        return MultiTensorStats(table, names, [g.dtype for g in grads], missing, range_dtype)
    import torch.distributed as dist

    from .distributed import global_total, local_view

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("fasthealth: process_group= needs torch.distributed to be initialized "
                         "(init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"fasthealth: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD), got {type(process_group).__name__}")

    rank0 = dist.get_rank(process_group) == 0
    local, owned = [], []
    for g in grads:
        data, own = local_view(g)
        local.append(data)
        owned.append(rank0 if own is None else own)
    if local:
        table = _table(local, names, backend, rng)
    else:
        table = _empty_table()
    total = global_total(table, owned, process_group, extra_bad)
    table = torch.cat([table[:-1], total[None].to(table.device)])
    return MultiTensorStats(table, names, [g.dtype for g in local], missing, range_dtype)


def check_params(
    model_or_params: Any,
    *,
    backend: str | None = None,
    range_dtype: torch.dtype | None = None,
) -> MultiTensorStats:
    """Statistics of the parameters themselves (not their gradients), e.g. before casting a
    model to float16 or float8: ``check_params(model, range_dtype=torch.float16).total.range``.
    """
    pairs, seen, names, tensors = _named_parameters(model_or_params), set(), [], []
    for name, p in pairs:
        if id(p) not in seen:
            seen.add(id(p))
            names.append(name)
            tensors.append(p.detach())
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
