"""The rule layer as a contributor meets it (CONTRIBUTING.md): a new rule is one file and one
registry entry; every threshold carries its reason; the kinds registry is what events,
incidents, the report and the docs read."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fasthealth as fh
from fasthealth.monitor import incidents, kinds, robust, rules, skip_rule
from fasthealth.monitor.rules.base import Context

ROOT = Path(__file__).resolve().parents[2]

NEW_RULE = '''
"""``loss_above``: the loss above a fixed ceiling (a test's rule)."""
from dataclasses import dataclass

from fasthealth.monitor import kinds, rules
from fasthealth.monitor.rules.base import Finding, Rule

kinds.register(kinds.Kind("loss_above", "the loss above a fixed ceiling", "the ceiling",
                          "#123456"))


@dataclass(frozen=True)
class CeilingConfig:
    ceiling: float = 1000.0
    """A loss above it is a test's fault."""


@rules.register
class LossAbove(Rule):
    name = "loss_above"
    kinds = ("loss_above",)
    Config = CeilingConfig

    def observe(self, s):
        loss = s.values["loss"]
        if loss > self.config.ceiling:
            return [Finding("loss_above", f"loss {loss:.3g} above {self.config.ceiling}",
                            {"loss": loss})]
        return []
'''


@pytest.fixture
def new_rule(tmp_path, monkeypatch):
    """The file above, imported as a user's module would be; the registries restored after."""
    monkeypatch.setattr(rules, "RULES", list(rules.RULES))
    monkeypatch.setattr(kinds, "KINDS", dict(kinds.KINDS))
    path = tmp_path / "loss_above.py"
    path.write_text(textwrap.dedent(NEW_RULE))
    spec = importlib.util.spec_from_file_location("loss_above", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "loss_above", module)
    spec.loader.exec_module(module)
    return module


def _train(mon: fh.Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer,
           steps: int, bad_from: int) -> None:
    g = torch.Generator().manual_seed(0)
    for t in range(steps):
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True) * (100.0 if t >= bad_from else 1.0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        mon.step(loss, batch=(x, y))
    mon.close()


def test_a_new_rule_is_one_file_and_one_registry_entry(new_rule, tmp_path):
    """The rule fires in a Monitor built with defaults, its event gets the registry's severity,
    it is filed into an incident, the report draws it in its colour and the docs table lists
    it: no other file was touched."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = fh.Monitor(model, opt, log_dir=tmp_path / "log", precursors=False)
    assert any(type(r).__name__ == "LossAbove" for r in mon.detectors)
    _train(mon, model, opt, 60, bad_from=40)
    mine = [e for e in mon.events if e.kind == "loss_above"]
    assert mine and mine[0].step == 40 and mine[0].severity == "alarm"
    assert mine[0].incident is not None
    assert "loss_above" in mon.incidents[mine[0].incident].kinds
    # the report draws it in the registry's colour, on the timeline row named for it
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from fasthealth import report

    log = report.read_log(mon.run_dir)
    fig = report.figure(log.meta, log.steps, log.events, log.incidents)
    timeline = next(ax for ax in fig.axes if ax.get_title() == "events by kind")
    labels = [t.get_text() for t in timeline.get_yticklabels()]
    row = labels.index("loss_above")
    drawn = {to_hex(c) for coll in timeline.collections
             if len(coll.get_offsets()) and coll.get_offsets()[0][1] == row
             for c in coll.get_facecolors()}
    assert drawn == {"#123456"}, drawn
    assert "| `loss_above` | alarm | the loss above a fixed ceiling | the ceiling |" \
        in kinds.table()
    # its threshold follows Monitor(rules=...) like a built-in's
    mon2 = fh.Monitor(model, opt, precursors=False, rules={"loss_above": {"ceiling": 9.0}})
    (rule,) = [r for r in mon2.detectors if type(r).__name__ == "LossAbove"]
    assert rule.config.ceiling == 9.0
    mon2.close()


def test_a_rule_whose_kind_is_not_registered_is_refused(monkeypatch):
    monkeypatch.setattr(rules, "RULES", list(rules.RULES))

    class Nameless(rules.Rule):
        name = "nameless"
        kinds = ("never_registered",)

    with pytest.raises(ValueError, match="never_registered"):
        rules.register(Nameless)


def test_an_override_names_an_existing_rule_and_setting():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="names no rule.*spike"):
        fh.Monitor(model, rules={"spikes": {"zscore": 8.0}})
    with pytest.raises(ValueError, match="no setting 'z'.*zscore"):
        fh.Monitor(model, rules={"spike": {"z": 8.0}})
    mon = fh.Monitor(model, spike_zscore=7.0, rules={"spike": {"max_run": 4}})
    (spike,) = [r for r in mon.detectors if isinstance(r, rules.Spike)]
    assert (spike.config.zscore, spike.config.max_run) == (7.0, 4)
    mon.close()


def _configs() -> list[type]:
    out = [incidents.IncidentConfig, skip_rule.SkipConfig]
    for r in rules.RULES:
        if dataclasses.is_dataclass(r.Config) and dataclasses.fields(r.Config):
            out.append(r.Config)
    return out


@pytest.mark.parametrize("config", _configs(), ids=lambda c: c.__name__)
def test_every_threshold_has_its_reason_next_to_it(config):
    """Each field of a rule's config is followed by a docstring (PEP 257 attribute docstring)."""
    src = textwrap.dedent(inspect.getsource(config))
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    missing = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(
                nxt.value, ast.Constant) else None
            if not isinstance(doc, str) or len(doc.split()) < 4:
                missing.append(node.target.id)  # type: ignore[union-attr]
    assert not missing, f"{config.__name__}: fields without a reason: {missing}"


def test_the_robust_constants_have_their_reasons():
    src = inspect.getsource(robust)
    for name in ("NOISE_QUANTILE", "NOISE_PER_SIGMA", "RECENT", "MIN_LOG_NOISE"):
        assert f'{name} = ' in src and src.split(f"{name} = ", 1)[1].split("\n", 1)[1] \
            .lstrip().startswith('"""'), name


def test_every_rule_raises_only_registered_kinds_and_is_built_by_default():
    names = [r.name for r in rules.RULES]
    assert len(names) == len(set(names))
    for r in rules.RULES:
        assert r.kinds and all(kinds.get(k) is not None for k in r.kinds), r
    ctx = Context(names=["w"], numels=[1], scaler=True)
    built = {type(r) for r in rules.build(ctx, precursors=False)}
    assert built == {r for r in rules.RULES if not r.precursor}


@pytest.mark.parametrize("doc", ["docs/guide/events.md", "docs/spec.md"])
def test_the_docs_list_every_kind_from_the_registry(doc):
    """The kinds tables are printed by ``python -m fasthealth.monitor.kinds``."""
    text = (ROOT / doc).read_text()
    assert kinds.with_table(text) == text, \
        f"{doc}'s kinds table is stale: python -m fasthealth.monitor.kinds"


def test_severity_and_explanations_come_from_the_registry():
    assert kinds.severity_of("grad_norm_spike") == "notice"
    assert kinds.severity_of("precursor_update_ratio") == "notice"
    assert kinds.severity_of("a_kind_nobody_registered") == "alarm"
    assert kinds.fatal_kinds() == {"nonfinite_loss", "nonfinite_grad"}
    assert kinds.KINDS["lr_jump"].explained_by == frozenset()
    assert kinds.colour_of("x") == kinds.colour_of("x") != kinds.colour_of("y")
    with pytest.raises(ValueError, match="already registered"):
        kinds.register(dataclasses.replace(kinds.KINDS["stall"], colour="#000000"))


def test_the_tensor_norm_rule_decides_as_its_general_path_does():
    """``TensorNorm`` takes a usual step (every tensor present, armed, within its bounds)
    through a short path; over a series with absent tensors, zeros, collapses that last and
    that do not, explosions and a restart, its findings and state are those of the general
    path alone, step for step and bit for bit."""
    from fasthealth.monitor.record import StepHost, StepRecord
    from fasthealth.monitor.rules.tensor_norm import TensorNorm

    names = [f"layer{i}.weight" for i in range(6)]
    g = torch.Generator().manual_seed(3)
    ctx = Context(names=names)
    fast, slow = TensorNorm(ctx=ctx), TensorNorm(ctx=ctx)
    found = []
    slow._steady = lambda norm: False  # type: ignore[method-assign]
    for t in range(400):
        norm = (torch.rand(6, generator=g, dtype=torch.float64) + 0.5).tolist()
        if 100 <= t < 106:
            norm[1] *= 1e-5  # a collapse that lasts
        if t in (150, 151):
            norm[2] *= 1e-5  # one that does not
        if t in (200, 260):
            norm[3] *= 1e3  # explosions
        if 220 <= t < 230:
            norm[4] = math.nan  # a tensor without gradient
        if t == 240:
            norm[5] = 0.0
        if t == 300:
            fast.rearm(), slow.rearm()
        s = StepRecord(t, dict(grads_finite=1.0, loss=1.0), norm, [0.0] * 6, StepHost(t))
        a, b = fast.observe(s), slow.observe(s)
        assert [(f.kind, f.message) for f in a] == [(f.kind, f.message) for f in b], t
        found += [(t, f.kind) for f in a]
        for k in TensorNorm.STATE:
            a, b = getattr(fast, k), getattr(slow, k)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.nan_to_num(-7), b.nan_to_num(-7))
            else:
                assert a == b, k
    assert found == [(102, "vanishing_grad"), (200, "exploding_grad"), (260, "exploding_grad")]


def test_the_tensor_norm_rule_starts_its_levels_again_when_the_rate_jumps():
    """A rate 4,500x higher at one step (a per-epoch warm-up from 1e-5 the Monitor was not
    told of): a tensor whose gradient then falls three orders below its level under the old
    rate is no collapse; the levels are made anew under the new rate. Without the jump the
    same fall is a collapse."""
    from fasthealth.monitor.record import StepHost, StepRecord
    from fasthealth.monitor.rules.tensor_norm import TensorNorm

    ctx = Context(names=["stem.bias", "head.weight"])

    def run(jump: bool) -> list[tuple[int, str]]:
        rule, found = TensorNorm(ctx=ctx), []
        for t in range(80):
            lr = 0.045 if jump and t >= 40 else 1e-5
            norm = [1e-5 if t >= 41 else 1.0, 1.0]
            s = StepRecord(t, dict(grads_finite=1.0, loss=1.0), norm, [0.0, 0.0],
                           StepHost(t, lr=lr))
            found += [(t, f.kind) for f in rule.observe(s)]
        return found
    assert run(jump=True) == []
    assert run(jump=False) == [(43, "vanishing_grad")]
