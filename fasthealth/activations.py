"""Activation statistics with first-producer attribution (docs/spec.md section 7).

Forward hooks compute the statistics of docs/spec.md section 2 for each selected module's inputs
and outputs in one fused call per module (no host sync: the tables stay on the device); backward
tensor hooks on each module call's inputs and outputs do the same for the gradients flowing
through it. Reading ``first_nonfinite`` or ``report()``
copies the tables of the latest forward/backward to the host once.

First producer: the first module, in forward order, whose inputs were finite and whose output
was not; failing that, the first module in backward order whose incoming gradient was finite
and whose outgoing gradient was not. Modules that only pass a NaN on are not blamed. A module's
inputs are its positional and keyword tensor arguments (a Hugging Face model is called with
``input_ids=``, ``inputs_embeds=``); its own parameters are not inputs: a NaN weight makes its
module the producer.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .checks import multi_tensor_stats
from .ops.layout import COL
from .ops.reference import merge_rows
from .stats import RangeStats

ROOT = "(model)"  # the name of the model itself with modules="all"


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.layout == torch.strided and not obj.is_complex() else []
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


class ActivationMonitor:
    """Hooks on the selected modules of ``model``.

    Args:
        modules: None for every leaf module; ``"all"`` for every module, the model itself
            (named ``"(model)"``) and the containers too, so that a value made inside a container's
            own forward code is attributed to it; a regex (``re.search`` on the qualified
            name); or a list of module names.
        every: record one forward/backward in ``every`` (sampling).
        allow_inf: regex of module names whose outputs may hold intended infinities (attention
            masks filled with -inf): they are not reported, and infinities downstream of them
            are not held against later modules' inputs (NaN always is).
        grads: also watch the gradients through each chosen module (True), only through the
            leaf modules among them ("leaves"), or not (False). Tensor hooks on each call's
            inputs and outputs, so in-place ops after a module are allowed.
        range_dtype: also count, in the same pass, values that would overflow or underflow
            this dtype (``stats()`` then has ``overflow_frac``/``underflow_frac``/``headroom``).
    """

    def __init__(self, model: torch.nn.Module, modules: Any = None, every: int = 1, *,
                 allow_inf: str | None = None, grads: bool | str = True,
                 range_dtype: torch.dtype | None = None, backend: str | None = None) -> None:
        if every < 1:
            raise ValueError(f"fasthealth: every must be >= 1, got {every}")
        self.every, self.backend, self.range_dtype = every, backend, range_dtype
        self._allow = re.compile(allow_inf) if allow_inf else None
        named = list(model.named_modules())
        if modules is None:
            chosen = [(n, m) for n, m in named if n and not list(m.children())]
        elif modules == "all":
            chosen = [(n or ROOT, m) for n, m in named]
        elif isinstance(modules, str):
            rx = re.compile(modules)
            chosen = [(n, m) for n, m in named if n and rx.search(n)]
        else:
            wanted = list(modules)
            by_name = dict(named)
            missing = [n for n in wanted if n not in by_name]
            if missing:
                raise ValueError(f"fasthealth: no module named {missing[0]!r} in the model")
            chosen = [(n, by_name[n]) for n in wanted]
        if not chosen:
            raise ValueError(f"fasthealth: no module matches {modules!r}")
        self.names = [n for n, _ in chosen]
        self._calls = 0
        self._recording = False
        # per recorded pass: [(name, table, n_inputs)] in execution order
        self._forward: list[tuple[str, torch.Tensor, int]] = []
        self._backward: list[tuple[str, torch.Tensor, int]] = []
        self._handles = []
        root = model
        self._all = modules == "all"
        self._grads = bool(grads)
        self._chosen = (chosen if grads != "leaves"
                        else [(n, m) for n, m in chosen if not list(m.children())])
        self._handles.append(root.register_forward_pre_hook(self._start_pass))
        leaves = {id(m) for n, m in self._chosen}
        for name, m in chosen:
            self._handles.append(m.register_forward_hook(
                self._forward_hook(name, self._grads and id(m) in leaves), with_kwargs=True))

    # hooks ----------------------------------------------------------------------------------

    def _start_pass(self, module: torch.nn.Module, args: Any) -> None:
        self._recording = self._calls % self.every == 0
        self._calls += 1
        if self._recording:
            self._forward, self._backward = [], []

    def _record(self, store: list, name: str, inputs: list[torch.Tensor],
                outputs: list[torch.Tensor]) -> None:
        if not outputs:
            return
        tensors = [t.detach() for t in inputs + outputs]
        s = multi_tensor_stats(tensors, backend=self.backend, range_dtype=self.range_dtype)
        store.append((name, s.raw, len(inputs)))

    def _forward_hook(self, name: str, grads: bool):
        def hook(module, args, kwargs, output):
            if not self._recording:
                return
            inputs, outputs = _tensors(args) + _tensors(kwargs), _tensors(output)
            self._record(self._forward, name, inputs, outputs)  # keyword arguments are inputs
            if grads and torch.is_grad_enabled():
                self._watch_grads(name, inputs, outputs)
        return hook

    def _watch_grads(self, name: str, inputs: list[torch.Tensor],
                     outputs: list[torch.Tensor]) -> None:
        """The gradients through one module call, by hooks on its output and input tensors:
        the gradient that reaches an output first, then, when the one of an input is computed,
        the record (incoming: the outputs', outgoing: the input's). Tensor hooks, not full
        backward hooks: those wrap a module's outputs in a custom Function's views, which an
        in-place op after the module (``ReLU(inplace=True)``, a residual ``x += shortcut``)
        may not modify. A hook lives as long as the pass's graph."""
        into = [t for t in inputs if t.requires_grad]
        out = [t for t in outputs if t.requires_grad]
        if not into or not out:
            return
        incoming: list[torch.Tensor] = []

        def on_output(g: torch.Tensor) -> None:
            incoming.append(g.detach())

        def on_input(g: torch.Tensor) -> None:
            if self._recording:  # backward flows from the outputs' gradients to the inputs'
                self._record(self._backward, name, list(incoming), [g.detach()])

        for t in out:
            t.register_hook(on_output)
        for t in into:
            t.register_hook(on_input)

    # results --------------------------------------------------------------------------------

    def _host(self, store: list) -> list[tuple[str, torch.Tensor, int]]:
        if not store:
            return []
        rows = torch.cat([t.to(store[0][1].device) for _, t, _ in store]).cpu()
        out, k = [], 0
        for name, t, n_in in store:
            out.append((name, rows[k:k + t.shape[0]], n_in))
            k += t.shape[0]
        return out

    def _scan(self, store: list) -> tuple[str | None, str | None]:
        """(first producer, first module that received non-finite inputs nobody produced).

        Modules are scanned in the order their calls finished (inner before outer). With leaf
        modules only, a module that receives non-finite inputs ends the scan: they came from
        outside the hooked modules. With every module hooked (``modules="all"``), it is only
        passing them on: the scan goes on to its container, whose own code made them."""
        upstream_inf, received = False, None
        for name, rows, n_in in self._host(store):
            ins, outs = rows[:n_in], rows[n_in:-1]
            allowed = self._allow is not None and self._allow.search(name) is not None
            in_nan = float(ins[:, COL["nan_count"]].sum()) if n_in else 0.0
            in_inf = float(ins[:, COL["inf_count"]].sum()) if n_in else 0.0
            out_nan = float(outs[:, COL["nan_count"]].sum())
            out_inf = float(outs[:, COL["inf_count"]].sum())
            inputs_clean = in_nan == 0 and (in_inf == 0 or upstream_inf)
            if allowed:
                upstream_inf = upstream_inf or out_inf > 0
                out_inf = 0.0
            if inputs_clean and (out_nan > 0 or (out_inf > 0 and not upstream_inf)):
                return name, None
            if not inputs_clean:
                if not self._all:
                    return None, name  # they came from outside the hooked modules
                received = received or name
        return None, received

    @property
    def first_nonfinite(self) -> str | None:
        """The module that first produced a non-finite value in the latest recorded pass
        (forward, then backward); None when all was finite or when the non-finite values came
        in with the inputs (see ``source``). One host copy."""
        return self._scan(self._forward)[0] or self._scan(self._backward)[0]

    @property
    def source(self) -> str | None:
        """Where the first non-finite value of the latest pass came from: 'forward' or
        'backward' (a module produced it: ``first_nonfinite``), 'input' (it arrived with the
        inputs of ``nonfinite_input``, e.g. a bad batch), or None when all was finite."""
        produced, received = self._scan(self._forward)
        if produced:
            return "forward"
        if received:
            return "input"
        return "backward" if self._scan(self._backward)[0] else None

    @property
    def nonfinite_input(self) -> str | None:
        """The first module whose inputs were already non-finite when no hooked module had
        produced a non-finite value: the data, or code outside the hooks, is the source."""
        return self._scan(self._forward)[1]

    def stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """{module: {"output": fields, "grad": fields}} of the latest recorded pass."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for key, store in (("output", self._forward), ("grad", self._backward)):
            for name, rows, n_in in self._host(store):
                outs = rows[n_in:-1]
                row = outs[0] if outs.shape[0] == 1 else merge_rows(outs)
                fields = {f: float(row[i]) for f, i in COL.items()}
                if self.range_dtype is not None:
                    r = RangeStats(row, torch.float64, self.range_dtype)
                    fields.update(overflow_frac=float(r.overflow_frac),
                                  underflow_frac=float(r.underflow_frac),
                                  headroom=float(r.headroom))
                out.setdefault(name, {})[key] = fields
        return out

    def report(self) -> str:
        """A readable per-module table of the latest recorded pass, in forward order."""
        st = self.stats()
        first = self.first_nonfinite
        head = (f"{'module':<32} {'out numel':>10} {'nan':>6} {'inf':>6} {'mean':>10} "
                f"{'std':>10} {'amax':>10} {'grad norm':>10} {'grad nan/inf':>12}")
        lines = [head]
        for name in self.names:
            if name not in st:
                continue
            o, g = st[name].get("output"), st[name].get("grad")
            mark = "!" if name == first else " "
            cells = [f"{mark}{name:<31}"]
            if o:
                cells += [f"{int(o['numel']):>10}", f"{int(o['nan_count']):>6}",
                          f"{int(o['inf_count']):>6}", f"{o['finite_mean']:>10.3g}",
                          f"{o['finite_std']:>10.3g}", f"{o['amax']:>10.3g}"]
            else:
                cells += [f"{'-':>10}"] * 6
            if g:
                cells += [f"{g['finite_norm']:>10.3g}",
                          f"{int(g['nan_count'])}/{int(g['inf_count'])}".rjust(12)]
            else:
                cells += [f"{'-':>10}", f"{'-':>12}"]
            lines.append(" ".join(cells))
        lines.append(f"first non-finite producer: {first or 'none'}")
        return "\n".join(lines)

    def remove(self) -> None:
        """Take the hooks away."""
        for h in self._handles:
            h.remove()
        self._handles = []
