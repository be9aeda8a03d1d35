"""`fasthealth report` on incidents: incidents.jsonl read (a log without one has none recorded,
and says so), the summary's incident table, alarms and notices counted apart, incidents drawn,
kinds coloured and ordered by the registry, and a heatmap of the recorded steps only."""

import json

import matplotlib
import numpy as np
import pytest

from fasthealth import report
from fasthealth.monitor import kinds
from fasthealth.report.runs import brief, find_runs

matplotlib.use("Agg")

NAMES = ["a.weight", "a.bias", "b.weight"]


def _step(t, every=10, spike=(), events=()):
    r = {"step": t, "loss": 2.0 / (1 + 0.05 * t) * (30.0 if t in spike else 1.0),
         "grad_norm": 50.0 if t in spike else 1.0, "nan_count": 0, "inf_count": 0,
         "grads_finite": True, "loss_finite": True, "skipped": False, "lr": 1e-3,
         "loss_scale": None}
    if t in events:
        r["events"] = list(events[t])
    if t % every == 0 or t in events:
        r["per_tensor_norms"] = {n: (40.0 if t in spike else 0.5) for n in NAMES}
    return r


def _event(step, kind, severity, incident, dump=None):
    return {"step": step, "kind": kind, "severity": severity, "incident": incident,
            "message": f"{kind} at {step}", "details": {}, "dump": dump}


def _incident(state, id_, start, end, kinds, cause, severity, n, dump=None, **more):
    return {"record": "incident", "state": state, "id": id_, "start": start, "end": end,
            "kinds": kinds, "cause": cause, "severity": severity, "events": n, "dump": dump,
            "message": f"{cause} at {start}", **more}


