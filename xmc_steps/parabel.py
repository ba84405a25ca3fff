"""Parabel baseline through the ``omikuji`` package, on the pipeline's TF-IDF features.

omikuji's default hyper-parameters are Parabel's (balanced 2-means trees, 3 trees,
max depth 20, leaves of at most 100 labels, hinge-loss liblinear rankers (dual L2-loss SVM) with
C = 1, eps 0.1, weights below 0.1 dropped); they come from config (``parabel``).
Sub-commands ``train`` and ``predict`` mirror :mod:`xmc_steps.xr_linear`.

omikuji trains from a file in the Extreme Classification Repository format; the
features are written to a temporary file in the model folder and removed afterwards.
Rows without features are written without a trailing space (omikuji rejects it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from . import io
from .stage import add_common_args, cli_main, stage_run

HYPER_KEYS = {
    "n_trees": "n_trees", "max_depth": "max_depth", "cluster_k": "cluster_k", "min_branch_size": "min_branch_size",
    "linear_c": "linear_c", "linear_eps": "linear_eps", "linear_weight_threshold": "linear_weight_threshold",
    "linear_max_iter": "linear_max_iter",
}


def write_xmc_file(path: Path, X: sp.csr_matrix, Y: sp.csr_matrix) -> None:
    """Write features and labels in the Extreme Classification Repository text format."""
    X, Y = sp.csr_matrix(X), sp.csr_matrix(Y)
    with io.atomic_path(path) as tmp, open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}\n")
        for i in range(X.shape[0]):
            labs = ",".join(map(str, Y.indices[Y.indptr[i]:Y.indptr[i + 1]]))
            a, b = X.indptr[i], X.indptr[i + 1]
            feats = " ".join(f"{j}:{v:.6g}" for j, v in zip(X.indices[a:b], X.data[a:b]))
            fh.write(f"{labs} {feats}\n" if feats else f"{labs}\n")


def train(X: sp.csr_matrix, Y: sp.csr_matrix, params: dict[str, Any], workdir: Path, threads: int):
    import omikuji

    hp = omikuji.Model.default_hyper_param()
    for k, attr in HYPER_KEYS.items():
        if k in params:
            setattr(hp, attr, type(getattr(hp, attr))(params[k]))
    data = workdir / "train.omikuji.txt"
    write_xmc_file(data, X, Y)
    try:
        return omikuji.Model.train_on_data(str(data), hp, n_threads=threads)
    finally:
        data.unlink(missing_ok=True)


def predict(model, X: sp.csr_matrix, topk: int, beam: int, n_labels: int) -> sp.csr_matrix:
    """Top-``topk`` scores per row as CSR (omikuji's beam search, width ``beam``)."""
    X = sp.csr_matrix(X)
    rows, cols, vals = [], [], []
    for i in range(X.shape[0]):
        a, b = X.indptr[i], X.indptr[i + 1]
        feats = list(zip(X.indices[a:b].tolist(), X.data[a:b].tolist()))
        for lab, s in model.predict(feats, beam_size=beam, top_k=topk):
            rows.append(i)
            cols.append(lab)
            vals.append(s)
    return sp.csr_matrix((np.asarray(vals, np.float32), (rows, cols)), shape=(X.shape[0], n_labels))


def _stack(paths: list[str]) -> sp.csr_matrix:
    return sp.vstack([io.load_csr(p) for p in paths]).tocsr()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.parabel", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = add_common_args(sub.add_parser("train", help="train the Parabel model"))
    t.add_argument("--features", nargs="+", required=True, help="feature NPZ files (rows stacked)")
    t.add_argument("--labels", nargs="+", required=True, help="label NPZ files, aligned with --features")
    t.add_argument("--out", required=True, help="model folder")
    q = add_common_args(sub.add_parser("predict", help="predict the top-k labels"))
    q.add_argument("--model", required=True)
    q.add_argument("--features", required=True)
    q.add_argument("--label-table", required=True, help="the ingest stage's labels.parquet (gives L)")
    q.add_argument("--out", required=True, help="predictions Parquet")
    args = p.parse_args(argv)
    if args.cmd == "train":
        out = Path(args.out)
        with stage_run("parabel-train", args, outputs=[str(out)]) as st:
            X, Y = _stack(args.features), _stack(args.labels)
            threads = int(st.params.get("threads", 2))
            st.log.info("training omikuji/Parabel on %d documents, %d features, %d labels, %d threads",
                        X.shape[0], X.shape[1], Y.shape[1], threads)
            with io.atomic_dir(out) as tmp:
                with st.timed("train"):
                    model = train(X, Y, st.params, tmp, threads)
                model.save(str(tmp / "omikuji"))
            st.output("model", out)
            st.extra["model_paths"] = [str(out)]
            st.metric("train_s", st.timings["train"])
    else:
        import omikuji

        with stage_run("parabel-predict", args, outputs=[args.out]) as st:
            model = omikuji.Model.load(str(Path(args.model) / "omikuji"))
            model.init_prediction_thread_pool(int(st.params.get("threads", 2)))
            X = io.load_csr(args.features)
            t0 = time.perf_counter()
            n_labels = io.read_table(args.label_table, ["label_id"]).num_rows
            scores = predict(model, X, int(st.params.get("topk", 100)), int(st.params.get("beam", 10)), n_labels)
            st.predictions(args.out, scores, int(st.params.get("topk", 100)), time.perf_counter() - t0)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
