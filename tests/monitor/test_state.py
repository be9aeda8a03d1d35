"""The Monitor's state by name (``fasthealth/monitor/state.py``): each component saves the fields
it lists in ``STATE``, and nothing else; the state says its format; a state of the format
before (every attribute saved) is migrated, one of an unknown format or with fields this
release does not list is refused before anything is applied.

Whether a resumed run raises the same events as the run uninterrupted is
tests/test_resume.py's; this file checks the lists themselves and the versions."""

from __future__ import annotations

import collections
import copy
import json
import math
import warnings
from pathlib import Path

import nanogpt  # noqa: E402  (tests/ is on sys.path)
import pytest
import test_resume as R  # noqa: E402
import torch

import fasthealth as fh
from fasthealth.monitor.rules import RULES
from fasthealth.monitor.state import FORMAT, StateError

# Saved by fasthealth 0.1.0 in format 1 (every attribute of every component) from
# test_resume's run (``R._train`` with ``R.FAULTS`` and ``R.OPTIONS``) at step 61, inside the
# incident of the NaN losses at 60 and 61.
FORMAT_1 = Path(__file__).parent / "data" / "monitor_state_format1.pt"
# Saved by this fasthealth in format 2 (listed fields; a record's type spelled
# "module:qualname") from the same run at the same step.
FORMAT_2 = Path(__file__).parent / "data" / "monitor_state_format2.pt"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple, collections.deque)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(type(a), "STATE") and type(a) is type(b):
        return not _unlisted_changes(a, b, "")
    return a == b


def _unlisted_changes(obj, fresh, path: str) -> list[str]:
    """The fields of ``obj`` outside its STATE whose value differs from a freshly made one's
    (a field the run changes that a resume would lose), and inside its parts."""
    out = []
    listed = set(type(obj).STATE)
    for k, v in vars(obj).items():
        if k in ("config", "ctx", "c") or k in getattr(type(obj), "DERIVED", ()):
            continue
        old = vars(fresh).get(k, "<missing>")
        if k in listed:
            if hasattr(type(v), "STATE") and type(v) is type(old):
                out += _unlisted_changes(v, old, f"{path}.{k}")
            elif isinstance(v, dict):
                for key, x in v.items():
                    if hasattr(type(x), "STATE") and type(old.get(key)) is type(x):
                        out += _unlisted_changes(x, old[key], f"{path}.{k}[{key!r}]")
            continue
        if not _same(v, old):
            out.append(f"{path}.{k}")
    return out


def _busy_run():
    """A nanoGPT-shaped run that moves every rule that can move on a CPU: a GradScaler (the
    loss-scale rules), the precursors (an LM head), a step schedule, a spike skipped on the
    device, NaN losses, a burst of learning rate, a batch repeated."""
    torch.manual_seed(0)
    model = nanogpt.GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 80, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=50)
    mon = fh.Monitor(model, opt, scaler=scaler, on_spike="skip", flush_every=20,
                     scheduler=sched)
    data, g = nanogpt.text(), torch.Generator().manual_seed(0)
    x, y = nanogpt.batch(data, g)
    for t in range(260):
        if not 150 <= t < 160:  # the same batch ten times
            x, y = nanogpt.batch(data, g)
        loss = model(x, y)
        if t in (100, 101):
            loss = loss * math.nan
        elif t == 200:
            loss = loss * 100
        if t == 230:
            for group in opt.param_groups:
                group["lr"] *= 50
        scaler.scale(loss).backward()
        mon.step(loss, batch=(x, y))
        opt.zero_grad()
        sched.step()
    mon.flush()
    return mon


@pytest.mark.slow
def test_every_field_a_component_changes_while_it_runs_is_listed_as_state():
    mon = _busy_run()
    ctx = mon.rule_context
    assert {type(r) for r in mon.detectors} == set(RULES)  # every built-in rule is checked
    kinds = {e.kind for e in mon.events}
    assert {"nonfinite_loss", "loss_spike", "repeated_batch"} <= kinds, kinds
    missing = []
    for rule in mon.detectors:
        fresh = type(rule)(rule.config, ctx)
        missing += _unlisted_changes(rule, fresh, type(rule).__name__)
    tracker = mon.analyser.tracker
    comps = [(tracker, type(tracker)(tracker.config), "tracker"),
             (mon._restarts, type(mon._restarts)(mon._restarts.config), "restarts"),
             (mon.skip_rule, type(mon.skip_rule)(mon.device, mon.skip_rule.config),
              "skip_rule")]
    for obj, fresh, name in comps:
        missing += _unlisted_changes(obj, fresh, name)
    assert not missing, f"fields that change but are not in STATE: {missing}"
    # and every listed field exists (a misspelt name would be saved as nothing)
    for obj in [*mon.detectors, *(c[0] for c in comps)]:
        for k in type(obj).STATE:
            assert hasattr(obj, k), f"{type(obj).__name__}.STATE names {k!r}, which it lacks"
    mon.close()


