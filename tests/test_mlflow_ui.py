"""The MLflow compare view explains itself: what a user sees in a browser.

Two targets' parent runs are annotated as the evaluate stage does (metrics, effective
hyper-parameters under shared names, the git commit); ``mlflow ui`` serves the store on
127.0.0.1 and headless Chromium (Debian's ``chromium``, which ``.ci/run`` installs) renders
the experiment page and the compare view of the two runs.  Both runs, their P@1 and a
parameter that differs between them must be on the rendered page.  The compare view's
screenshot is kept under ``test-artifacts/`` (or ``$XMC_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

pytestmark = pytest.mark.slow      # an MLflow server and a browser (see pyproject's markers)

pytest.importorskip("mlflow")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1600,2400"]
P_AT_1 = {"xr-linear": 89.47, "parabel": 89.68}


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


def _render(chromium: str, url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The page's text after its scripts ran (Chromium's --dump-dom), tags and scripts removed;
    with ``screenshot``, a PNG of the page instead (and no text)."""
    what = f"--screenshot={screenshot}" if screenshot else "--dump-dom"
    r = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                        what, url], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", r.stdout, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


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
    for method, p1 in P_AT_1.items():
        doc = {"dataset": "debtags", "method": method, "config_hash": f"hash-{method}",
               "settings": xcfg.method_settings(cfg, "debtags", method)}
        ev.annotate_parent_run("debtags", method, [], {"p_at_1": p1, "p_at_5": 40.0}, doc, 572)
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


def test_compare_view_shows_runs_metrics_and_differing_parameter(mlflow_ui, tmp_path):
    chromium = _chromium()
    url, ids = mlflow_ui
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=debtags") as r:
        exp_id = json.load(r)["experiment"]["experiment_id"]

    # the experiment in the UI's "Model training" mode (MLflow 3 opens on its GenAI view): the runs table
    page = _render(chromium, f"{url}/#/experiments/{exp_id}?workflowType=machine_learning", tmp_path / "profile-exp")
    for method in P_AT_1:
        assert method in page, f"experiment page lacks run {method}: {page[:2000]}"

    out = Path(os.environ.get("XMC_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "mlflow_compare_xr-linear_parabel.png"
    shot.unlink(missing_ok=True)
    runs = urllib.parse.quote(json.dumps([ids["xr-linear"], ids["parabel"]]))
    compare = f"{url}/#/compare-runs?runs={runs}&experiments={urllib.parse.quote(json.dumps([exp_id]))}"
    page = _render(chromium, compare, tmp_path / "profile-compare")
    _render(chromium, compare, tmp_path / "profile-shot", screenshot=shot)
    assert shot.exists() and shot.stat().st_size > 10_000, "no screenshot of the compare view"

    assert "Comparing 2 Runs" in page, page[:2000]
    for method, p1 in P_AT_1.items():
        assert method in page and ids[method] in page
        assert f"{p1:g}" in page, f"P@1 {p1} of {method} not on the compare page"
    # a parameter under a shared name whose value differs: the negatives each method trains on
    m = re.search(r"Parameters Show diff only (.*?) Metrics Show diff only", page)
    assert m, page[:3000]
    params = m.group(1)
    assert re.search(r"\bnegatives tfn\+man parent-positives\b", params), params[:3000]
    assert re.search(r"\bensemble 1 3\b", params), params[:3000]       # parabel's 3 trees
    assert "p_at_1" in page