def _write(d, steps, events=(), incidents=None, meta=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if incidents is not None:
        (d / "incidents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in incidents))
    (d / "meta.json").write_text(json.dumps(meta or {"names": NAMES, "per_tensor_every": 10}))


def _two_incidents(d):
    """An alarm incident at 20-24 (a loss spike, a gradient notice with it, a second spike) with
    a dump, and a notice incident at 70-71; incidents.jsonl as a Monitor writes it (opened,
    then closed with the final end and count)."""
    dump = d / "dumps" / "step_00000020.pt"
    dump.parent.mkdir(parents=True)
    dump.write_bytes(b"a dump")
    events = [_event(20, "loss_spike", "alarm", 0, str(dump)),
              _event(20, "grad_norm_spike", "notice", 0, str(dump)),
              _event(24, "loss_spike", "alarm", 0),
              _event(70, "grad_norm_spike", "notice", 1),
              _event(71, "exploding_grad", "notice", 1)]
    at = {}
    for e in events:
        at.setdefault(e["step"], []).append(e["kind"])
    steps = [_step(t, spike=(20, 24), events=at) for t in range(100)]
    incidents = [
        _incident("opened", 0, 20, 20, ["loss_spike", "grad_norm_spike"], "loss_spike", "alarm",
                  2, str(dump)),
        _incident("opened", 1, 70, 70, ["grad_norm_spike"], "grad_norm_spike", "notice", 1),
        _incident("closed", 0, 20, 24, ["loss_spike", "grad_norm_spike"], "loss_spike", "alarm",
                  3, str(dump)),
        _incident("closed", 1, 70, 71, ["grad_norm_spike", "exploding_grad"],
                  "grad_norm_spike", "notice", 2),
    ]
    _write(d, steps, events, incidents)
    return steps, events


def _table_line(text, ident):
    return next(line for line in text.splitlines() if line.strip().startswith(ident + " "))


def test_summary_lists_both_incidents_with_spans_causes_and_counts(tmp_path):
    _two_incidents(tmp_path)
    log = report.read_log(tmp_path)
    assert not log.problems.skipped and not log.problems.marked
    assert [(i["id"], i["start"], i["end"], i["state"]) for i in log.incidents] == [
        (0, 20, 24, "closed"), (1, 70, 71, "closed")]  # the closed records win
    path, text = report.write(tmp_path)
    assert "incidents: 2 (1 alarm, 1 notice)" in text
    first, second = _table_line(text, "#0"), _table_line(text, "#1")
    # a log from before causes: its 'cause' is a kind, shown as the trigger, the cause unknown
    assert first.split()[:6] == ["#0", "20-24", "alarm", "3", "?", "loss_spike"], first
    assert first.rstrip().endswith("loss_spike, grad_norm_spike")
    assert second.split()[:6] == ["#1", "70-71", "notice", "2", "?", "grad_norm_spike"], second
    assert second.rstrip().endswith("grad_norm_spike, exploding_grad")
    assert text.index("#0 ") < text.index("#1 ") < text.index("  events:")  # before the events
    # the dump, shown from the log dir; no replay output in this log: what to run
    dump_line = text.splitlines()[text.splitlines().index(first) + 1]
    assert "dump dumps/step_00000020.pt" in dump_line
    assert "run fh.replay(dump, model, loss_fn)" in dump_line
    # alarms and notices counted apart, the notices after the alarms
    assert "events: 5 (2 alarms, 3 notices)" in text
    alarms, notices = text.index("    alarms:"), text.index("    notices:")
    assert alarms < text.index("loss_spike                    2") < notices
    assert notices < text.index("grad_norm_spike               2")
    page = path.read_text()
    assert "<h2>Incidents</h2>" in page and "20-24" in page and "70-71" in page


def test_the_cli_reports_incidents(tmp_path):
    _two_incidents(tmp_path)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert report.main([str(tmp_path)]) == 0
    assert "incidents: 2 (1 alarm, 1 notice)" in out.getvalue()
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_incidents_are_drawn_as_labelled_spans(tmp_path):
    _two_incidents(tmp_path)
    log = report.read_log(tmp_path)
    fig = report.figure(log.meta, log.steps, log.events, log.incidents)
    loss = fig.axes[0]
    assert loss.get_title().startswith("loss")
    xs = [r["step"] for r in log.steps]
    assert report.span_extents(log.incidents, xs, "alarm") == [(19.5, 24.5)]
    assert report.span_extents(log.incidents, xs, "notice") == [(69.5, 71.5)]
    drawn = {c.get_label(): c for c in loss.collections}
    for sev, (x0, x1) in (("alarm", (19.5, 24.5)), ("notice", (69.5, 71.5))):
        (poly,) = drawn[f"_{sev} incidents"].get_paths()
        assert poly.vertices[:, 0].min() == x0 and poly.vertices[:, 0].max() == x1
        color = matplotlib.colors.to_hex(drawn[f"_{sev} incidents"].get_facecolor()[0],
                                         keep_alpha=False)
        assert color == report.SPAN_COLORS[sev]
    texts = [t.get_text() for t in loss.texts]
    assert texts == ["#0 loss_spike", "#1 grad_norm_spike"]
    # the notices' markers are hollow, the alarms' filled
    marks = {c.get_label(): c for c in loss.collections}
    assert marks["grad_norm_spike (notice)"].get_facecolor().size == 0
    assert marks["loss_spike"].get_facecolor()[0][3] == 1
    grad = next(ax for ax in fig.axes if ax.get_title().startswith("global gradient norm"))
    assert {"_alarm incidents", "_notice incidents"} <= {c.get_label() for c in grad.collections}
    matplotlib.pyplot.close(fig)


def test_heatmap_has_a_column_per_recorded_step_and_no_more(tmp_path):
    """Norms recorded every 50 steps and at an event step (51): the columns are those steps,
    the spike at 51 stands for its own step, not for the 49 after it."""
    steps = [_step(t, every=50, spike=(51,), events={51: ["loss_spike"]}) for t in range(101)]
    events = [_event(51, "loss_spike", "alarm", 0)]
    h = report.heatmap_data({"names": NAMES, "per_tensor_every": 50}, steps, events)
    assert h.steps == [0, 50, 51, 100] and h.cadence == 50
    assert h.ends == [50, 51, 52, 101]  # 52-99 not recorded
    assert h.quiet == [True, True, False, True]
    assert h.labels == NAMES and h.values.shape == (3, 4)
    assert np.allclose(h.values[:, 2], np.log10(40.0))
    assert np.allclose(h.values[:, [0, 1, 3]], np.log10(0.5))
    # without meta.json the cadence comes from the quiet records' spacing
    h2 = report.heatmap_data({}, steps, events)
    assert h2.steps == h.steps and h2.ends == h.ends and h2.cadence == 50
    # and the figure draws it so: the spike's column is narrow, gray after it until 100
    fig = report.figure({"names": NAMES, "per_tensor_every": 50}, steps, events)
    heat = next(ax for ax in fig.axes if "recorded steps" in ax.get_title())
    mesh = heat.collections[0]
    x = mesh.get_coordinates()[0, :, 0]
    grid = mesh.get_array()
    k = int(np.searchsorted(x, 51, side="right")) - 1
    assert x[k] == 50.5 and x[k + 1] < 52.5
    assert grid.mask[:, k + 1].all() and x[k + 2] == 99.5
    assert not grid.mask[:, k].any()
    matplotlib.pyplot.close(fig)


def test_heatmap_a_nonfinite_or_eventful_record_stands_for_its_own_step():
    steps = [_step(t, every=10) for t in range(40)]
    steps[20]["per_tensor_norms"]["a.bias"] = None  # a NaN, as jsonable writes it
    steps[20].update(grads_finite=False, nan_count=1)  # (a null at a finite step: no gradient)
    h = report.heatmap_data({"names": NAMES}, steps)
    assert h.steps == [0, 10, 20, 30] and h.ends == [10, 20, 21, 40]
    assert h.bad[1, 2] and not h.bad[[0, 2], 2].any()


def test_heatmap_combines_records_past_the_column_limit():
    steps = [_step(t, every=1) for t in range(5000)]
    steps[2500]["per_tensor_norms"]["a.weight"] = 1e6
    h = report.heatmap_data({"names": NAMES}, steps, max_columns=1000)
    assert len(h.steps) == 1000 and h.ends[-1] == 5000
    assert np.nanmax(h.values[0]) == pytest.approx(6.0)  # a spike survives the combining


def test_a_log_without_incidents_jsonl_has_none_recorded_and_says_so(tmp_path):
    """A log from before incidents.jsonl: no incidents are made up from its events; the summary
    says in one line that none were recorded, and the events are still counted (severities by
    kind where the log has none)."""
    steps, events = _two_incidents(tmp_path)
    (tmp_path / "incidents.jsonl").unlink()
    _write(tmp_path, steps, [{k: v for k, v in e.items() if k not in ("severity", "incident")}
                             for e in events])
    log = report.read_log(tmp_path)
    assert log.incidents is None and not log.problems.skipped and not log.problems.marked
    assert [e["severity"] for e in log.events] == ["alarm", "notice", "alarm", "notice",
                                                   "notice"]  # by kind
    path, text = report.write(tmp_path)
    lines = [s for s in text.splitlines() if "incident" in s]
    assert lines == ["  incidents: not recorded (no readable incidents.jsonl in this log)"]
    assert "events: 5 (2 alarms, 3 notices)" in text
    assert "not recorded" in path.read_text()
    fig = report.figure(log.meta, log.steps, log.events, log.incidents)
    assert not fig.axes[0].texts  # no incident labelled, none shaded
    assert not any(c.get_label().endswith(" incidents") for c in fig.axes[0].collections)
    matplotlib.pyplot.close(fig)


def test_an_empty_incidents_jsonl_is_no_incident(tmp_path):
    steps, events = _two_incidents(tmp_path)
    (tmp_path / "incidents.jsonl").write_text("")
    log = report.read_log(tmp_path)
    assert log.incidents == []
    text = report.summary(log.meta, log.steps, log.events, log.incidents, tmp_path)
    assert "  incidents: none" in text.splitlines()


def test_events_of_an_incident_with_no_record_make_no_incident(tmp_path):
    """Incidents come from incidents.jsonl alone: an event filed under an id that has no record
    (a record lost with a bad line) is listed with its id, not made into an incident."""
    _two_incidents(tmp_path)
    lines = (tmp_path / "incidents.jsonl").read_text().splitlines()
    (tmp_path / "incidents.jsonl").write_text(lines[0] + "\n" + lines[2] + "\n")  # #0 only
    log = report.read_log(tmp_path)
    assert [i["id"] for i in log.incidents] == [0]
    assert [e["incident"] for e in log.events] == [0, 0, 0, 1, 1]


def test_bad_incident_lines_are_named_and_the_rest_reported(tmp_path, capsys):
    _two_incidents(tmp_path)
    with open(tmp_path / "incidents.jsonl", "a") as f:
        f.write("not json\n")
        f.write(json.dumps({"record": "incident", "state": "closed", "id": "x", "start": 5})
                + "\n")
        f.write(json.dumps(_incident("closed", 0, 20, 24, "loss_spike", 7, "bad", 3)) + "\n")
        f.write('{"record": "incident", "id": 3, "sta')  # a partial last line
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "incidents.jsonl line 5: not JSON" in out.err
    assert "incidents.jsonl line 6: the incident's 'id' is \"x\", not an id" in out.err
    assert "incidents.jsonl line 7: the incident's 'kinds' is \"loss_spike\", not a list" in out.err
    assert "incidents.jsonl line 7: the incident's 'cause' is 7, not a cause or a kind" in out.err
    assert "incidents.jsonl line 7: the incident's 'severity' is \"bad\"" in out.err
    assert "incidents.jsonl line 8: a partial last line" in out.err
    # what the bad record has wrong, the incident's earlier records said
    first = _table_line(out.out, "#0")
    assert first.split()[:6] == ["#0", "20-24", "alarm", "3", "?", "loss_spike"], first


def test_an_incident_left_open_takes_its_end_from_its_events(tmp_path):
    _two_incidents(tmp_path)
    lines = (tmp_path / "incidents.jsonl").read_text().splitlines()
    (tmp_path / "incidents.jsonl").write_text("\n".join(lines[:3]) + "\n")  # killed before #1
    log = report.read_log(tmp_path)
    inc = log.incidents[1]
    assert (inc["state"], inc["start"], inc["end"], inc["events"]) == ("opened", 70, 71, 2)
    text = report.summary(log.meta, log.steps, log.events, log.incidents, tmp_path)
    assert _table_line(text, "#1").split()[:3] == ["#1", "70-71", "open"]
    assert "the log ends before the incident closed" in text


def test_replay_output_in_the_log_is_shown_instead_of_the_hint(tmp_path):
    _two_incidents(tmp_path)
    with open(tmp_path / "incidents.jsonl", "a") as f:
        f.write(json.dumps(_incident(
            "closed", 0, 20, 24, ["loss_spike", "grad_norm_spike"], "loss_spike", "alarm", 3,
            str(tmp_path / "dumps" / "step_00000020.pt"),
            replay={"first_nonfinite": "b.linear", "culprit_ids": [7, 9]})) + "\n")
    log = report.read_log(tmp_path)
    text = report.summary(log.meta, log.steps, log.events, log.incidents, tmp_path)
    assert "replay: first non-finite module b.linear; samples 7, 9" in text
    assert "run fh.replay" not in text


def test_a_moved_log_dir_finds_its_dumps_and_a_missing_dump_is_said(tmp_path):
    _two_incidents(tmp_path / "run")
    moved = tmp_path / "moved"
    (tmp_path / "run").rename(moved)
    _, text = report.write(moved)
    assert "dump dumps/step_00000020.pt (not replayed" in text
    (moved / "dumps" / "step_00000020.pt").unlink()
    _, text = report.write(moved)
    assert "(the file is missing)" in text


def test_a_reopened_log_dir_keeps_incidents_that_share_an_id(tmp_path):
    """A Monitor that continues a log_dir numbers its incidents from 0 again."""
    events = [_event(20, "loss_spike", "alarm", 0), _event(60, "nonfinite_loss", "alarm", 0)]
    steps = [_step(t, events={20: ["loss_spike"], 60: ["nonfinite_loss"]}) for t in range(80)]
    _write(tmp_path, steps, events, [
        _incident("opened", 0, 20, 20, ["loss_spike"], "loss_spike", "alarm", 1),
        _incident("closed", 0, 20, 20, ["loss_spike"], "loss_spike", "alarm", 1),
        _incident("opened", 0, 60, 60, ["nonfinite_loss"], "nonfinite_loss", "alarm", 1),
        _incident("closed", 0, 60, 60, ["nonfinite_loss"], "nonfinite_loss", "alarm", 1)])
    log = report.read_log(tmp_path)
    assert [(i["id"], i["start"], i["trigger"]) for i in log.incidents] == [
        (0, 20, "loss_spike"), (0, 60, "nonfinite_loss")]


@pytest.mark.slow
def test_report_survives_random_values_in_incident_and_event_fields(tmp_path):
    """Every field of incidents.jsonl's records and the events' severity and incident replaced,
    at random, by a JSON value of another kind: read, summarized and drawn without raising."""
    import random

    _two_incidents(tmp_path)
    rnd = random.Random(3)
    junk = [None, "abc", [], [1, 2], {}, {"a": 1}, True, -1, 0, 7, 1e308, 10**400, 2**70, "NaN",
            1.5, "opened", "closed", "alarm", "notice"]
    base = [json.loads(s) for s in (tmp_path / "incidents.jsonl").read_text().splitlines()]
    events = [json.loads(s) for s in (tmp_path / "events.jsonl").read_text().splitlines()]
    for _ in range(25):
        recs = [{k: (rnd.choice(junk) if rnd.random() < 0.3 else v) for k, v in r.items()}
                for r in base]
        (tmp_path / "incidents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        evs = [dict(e, **{k: rnd.choice(junk) for k in ("severity", "incident", "dump")
                          if rnd.random() < 0.4}) for e in events]
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
        log = report.read_log(tmp_path)
        report.summary(log.meta, log.steps, log.events, log.incidents, tmp_path)
        fig = report.figure(log.meta, log.steps, log.events, log.incidents)
        fig.canvas.draw()
        matplotlib.pyplot.close(fig)