def test_the_state_holds_the_listed_fields_and_says_its_format():
    m, opt = R._model()
    mon = fh.Monitor(m, opt, **R.OPTIONS)
    R._train(mon, m, opt, range(40), R.FAULTS)
    sd = mon.state_dict()
    assert sd["format"] == FORMAT == 3
    for key, saved in sd["rules"].items():
        rule = mon.detectors[int(key.split(":")[0])]
        assert saved["fields"]["k"] == list(type(rule).STATE), key
    tracker = sd["objects"]["tracker"]["fields"]["k"]
    assert tracker == list(type(mon.analyser.tracker).STATE)
    assert "quiet" not in tracker  # a setting the resumed Monitor's options make
    mon.close()


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_state_of_a_format_before_is_migrated_and_the_run_goes_on_the_same(fmt):
    """The format-1 and format-2 files were saved at step 61 of test_resume's run; loaded
    into a Monitor of this release, the run after 61 raises what the run uninterrupted
    raises."""
    whole = R._continuous(R.FAULTS)
    m, opt = R._model()
    first = fh.Monitor(m, opt, **R.OPTIONS)  # the model and optimizer as they were at 61
    R._train(first, m, opt, range(62), R.FAULTS)
    first.close()
    old = torch.load(FORMAT_1 if fmt == 1 else FORMAT_2, weights_only=True)
    assert old["format"] == fmt
    if fmt == 2:  # its records' types by module path, as that format spelled them
        assert "fasthealth.monitor.events:Event" in _types(old)
    mon = fh.Monitor(m, opt, **R.OPTIONS)
    mon.load_state_dict(old)
    R._train(mon, m, opt, range(62, R.STEPS), R.FAULTS)
    mon.close()
    assert R._key(mon.events, 61) == R._key(whole.events, 61)
    assert [(i.id, i.start, i.end, i.kinds) for i in mon.incidents] == \
        [(i.id, i.start, i.end, i.kinds) for i in whole.incidents]


def _types(sd) -> set[str]:
    """The type names a state spells (its records' and its parts')."""
    out: set[str] = set()

    def walk(v):
        if isinstance(v, dict):
            if v.get("__t") == "obj":
                out.add(v["cls"])
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(sd)
    return out


def _first_obj(v, cls: str):
    """The first encoded object of type ``cls`` in a state, depth first."""
    if isinstance(v, dict):
        if v.get("__t") == "obj" and v["cls"] == cls:
            return v
        v = list(v.values())
    if isinstance(v, list):
        for x in v:
            if (found := _first_obj(x, cls)) is not None:
                return found
    return None


def test_a_state_names_types_not_where_they_live():
    """A state spells a record's or a part's type by its name, never by the module that
    defines it (a release that moves a class still reads the states saved before); a name
    that is not one of fasthealth's records or a part of the resumed Monitor is refused."""
    m, opt = R._model()
    mon = fh.Monitor(m, opt, **R.OPTIONS)
    R._train(mon, m, opt, range(62), R.FAULTS)  # inside the incident of the NaN losses
    sd = mon.state_dict()
    mon.close()
    names = _types(sd)
    assert {"Event", "Incident", "_Series"} <= names, names
    assert not any(":" in n or "." in n for n in names), names
    assert "fasthealth.monitor" not in repr(sd)
    bad = copy.deepcopy(sd)
    _first_obj(bad, "Event")["cls"] = "os:system"
    mon = _fresh()
    with pytest.raises(StateError, match=r"names 'os:system' at .*refused"):
        mon.load_state_dict(bad)
    assert not mon.events
    mon.close()
    bad = copy.deepcopy(sd)
    series = bad["rules"][_spike_key(bad)]["fields"]
    part = series["v"][series["k"].index("series")]["v"][0]
    part["cls"] = "Elsewhere"
    mon = _fresh()
    with pytest.raises(StateError, match=r"has a Elsewhere at rules.*where this Monitor has "
                                         r"_Series"):
        mon.load_state_dict(bad)
    mon.close()


def _fresh() -> fh.Monitor:
    m, opt = R._model()
    return fh.Monitor(m, opt, **R.OPTIONS)


