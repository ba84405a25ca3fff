"""X-Transformer rankers (§3.4) and the final score of Eq. 2.

The stage: trains the rankers on the matcher's outputs (:mod:`xmc_steps.xtransformer.ranker`), scores
the test documents by Eq. 2, or writes the validation table the defaults are chosen from (``select``).
What the rankers are and why each default: docs/methods/xtransformer.md.

CLI::

    python -m xmc_steps.stages.xtransformer train --tfidf X_train.npz X_valid.npz \\
        [--emb emb_train.npz emb_valid.npz] --labels Y_train.npz Y_valid.npz \\
        --clusters clusters_train.npz clusters_valid.npz [--linear lin_train.npz lin_valid.npz] \\
        --tree tree.npz [--guard guard.json] --out DIR --params JSON
    python -m xmc_steps.stages.xtransformer predict --model DIR --matcher-model model.safetensors \\
        --tfidf X_test.npz --emb emb_test.npz --clusters clusters_test.npz [--linear lin_test.npz] \\
        --out predictions.parquet --params JSON
    python -m xmc_steps.stages.xtransformer select --tfidf X_train.npz X_valid.npz --emb ... --labels ... \\
        --clusters ... --linear ... --matcher-model model.safetensors --tree tree.npz \\
        --out-csv T.csv --out-md T.md --out-json T.json --params JSON

``train --guard`` is the matcher's ``guard.json``: with ``candidates: matcher`` the rankers search
the matcher's top-b alone, and the stage fails unless the matcher beat the trivial baselines on
its own (:func:`xmc_steps.xtransformer.guard.alone_failure`; a matcher trained with ``allow_weak`` only
warns).  The matcher stage's guard also passes a matcher through the union with the linear tree,
which that mode never searches.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import io, resources
from ..cluster_tree import ClusterTree
from ..layout import GUARD, WEIGHTS
from ..negatives import binarize
from ..ranker import ranker_features
from ..search import expand_children, matcher_scores
from ..stage import StageError, add_common_args, cli_main, stage_run
from ..xtransformer.guard import check_guard
from ..xtransformer.ranker import (CANDIDATES, COMBINERS, XTransformerRankerParams, candidate_clusters, load, load_head,
                                   predict, predict_model, predict_params, ranker_bytes, save, train)


def _stack_csr(paths: list[str]) -> sp.csr_matrix:
    return sp.vstack([io.load_csr(p) for p in paths], format="csr")


def _stack_emb(paths: list[str] | None) -> np.ndarray | None:
    return np.vstack([io.load_arrays(p)["emb"] for p in paths]) if paths else None


def _params(st) -> XTransformerRankerParams:
    try:
        return XTransformerRankerParams.from_dict(st.params)
    except (TypeError, ValueError) as e:
        raise StageError(str(e)) from e


def _load_candidates(args, n_rows: int, splits: str) -> sp.csr_matrix:
    """The candidate clusters of the stacked ``--clusters`` / ``--linear`` files."""
    p = args.p
    G = _stack_csr(args.clusters) if args.clusters else None
    Lin = _stack_csr(args.linear) if args.linear else None
    for name, M in (("matcher clusters", G), ("linear clusters", Lin)):
        if M is not None and M.shape[0] != n_rows:
            raise StageError(f"{name} of {splits} have {M.shape[0]} rows, the features {n_rows}")
    return candidate_clusters(G, Lin, p.candidates, p.topb)


_RANKER_SETTING = ("xtransformer.ranker.ranker_input: tfidf (the neural block is N x d and adds d weights to every "
                   "label's ranker)")


def _train_cli(args) -> None:
    out = Path(args.out)
    with stage_run("xtransformer_ranker", args, outputs=[str(out)]) as st:
        p = args.p = _params(st)
        st.params.clear()
        st.params.update(p.to_dict())
        with st.timed("load"):
            X = _stack_csr(args.tfidf)
            Y = _stack_csr(args.labels)
            emb = _stack_emb(args.emb)
            C = ClusterTree.load(args.tree).label_to_cluster(-1)
        if X.shape[0] != Y.shape[0]:
            raise StageError(f"row counts differ: TF-IDF {X.shape[0]}, labels {Y.shape[0]}")
        check_guard(args.guard, p.candidates, st.log)
        M_hat = _load_candidates(args, X.shape[0], "the training splits")
        if M_hat.shape[1] != C.shape[1]:
            raise StageError(f"the candidate clusters have {M_hat.shape[1]} columns but the tree's finest level has {C.shape[1]}")
        d = 0 if emb is None or p.ranker_input == "tfidf" else int(emb.shape[1])
        resources.check_memory(f"{Y.shape[1]:,} rankers on {X.shape[0]:,} documents ({p.ranker_input})",
                               ranker_bytes(X.shape[0], X.nnz, d, Y.shape[1]), _RANKER_SETTING, st.log)
        Xr = ranker_features(X, emb, p.ranker_input, p.neural_weight)
        st.log.info("training %d rankers on %d instances x %d features (%s, %s negatives, MAN from the %s "
                    "candidates: %.1f clusters per instance)", Y.shape[1], Xr.shape[0], Xr.shape[1], p.ranker_input,
                    p.negatives, p.candidates, M_hat.nnz / max(M_hat.shape[0], 1))
        with st.timed("train"):
            W = train(Xr, Y, C, M_hat, p, progress=st.progress("rankers (clusters)", C.shape[1]))
        with io.atomic_dir(out) as tmp:
            save(tmp, W, C, p, {"n_features": int(Xr.shape[1]), "n_tfidf": int(X.shape[1]),
                                "n_neural": 0 if emb is None else int(emb.shape[1])})
        st.output("model", out)
        st.extra["model_paths"] = [str(out)]
        st.metric("ranker_nnz", W.nnz)
        st.metric("train_s", st.timings["train"])


def _predict_cli(args) -> None:
    with stage_run("xtransformer_predict", args, outputs=[args.out]) as st:
        model = load(args.model)
        overrides = dict(st.params)                     # the rule's settings
        try:
            p = predict_params(model[2], overrides)
        except ValueError as e:
            raise StageError(str(e)) from e
        args.p = p
        st.params.update(p.to_dict())
        X = _stack_csr(args.tfidf)
        emb = _stack_emb(args.emb)
        head = load_head(args.matcher_model)
        if emb is None:
            raise StageError("--emb (the matcher's embeddings) is needed for the matcher scores of Eq. 2")
        d = 0 if p.ranker_input == "tfidf" else int(emb.shape[1])
        resources.check_memory(f"the rankers' predictions of {X.shape[0]:,} documents ({p.ranker_input})",
                               ranker_bytes(X.shape[0], X.nnz, d, 0, p.topk),          # the weights are loaded
                               f"xtransformer's topk (predictions kept per document) or {_RANKER_SETTING}", st.log)
        G = _stack_csr(args.clusters) if args.clusters else None
        Lin = _stack_csr(args.linear) if args.linear else None
        for name, M in (("matcher clusters", G), ("linear clusters", Lin)):
            if M is not None and M.shape[0] != X.shape[0]:
                raise StageError(f"{name} of the test split have {M.shape[0]} rows, the features {X.shape[0]}")
        t0 = time.perf_counter()
        P, _, G = predict_model(args.model, X, emb, head, G, Lin, overrides, model)
        # the index + ranker part; the matcher's encoder time is in the matcher stage's record
        st.predictions(args.out, P, p.topk, time.perf_counter() - t0)
        st.metric("candidate_clusters_per_doc", G.nnz / max(G.shape[0], 1))


def _select_cli(args) -> None:
    """Train the rankers on ``train`` and score the ``valid`` split under every candidate set
    and combiner: the table the defaults are chosen from."""
    from .. import metrics

    outs = [args.out_csv, args.out_md, args.out_json]
    with stage_run("xtransformer_select", args, outputs=outs) as st:
        base = _params(st)
        st.params.clear()
        st.params.update(base.to_dict())
        with st.timed("load"):
            X = {s: io.load_csr(f) for s, f in zip(("train", "valid"), args.tfidf)}
            Y = {s: io.load_csr(f) for s, f in zip(("train", "valid"), args.labels)}
            emb = {s: io.load_arrays(f)["emb"] for s, f in zip(("train", "valid"), args.emb)}
            G = {s: io.load_csr(f) for s, f in zip(("train", "valid"), args.clusters)}
            Lin = {s: io.load_csr(f) for s, f in zip(("train", "valid"), args.linear)}
            C = ClusterTree.load(args.tree).label_to_cluster(-1)
            head = load_head(args.matcher_model)
        Xr = {s: ranker_features(X[s], emb[s], base.ranker_input, base.neural_weight) for s in X}
        rows = []
        trained: dict[bytes, tuple[sp.csr_matrix, float]] = {}   # MAN pattern -> rankers (K <= b: all the same)
        for cand in CANDIDATES:
            p = XTransformerRankerParams.from_dict({**base.to_dict(), "candidates": cand})
            M_hat = candidate_clusters(G["train"], Lin["train"], cand, p.topb)
            key = hashlib.sha1(M_hat.indptr.tobytes() + M_hat.indices.tobytes()).digest()
            if key not in trained:
                st.log.info("candidates %s: training %d cluster rankers on %d instances (%.1f clusters each)",
                            cand, C.shape[1], M_hat.shape[0], M_hat.nnz / max(M_hat.shape[0], 1))
                t0 = time.perf_counter()
                W = train(Xr["train"], Y["train"], C, M_hat, p, progress=st.progress(f"{cand}: rankers (clusters)", C.shape[1]))
                trained[key] = (W, time.perf_counter() - t0)
            W, train_s = trained[key]
            st.timings[f"train_{cand}"] = train_s
            cv = candidate_clusters(G["valid"], Lin["valid"], cand, p.topb)
            Gv = matcher_scores(cv, emb["valid"], head)
            truth = Y["valid"]
            cluster_recall = _cluster_recall(cv, truth, C)
            for comb in COMBINERS:
                p.combiner = comb
                P = predict(Xr["valid"], W, C, Gv, p)
                prec = metrics.precision(P, truth, 5)
                rec = metrics.recall(P, truth, 100)
                row = {"candidates": cand, "combiner": comb, "p_at_1": 100 * prec[0], "p_at_3": 100 * prec[2],
                       "p_at_5": 100 * prec[4], "recall_at_100": 100 * rec[99],
                       "candidate_clusters_per_doc": cv.nnz / max(cv.shape[0], 1),
                       "label_recall_of_candidates": 100 * cluster_recall,
                       "ranker_train_s": round(st.timings[f"train_{cand}"], 1)}
                rows.append(row)
                st.log.info("valid: candidates %-7s combiner %-7s P@1 %.2f P@3 %.2f P@5 %.2f R@100 %.2f",
                            cand, comb, row["p_at_1"], row["p_at_3"], row["p_at_5"], row["recall_at_100"])
        best = max(rows, key=lambda r: (r["p_at_1"], r["recall_at_100"]))
        write_table(rows, best, args.out_csv, args.out_md, args.out_json, st.args.dataset,
                    {"K": int(C.shape[1]), "L": int(C.shape[0]), "n_train": int(X["train"].shape[0]),
                     "n_valid": int(X["valid"].shape[0]), "params": base.to_dict()})
        for o, k in zip(outs, ("csv", "md", "json")):
            st.output(k, o)
        st.extra["best"] = best


def _cluster_recall(cand: sp.csr_matrix, Y: sp.csr_matrix, C: sp.csr_matrix) -> float:
    """The share of a document's positive labels inside its candidate clusters (mean over documents)."""
    inside = expand_children(cand, sp.csr_matrix(C))
    Yb = binarize(Y)
    hits = np.asarray(binarize(inside).multiply(Yb).sum(axis=1)).ravel()
    npos = np.asarray(Yb.sum(axis=1)).ravel()
    ok = npos > 0
    return float(np.mean(hits[ok] / npos[ok])) if ok.any() else 0.0