def test_a_one_step_incident_is_drawn_wide_enough_to_see_and_crowds_are_not_labelled():
    xs = list(range(3000))
    one = [{"id": 0, "start": 1000, "end": 1000, "severity": "alarm", "cause": "loss_spike"}]
    ((x0, x1),) = report.span_extents(one, xs, "alarm")
    assert x0 == 999.5 and x1 - x0 == pytest.approx(3001 * report.MIN_DRAWN)
    many = [dict(one[0], id=k, start=10 * k, end=10 * k) for k in range(report.LABELLED + 1)]
    steps = [_step(t) for t in range(500)]
    fig = report.figure({"names": NAMES}, steps, [], many)
    assert not fig.axes[0].texts and "too many to label" in fig.axes[0].get_title()
    matplotlib.pyplot.close(fig)


def test_an_incident_shows_how_many_steps_each_kind_was_seen_at(tmp_path):
    """A Monitor records the first event of each kind in an incident and counts its repeats
    (``counts`` in the closed record): the table shows them; a count of the wrong kind is
    named and left out."""
    steps, events = _two_incidents(tmp_path)
    with open(tmp_path / "incidents.jsonl", "a") as f:
        f.write(json.dumps(_incident(
            "closed", 0, 20, 24, ["loss_spike", "grad_norm_spike"], "loss_spike", "alarm", 3,
            str(tmp_path / "dumps" / "step_00000020.pt"),
            counts={"loss_spike": 7, "grad_norm_spike": 1})) + "\n")
        f.write(json.dumps(_incident("closed", 1, 70, 71, ["grad_norm_spike"],
                                     "grad_norm_spike", "notice", 2, counts=["bad"])) + "\n")
    log = report.read_log(tmp_path)
    text = report.summary(log.meta, log.steps, log.events, log.incidents, tmp_path)
    assert "loss_spike x7, grad_norm_spike" in _table_line(text, "#0")
    assert " x" not in _table_line(text, "#1")
    assert any("'counts'" in why for _, _, why in log.problems.marked)