def _state() -> dict:
    m, opt = R._model()
    mon = fh.Monitor(m, opt, **R.OPTIONS)
    R._train(mon, m, opt, range(40), R.FAULTS)
    sd = mon.state_dict()
    mon.close()
    return sd


def _spike_key(sd: dict) -> str:
    return next(k for k in sd["rules"] if k.endswith(":spike"))


def test_an_unknown_format_is_refused_naming_the_formats_read():
    sd = _state()
    sd["format"] = 4
    mon = _fresh()
    with pytest.raises(StateError, match=r"format 4: this fasthealth reads format 3 and "
                                         r"migrates 1, 2; refused"):
        mon.load_state_dict(sd)
    mon.close()


@pytest.mark.parametrize("change", ["drop", "add"])
def test_a_component_with_other_fields_is_refused_and_nothing_is_applied(change):
    sd = _state()
    bad = copy.deepcopy(sd)
    fields = bad["objects"]["tracker"]["fields"]
    if change == "drop":
        i = fields["k"].index("losses")
        del fields["k"][i], fields["v"][i]
    else:
        fields["k"].append("surprise")
        fields["v"].append(1)
    mon = _fresh()
    before = (mon._next_step, mon.analyser.tracker.incidents, list(mon.analyser.events))
    with pytest.raises(StateError, match="tracker has the fields .* refused"):
        mon.load_state_dict(bad)
    assert (mon._next_step, mon.analyser.tracker.incidents, list(mon.analyser.events)) == before
    mon.load_state_dict(sd)  # the refusal changed nothing: the right state still loads
    mon.close()


def test_a_part_with_other_fields_is_refused_before_anything_is_applied():
    """A part of a rule (the spike rule's loss series) is checked before any component is
    set: the tracker, earlier in the state, stays as it was."""
    sd = _state()
    key = _spike_key(sd)
    series = sd["rules"][key]["fields"]["v"][0]  # {"loss": obj, "grad_norm": obj}
    part = series["v"][0]["state"]
    part["surprise"] = 0
    mon = _fresh()
    with pytest.raises(StateError, match=r"series\['loss'\] has the fields"):
        mon.load_state_dict(sd)
    assert mon.analyser.tracker.incidents == [] and mon._next_step == 0
    mon.close()


def test_a_state_saved_before_a_rule_listed_new_fields_resumes_it_warm():
    """The vanishing rules' fitted floor (``first_losses``, ``last_fitted``) came after format 2:
    a state without them resumes both rules warm, their other fields as saved, the new ones
    made by ``STATE_ADDED``; any other missing field is still a refusal."""
    sd = _state()
    old = copy.deepcopy(sd)
    dropped = {"vanishing": ["last_fitted"], "tensor_norm": ["first_losses", "last_fitted"]}
    for key, saved in old["rules"].items():
        fields = saved["fields"]
        for name in dropped.get(key.split(":")[1], []):
            i = fields["k"].index(name)
            del fields["k"][i], fields["v"][i]
    mon = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rule starts cold
        mon.load_state_dict(old)
    rules = {r.name: r for r in mon.detectors}
    assert rules["vanishing"].last_fitted is None and rules["tensor_norm"].first_losses == []
    assert rules["vanishing"].first_losses and rules["tensor_norm"].seen.min() >= 20
    mon.close()
    key = next(k for k in sd["rules"] if k.endswith(":vanishing"))
    fields = sd["rules"][key]["fields"]
    i = fields["k"].index("low")
    del fields["k"][i], fields["v"][i]
    mon = _fresh()
    with pytest.raises(StateError, match="vanishing.* has the fields"):
        mon.load_state_dict(sd)
    mon.close()


def test_a_state_saved_before_a_rule_was_added_resumes_the_other_rules_warm():
    """A release that adds a rule before others moves their places: a state saved without
    ``level_shift`` (the rules after it one place earlier) resumes every other rule warm, and
    the new rule starts cold, named."""
    sd = _state()
    old = copy.deepcopy(sd)
    keys = list(old["rules"])
    at = next(i for i, k in enumerate(keys) if k.endswith(":level_shift"))
    rules = {}
    for k in keys:
        place, name = k.split(":", 1)
        if name != "level_shift":
            rules[f"{int(place) - (int(place) > at)}:{name}"] = old["rules"][k]
    old["rules"] = rules
    mon = _fresh()
    with pytest.warns(RuntimeWarning, match=r"start cold .*: level_shift$"):
        mon.load_state_dict(old)

    def others(state):
        return json.dumps({k: v for k, v in state["rules"].items()
                           if not k.endswith(":level_shift")}, default=lambda t: t.tolist())

    assert others(mon.state_dict()) == others(sd)
    mon.close()
