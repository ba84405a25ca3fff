"""`snakemake --report`: a self-contained HTML (or zip) with each target's metrics JSON and plot."""

import base64
import json
import re
import zipfile

import pytest

from test_workflow import _run

pytestmark = pytest.mark.slow      # a whole pipeline run (see pyproject's markers)

TARGET = "results/toy/xr-linear.json"


def _report_results(html: str) -> dict:
    """The report's embedded result files: {path: {labels, mime_type, data_uri, ...}}."""
    m = re.search(r'<script id="results">\s*var results = (.*?);?\s*</script>', html, re.S)
    assert m, "no results block in the report"
    return json.loads(m.group(1))


def _decode(data_uri: str) -> bytes:
    head, _, b64 = data_uri.partition("base64,")
    assert head.startswith("data:") and b64
    return base64.b64decode(b64)


@pytest.fixture(scope="module")
def toy_run(toy_linear_run):
    return toy_linear_run


def test_html_report_holds_metrics_and_plot(toy_run):
    tmp = toy_run
    r = _run(tmp, TARGET, extra=["--report", "report.html"])
    assert "Report created" in r.stdout + r.stderr
    html = (tmp / "report.html").read_text(encoding="utf-8")
    # self-contained: no resource is fetched from elsewhere
    assert not re.search(r'<(script|img|link)[^>]+(src|href)="https?://', html)
    results = _report_results(html)
    res_json = next(v for k, v in results.items() if k.endswith("toy/xr-linear.json"))
    res_png = next(v for k, v in results.items() if k.endswith("toy/xr-linear_decile_recall.png"))
    assert res_png["mime_type"] == "image/png"
    png = _decode(res_png["data_uri"])
    assert png.startswith(b"\x89PNG") and png == (tmp / "results/toy/xr-linear_decile_recall.png").read_bytes()
    embedded = json.loads(_decode(res_json["data_uri"]))
    on_disk = json.loads((tmp / TARGET).read_text())
    assert embedded["metrics"] == on_disk["metrics"] and embedded["metrics"]["p_at_1"] > 50
    # one category per dataset, a subcategory per method (labels carry both)
    assert "'dataset': 'toy'" in str(res_json["labels"]) and "'method': 'xr-linear'" in str(res_json["labels"])
    assert '"toy"' in html and '"xr-linear"' in html
    # the target's metrics as tables (rendered inline: an HTML item)
    page = next(v for k, v in results.items() if k.endswith("toy/xr-linear_metrics.html"))
    assert page["mime_type"] == "text/html"
    tables = _decode(page["data_uri"]).decode()
    assert "<caption>ranking at k</caption>" in tables and f"<td>{on_disk['metrics']['p_at_1']:.2f}</td>" in tables


def test_report_holds_the_leaderboard_rendered(toy_run):
    tmp = toy_run
    lb = "results/toy/leaderboard.md"
    _run(tmp, lb)
    _run(tmp, lb, extra=["--report", "report-lb.html"])
    results = _report_results((tmp / "report-lb.html").read_text(encoding="utf-8"))
    page = next(v for k, v in results.items() if k.endswith("toy/leaderboard.html"))
    assert page["mime_type"] == "text/html"
    table = _decode(page["data_uri"]).decode()
    assert "<table>" in table and "<td>xr-linear</td>" in table and "<td>parabel</td>" in table


def test_zip_report(toy_run):
    tmp = toy_run
    _run(tmp, TARGET, extra=["--report", "report.zip"])
    with zipfile.ZipFile(tmp / "report.zip") as z:
        names = z.namelist()
        assert any(n.endswith("report.html") for n in names), names
        png = [n for n in names if n.endswith("xr-linear_decile_recall.png")]
        js = [n for n in names if n.endswith("/xr-linear.json")]
        assert png and js, names
        assert z.read(png[0]).startswith(b"\x89PNG")
        assert json.loads(z.read(js[0]))["metrics"] == json.loads((tmp / TARGET).read_text())["metrics"]
