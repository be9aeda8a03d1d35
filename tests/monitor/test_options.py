"""The Monitor's options (fasthealth/monitor/option_groups.py): each a keyword, documented by
concern in five groups that ``mon.options`` shows; a group passed to the Monitor (deprecated)
warns with the keywords to write and makes the same Monitor; an option given twice or an
unknown keyword is refused by name, the values are checked the same way either way, and every
field has its own docstring."""

import ast
import dataclasses
import inspect
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from runlog import run_of

import fasthealth as fh
from fasthealth.integrations.log import log_dir_option
from fasthealth.monitor import option_groups
from fasthealth.monitor.option_groups import DEFAULTS, FLAT, GROUPS, with_default

ROOT = Path(__file__).resolve().parents[2]
# every keyword Monitor took before the groups (README, examples/, integrations, bench/)
OLD_KEYWORDS = [
    "log_dir", "flush_every", "on_nonfinite", "on_spike", "spike_zscore", "spike_window",
    "warmup_steps", "max_grad_norm", "activations", "process_group", "replica_group", "scaler",
    "min_loss_scale", "per_tensor_every", "optimizer_check_every", "snapshot_max_bytes",
    "vanishing_threshold", "tensorboard", "backend", "detectors", "rules", "dumps",
    "precursors", "logits", "attention",
    "scheduler",  # the schedule as evidence
    "all_ranks",  # one rank writes under torch.distributed unless asked
    "incidents",  # how events are grouped into incidents, their causes named
    "rollback",  # the known-good snapshots a damaged run is rolled back to
    "averaged",  # an EMA/SWA copy, rolled back and checked with the model
]
# docs/spec.md section 6's signature: shown by IDEs, so kept in Monitor's own
SPEC_KEYWORDS = ["log_dir", "flush_every", "on_nonfinite", "on_spike", "spike_zscore",
                 "spike_window", "warmup_steps", "max_grad_norm", "activations", "process_group"]
# the tests of what a (deprecated) group passed to the Monitor still does
groups_passed = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def train(mon, model, steps=6):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        (mon.scaler.scale(loss) if mon.scaler is not None else loss).backward()
        mon.step(loss)
    mon.close()


