"""The MLflow runs table and compare view as a user gets them: what a user sees in a browser.

Two targets' parent runs are annotated as the evaluate stage does (metrics, effective
hyper-parameters under shared names, the git commit); ``mlflow ui`` serves the store on
127.0.0.1 and headless Chromium (Debian's ``chromium``, which ``.ci/run`` installs), driven over its
DevTools pipe (``tests/browser.py``), clicks through the experiment page as the README says: the
runs table, "Columns" and its "Metrics" box, then both runs selected and "Compare".  The metric
columns and their values, both runs, their P@1 and a parameter that differs between them must be on
the rendered pages.  The screenshots (``mlflow_runs_columns.png``, ``mlflow_runs_metrics.png``,
``mlflow_compare.png``) go to ``test-artifacts/`` (or ``$XMC_TEST_ARTIFACTS``; the README's are made with
``XMC_TEST_ARTIFACTS=docs/img``).  Without Chromium the test skips, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from browser import Browser
from conftest import ROOT

pytestmark = pytest.mark.slow      # an MLflow server and a browser (see pyproject's markers)

pytest.importorskip("mlflow")

#: debtags' test metrics of the default config's xr-linear and parabel (a run of 2026-12-05): what the
#: screenshots show
METRICS = {"xr-linear": {"p_at_1": 89.45, "p_at_3": 62.92, "p_at_5": 47.3, "ndcg_at_5": 86.51, "psp_at_1": 57.3,
                         "psp_at_5": 67.79, "recall_at_100": 97.15},
           "parabel": {"p_at_1": 89.73, "p_at_3": 63.31, "p_at_5": 47.75, "ndcg_at_5": 87.02, "psp_at_1": 57.34,
                       "psp_at_5": 68.59, "recall_at_100": 98.36}}
P_AT_1 = {m: v["p_at_1"] for m, v in METRICS.items()}


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("Chromium is not installed (Debian package `chromium`; .ci/run installs it with apt-get, "
                "which failed or was not available on this machine)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def annotated_store(tmp_path, monkeypatch):
    """A SQLite store with the xr-linear and parabel parent runs of debtags, as evaluate leaves them."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XMC_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("XMC_TRACKING", "1")
    from xmc_steps import config as xcfg
    from xmc_steps import evaluate as ev
    from xmc_steps import tracking

    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    ids = {}
    for method, metrics in METRICS.items():
        doc = {"dataset": "debtags", "method": method, "config_hash": f"hash-{method}",
               "settings": xcfg.method_settings(cfg, "debtags", method)}
        ev.annotate_parent_run("debtags", method, [], metrics, doc, 572,
                               sizes={"n_train_docs": 24234, "n_test_docs": 6059})
        ids[method] = tracking.parent_run_id("debtags", method)
    return tmp_path / "results", ids


@pytest.fixture
def mlflow_ui(annotated_store, tmp_path):
    results, ids = annotated_store
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "mlflow-ui.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                             f"sqlite:///{results / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"mlflow ui did not come up:\n{(tmp_path / 'mlflow-ui.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, ids
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def _get_json(url: str, patience: float = 900) -> dict:
    """A GET of the MLflow server's REST API; a dropped or timed-out connection is tried again for
    ``patience`` seconds (its workers may still be starting on a loaded machine although /health answered)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            with urllib.request.urlopen(url, timeout=120) as r:
                return json.load(r)
        except OSError:                  # URLError, a reset connection, a timeout
            if time.monotonic() > deadline:
                raise
            time.sleep(3)


def _headers(b: Browser) -> list[str]:
    return b.js("Array.from(document.querySelectorAll('[role=columnheader]')).map(e => e.innerText.trim())"
                ".filter(t => t)") or []


SELECTOR = '[data-component-id="mlflow.experiment_page.runs_table.column_selector"]'


@pytest.fixture
def chromium() -> str:
    """Chromium's path; without it the test skips, saying why, before any server starts."""
    return _chromium()


