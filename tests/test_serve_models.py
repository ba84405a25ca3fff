"""Every evaluated target is an MLflow model: registered as ``<dataset>-<method>`` with a signature and an
input example; ``mlflow models serve`` (a real server on 127.0.0.1) and ``xmc serve`` answer
``/invocations`` with the predict CLI's labels and scores."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT
from test_mlflow_server import _free_port, _healthy
from xmc_steps import service
from xmc_steps.stages import predict as predict_stage

pytestmark = pytest.mark.slow      # reads the toy DAG's run (toy_linear_run) and starts servers

TEXTS = ["aw0 aw1 aw2 bw3 common filler", "hw1 hw2 hw3 hw4", "nothing the model knows"]


def _cli_answers(model: Path, texts: list[str], top_k: int, capsys) -> list[dict]:
    src = model.parent / "texts-for-test.txt"
    src.write_text("".join(t + "\n" for t in texts))
    capsys.readouterr()
    assert predict_stage.main(["--model", str(model), "--input", str(src), "--top-k", str(top_k)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    return [{"labels": [d["label"] for d in r["labels"]], "names": [d["name"] for d in r["labels"]],
             "scores": [d["score"] for d in r["labels"]]} for r in rows]


def _post(url: str, doc: dict) -> dict:
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


class _Server:
    """A server process (its own process group) on a free port of 127.0.0.1, stopped on exit."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict, log: Path, url_of=None):
        self.log = open(log, "w")
        self.logpath = log
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, url: str) -> str:
        deadline = time.time() + 600
        while not _healthy(url):
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the server did not come up:\n{self.logpath.read_text()[-4000:]}")
            time.sleep(0.5)
        return url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()


def _env(tmp: Path) -> dict:
    # the venv's bin first: `mlflow models serve` starts `uvicorn` by name
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'results' / 'mlflow.db'}",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.pop("MLFLOW_REGISTRY_URI", None)
    return env


def test_each_target_is_a_registered_model_with_signature_and_example(toy_linear_run, capsys):
    from mlflow import MlflowClient
    import mlflow.pyfunc

    tmp = toy_linear_run
    uri = f"sqlite:///{tmp / 'results' / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    for method in ("xr-linear", "parabel"):
        name = f"toy-{method}"
        versions = client.search_model_versions(f"name = '{name}'")
        assert versions, f"{name} is not registered"
        v = max(versions, key=lambda m: int(m.version))
        res = json.loads((tmp / "results" / "toy" / f"{method}.json").read_text())
        assert v.run_id == res["mlflow"]["parent_run_id"]          # logged in the target's parent run
        models = client.search_logged_models([client.get_experiment_by_name("toy").experiment_id])
        assert any(m.source_run_id == v.run_id for m in models)      # in the dataset's experiment, not Default
        assert "toy" in v.description and method in v.description
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        info = mlflow.models.get_model_info(f"models:/{name}/{v.version}")
        assert info.signature.inputs.input_names() == ["text"]
        assert {c.name for c in info.signature.outputs.inputs} == {"labels", "names", "scores"}
        assert info.saved_input_example_info                       # an input example was logged
        # in-process: the pyfunc answers as the predict CLI
        model = mlflow.pyfunc.load_model(f"models:/{name}/{v.version}")
        import pandas as pd

        got = model.predict(pd.DataFrame({"text": TEXTS}), params={"top_k": 3})
        want = _cli_answers(tmp / "results" / "toy" / method, TEXTS, 3, capsys)
        assert [{"labels": list(r.labels), "names": list(r.names), "scores": [float(x) for x in r.scores]}
                for r in got.itertuples()] == want


def test_mlflow_models_serve_answers_as_the_predict_cli(toy_linear_run, tmp_path, capsys):
    tmp = toy_linear_run
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", "models:/toy-xr-linear/1",
           "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with _Server(cmd, tmp_path, _env(tmp), tmp_path / "serve.log") as s:
        s.wait(url)
        got = _post(url, {"inputs": TEXTS, "params": {"top_k": 3}})["predictions"]
        want = _cli_answers(tmp / "results" / "toy" / "xr-linear", TEXTS, 3, capsys)
        assert [{k: r[k] for k in ("labels", "names", "scores")} for r in got] == want
        # the DataFrame formats give the same
        split = _post(url, {"dataframe_split": {"columns": ["text"], "data": [[t] for t in TEXTS]},
                            "params": {"top_k": 3}})["predictions"]
        assert split == got


def test_xmc_serve_answers_as_the_predict_cli(toy_linear_run, tmp_path, capsys):
    tmp = toy_linear_run
    model = tmp / "results" / "toy" / "parabel"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "xmc_steps.cli", "serve", "--model", str(model), "--port", str(port), "--top-k", "3"]
    with _Server(cmd, tmp_path, _env(tmp), tmp_path / "xmc-serve.log") as s:
        s.wait(url)
        want = _cli_answers(model, TEXTS, 3, capsys)
        assert _post(url, {"inputs": TEXTS})["predictions"] == want
        assert _post(url, {"dataframe_records": [{"text": t} for t in TEXTS], "params": {"top_k": 3}})["predictions"] == want
        req = urllib.request.Request(f"{url}/invocations", data=b'{"inputs": [1]}', headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400 and "inputs[0]: not a text" in json.loads(e.value.read())["message"]


@pytest.mark.parametrize("body, texts, params", [
    ({"inputs": ["a", "b"]}, ["a", "b"], {}),
    ({"inputs": {"text": ["a"]}, "params": {"top_k": 2}}, ["a"], {"top_k": 2}),
    ({"instances": [{"text": "a"}]}, ["a"], {}),
    ({"dataframe_split": {"columns": ["id", "text"], "data": [[1, "a"], [2, "b"]]}}, ["a", "b"], {}),
    ({"dataframe_records": [{"text": "a"}]}, ["a"], {}),
])
def test_requests_in_mlflow_formats(body, texts, params):
    assert service.parse_request(json.dumps(body).encode()) == (texts, params)


@pytest.mark.parametrize("body, message", [
    (b"not json", "not JSON"), (b"[1]", "not a JSON object"), (b'{"x": 1}', "expected one of inputs"),
    (b'{"inputs": ["a"], "params": {"top_k": 0}}', "at least 1"),
    (b'{"dataframe_split": {"columns": ["a"], "data": [["x"]]}}', "no 'text' column"),
])
def test_bad_requests_say_why(body, message):
    with pytest.raises(service.RequestError, match=re.escape(message)):
        service.parse_request(body)
