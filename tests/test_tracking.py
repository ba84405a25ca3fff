"""Tests of xmc_steps.tracking: run layout in MLflow, and parallel jobs on one SQLite store."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("filelock")

from mlflow.tracking import MlflowClient  # noqa: E402

from xmc_steps import tracking  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XMC_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("XMC_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("XMC_TRACKING", "1")  # conftest turns tracking off by default
    return tmp_path / "results"


def _record(stage, method, dataset="debtags", **kw):
    rec = {
        "stage": stage,
        "rule": kw.pop("rule", f"{method or 'shared'}_{stage}"),
        "dataset": dataset,
        "method": method,
        "config_hash": kw.pop("config_hash", "h123"),
        "wall_s": 2.5,
        "peak_rss_mb": 321.0,
        "timings_s": {"fit": 1.25},
        "params": {"tfidf": {"min_df": 2, "ngram": [1, 2]}, "seed": 0},
        "metrics": {"p_at_1": 0.5},
        "outputs": {"model": f"/results/{dataset}/{stage}.npz"},
        "tags": {"device": "cpu"},
        "extra": {"note": "x"},
    }
    rec.update(kw)
    return rec


def _runs(client, exp_id, flt):
    return client.search_runs([exp_id], filter_string=flt, max_results=1000)


def test_tracking_uri_default_and_env(store, monkeypatch):
    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{store.resolve() / 'mlflow.db'}"
    assert tracking.lock_path(uri) == store.resolve() / "mlflow.db.lock"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert tracking.tracking_uri() == "http://mlflow.example:5000"
    assert tracking.lock_path() == store.resolve() / "mlflow.lock"


def test_log_stages_layout(store):
    curve = [("loss", 1.0 / s, s) for s in range(1, 1501)]  # > 1000: several log_batch calls
    long_value = "v" * 7000
    rid_tfidf = tracking.log_stage(_record("tfidf", "", rule="tfidf", config_hash="hs"), [])
    rid_train = tracking.log_stage(
        _record("train", "xr-linear", params={"model": {"beam": 10, "blob": long_value}}), curve
    )
    rid_eval = tracking.log_stage(_record("evaluate", "xr-linear", metrics={"p_at_1": 0.9, "ndcg_at_3": 0.8}), [])
    assert len({rid_tfidf, rid_train, rid_eval}) == 3

    client = MlflowClient(tracking.tracking_uri())
    exp = client.get_experiment_by_name("debtags")
    assert exp is not None
    assert exp.artifact_location.startswith((store.resolve() / "mlartifacts").as_uri())

    parents = _runs(client, exp.experiment_id, "tags.`xmc.run_type` = 'target'")
    by_method = {p.data.tags["xmc.method"]: p for p in parents}
    assert sorted(by_method) == ["shared", "xr-linear"]
    xr, shared = by_method["xr-linear"], by_method["shared"]
    assert xr.info.run_name == "xr-linear" and shared.info.run_name == "shared"
    assert xr.data.tags["xmc.dataset"] == "debtags"
    assert xr.data.tags["xmc.config_hash"] == "h123"
    assert tracking.parent_run_id("debtags", "xr-linear") == xr.info.run_id
    assert tracking.parent_run_id("debtags", "") == shared.info.run_id
    assert tracking.parent_run_id("debtags", "parabel") is None
    assert tracking.parent_run_id("other", "xr-linear") is None

    train = client.get_run(rid_train)
    tags = train.data.tags
    assert tags["mlflow.parentRunId"] == xr.info.run_id
    assert train.info.run_name == "xr-linear_train"
    assert train.info.status == "FINISHED"
    assert tags["xmc.rule"] == "xr-linear_train"
    assert tags["xmc.stage"] == "train"
    assert tags["xmc.dataset"] == "debtags"
    assert tags["xmc.method"] == "xr-linear"
    assert tags["xmc.config_hash"] == "h123"
    assert tags["xmc.git_commit"] in ("feedbeef",) or len(tags["xmc.git_commit"]) == 40
    assert tags["device"] == "cpu"
    assert tags["artifact.model"] == "/results/debtags/train.npz"
    params = train.data.params
    assert params["model.beam"] == "10"
    assert len(params["model.blob"]) == tracking.MAX_PARAM_VAL_LENGTH
    assert params["artifact.model"] == "/results/debtags/train.npz"
    assert params["extra.note"] == "x"
    m = train.data.metrics
    assert m["p_at_1"] == 0.5 and m["wall_s"] == 2.5 and m["peak_rss_mb"] == 321.0
    assert m["time_s.fit"] == 1.25
    hist = client.get_metric_history(rid_train, "loss")
    assert sorted(h.step for h in hist) == list(range(1, 1501))
    assert {h.step: h.value for h in hist}[4] == 0.25
    # the training run started wall_s before it was logged
    assert train.info.end_time - train.info.start_time >= 2000

    ev = client.get_run(rid_eval)
    assert ev.data.tags["mlflow.parentRunId"] == xr.info.run_id
    assert ev.data.metrics["ndcg_at_3"] == 0.8

    tf = client.get_run(rid_tfidf)
    assert tf.data.tags["mlflow.parentRunId"] == shared.info.run_id
    assert tf.data.tags["xmc.method"] == "shared"
    assert tf.info.run_name == "tfidf"
    assert tf.data.params["tfidf.min_df"] == "2"
    assert tf.data.params["tfidf.ngram"] == "[1, 2]"

    children = _runs(client, exp.experiment_id, "tags.`xmc.run_type` = 'stage'")
    assert {c.info.run_id for c in children} == {rid_tfidf, rid_train, rid_eval}

    # shared stages are referenced from the method's parent
    assert tracking.link_shared("debtags", "xr-linear", {"tfidf": rid_tfidf}) == xr.info.run_id
    assert client.get_run(xr.info.run_id).data.tags["xmc.uses.tfidf"] == rid_tfidf


def test_parent_params_supersede_and_artifacts(store, tmp_path):
    """The evaluate stage's parent annotation: parameters land on the parent; a later build with
    other parameters supersedes that parent (MLflow forbids changing a parameter) and takes its
    stage runs along; artifacts are copied into the parent's artifact store."""
    client = MlflowClient(tracking.tracking_uri())
    rid_train = tracking.log_stage(_record("train", "xr-linear"))
    parent = tracking.annotate_parent("debtags", "xr-linear", metrics={"p_at_1": 89.5},
                                      params={"beam": 10, "xr_linear.solver.C": 1.0}, config_hash="h1",
                                      stage_run_ids=[rid_train])
    run = client.get_run(parent)
    assert run.data.params == {"beam": "10", "xr_linear.solver.C": "1.0"}
    assert run.data.metrics["p_at_1"] == 89.5
    # the same parameters again (a re-evaluation): same parent, nothing superseded
    assert tracking.annotate_parent("debtags", "xr-linear", params={"beam": 10, "new_key": "x"},
                                    stage_run_ids=[rid_train]) == parent
    assert client.get_run(parent).data.params["new_key"] == "x"
    # another beam: a new parent for the new configuration; the old one keeps its numbers
    rid_train2 = tracking.log_stage(_record("train", "xr-linear"))
    assert client.get_run(rid_train2).data.tags["mlflow.parentRunId"] == parent
    new = tracking.annotate_parent("debtags", "xr-linear", metrics={"p_at_1": 90.0}, params={"beam": 20},
                                   config_hash="h2", stage_run_ids=[rid_train2])
    assert new != parent
    assert tracking.parent_run_id("debtags", "xr-linear") == new
    old = client.get_run(parent)
    assert old.data.tags["xmc.run_type"] == "target-superseded" and old.data.tags["xmc.superseded_by"] == new
    assert old.data.params["beam"] == "10" and old.data.metrics["p_at_1"] == 89.5
    cur = client.get_run(new)
    assert cur.data.params == {"beam": "20"} and cur.data.tags["xmc.config_hash"] == "h2"
    assert client.get_run(rid_train2).data.tags["mlflow.parentRunId"] == new
    assert client.get_run(rid_train).data.tags["mlflow.parentRunId"] == parent

    f = tmp_path / "xr-linear.json"
    f.write_text('{"p_at_1": 90.0}')
    tracking.log_artifacts(new, {"xr-linear.json": f, "plots/row.csv": f})
    names = {a.path for a in client.list_artifacts(new)} | {a.path for a in client.list_artifacts(new, "plots")}
    assert {"xr-linear.json", "plots/row.csv"} <= names
    local = client.download_artifacts(new, "xr-linear.json", str(tmp_path / "dl"))
    assert Path(local).read_text() == '{"p_at_1": 90.0}'


