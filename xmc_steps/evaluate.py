"""What the evaluate stage (:mod:`xmc_steps.stages.evaluate`, whose docstring says what a results file
holds) computes with: stage records, their phases and their summary (wall times, peak memory, training
time, model size, prediction latency), package versions and the device, the MLflow parent run's
annotation and artifacts, the results schema, the decile-recall plot and the propensity constants.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from . import io
from . import metrics as xm
from .errors import StageError

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "results.schema.json"
SCHEMA_VERSION = 1
N_BINS = 10

#: Phases a stage record can declare in ``extra.phase``.
PHASES = ("data", "train", "predict", "eval")
_DATA_STAGES = {"prepare", "prepare_debtags", "ingest"}


# --------------------------------------------------------------------------- stage records


def load_stage_records(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Read stage-record JSON files (written by :func:`xmc_steps.stage.stage_run`)."""
    out = []
    for p in paths:
        try:
            rec = io.read_json(p)
        except FileNotFoundError as e:
            raise StageError(f"stage record not found: {p}") from e
        except json.JSONDecodeError as e:
            raise StageError(f"stage record {p} is not valid JSON: {e}") from e
        if not isinstance(rec, dict) or "wall_s" not in rec or "peak_rss_mb" not in rec:
            raise StageError(f"{p} is not a stage record (needs wall_s and peak_rss_mb)")
        rec = dict(rec)
        rec["_path"] = str(p)
        out.append(rec)
    return out


def record_phase(record: Mapping[str, Any]) -> str:
    """The phase a record counts towards: ``data``, ``train``, ``predict`` or ``eval``.

    ``extra.phase`` wins when the stage declares it.  Otherwise, by stage/rule name:
    ``prepare``/``prepare_debtags``/``ingest`` (or a name starting with ``data``) are
    ``data``; a name containing ``predict`` is ``predict``; one containing ``eval``
    is ``eval``; everything else (features such as TF-IDF and tokenisation, label
    embedding, clustering, matcher, ranker, calibration, ...) is ``train``.  Only
    ``train`` records add up to ``total_train_time_s``.
    """
    phase = (record.get("extra") or {}).get("phase")
    if phase in PHASES:
        return phase
    names = {str(record.get("stage") or ""), str(record.get("rule") or "")}
    if any(n in _DATA_STAGES or n.startswith("data") for n in names):
        return "data"
    if any("predict" in n for n in names):
        return "predict"
    if any("eval" in n for n in names):
        return "eval"
    return "train"


def path_size(path: str | os.PathLike) -> int:
    """Size in bytes of a file, or of every file under a folder."""
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size


def summarise_stages(records: list[Mapping[str, Any]], log=None) -> dict[str, Any]:
    """Per-stage table, train/total wall time, peak memory, model size, prediction latency, the
    machines the stages ran on (host, CPU model, cores, GPU; each distinct one once), and the validation
    checks of the stages whose input is another model's ranking (``second_stages``: input, chosen, whether
    the stage was switched off; :mod:`xmc_steps.second_stage`)."""
    stages, model_paths, machines, second = [], [], [], []
    parts, predicted = {}, False
    for r in records:
        extra = r.get("extra") or {}
        stages.append({
            "stage": str(r.get("stage", "")),
            "rule": str(r.get("rule", "") or r.get("stage", "")),
            "phase": record_phase(r),
            "wall_s": float(r["wall_s"]),
            # a training stage that resumed from a checkpoint: the processes before this record's
            "resumed_wall_s": float((r.get("metrics") or {}).get("resumed_wall_s", 0.0)),
            "peak_rss_mb": float(r["peak_rss_mb"]),
            "mlflow_run_id": r.get("mlflow_run_id"),
            "device": extra.get("device"),
            "precision": extra.get("precision"),        # a neural training stage's: fp32, bfloat16, float16
            "host": (r.get("machine") or {}).get("host"),
            "record": r.get("_path", ""),
        })
        if extra.get("second_stage") is not None:      # a re-ranker's or ensemble's validation check
            second.append({"rule": stages[-1]["rule"], **extra["second_stage"]})
        m = r.get("machine")
        if m and m not in machines:
            machines.append(dict(m))
        mps = extra.get("model_paths") or []
        for mp in (mps.values() if isinstance(mps, dict) else mps):
            if str(mp) not in model_paths:
                model_paths.append(str(mp))
        lat = (r.get("metrics") or {}).get("predict_latency_ms_per_doc")
        if lat is not None and record_phase(r) == "predict":
            predicted = True
            parts[stages[-1]["record"] or stages[-1]["rule"]] = float(lat)
        online = (r.get("metrics") or {}).get("online_ms_per_doc")
        if online is not None and record_phase(r) != "predict":
            parts[stages[-1]["record"] or stages[-1]["rule"]] = float(online)
    size = 0
    for mp in model_paths:
        try:
            size += path_size(mp)
        except FileNotFoundError:
            if log:
                log.warning("model path %s listed in a stage record does not exist; not counted", mp)
    return {
        "stages": stages,
        "total_train_time_s": round(sum(s["wall_s"] + s["resumed_wall_s"] for s in stages if s["phase"] == "train"), 3),
        "total_wall_s": round(sum(s["wall_s"] + s["resumed_wall_s"] for s in stages), 3),
        "peak_rss_mb": max((s["peak_rss_mb"] for s in stages), default=0.0),
        "model_size_bytes": int(size),
        "model_paths": model_paths,
        "predict_latency_ms_per_doc": round(sum(parts.values()), 6) if predicted else None,
        "predict_latency_parts_ms_per_doc": parts,
        "machines": machines,
        "second_stages": second,
    }