def test_every_old_keyword_has_one_field_and_the_same_default():
    assert sorted(FLAT) == sorted(OLD_KEYWORDS)
    assert set(GROUPS) == {"measure", "detect", "precursors", "act", "log"}
    params = inspect.signature(fh.Monitor).parameters
    for kw in SPEC_KEYWORDS:
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY, kw
        assert params[kw].default == DEFAULTS[kw], kw  # one default, whichever way it is given
    assert params["precursors"].default is True and DEFAULTS["precursors"] is True
    for g, cls in GROUPS.items():
        assert getattr(fh, cls.__name__) is cls
        assert params[g].kind is inspect.Parameter.KEYWORD_ONLY
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def test_every_field_has_its_own_docstring():
    """Each field is followed by its docstring (what it does, its default and why), and the
    Monitor's docstring lists every group."""
    tree = ast.parse((ROOT / "fasthealth/monitor/option_groups.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for cls in GROUPS.values():
        body = classes[cls.__name__].body
        documented = {a.target.id for a, b in zip(body, body[1:])
                      if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                      and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                      and isinstance(b.value.value, str) and len(b.value.value) > 40}
        assert documented == {f.name for f in dataclasses.fields(cls)}, cls.__name__
    for cls in GROUPS.values():
        assert f"fh.{cls.__name__}(" in fh.Monitor.__doc__


def test_keywords_do_not_warn_and_each_group_passed_warns_with_its_keywords(tmp_path):
    """Every option as a keyword: no warning. Each group passed: a DeprecationWarning that
    names the keywords to write, pointing at the caller's line, and the same options."""
    scaler = torch.amp.GradScaler("cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = fh.Monitor(model, opt, **_flat(scaler, tmp_path / "f"))
    flat.close()
    grouped = _grouped(scaler, tmp_path / "g")
    for name, group in grouped.items():
        with pytest.warns(DeprecationWarning) as caught:
            mon = fh.Monitor(model, opt, **{name: group})
        mon.close()
        [w] = caught.list
        text = str(w.message)
        assert text.startswith(f"fasthealth: {name}=fh.{type(group).__name__}(...) is "
                               "deprecated and will be removed: give its options as Monitor "
                               "keywords ("), text
        given = text.split("keywords (", 1)[1]
        for f in dataclasses.fields(group):
            kw = f.metadata.get("keyword", f.name)
            assert (f"{kw}=" in given) == (getattr(group, f.name) != DEFAULTS[kw]), (kw, text)
        assert w.filename == __file__
        assert getattr(mon.options, name) == group


def _grouped(scaler, log_dir):
    return dict(
        measure=fh.MeasureOptions(backend="torch", activations=True),
        detect=fh.DetectOptions(spike_zscore=8.0, spike_window=64, warmup_steps=10,
                                vanishing_threshold=1e-9, min_loss_scale=0.5,
                                optimizer_check_every=3, rules={"spike": {"max_run": 4}}),
        precursors=fh.PrecursorOptions(logits=False),
        act=fh.ActOptions(on_nonfinite="raise", on_spike="skip", max_grad_norm=2.0,
                          scaler=scaler),
        log=fh.LogOptions(log_dir=log_dir, flush_every=3, per_tensor_every=2, dumps="event",
                          snapshot_max_bytes=0))


def _flat(scaler, log_dir):
    return dict(backend="torch", activations=True, spike_zscore=8.0, spike_window=64,
                warmup_steps=10, vanishing_threshold=1e-9, min_loss_scale=0.5,
                optimizer_check_every=3, rules={"spike": {"max_run": 4}}, logits=False,
                on_nonfinite="raise", on_spike="skip", max_grad_norm=2.0, scaler=scaler,
                log_dir=log_dir, flush_every=3, per_tensor_every=2, dumps="event",
                snapshot_max_bytes=0)


def _mixed(scaler, log_dir):
    """Some options flat, the rest in their groups."""
    g = _grouped(scaler, log_dir)
    return dict(spike_zscore=8.0, flush_every=3, scaler=scaler, logits=False,
                detect=dataclasses.replace(g["detect"], spike_zscore=6.0), measure=g["measure"],
                act=dataclasses.replace(g["act"], scaler=None),
                log=dataclasses.replace(g["log"], flush_every=50))


@groups_passed
@pytest.mark.parametrize("make", [_flat, _mixed])
def test_groups_and_flat_keywords_make_the_same_monitor(tmp_path, make):
    scaler = torch.amp.GradScaler("cpu")
    made = {}
    for name, kwargs in (("grouped", _grouped(scaler, tmp_path / "g")),
                         ("other", make(scaler, tmp_path / "f"))):
        model = make_model()
        mon = fh.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01), **kwargs)
        made[name] = mon
        train(mon, model)
    a, b = made["grouped"], made["other"]
    assert dataclasses.replace(a.options.log, log_dir=None) == \
        dataclasses.replace(b.options.log, log_dir=None)
    assert [a.options.measure, a.options.detect, a.options.precursors, a.options.act] == \
        [b.options.measure, b.options.detect, b.options.precursors, b.options.act]
    assert [type(r) for r in a.detectors] == [type(r) for r in b.detectors]
    assert [r.config for r in a.detectors] == [r.config for r in b.detectors]
    spike = next(r.config for r in a.detectors if r.name == "spike")
    assert (spike.zscore, spike.window, spike.warmup, spike.max_run) == (8.0, 64, 10, 4)
    assert a.skip_rule is not None and b.skip_rule is not None
    assert a.skip_rule.config == b.skip_rule.config
    for attr in ("flush_every", "on_nonfinite", "on_spike", "max_grad_norm", "min_loss_scale",
                 "per_tensor_every", "optimizer_check_every", "backend", "scaler"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.flush_every == 3 and a.scaler is scaler and a.precursors is not None
    assert a.activations is not None and b.activations is not None
    meta = [json.loads((run_of(tmp_path / d) / "meta.json").read_text()) for d in ("g", "f")]
    for m in meta:
        m.pop("started")
    assert meta[0] == meta[1]
    assert [json.loads(s)["step"] for s in (run_of(tmp_path / "f") / "steps.jsonl").open()] == \
        list(range(6))


@groups_passed
def test_the_defaults_are_the_same_without_any_option():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plain = fh.Monitor(model, opt)
    empty = fh.Monitor(model, opt, log=fh.LogOptions(), act=fh.ActOptions(),
                       detect=fh.DetectOptions(), precursors=fh.PrecursorOptions(),
                       measure=fh.MeasureOptions())
    assert plain.options == empty.options == option_groups.Options()
    assert [r.config for r in plain.detectors] == [r.config for r in empty.detectors]
    off = fh.Monitor(model, opt, precursors=False)
    assert off.options.precursors == fh.PrecursorOptions(enabled=False) and off.precursors is None
    assert len(off.detectors) < len(plain.detectors)
    for mon in (plain, empty, off):
        mon.close()


@groups_passed
def test_a_flat_option_at_its_default_leaves_the_group_alone():
    """An option counts as given when it is not its default: flush_every=50 (the default)
    beside log=LogOptions(flush_every=5) is no conflict, and the group's 5 holds."""
    model = make_model()
    mon = fh.Monitor(model, flush_every=50, log=fh.LogOptions(flush_every=5),
                     precursors=fh.PrecursorOptions(logits=False), attention=None)
    assert mon.flush_every == 5 and mon.options.precursors.logits is False
    mon.close()


@groups_passed
@pytest.mark.parametrize("kwargs, name", [
    (dict(flush_every=20, log=fh.LogOptions(flush_every=10)), "flush_every"),
    (dict(flush_every=20, log=fh.LogOptions(flush_every=20)), "flush_every"),  # even alike
    (dict(dumps="alarm", log=fh.LogOptions(dumps="event")), "dumps"),
    (dict(max_grad_norm=1.0, act=fh.ActOptions(max_grad_norm=2.0)), "max_grad_norm"),
    (dict(spike_zscore=8, detect=fh.DetectOptions(spike_zscore=7.0)), "spike_zscore"),
    (dict(rules={"spike": {}}, detect=fh.DetectOptions(rules={"stall": {}})), "rules"),
    (dict(logits="head", precursors=fh.PrecursorOptions(logits="lm_head")), "logits"),
    (dict(backend="torch", measure=fh.MeasureOptions(backend="cpu")), "backend"),
])
def test_an_option_given_twice_is_refused_by_name(tmp_path, kwargs, name):
    model = make_model()
    with pytest.raises(ValueError, match=rf"^fasthealth: {name} is given twice, as {name}="):
        fh.Monitor(model, log_dir=tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(flush_evry=10), "unknown keyword argument 'flush_evry' (did you mean 'flush_every'?)"),
    (dict(spike_zcore=8.0),
     "unknown keyword argument 'spike_zcore' (did you mean 'spike_zscore'?)"),
    (dict(logs=fh.LogOptions()), "unknown keyword argument 'logs' (did you mean 'log'?)"),
    (dict(enabled=False), "unknown keyword argument 'enabled' (did you mean 'precursors'?)"),
    (dict(zzz=1), "unknown keyword argument 'zzz'; its options are the keywords documented in"),
])
def test_an_unknown_keyword_is_a_type_error_naming_it(kwargs, message):
    with pytest.raises(TypeError) as info:
        fh.Monitor(make_model(), **kwargs)
    assert str(info.value).startswith("fasthealth: Monitor got an " + message), str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(log={"flush_every": 10}),
     "fasthealth: log must be a fh.LogOptions or None, got {'flush_every': 10} (a dict)"),
    (dict(act=fh.LogOptions()), "fasthealth: act must be a fh.ActOptions or None, got"),
    (dict(precursors="yes"),
     "fasthealth: precursors must be True, False or a fh.PrecursorOptions, got 'yes'"),
])
def test_a_group_keyword_takes_its_group(kwargs, message):
    with pytest.raises(TypeError) as info:
        fh.Monitor(make_model(), **kwargs)
    assert str(info.value).startswith(message), str(info.value)


