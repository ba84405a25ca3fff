"""ELIAS++ (§3.5) stage: train the sparse ranker over ELIAS's top predictions, fit the score
calibration, predict (the method: :mod:`xmc_steps.elias_plus`).

CLI::

    python -m xmc_steps.stages.elias_plus train --tfidf X_train.npz [..] --emb emb_train.npz [..] \\
        --labels Y_train.npz [..] --candidates elias_train.parquet [..] --out DIR --params JSON
    python -m xmc_steps.stages.elias_plus calibrate --model DIR --tfidf X_valid.npz --emb emb_valid.npz \\
        --labels Y_valid.npz --candidates elias_valid.parquet --out DIR_CAL [--valid-out pred_valid.parquet] \\
        --params JSON
    python -m xmc_steps.stages.elias_plus predict --model DIR [--calibration DIR_CAL] --tfidf X_test.npz \\
        --emb emb_test.npz --candidates elias_test.parquet --out predictions.parquet --params JSON
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from .. import elias_plus, io
from ..elias_plus import FORMAT, EliasPlusParams
from ..errors import StageError
from ..ranker import ranker_features
from ..search import topk_per_row
from ..stage import add_common_args, cli_main, stage_run


def _stack_csr(paths):
    return sp.vstack([io.load_csr(p) for p in paths], format="csr")


def _stack_emb(paths):
    return np.vstack([io.load_arrays(p)["emb"] for p in paths])


def _stack_pred(paths, L):
    return sp.vstack([io.read_predictions(p, L) for p in paths], format="csr")


def _params(st) -> EliasPlusParams:
    try:
        return EliasPlusParams.from_dict(st.params)
    except (TypeError, ValueError) as e:
        raise StageError(str(e)) from e


def _inputs(args, st, p, L):
    X = _stack_csr(args.tfidf)
    E = _stack_emb(args.emb)
    Xr = ranker_features(X, E, "tfidf+neural", p.neural_weight)
    cand = elias_plus.candidates(_stack_pred(args.candidates, L), p.n_candidates)
    if cand.shape[0] != Xr.shape[0]:
        raise StageError(f"{sum(1 for _ in args.candidates)} candidate table(s) hold {cand.shape[0]} rows "
                         f"but the features {Xr.shape[0]}")
    return Xr, cand


def _train_cli(args) -> None:
    out = Path(args.out)
    with stage_run("elias_plus_ranker", args, outputs=[str(out)]) as st:
        p = _params(st)
        st.params.clear()
        st.params.update(p.to_dict())
        Y = _stack_csr(args.labels)
        L = Y.shape[1]
        Xr, cand = _inputs(args, st, p, L)
        st.log.info("sparse ranker: %d labels, %d instances x %d features, %d candidates (%.1f per row)",
                    L, Xr.shape[0], Xr.shape[1], cand.nnz, cand.nnz / max(1, cand.shape[0]))
        with st.timed("train"):
            W = elias_plus.train(Xr, Y, cand, p, progress=st.progress("rankers (labels)", L))
        with io.atomic_dir(out) as tmp:
            io.save_csr(tmp / "W.npz", W)
            io.save_arrays(tmp / "label_freq.npz", freq=np.asarray(Y.sum(axis=0)).ravel().astype(np.int64))
            io.write_json(tmp / "ranker.json", {"format": FORMAT, "params": p.to_dict(), "n_features": int(Xr.shape[1]),
                                               "n_labels": int(L)})
        st.output("model", out)
        st.extra["model_paths"] = [str(out)]
        st.metric("ranker_nnz", W.nnz)


def _calibrate_cli(args) -> None:
    out = Path(args.out)
    with stage_run("elias_plus_calibrate", args, outputs=[str(out)] + ([args.valid_out] if args.valid_out else [])) as st:
        W, meta = elias_plus.load_ranker(args.model)
        p = EliasPlusParams.from_dict({**EliasPlusParams.upgrade(meta["params"]),
                                       **{k: v for k, v in st.params.items() if k in elias_plus.FIT_KEYS}})
        L = meta["n_labels"]
        Y = _stack_csr(args.labels)
        Xr, cand = _inputs(args, st, p, L)
        rows = elias_plus.calibration_rows(Xr.shape[0], p.calibrate_docs, p.seed)
        freq = elias_plus.label_train_freq(args.model)
        # the ranker's margins, once: of every row where they are all needed, else of the calibration's rows
        h_all = elias_plus.ranker_scores(Xr, W, cand, p.solver.bias) if args.valid_out or rows is None else None
        cand_all, h = cand, h_all
        if rows is not None:
            st.log.info("calibration on %d of the %d validation documents (calibrate_docs, seed %d)",
                        len(rows), Xr.shape[0], p.seed)
            Xr, cand, Y = Xr[rows], cand[rows], Y[rows]
            h = (elias_plus.candidate_rows(cand_all, h_all, rows)[1].astype(h_all.dtype) if h_all is not None
                 else elias_plus.ranker_scores(Xr, W, cand, p.solver.bias))
        st.metric("n_fit_docs", Xr.shape[0])
        what, section = {"dual-encoder": ("the dual encoder's ranker", "dual_encoder.ranker")}.get(
            args.method, ("ELIAS++'s ranker", "elias.plus"))
        oof: dict = {}
        with st.timed("fit"):
            c, choice = elias_plus.select(cand, h, Y, p, freq, what, section, st.log, out_of_fold=oof)
        if args.valid_out:
            _write_valid(args.valid_out, st, c, cand_all, h_all, rows, oof["scores"], p, freq)
        record = choice.record()
        with io.atomic_dir(out) as tmp:
            elias_plus.save_combination(tmp, c, {"max_depth": p.max_depth, "calibrate_top": p.calibrate_top,
                                                 "n_fit_docs": int(Xr.shape[0]), "second_stage": record,
                                                 "features": ["ranker_margin", "first_model_score",
                                                              "label_train_freq"]})
        st.output("calibration", out)
        st.extra["model_paths"] = [str(out)]
        st.extra["second_stage"] = record
        if c.n_fit:
            st.metric("n_fit_candidates", c.n_fit)
            st.metric("fit_positive_rate", c.positives / c.n_fit)
        st.params["combine_chosen"] = c.name
        st.metric("second_stage_switched_off", float(choice.switched_off))
        for side in ("input", "chosen"):
            for k, v in record["valid"][side].items():
                st.metric(f"valid_{side}_{k}", v)


def _write_valid(path: str, st, c, cand: sp.csr_matrix, h: np.ndarray, rows: np.ndarray | None,
                 oof: sp.csr_matrix, p, freq: np.ndarray) -> None:
    """Every validation document's scores under the kept combination, none scored by a fit that saw its
    labels: the calibration's rows out of fold (:func:`elias_plus.select`), the others (``calibrate_docs``
    left them out) by the combination fit on all the calibration's rows."""
    P = sp.csr_matrix(oof)
    if rows is not None:    # stacked, then put back in row order (explicit zero scores stay ranked)
        rest = np.setdiff1d(np.arange(cand.shape[0]), rows)
        R = topk_per_row(elias_plus.combination_scores(c, *elias_plus.candidate_rows(cand, h, rest), p, freq), p.topk)
        P = sp.vstack([P, R], format="csr")[np.argsort(np.concatenate([rows, rest]))]
    io.write_predictions(path, P, p.topk)
    st.output("valid_predictions", path)


