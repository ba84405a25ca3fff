"""The evaluate stage: predictions + truth -> ``results/{dataset}/{method}.json`` and a plot.

CLI::

    python -m xmc_steps.stages.evaluate \\
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
  :func:`xmc_steps.evaluate.record_phase`), a resumed training stage with the wall time of its earlier
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
* ``<method>_metrics.html`` beside ``--out``: the results as tables, for ``snakemake --report``
  (:func:`xmc_steps.report_html.metrics_page`);
* the effective config (``--effective-config`` JSON) and ``--config-hash``,
  package versions, device, MLflow run ids (this stage's and the parent run's),
  and the paper's reported figures (``--reported``; see :func:`xmc_steps.papers.select_reported`).

With tracking on, the target is then logged as an MLflow model in its parent run and registered as
``<dataset>-<method>`` (:mod:`xmc_steps.mlflow_model`; ``XMC_LOG_MODEL=0`` skips it).

The result is validated against ``workflow/schemas/results.schema.json`` before
anything is written; the plot and the JSON are written atomically, and the stage
harness removes both if anything fails.  The evaluate stage's own MLflow run id only
exists once the harness has finished, so when tracking is on and ``--record`` is
given, the JSON is rewritten (atomically, validated again) with that id afterwards.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import io, report_html
from .. import metrics as xm
from ..evaluate import (N_BINS, SCHEMA_VERSION, annotate_parent_run, collect_versions, detect_device, load_schema,
                        load_stage_records, log_parent_artifacts, log_parent_model, parent_run_id, plot_decile_recall,
                        propensity, summarise_stages, validate_result)
from ..papers import select_reported
from ..stage import StageError, add_common_args, cli_main, stage_run


def tracking_enabled(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_tracking", False) and os.environ.get("XMC_TRACKING", "1") != "0"


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
    with st.timed("zero_shot"):
        zs = xm.zero_shot(scores, truth, freq)
    if zs is not None:
        log.info("zero-shot: %d test documents hold %d labels training never saw: P@1 %.2f, R@100 %.2f",
                 zs["n_docs"], zs["n_labels"], zs["p_at_1"], zs["recall_at_100"])
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
        "zero_shot": zs,
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
        result["mlflow"]["shared_stage_runs"] = annotate_parent_run(
            dataset, method, records, m, config, int(L), log, costs=summary,
            sizes={"n_train_docs": int(Y_train.shape[0]), "n_test_docs": int(n_test)})
        result["mlflow"]["parent_run_id"] = parent_run_id(dataset, method, log)
    return result


def metrics_page_path(out: str) -> str:
    """The report's metrics tables beside the results file: ``<method>.json`` -> ``<method>_metrics.html``."""
    return (out[:-len(".json")] if out.endswith(".json") else out) + "_metrics.html"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.evaluate", description=__doc__.split("\n\n")[0])
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
    page = metrics_page_path(args.out)
    with stage_run("evaluate", args, outputs=[args.out, args.plot, page]) as st:
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
        io.write_text(page, report_html.metrics_page(result))
        st.output("metrics_page", page)
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
        log_parent_model(result, args.out, logging.getLogger("xmc_steps.evaluate"))
    return result


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
