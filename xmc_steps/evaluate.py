"""The evaluate stage: predictions + truth -> ``results/{dataset}/{method}.json`` and a plot.

CLI::

    python -m xmc_steps.evaluate \\
        --predictions test_predictions.parquet --truth Y_test.npz \\
        --train-labels Y_train.npz --labels labels.parquet \\
        --stage-records rec1.json rec2.json ... \\
        --out results/{dataset}/{method}.json \\
        --plot results/{dataset}/{method}_decile_recall.png \\
        [--reported paper.json] [--effective-config config.json] [--schema S.json] \\
        [--log ... --record ... --params '{"propensity": {"A": .., "B": ..}}' \\
         --dataset D --method M --rule evaluate --config-hash H --no-tracking]

What it computes (see :mod:`xmc_steps.metrics` for every metric convention):

* metrics as **percentages** (:func:`xmc_steps.metrics.all_metrics`); inverse
  propensities from ``--train-labels`` (N = its rows, N_l = its column counts) with
  the dataset's (A, B) (:func:`xmc_steps.metrics.propensity_constants` by the dataset's
  name; ``evaluate.propensity: {A, B}`` in config.yaml, i.e. ``--params``, sets them,
  null keeps the named default); label deciles from the same training frequencies (a
  mismatch with ``labels.parquet``'s ``train_freq`` is logged as a warning);
* per-stage wall time and peak memory, copied from the stage records;
  ``total_train_time_s`` sums the records of phase ``train`` (see
  :func:`record_phase`), a resumed training stage with the wall time of its earlier
  processes up to the checkpoint it resumed from (``metrics.resumed_wall_s``);
* ``model_size_bytes``: total size of the files (recursively for folders) listed in
  the records' ``extra.model_paths`` (0 when no record lists any);
* ``predict_latency_ms_per_doc``: end to end from raw text, batched wall time per test
  document: ``metrics.predict_latency_ms_per_doc`` of the ``predict``-phase record(s)
  that carry it (an ensemble runs each member; ELIAS++ runs the ELIAS model and then
  its ranker) plus ``metrics.online_ms_per_doc`` of every other record (the test
  split's tokenisation, TF-IDF transform, matcher encoder pass, linear-tree beam: what
  predicting for new text repeats; :meth:`xmc_steps.stage.StageContext.online_cost`);
  ``predict_latency_parts_ms_per_doc`` lists the parts by stage.  Predictions made on
  the training or validation split to train a later stage are ``train`` phase;
  ``null`` when no predict-phase record carries a latency;
* the effective config (``--effective-config`` JSON) and ``--config-hash``,
  package versions, device, MLflow run ids (this stage's and the parent run's),
  and the paper's reported figures (``--reported``; see :func:`select_reported`).

The result is validated against ``workflow/schemas/results.schema.json`` before
anything is written; the plot and the JSON are written atomically, and the stage
harness removes both if anything fails.  The evaluate stage's own MLflow run id only
exists once the harness has finished, so when tracking is on and ``--record`` is
given, the JSON is rewritten (atomically, validated again) with that id afterwards.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import scipy.sparse as sp

from . import io
from . import metrics as xm
from .papers import select_reported
from .stage import StageError, add_common_args, cli_main, stage_run

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
    """Per-stage table, train/total wall time, peak memory, model size, prediction latency, and the
    machines the stages ran on (host, CPU model, cores, GPU; each distinct one once)."""
    stages, model_paths, machines = [], [], []
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


def annotate_parent_run(dataset: str, method: str, records: list[dict[str, Any]],
                        metrics: Mapping[str, Any], config: Mapping[str, Any] | None = None,
                        n_labels: int | None = None, log=None) -> dict[str, str]:
    """Put the target's test metrics on its MLflow parent run, with its effective
    hyper-parameters (:func:`xmc_steps.target_params.parent_params` of the effective config,
    when given) and the git commit, and reference the shared stages' runs (TF-IDF, ingest,
    ...: logged once under the dataset's ``shared`` parent) with tags ``xmc.uses.<stage>`` =
    run id.  Returns the referenced run ids."""
    used = {r.get("stage") or r.get("rule"): r["mlflow_run_id"] for r in records
            if not r.get("method") and r.get("mlflow_run_id")}
    own = [r["mlflow_run_id"] for r in records if r.get("method") and r.get("mlflow_run_id")]
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    try:
        from . import target_params, tracking

        params = target_params.parent_params(config, n_labels) if config and config.get("method") else None
        commit = tracking.git_commit()
        tags = {f"xmc.uses.{k}": v for k, v in used.items()}
        tags.update({"mlflow.source.git.commit": commit, "xmc.git_commit": commit})
        tracking.annotate_parent(dataset, method, tags=tags, metrics=scalars, params=params,
                                 config_hash=(config or {}).get("config_hash", ""), stage_run_ids=own, log=log)
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


def tracking_enabled(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_tracking", False) and os.environ.get("XMC_TRACKING", "1") != "0"


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


def _read_inputs(args: argparse.Namespace, log):
    for flag, path in (("--predictions", args.predictions), ("--truth", args.truth),
                       *(("--train-labels", p) for p in args.train_labels), ("--labels", args.labels)):
        if not Path(path).is_file():
            raise StageError(f"{flag} file not found: {path}")
    try:
        labels = io.read_table(args.labels)
    except (FileNotFoundError, OSError) as e:
        raise StageError(f"cannot read labels table {args.labels}: {e}") from e
    L = labels.num_rows
    if L < 1:
        raise StageError(f"{args.labels} has no labels")
    truth = io.load_csr(args.truth)
    Y_train = sp.vstack([io.load_csr(p) for p in args.train_labels]).tocsr()
    if truth.shape[1] != L:
        raise StageError(f"{args.truth} has {truth.shape[1]} label columns, {args.labels} has {L} labels")
    if Y_train.shape[1] != L:
        raise StageError(f"{' + '.join(args.train_labels)} have {Y_train.shape[1]} label columns, {args.labels} has {L} labels")
    docs = np.asarray(io.read_table(args.predictions, columns=["doc"]).column("doc").to_numpy())
    if docs.shape[0] != truth.shape[0] or not np.array_equal(docs, np.arange(truth.shape[0])):
        raise StageError(
            f"{args.predictions} must have one row per test document in order (doc = 0..{truth.shape[0] - 1}); "
            f"got {docs.shape[0]} rows"
        )
    try:
        scores = io.read_predictions(args.predictions, L)
    except ValueError as e:
        raise StageError(f"{args.predictions}: bad label indices for {L} labels: {e}") from e
    if scores.nnz and (scores.indices.min() < 0 or scores.indices.max() >= L):
        raise StageError(f"{args.predictions}: label index outside 0..{L - 1}")
    freq = xm.label_frequency(Y_train)
    if "train_freq" in labels.column_names:
        tf = np.asarray(labels.column("train_freq").to_numpy())
        if tf.shape[0] == L and not np.array_equal(tf.astype(np.int64), freq):
            log.warning("labels.parquet train_freq differs from the column counts of %s; using the latter",
                        " + ".join(args.train_labels))
    return scores, truth, Y_train, freq, L


def propensity(params: Mapping[str, Any], dataset: str) -> tuple[float, float]:
    """(A, B): ``params["propensity"]`` where set (a null keeps the dataset's named default)."""
    A, B = xm.propensity_constants(dataset)
    given = params.get("propensity") or {}
    if not isinstance(given, Mapping) or set(given) - {"A", "B"}:
        raise StageError(f"evaluate: propensity must be {{A, B}}; got {given!r}")
    return (float(given["A"]) if given.get("A") is not None else A,
            float(given["B"]) if given.get("B") is not None else B)


def evaluate(args: argparse.Namespace, st) -> dict[str, Any]:
    """Compute the result document (validated by the caller)."""
    log = st.log
    dataset = args.dataset or Path(args.out).parent.name
    method = args.method or Path(args.out).stem
    params = st.params
    A, B = propensity(params, dataset)
    st.params.update({"propensity": {"A": A, "B": B}})

    with st.timed("read"):
        scores, truth, Y_train, freq, L = _read_inputs(args, log)
    n_test = truth.shape[0]
    pred_k = int(np.diff(scores.indptr).max()) if n_test else 0
    if pred_k < 100:
        log.warning("predictions hold at most %d labels per document: recall@100 is over fewer than 100", pred_k)

    with st.timed("metrics"):
        w = xm.inverse_propensity(Y_train, A=A, B=B)
        try:
            m = xm.all_metrics(scores, truth, w, freq, n_bins=N_BINS, curve=True)
            curve = m.pop(xm.CURVE_KEY)
        except ValueError as e:
            raise StageError(f"cannot evaluate: {e}") from e
    n_empty = xm.n_docs_without_labels(truth)
    if n_empty:
        log.info("%d of %d test documents have no label; excluded from the averages", n_empty, n_test)

    bins = xm.label_deciles(freq, N_BINS)
    bin_freq = [freq[bins == b] for b in range(N_BINS)]
    records = load_stage_records(args.stage_records or [])
    summary = summarise_stages(records, log=log)

    config = None
    if args.effective_config:
        try:
            config = io.read_json(args.effective_config)
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise StageError(f"cannot read --effective-config {args.effective_config}: {e}") from e
        if not isinstance(config, dict):
            raise StageError("--effective-config must hold a JSON object")
    reported = None
    if args.reported:
        try:
            reported = select_reported(io.read_json(args.reported), dataset, method)
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise StageError(f"cannot read --reported {args.reported}: {e}") from e

    result = {
        "schema_version": SCHEMA_VERSION,
        "dataset": dataset,
        "method": method,
        "metrics": m,
        "metric_units": "percent",
        "n_test_docs": int(n_test),
        "n_test_docs_without_labels": int(n_empty),
        "n_labels": int(L),
        "n_train_docs": int(Y_train.shape[0]),
        "prediction_k": pred_k,
        "recall_curve": curve,
        "propensity": {"A": A, "B": B},
        "decile_bins": {
            "n_bins": N_BINS,
            "label_counts": [int(f.size) for f in bin_freq],
            "train_freq_max": [int(f.max()) if f.size else None for f in bin_freq],
            "train_freq_min": [int(f.min()) if f.size else None for f in bin_freq],
        },
        **summary,
        "config": config,
        "config_hash": args.config_hash or "",
        "versions": collect_versions(),
        "device": detect_device(summary["stages"]),
        "mlflow": {
            "evaluate_run_id": None,
            "parent_run_id": None,
            "shared_stage_runs": {},
        },
        "reported": reported,
        "plot": str(args.plot),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if tracking_enabled(args):
        result["mlflow"]["shared_stage_runs"] = annotate_parent_run(dataset, method, records, m, config, int(L), log)
        result["mlflow"]["parent_run_id"] = parent_run_id(dataset, method, log)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions", required=True, help="test predictions Parquet (doc, labels, scores)")
    p.add_argument("--truth", required=True, help="test label matrix Y_test.npz (CSR)")
    p.add_argument("--train-labels", nargs="+", required=True,
                   help="training label matrices (CSR NPZ, rows stacked: train and valid)")
    p.add_argument("--labels", required=True, help="labels.parquet (label_id, label_text, train_freq)")
    p.add_argument("--stage-records", nargs="*", default=[], help="stage record JSON files of this method")
    p.add_argument("--out", required=True, help="results JSON (results/{dataset}/{method}.json)")
    p.add_argument("--plot", required=True, help="decile-recall bar chart PNG")
    p.add_argument("--reported", help="JSON with the papers' reported figures (optional)")
    p.add_argument("--effective-config", help="JSON file holding the effective config (optional)")
    p.add_argument("--schema", help="results JSON schema (default: workflow/schemas/results.schema.json)")
    add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    schema = load_schema(args.schema)
    result: dict[str, Any] = {}
    with stage_run("evaluate", args, outputs=[args.out, args.plot]) as st:
        result = evaluate(args, st)
        validate_result(result, schema)
        for key in xm.METRIC_KEYS:
            st.metric(key, result["metrics"][key])
        for i, v in enumerate(result["metrics"][xm.DECILE_KEY], start=1):
            st.metric(f"decile_recall_at_100_d{i:02d}", v)
        for key in ("total_train_time_s", "model_size_bytes"):
            st.metric(key, result[key])
        if result["predict_latency_ms_per_doc"] is not None:
            st.metric("predict_latency_ms_per_doc", result["predict_latency_ms_per_doc"])
        plot_decile_recall(result["metrics"][xm.DECILE_KEY], args.plot,
                           f"{result['dataset']} / {result['method']}", result["metrics"]["recall_at_100"])
        st.output("plot", args.plot)
        io.write_json(args.out, result)
        st.output("results", args.out)
        st.log.info("P@1 %.2f  P@5 %.2f  PSP@5 %.2f  R@100 %.2f", result["metrics"]["p_at_1"],
                    result["metrics"]["p_at_5"], result["metrics"]["psp_at_5"], result["metrics"]["recall_at_100"])
    # The harness knows this stage's MLflow run id only after the block: fill it in.
    if args.record and tracking_enabled(args):
        try:
            run_id = io.read_json(args.record).get("mlflow_run_id")
        except (FileNotFoundError, json.JSONDecodeError):
            run_id = None
        if run_id:
            result["mlflow"]["evaluate_run_id"] = run_id
            validate_result(result, schema)
            io.write_json(args.out, result)
    if tracking_enabled(args):
        log_parent_artifacts(result, args.out, args.plot, logging.getLogger("xmc_steps.evaluate"))
    return result


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