def _predict_cli(args) -> None:
    with stage_run("elias_plus_predict", args, outputs=[args.out]) as st:
        try:
            L = io.read_json(Path(args.model) / "ranker.json")["n_labels"]
        except (OSError, ValueError, KeyError) as e:
            raise StageError(f"--model {args.model}: not an ELIAS++ ranker ({e})") from e
        X, E, P = _stack_csr(args.tfidf), _stack_emb(args.emb), _stack_pred(args.candidates, L)
        t0 = time.perf_counter()
        out, p = elias_plus.predict(args.model, X, E, P, st.params, args.calibration)
        st.predictions(args.out, out, p.topk, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.stages.elias_plus", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "calibrate", "predict"):
        q = add_common_args(sub.add_parser(name))
        q.add_argument("--tfidf", nargs="+", required=True)
        q.add_argument("--emb", nargs="+", required=True)
        q.add_argument("--candidates", nargs="+", required=True, help="ELIAS prediction tables (top-K)")
        q.add_argument("--out", required=True)
        if name != "predict":
            q.add_argument("--labels", nargs="+", required=True)
        if name != "train":
            q.add_argument("--model", required=True)
        if name == "predict":
            q.add_argument("--calibration", default=None)
        if name == "calibrate":
            q.add_argument("--valid-out", default=None,
                           help="a prediction table: every validation document scored by the kept combination out "
                                "of fold (what an ensemble of these models chooses on)")
    args = ap.parse_args(argv)
    {"train": _train_cli, "calibrate": _calibrate_cli, "predict": _predict_cli}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
