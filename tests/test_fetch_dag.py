"""A PECOS benchmark by name through the DAG, offline: a loopback server serves a small xmc-base
tarball (built here), `results/eurlex4k/xr-linear.json` fetches, verifies and reads it with its own
features; a download cut halfway resumes on the rerun; a wrong pinned hash and a refusing server
stop at the fetch job with one line; a missing dataset stops the DAG with one line."""

import hashlib

from conftest import xmc_base_tarball
from test_workflow import _run

TARGET = "results/eurlex4k/xr-linear.json"
FOLDER = "data/xmc-base/eurlex-4k"
#: the tiny set's tree and its own features (tfidf.source: dataset, what config.paper.yaml reads)
OVERRIDES = {"datasets": {"eurlex4k": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1,
                                      "tfidf": {"source": "dataset"}}}}


def _env(server, manifest=None):
    env = {"XMC_DATASET_BASE_URL": server.url, "XMC_TRACKING": "0"}     # the fetch and the run, not the tracking
    if manifest is not None:
        env["XMC_DATASET_MANIFEST"] = str(manifest)
    return env


def _error_lines(r) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]


def test_a_benchmark_is_fetched_resumed_after_a_cut_and_run(tmp_path, tarball_server):
    import json

    data = xmc_base_tarball(tmp_path, "eurlex-4k")
    tarball_server.files["/eurlex-4k.tar.gz"] = data
    tarball_server.cut_next = True
    r = _run(tmp_path, TARGET, overrides=OVERRIDES, env=_env(tarball_server), check=False)
    assert r.returncode != 0
    errors = _error_lines(r)
    assert any("the download was cut at" in e and "run again to resume" in e for e in errors), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert 0 < (tmp_path / f"{FOLDER}.tar.gz.part").stat().st_size < len(data)
    assert not (tmp_path / FOLDER / "X.trn.txt").exists()
    _run(tmp_path, TARGET, overrides=OVERRIDES, env=_env(tarball_server))
    assert tarball_server.requests[-1][1] == f"bytes={len(data) // 2}-"
    rec = json.loads((tmp_path / FOLDER / "download.json").read_text())["extra"]["download"]
    assert rec["sha256"] == hashlib.sha256(data).hexdigest() and not rec["pinned"]
    ingest = json.loads((tmp_path / "results/eurlex4k/ingest/ingest.json").read_text())
    assert ingest["layout"] == "xmc-base" and ingest["has_own_features"]
    result = json.loads((tmp_path / TARGET).read_text())
    assert result["metrics"]["p_at_1"] > 0.3, result["metrics"]
    assert not (tmp_path / f"{FOLDER}.tar.gz.part").exists() and not (tmp_path / f"{FOLDER}.tar.gz").exists()


def test_a_wrong_pin_or_a_refusing_server_stops_the_fetch_with_one_line(tmp_path, tarball_server):
    data = xmc_base_tarball(tmp_path, "eurlex-4k")
    tarball_server.files["/eurlex-4k.tar.gz"] = data
    manifest = tmp_path / "downloads.tsv"
    manifest.write_text(f"eurlex-4k\thttps://archive.org/download/pecos-dataset/xmc-base/eurlex-4k.tar.gz\t-\t{'ab' * 32}\n")
    r = _run(tmp_path, TARGET, overrides=OVERRIDES, env=_env(tarball_server, manifest), check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    [err] = [e for e in _error_lines(r) if "sha256" in e]
    assert hashlib.sha256(data).hexdigest() in err and "ab" * 32 in err and f"{manifest}:1" in err
    assert not (tmp_path / FOLDER / "X.trn.txt").exists() and not (tmp_path / f"{FOLDER}.tar.gz.part").exists()
    assert not (tmp_path / "results/eurlex4k/ingest").exists()          # the DAG stopped at the fetch job
    tarball_server.refuse = 503
    r = _run(tmp_path, TARGET, overrides=OVERRIDES, env=_env(tarball_server), check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    [err] = [e for e in _error_lines(r) if "HTTP 503" in e]
    assert f"{tarball_server.url}/eurlex-4k.tar.gz" in err and "xmc_steps.stages.synth" in err and FOLDER in err


def test_a_missing_dataset_stops_the_dag_with_one_line(tmp_path):
    r = _run(tmp_path, "results/lf-amazontitles131k/xr-linear.json", extra=["-n"], check=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "InputFunctionException" not in r.stderr
    [err] = _error_lines(r)
    assert "dataset 'lf-amazontitles131k': none of" in err and "xmc_steps.stages.synth" in err
