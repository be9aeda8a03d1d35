"""report.html and report.png: a report replaces its own earlier report, never a file it did not
write (fasthealth/report/html.py)."""

import json

import matplotlib
import pytest

from fasthealth import report
from fasthealth.report import html

matplotlib.use("Agg")


def _log(d):
    steps = [{"step": t, "loss": 1.0 / (1 + t), "grad_norm": 1.0, "nan_count": 0,
              "inf_count": 0, "grads_finite": True, "loss_finite": True, "skipped": False}
             for t in range(30)]
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (d / "incidents.jsonl").write_text("")


def test_a_report_replaces_its_own_report(tmp_path):
    _log(tmp_path)
    first, _ = report.write(tmp_path)
    assert first == tmp_path / "report.html"
    page = first.read_text()
    assert page.startswith("<!doctype html>" + html.HTML_MARK)
    assert html._is_our_page(first) and html._is_our_png(tmp_path / "report.png")
    again, _ = report.write(tmp_path)
    assert again == first and sorted(p.name for p in tmp_path.iterdir()) == [
        "incidents.jsonl", "report.html", "report.png", "steps.jsonl"]


@pytest.mark.parametrize("theirs", ["report.html", "report.png"])
def test_a_file_it_did_not_write_is_left_alone(tmp_path, theirs, capsys):
    """The user's own report.html (or a report.png from elsewhere, a real PNG without the mark):
    untouched; the report goes to report-1.html and report-1.png, and the CLI says so."""
    _log(tmp_path)
    if theirs == "report.html":
        mine = b"<!doctype html><p>my notes on this run</p>"
    else:
        fig = matplotlib.pyplot.figure()
        fig.savefig(tmp_path / "other.png")
        matplotlib.pyplot.close(fig)
        mine = (tmp_path / "other.png").read_bytes()
    (tmp_path / theirs).write_bytes(mine)
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert (tmp_path / theirs).read_bytes() == mine
    assert html._is_our_page(tmp_path / "report-1.html")
    assert html._is_our_png(tmp_path / "report-1.png")
    assert f"wrote {tmp_path / 'report-1.html'} and {tmp_path / 'report-1.png'}" in out.out
    assert "that fasthealth report did not write: left as it is; this report is report-1.html " \
           "and report-1.png" in out.err
    # the next report replaces its own report-1, leaving the user's file alone again
    assert report.write(tmp_path)[0] == tmp_path / "report-1.html"
    assert not (tmp_path / "report-2.html").exists()


def test_names_taken_by_others_are_skipped_until_one_is_free(tmp_path):
    (tmp_path / "report.html").write_text("mine")
    (tmp_path / "report-1.png").write_bytes(b"\x89PNG\r\n\x1a\nnot ours")
    (tmp_path / "report-2.html").mkdir()  # not a file: not ours either
    assert html.report_paths(tmp_path) == (tmp_path / "report-3.html",
                                           tmp_path / "report-3.png")


def test_a_png_is_ours_only_with_the_mark_in_a_text_chunk(tmp_path):
    fig = matplotlib.pyplot.figure()
    fig.savefig(tmp_path / "plain.png")
    fig.savefig(tmp_path / "marked.png", metadata={html.PNG_KEY: html.PNG_TEXT})
    fig.savefig(tmp_path / "other.png", metadata={html.PNG_KEY: "something else"})
    matplotlib.pyplot.close(fig)
    assert html._is_our_png(tmp_path / "marked.png")
    assert not html._is_our_png(tmp_path / "plain.png")
    assert not html._is_our_png(tmp_path / "other.png")
    (tmp_path / "text.png").write_text("fasthealth\0report")  # the mark, but not a PNG
    assert not html._is_our_png(tmp_path / "text.png")
