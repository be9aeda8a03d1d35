"""Which tensors ``check_grads`` reads: a module's parameter list, kept between calls, and the
compiled front door that reads their gradients in one call.

Walking ``named_parameters()`` costs about as much per parameter as checking a small tensor, so
each module's list is kept (weakly) and reused until something changes it. Changes are seen in
two ways: torch's global registration hooks (any parameter or submodule registered anywhere:
``setattr``, ``register_parameter``, FSDP's sharding) bump ``_structure``, which makes every
kept list stale; and each call checks that every kept parameter is still the object its module
holds, which catches a replacement behind the hooks (``module._parameters[name] = ...``).
The hooks are registered once, at import: they only bump a counter.
"""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from . import ops
from .ops.layout import DTYPES_BY_CODE


def unique_names(names: list[str]) -> None:
    """Raises ValueError naming the first name given twice: results are looked up by name
    (``s["name"]``, ``to_dict()``), and a second entry would hide the first (a NaN with it)."""
    if len(set(names)) == len(names):
        return
    first: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in first:
            raise ValueError(f"fasthealth: the name {n!r} is given to inputs {first[n]} and "
                             f"{i}; names must be unique")
        first[n] = i


_structure = 0  # bumped by the registration hooks below: every kept list older is stale


class _Kept:
    """One module's parameters as ``named_parameters()`` lists them (tied ones once), with the
    dict and key each is held under."""

    __slots__ = ("module", "structure", "pairs", "names", "dicts", "keys", "params", "split")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)
        self.structure = _structure
        self.pairs: list[tuple[str, Any]] = []
        self.dicts: list[dict] = []
        self.keys: list[str] = []
        seen: set[int] = set()
        for prefix, mod in module.named_modules():
            for k, p in mod._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                self.pairs.append((f"{prefix}.{k}" if prefix else k, p))
                self.dicts.append(mod._parameters)
                self.keys.append(k)
        self.names = [n for n, _ in self.pairs]
        self.params = [p for _, p in self.pairs]
        # (indices without a gradient, names with one, names without): the last split, since
        # the same parameters stay frozen step after step
        self.split: tuple[list[int], list[str], list[str]] = ([], self.names, [])

    def names_split(self, absent: list[int]) -> tuple[list[str], list[str]]:
        """The names of the parameters with a gradient and of those without (``absent``)."""
        if absent != self.split[0]:
            skip = set(absent)
            self.split = (absent, [n for i, n in enumerate(self.names) if i not in skip],
                          [self.names[i] for i in absent])
        return list(self.split[1]), list(self.split[2])

    def current(self, module: torch.nn.Module) -> bool:
        """Still ``module``'s, nothing registered since (the slots are checked apart)."""
        return self.module() is module and self.structure == _structure

    def slots_hold(self) -> bool:
        return all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.params))


_kept: dict[int, _Kept] = {}


def _changed(*args: Any) -> None:
    global _structure
    _structure += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_changed)
torch.nn.modules.module.register_module_module_registration_hook(_changed)


def module_parameters(module: torch.nn.Module) -> list[tuple[str, Any]]:
    kept = _kept.get(id(module))
    if kept is not None and kept.current(module) and kept.slots_hold():
        return kept.pairs
    if len(_kept) > 64:
        _kept.clear()
    kept = _kept[id(module)] = _Kept(module)
    return kept.pairs


def front_door(model: Any, backend: str | None, rng: tuple[float, float]
                ) -> tuple[torch.Tensor, CodedDtypes, list[int], _Kept] | None:
    """check_grads of a CPU module whose parameter list is kept and whose gradients are all
    plain dense CPU tensors, in one call into the compiled CPU kernel (``_C``'s
    ``param_grads_table`` checks each slot and reads each ``.grad`` in C++; the gradients'
    dtypes come back as codes, parameters without a gradient as indices); None otherwise."""
    kept = _kept.get(id(model))
    if (kept is None or not kept.current(model) or ops.compiled.C is None
            or torch.compiler.is_compiling() or backend not in (None, "auto", "cpu")
            or os.environ.get("FASTHEALTH_BACKEND", "auto") not in ("", "auto", "cpu")):
        return None
    found = ops.compiled.C.param_grads_table(kept.params, kept.dicts, kept.keys, *rng)
    if found is None:
        return None
    table, codes, absent = found
    return table, CodedDtypes(codes), absent, kept


class CodedDtypes:
    """The gradients' dtypes as the front door reports them, one code a byte
    (``fasthealth.ops.layout.DTYPE_CODES``), turned into torch dtypes only when read."""

    __slots__ = ("codes",)

    def __init__(self, codes: bytes):
        self.codes = codes

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self) -> Iterator[torch.dtype]:
        return map(DTYPES_BY_CODE.__getitem__, self.codes)


def named_parameters(model_or_params: Any, what: str) -> list[tuple[str, Any]]:
    """(name, parameter) pairs, each parameter once (tied weights are counted once)."""
    if isinstance(model_or_params, torch.nn.Module):
        return module_parameters(model_or_params)
    if isinstance(model_or_params, torch.Tensor):
        return [("0", model_or_params)]
    try:
        items = list(model_or_params)
    except TypeError:
        raise TypeError(
            f"fasthealth: {what} expects an nn.Module or an iterable of parameters or of "
            f"(name, parameter) pairs, got {type(model_or_params).__name__}"
        ) from None
    pairs, seen = [], set()
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            item = (str(i), item)
        elif not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                  and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"fasthealth: {what} item {i} is a {type(item).__name__}; expected "
                            "a parameter or a (name, parameter) pair")
        if id(item[1]) not in seen:
            seen.add(id(item[1]))
            pairs.append(item)
    unique_names([n for n, _ in pairs])
    return pairs


def kept(module: torch.nn.Module) -> _Kept | None:
    """The kept parameter list of ``module`` if it is current, else None."""
    entry = _kept.get(id(module))
    return entry if entry is not None and entry.current(module) else None