@groups_passed
@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(log=fh.LogOptions(flush_every=0)), ValueError,
     "fasthealth: flush_every must be >= 1, got 0"),
    (dict(detect=fh.DetectOptions(warmup_steps=200)), ValueError,
     "fasthealth: warmup_steps=200 is more than spike_window=128"),
    (dict(act=fh.ActOptions(on_nonfinite="ignore")), ValueError,
     "fasthealth: on_nonfinite must be one of 'skip', 'raise', 'warn', got 'ignore'"),
    (dict(log=fh.LogOptions(tensorboard=True)), ValueError,
     "fasthealth: tensorboard=True needs log_dir="),
    (dict(measure=fh.MeasureOptions(process_group="world")), TypeError,
     "fasthealth: process_group must be a torch.distributed ProcessGroup"),
    (dict(precursors=fh.PrecursorOptions(attention="([")), ValueError,
     "fasthealth: attention='([' is not a valid regular expression"),
])
def test_a_bad_value_in_a_group_is_checked_as_a_flat_one(tmp_path, kwargs, exc, message):
    """The same check, the same message, and nothing written."""
    model = make_model()
    if "log" not in kwargs:
        kwargs["log_dir"] = tmp_path / "run"
    elif not kwargs["log"].tensorboard:
        kwargs["log"] = dataclasses.replace(kwargs["log"], log_dir=tmp_path / "run")
    with pytest.raises(exc) as info:
        fh.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert str(info.value).startswith(message), str(info.value)
    assert not (tmp_path / "run").exists()