# --------------------------------------------------------------------------- environment


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    dist = {"sklearn": "scikit-learn"}.get(module, module)
    try:
        return version(dist)
    except PackageNotFoundError:
        if importlib.util.find_spec(module) is None:
            return None
        mod = importlib.import_module(module)
        return str(getattr(mod, "__version__", "unknown"))


def collect_versions() -> dict[str, str | None]:
    """Versions of python, numpy, scipy, torch, sklearn, xmc_steps (None: not installed)."""
    from . import __version__ as xmc_version

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": _version("scipy") or "unknown",
        "torch": _version("torch"),
        "sklearn": _version("sklearn"),
        "pyarrow": _version("pyarrow"),
        "xmc_steps": xmc_version,
    }


def detect_device(stages: Iterable[Mapping[str, Any]] = ()) -> str:
    """The device the method's stages ran on: ``cuda:<name>`` when any stage record says it
    used CUDA (the name from torch, or the record's own string when torch cannot tell), else ``cpu``.

    Read from the stage records rather than from the evaluating machine, which is not where
    training ran on a cluster; importing torch (seconds) only happens for a CUDA run.
    """
    used = [str(s.get("device") or "") for s in stages]
    cuda = [d for d in used if d.startswith("cuda")]
    if not cuda:
        return "cpu"
    if any(d.startswith("cuda:") and not d[5:].isdigit() for d in cuda):
        return next(d for d in cuda if d.startswith("cuda:") and not d[5:].isdigit())
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.get_device_name(0)}"
    except Exception:  # a broken CUDA install must not fail the evaluation
        pass
    return cuda[0]


def parent_run_id(dataset: str, method: str, log=None) -> str | None:
    """The MLflow parent run of (dataset, method), via ``xmc_steps.tracking`` if present."""
    try:
        from . import tracking

        return tracking.parent_run_id(dataset, method)
    except (ImportError, AttributeError):
        return None
    except Exception as e:  # tracking trouble must not lose the results
        if log:
            log.warning("could not look up the MLflow parent run: %s", e)
        return None


def parent_costs(summary: Mapping[str, Any]) -> dict[str, float]:
    """The parent run's cost metrics from a results summary: ``train_s``, ``predict_ms_per_doc``, ``model_mb``
    (3 significant places; a cost that is not known is left out)."""
    out = {}
    for key, name, scale in (("total_train_time_s", "train_s", 1.0), ("predict_latency_ms_per_doc", "predict_ms_per_doc", 1.0),
                             ("model_size_bytes", "model_mb", 1e-6)):
        v = summary.get(key)
        if isinstance(v, (int, float)):
            out[name] = float(f"{float(v) * scale:.3g}")
    return out