def test_an_event_without_a_step_is_named_and_listed_not_plotted(tmp_path, capsys):
    """An events.jsonl line with no "step" (a tool's own line, a truncated record): named on
    stderr with its line, listed in the event table, left out of the plots and the summary's
    "first at step"; the report is written."""
    _two_incidents(tmp_path)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "loss_spike", "severity": "alarm", "incident": 0,
                            "message": "no step here"}) + "\n")
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "events.jsonl line 6: an event with no 'step': listed, not plotted" in out.err
    assert "loss_spike                    3  (first at step 20)" in out.out
    page = (tmp_path / "report.html").read_text()
    assert "<tr><td>?</td>" in page and "no step here" in page


def test_step_fields_are_checked_by_their_schema_type(tmp_path):
    """The reader checks every field monitor/schema.py declares, by its type: a precursor's
    float, a count, a flag that may be null."""
    steps, events = _two_incidents(tmp_path)
    steps[3].update(update_ratio_max="big", replica_mismatch=[1], spike_skip=None)
    steps[4].update(spike_skip="yes", skip_z_loss=2.5)
    _write(tmp_path, steps, events, meta={"names": NAMES})
    (tmp_path / "incidents.jsonl").unlink()
    log = report.read_log(tmp_path)
    marked = [why for _, _, why in log.problems.marked]
    assert marked == ["'replica_mismatch' is [1], not a number: shown as missing",
                      "'update_ratio_max' is \"big\", not a number: shown as missing",
                      "'spike_skip' is \"yes\", not true or false: shown as missing"]
    assert log.steps[3]["update_ratio_max"] is None and log.steps[4]["spike_skip"] is None
    assert log.steps[4]["skip_z_loss"] == 2.5


