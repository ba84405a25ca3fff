"""Parabel baseline through the ``omikuji`` package, on the pipeline's TF-IDF features.

The stage: sub-commands ``train`` and ``predict`` mirror :mod:`xmc_steps.stages.xr_linear`.  ``train`` saves
the prediction parameters with the model (``parabel.json``); ``predict`` is :func:`xmc_steps.parabel.serve.predict`,
serving's too, with the rule's ``beam`` and ``topk`` over the saved ones.  The
model (omikuji's Parabel, its hyper-parameters and the training file): :mod:`xmc_steps.parabel`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import scipy.sparse as sp

from .. import io
from ..errors import StageError
from ..parabel import ParabelParams, load, save_meta, train
from ..stage import add_common_args, cli_main, stage_run


def _stack(paths: list[str]) -> sp.csr_matrix:
    return sp.vstack([io.load_csr(p) for p in paths]).tocsr()


def _params(st) -> ParabelParams:
    """The ``parabel`` section the rule passes (and the stage's --threads)."""
    try:
        params = ParabelParams.from_dict(st.params)
    except (ValueError, TypeError) as e:
        raise StageError(str(e)) from e
    st.params.clear()
    st.params.update(params.to_dict())
    return params


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.parabel", description=__doc__.splitlines()[0])
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
            params = _params(st)
            X, Y = _stack(args.features), _stack(args.labels)
            threads = params.threads
            st.log.info("training omikuji/Parabel on %d documents, %d features, %d labels, %d threads",
                        X.shape[0], X.shape[1], Y.shape[1], threads)
            with io.atomic_dir(out) as tmp:
                with st.timed("train"):
                    model = train(X, Y, params.to_dict(), tmp, threads)
                model.save(str(tmp / "omikuji"))
                save_meta(tmp, params)
            st.output("model", out)
            st.extra["model_paths"] = [str(out)]
            st.metric("train_s", st.timings["train"])
    else:
        from ..parabel.serve import PredictParams, predict, saved

        with stage_run("parabel-predict", args, outputs=[args.out]) as st:
            over = {k: st.params[k] for k in PredictParams.keys() if k in st.params}   # the rule's beam, topk
            params = _params(st)
            try:
                p = PredictParams.effective(saved(args.model), over)
            except (ValueError, TypeError) as e:
                raise StageError(f"predict parameters: {e}") from e
            st.params.update(p.to_dict())
            model = load(Path(args.model) / "omikuji", params.threads)
            X = io.load_csr(args.features)
            t0 = time.perf_counter()
            n_labels = io.read_table(args.label_table, ["label_id"]).num_rows
            scores = predict(args.model, X, n_labels, p, model)["scores"]
            st.predictions(args.out, scores, p.topk, time.perf_counter() - t0)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