def annotate_parent_run(dataset: str, method: str, records: list[dict[str, Any]],
                        metrics: Mapping[str, Any], config: Mapping[str, Any] | None = None,
                        n_labels: int | None = None, log=None, costs: Mapping[str, Any] | None = None,
                        sizes: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Put the target's test metrics on its MLflow parent run, with its effective
    hyper-parameters (:func:`xmc_steps.target_params.parent_params` of the effective config,
    when given) and the git commit, and reference the shared stages' runs (TF-IDF, ingest,
    ...: logged once under the dataset's ``shared`` parent) with tags ``xmc.uses.<stage>`` =
    run id.  Returns the referenced run ids."""
    used = {r.get("stage") or r.get("rule"): r["mlflow_run_id"] for r in records
            if not r.get("method") and r.get("mlflow_run_id")}
    own = [r["mlflow_run_id"] for r in records if r.get("method") and r.get("mlflow_run_id")]
    # rounded: the metrics (percent) to 4 decimals, the costs to 3 significant places (parent_costs)
    scalars = {k: round(float(v), 4) for k, v in metrics.items() if isinstance(v, (int, float))}
    costs = parent_costs(costs or {})
    try:
        from . import registry, target_params, tracking
        from .metrics import GLOSSARY

        params = target_params.parent_params(config, n_labels) if config and config.get("method") else None
        commit = tracking.git_commit()
        tags = {f"xmc.uses.{k}": v for k, v in used.items()}
        tags.update({"mlflow.source.git.commit": commit, "xmc.git_commit": commit})
        try:
            paper = registry.get(method).paper
        except KeyError:
            paper = ""
        sizes = sizes or {}
        size = (f"{sizes.get('n_train_docs', '?')} training and {sizes.get('n_test_docs', '?')} test documents, "
                f"{n_labels if n_labels is not None else '?'} labels")
        main = ", ".join(f"{k} {scalars[k]:.2f}" for k in ("p_at_1", "p_at_5", "psp_at_5", "recall_at_100") if k in scalars)
        cost = ", ".join(f"{k} {v:g}" for k, v in costs.items())
        description = (f"Target {dataset}/{method}" + (f": {paper}" if paper else "") + f".  Dataset {dataset}: {size}.  "
                       f"Test: {main}" + (f"; costs: {cost}" if cost else "") + f" (results/{dataset}/{method}.json).  "
                       + GLOSSARY)
        exp_note = (f"XMC dataset '{dataset}' ({size}): one parent run per (dataset, method) target (its test "
                    "metrics, costs, effective settings and the trained model, registered as <dataset>-<method>), "
                    "one child run per stage job; the stages shared by the methods under the parent 'shared'.  "
                    + GLOSSARY)
        tracking.annotate_parent(dataset, method, tags=tags, metrics={**scalars, **costs}, params=params,
                                 config_hash=(config or {}).get("config_hash", ""), stage_run_ids=own, log=log,
                                 description=description, experiment_description=exp_note)
    except Exception as e:  # tracking trouble must not lose the results
        if log:
            log.warning("could not annotate the MLflow parent run: %s", e)
    return used


def log_parent_artifacts(result: Mapping[str, Any], out: str, plot: str, log=None) -> None:
    """The results JSON, its plot and its leaderboard row (CSV) as artifacts of the parent run."""
    run_id = (result.get("mlflow") or {}).get("parent_run_id")
    if not run_id:
        return
    try:
        import tempfile

        from . import leaderboard, tracking

        with tempfile.TemporaryDirectory(prefix="xmc-row-") as tmp:
            row = Path(tmp) / "leaderboard_row.csv"
            leaderboard.write_csv(row, leaderboard.rows_of([result]))
            tracking.log_artifacts(run_id, {Path(out).name: out, Path(plot).name: plot, row.name: row}, log=log)
    except Exception as e:  # tracking trouble must not lose the results
        if log:
            log.warning("could not log the results as artifacts of the MLflow parent run: %s", e)


def log_parent_model(result: Mapping[str, Any], out: str, log=None) -> tuple[str, str] | None:
    """The target (``out`` without ``.json``: ``results/<dataset>/<method>``) as an MLflow pyfunc model in
    its parent run, registered as ``<dataset>-<method>`` (:mod:`xmc_steps.mlflow_model`); returns (name,
    version).  ``XMC_LOG_MODEL=0`` skips it; trouble is a warning, as every tracking trouble is."""
    run_id = (result.get("mlflow") or {}).get("parent_run_id")
    if not run_id or os.environ.get("XMC_LOG_MODEL", "1") == "0":
        return None
    try:
        from . import mlflow_model

        return mlflow_model.log_target_model(str(out)[:-len(".json")] if str(out).endswith(".json") else out, run_id, log)
    except Exception as e:  # tracking trouble must not lose the results
        if log:
            log.warning("could not log the target as an MLflow model: %s: %s", type(e).__name__, e)
        return None


# --------------------------------------------------------------------------- schema, plot


def load_schema(path: str | os.PathLike | None = None) -> dict[str, Any]:
    p = Path(path) if path else SCHEMA_PATH
    try:
        return io.read_json(p)
    except FileNotFoundError as e:
        raise StageError(f"results schema not found: {p}") from e


def validate_result(result: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
    """Raise :class:`StageError` listing every violation of the results schema."""
    import jsonschema

    # Round-trip through JSON so numpy scalars etc. are validated as they will be written.
    doc = json.loads(json.dumps(result, default=io._json_default))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        msgs = "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:10])
        raise StageError(f"result does not match the results schema: {msgs}")


def plot_decile_recall(deciles: list[float], path: str | os.PathLike, title: str, total: float | None = None) -> None:
    """Bar chart of the per-decile contribution to recall@100, written atomically (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    x = np.arange(1, len(deciles) + 1)
    ax.bar(x, deciles, color="#3b75af")
    ax.set_xticks(x)
    ax.set_xlabel("label decile by training frequency (1 = head, %d = tail)" % len(deciles))
    ax.set_ylabel("contribution to recall@100 (%)")
    ax.set_title(title + (f"  (R@100 = {total:.2f})" if total is not None else ""), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    try:
        with io.atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- evaluation


def propensity(params: Mapping[str, Any], dataset: str) -> tuple[float, float]:
    """(A, B): ``params["propensity"]`` where set (a null keeps the dataset's named default)."""
    A, B = xm.propensity_constants(dataset)
    given = params.get("propensity") or {}
    if not isinstance(given, Mapping) or set(given) - {"A", "B"}:
        raise StageError(f"evaluate: propensity must be {{A, B}}; got {given!r}")
    return (float(given["A"]) if given.get("A") is not None else A,
            float(given["B"]) if given.get("B") is not None else B)