@groups_passed
def test_a_trainer_setting_yields_to_the_users_flat_or_grouped():
    """What the trainer callbacks hand the Monitor (their clipping, their log_dir): set when
    the user gave nothing, left alone when the user gave it, flat or in its group."""
    assert with_default({}, "max_grad_norm", 1.0) == {"max_grad_norm": 1.0}
    assert with_default({"max_grad_norm": None}, "max_grad_norm", 1.0) == {"max_grad_norm": None}
    act = fh.ActOptions(max_grad_norm=0.5)
    assert with_default({"act": act}, "max_grad_norm", 1.0) == {"act": act}
    other = fh.ActOptions(on_spike="skip")
    assert with_default({"act": other}, "max_grad_norm", 1.0) == {"act": other,
                                                                   "max_grad_norm": 1.0}
    assert log_dir_option({}, None, "out") == {"log_dir": str(Path("out", "fasthealth"))}
    log = fh.LogOptions(log_dir="mine")
    assert log_dir_option({"log": log}, None, "out") == {"log": log}
    assert log_dir_option({}, False, "out") == {"log_dir": None}
    assert log_dir_option({"log": log}, "theirs", "out") == {"log": log, "log_dir": "theirs"}
    with pytest.raises(ValueError, match="^fasthealth: log_dir is given twice"):
        fh.Monitor(make_model(), **log_dir_option({"log": log}, "theirs", "out"))


def test_watch_takes_the_keywords(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = fh.watch(model, opt, log_dir=tmp_path, flush_every=2, max_grad_norm=0.5)
    assert mon.flush_every == 2 and mon.max_grad_norm == 0.5
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    mon.close()
    assert len((mon.run_dir / "steps.jsonl").read_text().splitlines()) == 4


@groups_passed
def test_the_incident_settings_reach_the_analyser_and_group_events_by_them():
    """``incidents=fh.IncidentConfig(...)`` (or ``detect=fh.DetectOptions(incidents=...)``)
    sets how events are grouped: two skipped NaN losses 6 steps apart are two incidents by
    default (one whose events were all at skipped steps closes after 3 quiet steps), one with
    ``skipped_quiet=10``."""
    def alarms(**options):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        with fh.Monitor(m, opt, flush_every=10, precursors=False, **options) as mon:
            for t in range(100):
                loss = m(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                mon.step(loss * math.nan if t in (60, 66) else loss)
                opt.zero_grad()
        return [(i.start, i.kinds) for i in mon.incidents if i.severity == "alarm"]

    assert alarms() == [(60, ["nonfinite_loss"]), (66, ["nonfinite_loss"])]
    one = [(60, ["nonfinite_loss"])]
    assert alarms(incidents=fh.IncidentConfig(skipped_quiet=10)) == one
    assert alarms(detect=fh.DetectOptions(incidents=fh.IncidentConfig(skipped_quiet=10))) == one
    with pytest.raises(TypeError, match="incidents must be a fasthealth.monitor.IncidentConfig"):
        fh.Monitor(torch.nn.Linear(2, 1), incidents={"quiet": 10})
