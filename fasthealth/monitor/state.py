"""The Monitor's state, to resume a stopped run as if it had never stopped (docs/spec.md
section 11): ``Monitor.state_dict()`` and ``Monitor.load_state_dict(sd)``.

What a run's verdicts depend on lives in a handful of host objects: each rule's windows
(``rules/``), the device skip rule's rings (``skip_rule.py``), the incident tracker with its open
incident (``incidents.py``), the schedule's view of the learning rate (``schedule.py``), the step
counter and the run id. The state is those objects' fields, encoded as plain containers (dicts,
lists, numbers, strings) and CPU tensors, so that ``torch.load(..., weights_only=True)`` reads it
without running code. What is not state stays out: the rules' configs (a resumed Monitor's options
decide them; a rule whose config changed starts cold, with a warning), references to the model, the
optimizer and the precursor probe's copies of the weights (the probe copies them again at its next
due step), the batches kept for the dump.

The state stays small however long and noisy the run: of the events it keeps the last
``EVENTS_KEPT`` (256) and the open incident's (the first of each kind, on which its later repeats
are counted), of the incidents the last ``INCIDENTS_KEPT`` (64, the open one among them). After
``load_state_dict``, ``mon.events`` holds those kept events followed by the ones the resumed run
raises, and ``mon.incidents`` every incident in its place (an incident's ``id`` is its index),
those before the kept ones as ``Forgotten`` placeholders (their id only, closed). Nothing a rule
or the tracker decides on is lost: the tracker counts repeats on the open incident's events and
numbers new incidents from the count, so a resumed run raises the same events and incidents
after the stop as the run uninterrupted.

State by name: each stateful class lists its state fields in ``STATE`` (``Rule.STATE`` says what
belongs there), and only those are saved and restored, into the objects the resumed Monitor made
from its own options. What a class makes from its state to be fast (a window's values kept
sorted, a cached check) it lists in ``DERIVED``: never saved, rebuilt when the state is set (a
property's setter). With ``rollback=``
the rollbacks' history, the quarantine and the budget's counts are state; the snapshots (copies
of the model) are not. A record (``Event``, ``Incident``) is saved by its dataclass fields. An
object becomes ``{"__t": "obj", "cls": name, "id": n, "state": {...}}`` (the same object twice
becomes a reference to its ``id``: an incident's events are the Monitor's events), a deque,
tuple, set or dict a tagged list. ``name`` is the type's name, never the module that defines
it: a release that moves a class reads the states saved before, and decoding imports nothing.
It makes records only of the few types ``_records`` lists, and restores a part of a rule (a
spike rule's series) into the part of that name the resumed rule has; anything else in a
state is refused with the path to it. A user's rule
(``DetectOptions(detectors=...)``) of its own class keeps its state through its own
``state_dict()`` / ``load_state_dict()`` if it has them, and starts cold (with a warning)
otherwise.

Versions: a state says its ``format`` (``FORMAT``). Format 2 was this layout with each type
spelled "module:qualname"; it is read by the qualname. Fields added to a list since a state was
saved are made from the saved ones (``STATE_ADDED``), in any format. Format 1 (fasthealth 0.1.0
before state by name) saved every attribute of these objects; it is migrated: the listed fields
are taken, the rest (settings the resumed Monitor makes from its options) dropped, and a component
that lacks a listed field starts cold, with a warning that names it. A format this fasthealth
does not know, or a component whose fields differ from its list in a state of this format, is
refused with a StateError before anything is applied: never half-loaded. A rule resumes warm
only under the settings it was saved with (its config); a config saved before some of its fields
became named constants, or came (``retired.py``), is read as it was then.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from typing import Any, Protocol

import torch

from .events import Event, Incident, RollbackRecord
from .retired import ADDED, RETIRED, saved_key


class Monitor(Protocol):
    """What of a ``monitor.Monitor`` (which imports this module) the state reads and sets."""

    names: list[str]
    journal: Any
    analyser: Any
    detectors: list[Any]
    skip_rule: Any
    rollback: Any
    precursors: Any
    _restarts: Any
    _next_step: int
    steps_seen: int
    _stepped: bool
    _resumed: bool
    _closed: bool

    def flush(self) -> Any: ...

    def _continue_run(self, run_id: str | None, step: int) -> None: ...

FORMAT = 3  # the layout of the state: 2 and 3 save listed fields (STATE), 1 every attribute
MIGRATED = (1, 2)  # older formats this fasthealth reads
BY_NAME = (2, 3)  # the formats of listed fields: 2 named a record's type "module:qualname"


class StateError(ValueError):
    """A state that cannot be saved or loaded; the message names the field."""


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "fasthealth"


def _fields(obj: Any) -> dict[str, Any]:
    """The state of ``obj`` by name: a record's dataclass fields, else the fields its class
    lists in ``STATE``; a class of ours that lists none cannot be kept."""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    names = getattr(type(obj), "STATE", None)
    if names is None:
        raise StateError(f"fasthealth: {type(obj).__qualname__} lists no STATE fields: it "
                         "cannot be kept in the Monitor's state")
    return {k: getattr(obj, k) for k in names}


@dataclasses.dataclass
class _Part:
    """A decoded part of a component (``cls``'s listed fields), restored into the part the
    resumed component has made."""

    name: str  # the qualname of the part's class
    fields: dict[str, Any]
    fmt: int  # the state's format


class _Encoder:
    def __init__(self) -> None:
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # the encoded objects stay alive: their ids stay unique

    def __call__(self, v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            if isinstance(v, torch.nn.Parameter):
                raise StateError(f"fasthealth: the Monitor's state would hold a model "
                                 f"parameter at {path}")
            return v.detach().to("cpu", copy=True)
        if isinstance(v, (torch.device, torch.dtype)):
            return {"__t": type(v).__name__, "v": str(v)}
        if isinstance(v, collections.deque):
            return {"__t": "deque", "maxlen": v.maxlen,
                    "v": [self(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (tuple, set, frozenset)) and not hasattr(v, "_fields"):
            return {"__t": type(v).__name__, "v": [self(x, f"{path}[{i}]")
                                                   for i, x in enumerate(v)]}
        if isinstance(v, dict):
            return {"__t": "dict", "k": [self(k, f"{path}.keys") for k in v],
                    "v": [self(x, f"{path}[{k!r}]") for k, x in v.items()]}
        if hasattr(v, "__dict__") and _ours(type(v)) and not isinstance(
                v, (torch.nn.Module, torch.optim.Optimizer)):
            if id(v) in self.memo:
                return {"__t": "ref", "id": self.memo[id(v)]}
            n = self.memo[id(v)] = len(self.memo)
            self.keep.append(v)
            return {"__t": "obj", "cls": _name(type(v)), "id": n,
                    "state": {k: self(x, f"{path}.{k}") for k, x in _fields(v).items()}}
        if type(v).__module__ == "numpy" and hasattr(v, "item"):
            return v.item()
        raise StateError(f"fasthealth: cannot keep {type(v).__qualname__} (at {path}) in the "
                         "Monitor's state")


def _name(cls: type) -> str:
    return cls.__qualname__


def _records() -> dict[str, type]:
    """The records a state makes, by name: nothing else is made from a state."""
    return {c.__qualname__: c for c in (Event, Incident, Forgotten, RollbackRecord)}


def _spelled(name: str, fmt: int) -> str:
    """A saved type's name: format 2 spelled it "module:qualname", later ones the qualname."""
    if fmt <= 2:
        module, _, qual = name.partition(":")
        if module.split(".")[0] != "fasthealth":
            return name  # refused by the caller: not a name of ours
        return qual
    return name


class _Decoder:
    def __init__(self, fmt: int = FORMAT) -> None:
        self.memo: dict[int, Any] = {}
        self.fmt = fmt

    def __call__(self, v: Any, path: str) -> Any:
        if isinstance(v, list):
            return [self(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            return v
        tag = v.get("__t")
        items = [self(x, f"{path}[{i}]") for i, x in enumerate(v.get("v", ()))] if tag in (
            "deque", "tuple", "set", "frozenset") else None
        if tag == "deque":
            return collections.deque(items or [], maxlen=v["maxlen"])
        if tag in ("tuple", "set", "frozenset"):
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items or [])
        if tag == "dict":
            return {self(k, path): self(x, f"{path}[{k!r}]") for k, x in zip(v["k"], v["v"])}
        if tag == "device":
            return torch.device(v["v"])
        if tag == "dtype":
            return getattr(torch, v["v"].removeprefix("torch."))
        if tag == "ref":
            return self.memo[v["id"]]
        if tag == "obj":
            name = _spelled(v["cls"], self.fmt)
            cls = _records().get(name)
            if cls is None:
                if not name.isidentifier():
                    raise StateError(f"fasthealth: the state names {v['cls']!r} at {path}, "
                                     "not a type of fasthealth's: refused")
                part = _Part(name, {}, self.fmt)  # a component's part: into the resumed one's
                self.memo[v["id"]] = part
                part.fields.update({k: self(x, f"{path}.{k}") for k, x in v["state"].items()})
                return part
            obj: Any = object.__new__(cls)
            self.memo[v["id"]] = obj
            state = {k: self(x, f"{path}.{k}") for k, x in v["state"].items()}
            fields = {f.name: f for f in dataclasses.fields(cls)}  # a record: a dataclass
            added = {n: f.default for n, f in fields.items()  # added since, with a default
                     if n not in state and f.default is not dataclasses.MISSING}
            if self.fmt in BY_NAME and set(state) | set(added) != set(fields):
                raise StateError(f"fasthealth: the {v['cls']} at {path} has fields "
                                 f"{sorted(state)}, this fasthealth's has {sorted(fields)}")
            obj.__dict__.update({**added, **{k: x for k, x in state.items() if k in fields}})
            return obj
        raise StateError(f"fasthealth: unreadable entry at {path} of the Monitor's state")


def _into(old: Any, new: Any, path: str, apply: bool) -> Any:
    """``new`` as the value that replaces ``old``: a part restored into ``old`` (the resumed
    component's), a dict of parts key by key, a tensor on ``old``'s device (the skip rule's
    rings). ``apply=False`` only checks that it fits, and raises StateError where it does not."""
    if isinstance(new, _Part):
        if type(old).__qualname__ != new.name:
            raise StateError(f"fasthealth: the state has a {new.name} at {path} "
                             f"where this Monitor has {type(old).__qualname__}")
        _restore(old, _check(old, new.fields, new.fmt, path) or {}, path, apply)
        return old
    if isinstance(new, dict) and isinstance(old, dict) and any(
            isinstance(x, _Part) for x in new.values()):
        if set(new) != set(old):
            raise StateError(f"fasthealth: the state has {sorted(new)} at {path} where this "
                             f"Monitor has {sorted(old)}")
        return {k: _into(old[k], x, f"{path}[{k!r}]", apply) for k, x in new.items()}
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        return new.to(old.device)
    return new


def _restore(target: Any, fields: dict[str, Any], path: str, apply: bool = True) -> None:
    """Sets ``target``'s listed fields from ``fields`` (their names checked by ``_check``);
    with ``apply=False`` checks every part of them and sets nothing."""
    for k, v in fields.items():
        value = _into(getattr(target, k, None), v, f"{path}.{k}", apply)
        if apply:
            setattr(target, k, value)


def _check(target: Any, fields: dict[str, Any], fmt: int, path: str) -> dict[str, Any] | None:
    """The fields to restore into ``target``: exactly its ``STATE``, those added since made by
    ``STATE_ADDED``. In a state of this format other names are a refusal; in a migrated one the
    listed fields are taken, the rest dropped, and another missing one makes it start cold."""
    names, added = list(_fields(target)), getattr(type(target), "STATE_ADDED", {})
    missing = [k for k in names if k not in fields]
    if missing and set(missing) <= set(added) and (fmt not in BY_NAME
                                                   or set(fields) <= set(names)):
        fields = {**fields, **{k: added[k](fields) for k in missing}}
    if fmt in BY_NAME:
        if set(fields) != set(names):
            raise StateError(
                f"fasthealth: the state's {path} has the fields {sorted(fields)}, this "
                f"fasthealth's has {sorted(names)}: a state of another release of format "
                f"{FORMAT}? refused")
        return fields
    return None if any(k not in fields for k in names) else {k: fields[k] for k in names}


def _rule_key(rule: Any, i: int) -> str:
    return f"{i}:{getattr(rule, 'name', '') or type(rule).__qualname__}"


def _canonical(v: Any, retired: dict[str, list[tuple[int, str, Any]]] | None = None,
               added: dict[str, tuple[str, ...]] | None = None) -> Any:
    """``v`` with its sets sorted and dataclasses spelled field by field: a config's repr that
    does not depend on the process (a frozenset's order follows the hash seed). With
    ``retired`` (``added``), spelled as before those fields left the configs (came)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        name = type(v).__qualname__
        new = (added or {}).get(name, ())
        fields = [(f.name, _canonical(getattr(v, f.name), retired, added))
                  for f in dataclasses.fields(v) if f.name not in new]
        for at, field, value in (retired or {}).get(name, []):
            fields.insert(at, (field, value))
        return (name, tuple(fields))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(_canonical(x, retired, added)) for x in v)))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), repr(_canonical(x, retired, added)))
                                     for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return tuple(_canonical(x, retired, added) for x in v)
    return v


def _config(obj: Any) -> str:
    c = getattr(obj, "config", None)
    return repr(_canonical(c)) if dataclasses.is_dataclass(c) else ""


def _same_config(saved: str, obj: Any) -> bool:
    """Whether a saved config is ``obj``'s, spelled now or before fields left or came."""
    if saved == _config(obj):
        return True
    c = getattr(obj, "config", None)
    return dataclasses.is_dataclass(c) and saved in (repr(_canonical(c, *a)) for a in (
        (RETIRED,), (None, ADDED), (RETIRED, ADDED)))


def _host_state(mon: Monitor) -> dict[str, Any]:
    """The objects whose fields are state, by name."""
    return {"tracker": mon.analyser.tracker, "restarts": mon._restarts,
            "skip_rule": mon.skip_rule, "rollback": mon.rollback}


EVENTS_KEPT = 256  # the latest events a state keeps (besides the open incident's)
INCIDENTS_KEPT = 64  # the latest incidents a state keeps (the open one among them)


@dataclasses.dataclass
class Forgotten(Incident):
    """An incident of a resumed run from before the ones its state kept (``INCIDENTS_KEPT``):
    it holds its ``id`` and nothing else, closed (incidents.jsonl has it whole)."""

    @classmethod
    def at(cls, n: int) -> Forgotten:
        return cls(id=n, start=-1, end=-1, kinds=[], cause="", severity="", open=False,
                   why="not kept in the Monitor's state: incidents.jsonl has it")

    @property
    def message(self) -> str:
        return f"incident #{self.id}: {self.why}"


def kept_events(a: Any) -> list[Any]:
    """The events a state keeps of ``a.events`` (an ``Analyser``), in order: the last
    ``EVENTS_KEPT`` and the open incident's (what the tracker goes on counting repeats on)."""
    cur = a.tracker.current
    held = {id(e) for e in cur.events} if cur is not None else set()
    first = len(a.events) - EVENTS_KEPT
    return [e for n, e in enumerate(a.events) if n >= first or id(e) in held]


def _kept_fields(name: str, obj: Any) -> dict[str, Any]:
    """The fields of a host object the state keeps: the tracker's last ``INCIDENTS_KEPT``
    incidents (the open one is the last opened), not every one of the run."""
    fields = _fields(obj)
    if name == "tracker":
        fields["incidents"] = obj.incidents[-INCIDENTS_KEPT:]
    return fields


def state_dict(mon: Monitor) -> dict[str, Any]:
    """``Monitor.state_dict``: flushes (one sync), then the state as plain values."""
    if not mon._closed:  # closed: its last flush was done, and flush() refuses
        mon.flush()
    enc = _Encoder()
    rules: dict[str, Any] = {}
    for i, rule in enumerate(mon.detectors):
        key = _rule_key(rule, i)
        if not _ours(type(rule)):
            own = getattr(rule, "state_dict", None)
            rules[key] = {"own": own()} if callable(own) else None
            continue
        rules[key] = {"config": _config(rule),
                      "fields": enc(_fields(rule), f"rules[{key}]")}
    objects = {name: None if obj is None else {"config": _config(obj),
                                               "fields": enc(_kept_fields(name, obj), name)}
               for name, obj in _host_state(mon).items()}
    j, a = mon.journal, mon.analyser
    last = mon._next_step - 1 if mon.steps_seen else None
    return {
        "format": FORMAT, "names": list(mon.names),
        "run": {"id": getattr(mon, "run_id", None), "step": last},
        "next_step": mon._next_step, "steps_seen": mon.steps_seen,
        "rules": rules, "objects": objects,
        "journal": enc({"events": kept_events(a), "recent_lr": j.recent_lr,
                        "optimizer": j.optimizer}, "journal"),
        "incidents": len(a.tracker.incidents),
    }


def _format(mon: Monitor, sd: Any) -> int:
    """The format of ``sd``, after checking that this Monitor may load it."""
    if mon._stepped or mon._resumed:
        raise RuntimeError("fasthealth: load_state_dict must come once, before the Monitor's "
                           "first step" + (" (this one has stepped)" if mon._stepped else
                                           " (this one has loaded a state already)"))
    if not isinstance(sd, dict) or "format" not in sd:
        raise StateError("fasthealth: load_state_dict expects what Monitor.state_dict() "
                         f"returned, got {type(sd).__name__}")
    fmt = sd["format"]
    if fmt != FORMAT and fmt not in MIGRATED:
        raise StateError(f"fasthealth: a Monitor state of format {fmt}: this fasthealth reads "
                         f"format {FORMAT} and migrates {', '.join(map(str, MIGRATED))}; "
                         "refused (a newer fasthealth wrote it?)")
    if list(sd["names"]) != list(mon.names):
        gone = sorted(set(sd["names"]) - set(mon.names))
        new = sorted(set(mon.names) - set(sd["names"]))
        raise StateError("fasthealth: the state is of a Monitor of other parameters "
                         f"(missing here: {gone[:3]}, new here: {new[:3]}, or in another "
                         "order): load it into a Monitor of the same model")
    return int(fmt)


Plan = tuple[list[tuple[Any, dict[str, Any], str]], list[tuple[Any, Any]], list[str]]


def _plan(mon: Monitor, sd: dict[str, Any], rules: dict[str, Any], objects: dict[str, Any],
          fmt: int) -> Plan:
    """What goes where: (each object with its fields and path, each user's rule of its own
    class with its own state, what starts cold); raises StateError where a part does not fit."""
    cold: list[str] = []
    restore: list[tuple[Any, dict[str, Any], str]] = []
    own: list[tuple[Any, Any]] = []
    for name, obj in _host_state(mon).items():
        saved = sd["objects"].get(name)
        if obj is None or saved is None:
            continue
        settled = getattr(obj, "STATE_UNDER_ANY_CONFIG", False) or _same_config(
            saved["config"], obj)
        fields = _check(obj, objects[name] or {}, fmt, name) if settled else None
        if fields is None:
            cold.append(name)
            continue
        restore.append((obj, fields, name))
    for i, rule in enumerate(mon.detectors):
        key = saved_key(sd["rules"], _rule_key(rule, i))
        saved = sd["rules"].get(key)
        if saved is None:
            cold.append(key.split(":", 1)[1])
        elif "own" in saved:
            own.append((rule, saved["own"]))
        elif not _same_config(saved["config"], rule) or (
                fields := _check(rule, rules[key] or {}, fmt, f"rules[{key}]")) is None:
            cold.append(key.split(":", 1)[1])
        else:
            restore.append((rule, fields, f"rules[{key}]"))
    for target, fields, path in restore:  # every part fits before anything is set
        _restore(target, fields, path, apply=False)
    return restore, own, cold


def load_state_dict(mon: Monitor, sd: dict[str, Any]) -> None:
    """``Monitor.load_state_dict``; see the module docstring. Everything is decoded and checked
    before the run is continued, and the run is continued before anything is applied: a state
    refused while decoding leaves the log directory (meta.json, the writer lock) and the
    Monitor as they were, and so does a refused writer (another live Monitor of the run)."""
    fmt = _format(mon, sd)
    # 1. decoded whole, in the order it was encoded (a reference names an object decoded
    # before), into locals: a refused state changes nothing
    dec = _Decoder(fmt)
    rules = {key: None if saved is None or "own" in saved
             else dec(saved["fields"], f"rules[{key}]") for key, saved in sd["rules"].items()}
    objects = {name: None if saved is None else dec(saved["fields"], name)
               for name, saved in sd["objects"].items()}
    journal = dec(sd["journal"], "journal")
    events, recent_lr, optimizer = journal["events"], journal["recent_lr"], journal["optimizer"]
    next_step, steps_seen = sd["next_step"], sd["steps_seen"]
    total = sd.get("incidents")
    # 2. what goes where, and what starts cold
    restore, own, cold = _plan(mon, sd, rules, objects, fmt)
    # 3. the run: a refusal (another live writer) leaves this Monitor as it was
    run = sd.get("run") or {}
    step = run.get("step")
    mon._continue_run(run.get("id"), -1 if step is None or not math.isfinite(step) else step)
    # 4. applied
    for target, fields, path in restore:
        _restore(target, fields, path)
    for rule, saved in own:
        rule.load_state_dict(saved)
    j, a = mon.journal, mon.analyser
    if isinstance(total, int) and any(t is a.tracker for t, _, _ in restore):
        # the incidents before the kept ones, each in its place (an incident's id is its index)
        before = total - len(a.tracker.incidents)
        a.tracker.incidents[:0] = [Forgotten.at(n) for n in range(before)]
    a.events[:] = events
    j.recent_lr.extend(recent_lr)
    j.optimizer = optimizer
    mon._next_step, mon.steps_seen, mon._resumed = next_step, steps_seen, True
    if mon.precursors is not None:  # the LM head hooked for the step the run goes on with
        mon.precursors.arm(next_step)
    if cold:
        warnings.warn("fasthealth: these rules start cold (their settings differ from the "
                      "saved run's, they keep no state, or an older state lacks their fields): "
                      f"{', '.join(cold)}", RuntimeWarning,
                      stacklevel=3)
