"""MLflow server mode: scripts/mlflow-server.sh on 127.0.0.1, every stage job logs over HTTP.

The toy xr-linear DAG runs with MLFLOW_TRACKING_URI pointing at the server; every
stage run must be a child of its target's parent run (xr-linear) or of the dataset's
``shared`` parent, and nothing may be written to a local SQLite store.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT
from test_workflow import RUN_TIMEOUT, _toy

pytestmark = pytest.mark.slow      # a whole pipeline run (see pyproject's markers)

SHARED_RULES = {"ingest", "tfidf", "label_embedding_pifa_tfidf", "cluster"}   # xmc.rule: the Snakemake rule
METHOD_RULES = {"xr_linear_train", "xr_linear_predict", "evaluate"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture
def mlflow_server(tmp_path):
    """A server on a free port of 127.0.0.1 with a SQLite store in tmp_path; stopped afterwards."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, XMC_PYTHON=sys.executable,
               XMC_MLFLOW_BACKEND_STORE_URI=f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}",
               XMC_MLFLOW_ARTIFACTS=str(tmp_path / "server" / "artifacts"))
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(tmp_path / "mlflow-server.log", "w")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "mlflow-server.sh"), "--port", str(port), "--workers", "1"],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not _healthy(url):
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"mlflow server did not come up:\n{(tmp_path / 'mlflow-server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        # the server runs uvicorn workers and a job runner: stop the whole process group
        with _suppress():
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with _suppress():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def _run_tracked(tmp_path: Path, uri: str, *targets):
    """tests/test_workflow.py's _run, with MLFLOW_TRACKING_URI kept (set to the server)."""
    import yaml

    over = {"data_dir": str(tmp_path / "data"), "results_dir": "results",
            "datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}}}}
    (tmp_path / "override.yaml").write_text(yaml.safe_dump(over))
    cmd = [sys.executable, "-m", "snakemake", *targets, "--snakefile", str(ROOT / "Snakefile"),
           "--directory", str(tmp_path), "--cores", "2",
           "--configfile", str(ROOT / "config.yaml"), str(tmp_path / "override.yaml")]
    env = dict(os.environ, XMC_TRACKING="1", MLFLOW_TRACKING_URI=uri)
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    if r.returncode != 0:
        raise AssertionError(f"snakemake failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r


def _records(results: Path) -> list[dict]:
    files = [p for p in results.rglob("*.json") if p.name.endswith("record.json") or p.parent.name == "records"]
    return [json.loads(p.read_text()) for p in files]


def test_stage_runs_logged_over_http_nested_under_parents(tmp_path, mlflow_server):
    _toy(tmp_path)
    _run_tracked(tmp_path, mlflow_server, "results/toy/xr-linear.json")
    results = tmp_path / "results"
    assert not (results / "mlflow.db").exists()              # nothing went to a local store

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("toy")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = {r.data.tags["xmc.method"]: r.info.run_id for r in runs if r.data.tags.get("xmc.run_type") == "target"}
    assert set(parents) == {"xr-linear", "shared"}            # one parent per target, one for shared stages
    stages = [r for r in runs if r.data.tags.get("xmc.run_type") == "stage"]
    by_rule = {r.data.tags["xmc.rule"]: r for r in stages}
    assert SHARED_RULES | METHOD_RULES <= set(by_rule), sorted(by_rule)
    for r in stages:
        parent = r.data.tags.get("mlflow.parentRunId")
        want = parents["shared"] if r.data.tags["xmc.method"] == "shared" else parents[r.data.tags["xmc.method"]]
        assert parent == want, (r.data.tags["xmc.rule"], parent, want)
    for rule in SHARED_RULES:
        assert by_rule[rule].data.tags["mlflow.parentRunId"] == parents["shared"], rule
    for rule in METHOD_RULES:
        assert by_rule[rule].data.tags["mlflow.parentRunId"] == parents["xr-linear"], rule
    # every stage job's record names a run that the server holds, with the same parent layout
    recs = _records(results)
    assert len(recs) >= len(SHARED_RULES | METHOD_RULES)
    stage_ids = {r.info.run_id for r in stages}
    for rec in recs:
        assert rec.get("mlflow_run_id") in stage_ids, rec.get("rule")
    # the target's parent carries its test metrics, as with the local store
    res = json.loads((results / "toy" / "xr-linear.json").read_text())
    parent = client.get_run(parents["xr-linear"])
    assert parent.data.metrics["p_at_1"] == pytest.approx(res["metrics"]["p_at_1"])
    # ... its effective hyper-parameters under the shared names, and its results as artifacts
    assert parent.data.params["method"] == "xr-linear" and parent.data.params["negatives"] == "tfn+man"
    assert parent.data.params["config_hash"] == res["config_hash"]
    assert {"xr-linear.json", "leaderboard_row.csv"} <= {a.path for a in client.list_artifacts(parents["xr-linear"])}