def test_kinds_are_drawn_in_the_registry_order_and_colour_an_unknown_one_too(tmp_path):
    steps = [_step(t) for t in range(60)]
    events = [_event(10, "oscillation", "alarm", None), _event(20, "lr_jump", "alarm", None),
              _event(30, "my_own_rule", "alarm", None), _event(40, "stall", "alarm", None),
              _event(50, "precursor_adam_eps", "notice", None)]
    fig = report.figure({"names": NAMES}, steps, events, [])
    timeline = next(ax for ax in fig.axes if ax.get_title() == "events by kind")
    rows = [t.get_text() for t in timeline.get_yticklabels()]
    # the notices below the alarms; each group in the registry's order, unknown kinds last
    assert rows == ["precursor_adam_eps (notice)", "my_own_rule", "stall", "oscillation",
                    "lr_jump"]
    colours = {c.get_offsets()[0][0]: matplotlib.colors.to_hex(c.get_edgecolor()[0])
               for c in timeline.collections if len(c.get_offsets()) == 1}
    for e in events:
        assert colours[e["step"]] == kinds.colour_of(e["kind"]), e["kind"]
    assert kinds.colour_of("my_own_rule") != "gray"
    matplotlib.pyplot.close(fig)


def test_a_healthy_monitored_run_reports_0_incidents_not_unrecorded(tmp_path):
    """The Monitor writes incidents.jsonl even when no incident opens: the report then says
    none happened, not that none were recorded."""
    import torch

    import fasthealth as fh

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with fh.Monitor(model, opt, log_dir=tmp_path, flush_every=5) as mon:
        for _ in range(10):
            x = torch.randn(8, 4)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            mon.step(loss)
            opt.zero_grad()
    assert not mon.incidents
    assert (mon.run_dir / "incidents.jsonl").read_text() == ""
    log = report.read_log(mon.run_dir)
    assert log.incidents == []
    text = report.write(mon.run_dir)[1]
    assert "  incidents: none" in text.splitlines() and "not recorded" not in text
    assert brief(find_runs(tmp_path)[0]).endswith("incidents 0")