def test_flatten_params():
    flat = tracking.flatten_params({"a": {"b": {"c": 1}, "d": None}, "e@k": [1, "x"], "f": {}})
    assert flat == {"a.b.c": "1", "a.d": "None", "e_at_k": '[1, "x"]', "f": "{}"}


def test_retry_on_locked(monkeypatch):
    monkeypatch.setattr(tracking, "RETRY_BASE_S", 0.001)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise sqlite3.OperationalError("database is locked")
        return "ok"

    assert tracking._retry(flaky, "test") == "ok" and len(calls) == 3

    def broken():
        calls.append(1)
        raise ValueError("no such table")

    calls.clear()
    with pytest.raises(ValueError):
        tracking._retry(broken, "test")
    assert len(calls) == 1  # other errors are not retried


def test_failure_is_a_clear_runtime_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XMC_RESULTS_DIR", str(blocker / "results"))
    with pytest.raises(RuntimeError, match="MLflow tracking at sqlite:///"):
        tracking.log_stage(_record("tfidf", ""), [])


# --------------------------------------------------------------------------- parallel

_JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from xmc_steps import tracking
    tracking._preimport(tracking.tracking_uri())  # import mlflow before the barrier
    i, method, sync = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    (sync / f"ready{{i}}").touch()
    t_end = time.time() + 600
    while not (sync / "go").exists() and time.time() < t_end:
        time.sleep(0.005)
    rec = {{
        "stage": f"stage{{i}}", "rule": f"rule{{i}}", "dataset": "debtags", "method": method,
        "config_hash": "h" + method, "wall_s": float(i), "peak_rss_mb": 10.0 * i,
        "timings_s": {{"fit": 0.5}}, "params": {{"job": i, "nested": {{"k": i}}}},
        "metrics": {{"p_at_1": i / 10, "job_index": i}}, "outputs": {{"out": f"/r/{{i}}.npz"}},
        "tags": {{}}, "extra": {{}},
    }}
    curve = [("loss", i + s / 1000, s) for s in range(1200)]
    rid = tracking.log_stage(rec, curve)
    (sync / f"done{{i}}.json").write_text(json.dumps({{"run_id": rid, "method": method}}))
    """
)

_METHODS = ["xr-linear", "parabel", "", "xr-linear", "parabel", "", "xr-linear", "parabel"]


@pytest.mark.slow
def test_parallel_jobs_one_sqlite_store(tmp_path):
    results = tmp_path / "results"
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(XMC_RESULTS_DIR=str(results), XMC_GIT_COMMIT="feedbeef", XMC_TRACKING="1", PYTHONPATH=str(REPO))
    code = _JOB.format(repo=str(REPO))
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(i), m, str(sync)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i, m in enumerate(_METHODS)
    ]
    try:
        deadline = time.time() + 600
        while len(list(sync.glob("ready*"))) < len(procs) and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.02)
        (sync / "go").touch()  # all 8 hit the fresh (not yet created) store at once
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.perf_counter() - t0
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"job {i} failed:\n{err[-3000:]}"
        assert "Traceback" not in err, err[-3000:]
    print(f"8 parallel jobs took {elapsed:.1f} s")

    done = {i: json.loads((sync / f"done{i}.json").read_text()) for i in range(len(procs))}
    run_ids = {i: d["run_id"] for i, d in done.items()}
    assert len(set(run_ids.values())) == 8

    client = MlflowClient(f"sqlite:///{results.resolve() / 'mlflow.db'}")
    exps = [e for e in client.search_experiments() if e.name == "debtags"]
    assert len(exps) == 1
    exp_id = exps[0].experiment_id

    parents = _runs(client, exp_id, "tags.`xmc.run_type` = 'target'")
    methods = sorted(p.data.tags["xmc.method"] for p in parents)
    assert methods == ["parabel", "shared", "xr-linear"], methods  # exactly one parent each
    parent_of = {p.data.tags["xmc.method"]: p.info.run_id for p in parents}

    children = _runs(client, exp_id, "tags.`xmc.run_type` = 'stage'")
    assert {c.info.run_id for c in children} == set(run_ids.values())
    for i, method in enumerate(_METHODS):
        run = client.get_run(run_ids[i])
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent_of[method or "shared"]
        assert run.data.tags["xmc.rule"] == f"rule{i}"
        assert run.data.params["job"] == str(i) and run.data.params["nested.k"] == str(i)
        assert run.data.params["artifact.out"] == f"/r/{i}.npz"
        m = run.data.metrics
        assert m["p_at_1"] == pytest.approx(i / 10) and m["job_index"] == i
        assert m["wall_s"] == float(i) and m["peak_rss_mb"] == 10.0 * i and m["time_s.fit"] == 0.5
        hist = client.get_metric_history(run_ids[i], "loss")
        assert sorted(h.step for h in hist) == list(range(1200))


def test_stage_harness_logs_to_mlflow(store, tmp_path):
    import argparse

    from xmc_steps.stage import add_common_args, stage_run

    rec_path = tmp_path / "rec.json"
    args = add_common_args(argparse.ArgumentParser()).parse_args(
        ["--record", str(rec_path), "--dataset", "debtags", "--method", "parabel",
         "--rule", "parabel_train", "--config-hash", "abc", "--params", '{"trees": 3}']
    )
    with stage_run("train", args) as st:
        st.metric("n_trees", 3)
        st.step_metric("loss", 0.5, 1)
        st.step_metric("loss", 0.25, 2)
    rec = json.loads(rec_path.read_text())
    rid = rec["mlflow_run_id"]
    run = MlflowClient(tracking.tracking_uri()).get_run(rid)
    assert run.info.run_name == "parabel_train"
    assert run.data.tags["mlflow.parentRunId"] == tracking.parent_run_id("debtags", "parabel")
    assert run.data.params["trees"] == "3" and run.data.metrics["n_trees"] == 3
    assert run.data.metrics["loss"] == 0.25


def test_batches_respect_mlflow_limits():
    metrics, params, tags = list(range(2500)), [f"p{i}" for i in range(150)], [f"t{i}" for i in range(30)]
    pieces = list(tracking._chunks(metrics, params, tags))
    assert all(len(p) + len(t) <= 100 and len(m) + len(p) + len(t) <= 1000 for m, p, t in pieces)
    assert [x for m, _, _ in pieces for x in m] == metrics
    assert [x for _, p, _ in pieces for x in p] == params
    assert [x for _, _, t in pieces for x in t] == tags
    assert list(tracking._chunks([], [], [])) == []


def test_the_tracking_store_takes_the_umasks_mode(tmp_path):
    """Issue 54: under umask 002 (a group sharing results/) the SQLite store and its lock are group-writable;
    SQLite alone makes a new database 0644."""
    results = tmp_path / "results"
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from xmc_steps import tracking; "
            "tracking.log_stage({'stage': 's', 'rule': 'r', 'dataset': 'd', 'method': 'm', 'config_hash': 'h', "
            "'wall_s': 1.0, 'params': {}, 'metrics': {'x': 1.0}, 'outputs': {}, 'tags': {}, 'extra': {}})")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(XMC_RESULTS_DIR=str(results), XMC_TRACKING="1", XMC_GIT_COMMIT="feedbeef")
    r = subprocess.run(["bash", "-c", 'umask 002 && exec "$0" -c "$1"', sys.executable, code], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    assert (results / "mlflow.db").stat().st_mode & 0o777 == 0o664
    assert (results / "mlflow.db.lock").stat().st_mode & 0o777 == 0o664


def test_parents_span_their_children_and_runs_explain_themselves(store):
    """A parent starts with its first stage and ends with its last; runs and the experiment have descriptions
    (the target, its paper, the dataset's size, what PSP is); the parent carries the costs, rounded."""
    from xmc_steps.evaluate import annotate_parent_run

    train = tracking.log_stage(_record("train", "xr-linear", wall_s=30.0))
    predict = tracking.log_stage(_record("predict", "xr-linear", wall_s=5.0))
    records = [{"method": "xr-linear", "mlflow_run_id": train}, {"method": "xr-linear", "mlflow_run_id": predict}]
    annotate_parent_run("debtags", "xr-linear", records, {"p_at_1": 88.123456789, "psp_at_5": 50.0}, None, 572,
                        costs={"total_train_time_s": 30.1234, "predict_latency_ms_per_doc": 0.123456,
                               "model_size_bytes": 12_345_678}, sizes={"n_train_docs": 24234, "n_test_docs": 6059})
    client = MlflowClient(tracking.tracking_uri())
    exp = client.get_experiment_by_name("debtags")
    parent = client.get_run(tracking.parent_run_id("debtags", "xr-linear"))
    children = [client.get_run(r) for r in (train, predict)]
    assert parent.info.start_time <= min(c.info.start_time for c in children)
    assert parent.info.end_time >= max(c.info.end_time for c in children)
    m = parent.data.metrics
    assert m["p_at_1"] == 88.1235 and m["train_s"] == 30.1 and m["predict_ms_per_doc"] == 0.123 and m["model_mb"] == 12.3
    note = parent.data.tags[tracking.NOTE]
    assert "PECOS" in note and "24234 training and 6059 test documents, 572 labels" in note
    assert "psp_at_k: propensity-scored precision@k" in note
    assert "psp_at_k" in exp.tags[tracking.NOTE] and "572 labels" in exp.tags[tracking.NOTE]
    assert children[0].data.tags[tracking.NOTE].startswith("Stage job xr-linear_train of debtags/xr-linear: 30.0 s")