def write_table(rows: list[dict[str, Any]], best: dict[str, Any], csv_path: str, md_path: str, json_path: str,
                dataset: str, info: dict[str, Any]) -> None:
    """The validation table as CSV, Markdown and JSON (each written atomically)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    with io.atomic_path(csv_path) as tmp:
        df.to_csv(tmp, index=False, float_format="%.2f")
    lines = [f"# X-Transformer prediction settings on the validation split of {dataset or 'the dataset'}", "",
             f"Rankers fit on train only ({info['n_train']} documents), scored on valid ({info['n_valid']}); "
             f"K = {info['K']} clusters over L = {info['L']} labels; top-b = {info['params']['topb']} per source; "
             f"ranker input {info['params']['ranker_input']}, negatives {info['params']['negatives']} (MAN from the "
             "candidate set of the row).", "",
             "| candidates | combiner | P@1 | P@3 | P@5 | R@100 | clusters/doc | label recall of candidates |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **(best)**" if r is best else ""
        lines.append(f"| {r['candidates']} | {r['combiner']}{mark} | {r['p_at_1']:.2f} | {r['p_at_3']:.2f} | "
                     f"{r['p_at_5']:.2f} | {r['recall_at_100']:.2f} | {r['candidate_clusters_per_doc']:.1f} | "
                     f"{r['label_recall_of_candidates']:.2f} |")
    lines += ["", f"Best by P@1 (then R@100): candidates `{best['candidates']}`, combiner `{best['combiner']}`.", ""]
    tmp = Path(md_path).with_name(f".{Path(md_path).name}.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(md_path)
    io.write_json(json_path, {"dataset": dataset, **info, "rows": rows, "best": best})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.stages.xtransformer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = add_common_args(sub.add_parser("train", help="train the rankers"))
    t.add_argument("--tfidf", nargs="+", required=True)
    t.add_argument("--emb", nargs="+", default=None, help="matcher embeddings (needed for tfidf+neural)")
    t.add_argument("--labels", nargs="+", required=True)
    t.add_argument("--clusters", nargs="+", default=None, help="the matcher's top-b cluster scores (MAN)")
    t.add_argument("--linear", nargs="+", default=None, help="the linear tree's top-b clusters (MAN of the union)")
    t.add_argument("--tree", required=True, help="cluster tree; its finest level is the matcher's K clusters")
    t.add_argument("--guard", default=None, help=f"the matcher's {GUARD}: with candidates: matcher, the matcher "
                                                 "must beat the trivial baselines on its own")
    t.add_argument("--out", required=True)
    q = add_common_args(sub.add_parser("predict", help="Eq. 2 scores of the test documents"))
    q.add_argument("--model", required=True)
    q.add_argument("--matcher-model", required=True, help=f"the matcher's {WEIGHTS} (its head gives g)")
    q.add_argument("--tfidf", nargs="+", required=True)
    q.add_argument("--emb", nargs="+", required=True, help="the matcher's embeddings of the documents")
    q.add_argument("--clusters", nargs="+", default=None)
    q.add_argument("--linear", nargs="+", default=None)
    q.add_argument("--out", required=True)
    v = add_common_args(sub.add_parser("select", help="the validation table of candidate sets x combiners"))
    for name in ("tfidf", "emb", "labels", "clusters", "linear"):
        v.add_argument(f"--{name}", nargs=2, required=True, metavar=("TRAIN", "VALID"))
    v.add_argument("--matcher-model", required=True)
    v.add_argument("--tree", required=True)
    v.add_argument("--out-csv", required=True)
    v.add_argument("--out-md", required=True)
    v.add_argument("--out-json", required=True)
    args = ap.parse_args(argv)
    {"train": _train_cli, "predict": _predict_cli, "select": _select_cli}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