def test_runs_table_metric_columns_and_compare_view_as_a_user_gets_them(chromium, mlflow_ui, tmp_path):
    """What the README shows (docs/img/, made here with XMC_TEST_ARTIFACTS=docs/img): MLflow's runs table
    opens without a metric column (MLflow has no setting or API for its default columns); "Columns", then
    the "Metrics" box adds every metric, the browser keeps the choice for the experiment; selecting the
    runs and "Compare" lines the two targets' metrics and settings up."""
    url, ids = mlflow_ui
    exp_id = _get_json(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=debtags")["experiment"]["experiment_id"]
    out = Path(os.environ.get("XMC_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    shots = {name: out / f"mlflow_{name}.png" for name in ("runs_columns", "runs_metrics", "compare")}
    for shot in shots.values():
        shot.unlink(missing_ok=True)

    b = Browser(chromium, tmp_path / "profile")
    try:
        page = _walk(b, url, exp_id, shots)
    finally:
        b.close()
    for shot in shots.values():
        assert shot.exists() and shot.stat().st_size > 10_000, f"no screenshot {shot}"

    for method, p1 in P_AT_1.items():
        assert method in page and ids[method] in page, page[:2000]
        assert f"{p1:g}" in page, f"P@1 {p1} of {method} not on the compare page"
    # a parameter under a shared name whose value differs: the negatives each method trains on
    m = re.search(r"Parameters Show diff only (.*?) Metrics Show diff only", page)
    assert m, page[:3000]
    params = m.group(1)
    assert re.search(r"\bnegatives (tfn\+man parent-positives|parent-positives tfn\+man)\b", params), params[:3000]
    assert re.search(r"\bensemble (1 3|3 1)\b", params), params[:3000]       # parabel's 3 trees
    assert not re.search(r"\bdataset debtags debtags\b", params), params[:3000]   # diff only: no shared value
    assert "p_at_1" in page and "psp_at_5" in page


def _walk(b: Browser, url: str, exp_id: str, shots: dict[str, Path]) -> str:
    """The README's clicks, checked on the way, each view's screenshot taken; the compare view's text."""
    # the experiment in the UI's "Model training" mode (MLflow 3 opens on its GenAI view): the runs table
    b.open(f"{url}/#/experiments/{exp_id}?workflowType=machine_learning")
    b.wait_for("document.body && " + " && ".join(f"document.body.innerText.includes({json.dumps(m)})" for m in P_AT_1),
               what="both runs in the runs table")
    b.js("document.querySelector('button[aria-label=Close]')?.click()")     # the assistant's side panel
    assert "Run Name" in _headers(b) and "p_at_1" not in _headers(b), _headers(b)   # MLflow's defaults

    # Columns -> Metrics: every metric becomes a column
    b.click_text("Columns")
    b.wait_for(f"!!document.querySelector({json.dumps(SELECTOR)})", what="the column selector")
    menu = b.js(f"document.querySelector({json.dumps(SELECTOR)}).innerText")
    assert re.search(r"Metrics \(\d+\)", menu) and "p_at_1" in menu and "psp_at_5" in menu, menu[:2000]
    b.js(f"Array.from(document.querySelector({json.dumps(SELECTOR)}).querySelectorAll('.du-bois-light-tree-treenode'))"
         ".find(n => /^Metrics \\(/.test(n.innerText.trim())).querySelector('.du-bois-light-tree-checkbox').click()")
    b.wait_for("Array.from(document.querySelectorAll('[role=columnheader]')).some(e => e.innerText.trim() === 'p_at_1')",
               what="a p_at_1 column")
    b.screenshot(shots["runs_columns"])
    b.key("Escape", "Escape", 27)
    b.wait_for(f"!document.querySelector({json.dumps(SELECTOR)})", what="the column selector closed")
    for method, p1 in P_AT_1.items():
        row = b.wait_for(f"({_ROW_JS})({json.dumps(method)})", what=f"{method}'s row")
        assert f"{p1:g}" in row, f"P@1 {p1} not in {method}'s row: {row}"
    headers = _headers(b)
    assert {"p_at_1", "p_at_3", "p_at_5"} <= set(headers), headers         # the grid draws the columns in view
    b.screenshot(shots["runs_metrics"])

    # the browser keeps the columns for this experiment
    b.js("location.reload()")
    b.wait_for("Array.from(document.querySelectorAll('[role=columnheader]')).some(e => e.innerText.trim() === 'p_at_1')",
               what="the p_at_1 column after a reload")

    # select both runs, Compare: once the reloaded table holds the rows (a select-all clicked before they load
    # selects nothing, and no Compare button comes: seen once on a slow machine)
    for method in P_AT_1:
        b.wait_for(f"({_ROW_JS})({json.dumps(method)})", what=f"{method}'s row after the reload")
    b.wait_for("!!document.querySelector('input[aria-label=\"Select all runs\"]')", what="the select-all box")
    b.js("document.querySelector('input[aria-label=\"Select all runs\"]').click()")
    b.click_text("Compare")
    b.wait_for("document.body.innerText.includes('Comparing 2 Runs') && "
               "document.body.innerText.includes('Show diff only')", what="the compare view")
    # the settings that differ, beside the runs' details (the plots above them pick their axes by hand)
    b.js("document.querySelector('[role=switch][aria-label=\"Parameters - Show diff only\"]').click()")
    b.js("Array.from(document.querySelectorAll('*')).filter(e => e.innerText && e.innerText.trim() === 'Run details')"
         ".pop().scrollIntoView()")
    time.sleep(1)                                       # the scroll and the switch's re-render, for the picture
    b.screenshot(shots["compare"])
    return re.sub(r"\s+", " ", b.text())


#: a function of a run name: the text of its row in the runs table (the grid draws a row's pinned and
#: scrolled parts as two elements with the same row-id)
_ROW_JS = """(name => {
  const rows = Array.from(document.querySelectorAll('[role=row]'));
  const hit = rows.find(r => r.innerText.includes(name) && r.getAttribute('row-id'));
  if (!hit) return '';
  return rows.filter(r => r.getAttribute('row-id') === hit.getAttribute('row-id'))
             .map(r => r.innerText.replace(/\\s+/g, ' ')).join(' ');
})"""