def test_heatmap_draws_steps_after_an_event_as_not_sampled_not_as_missing():
    """Norms every 50 steps and at an event (51): steps 52-99 were logged, their norms just not
    sampled: hatched, and the title says so; steps missing from the log (120-129) are not."""
    steps = [_step(t, every=50, spike=(51,), events={51: ["loss_spike"]}) for t in range(160)
             if not 120 <= t < 130]
    events = [_event(51, "loss_spike", "alarm", 0)]
    h = report.heatmap_data({"names": NAMES, "per_tensor_every": 50}, steps, events)
    assert h.steps == [0, 50, 51, 100, 150]
    assert h.unsampled == [(52, 100)]  # 100-149 stand for the record at 100; 120-129 absent
    fig = report.figure({"names": NAMES, "per_tensor_every": 50}, steps, events)
    heat = next(ax for ax in fig.axes if "recorded steps" in ax.get_title())
    assert "hatched: not sampled (norms every 50 steps and at events)" in heat.get_title()
    spans = [p for p in heat.patches if p.get_hatch()]
    assert len(spans) == 1
    xs = spans[0].get_path().transformed(spans[0].get_patch_transform()).vertices[:, 0]
    assert (xs.min(), xs.max()) == (51.5, 99.5)
    assert matplotlib.colors.to_hex(spans[0].get_facecolor()) == "#ffffff"
    matplotlib.pyplot.close(fig)
