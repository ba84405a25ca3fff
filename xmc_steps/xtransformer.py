"""X-Transformer rankers (§3.4) and the final score of Eq. 2.

The matcher (:mod:`xmc_steps.matcher`) maps a text to the top-``b`` of ``K`` label
clusters and gives the instance embedding ``phi_neural``; this module trains the linear
one-vs-all rankers ``h(x, l) = w_l^T phi(x)`` and combines both:

* ranker input ``phi(x)``: ``phi_tfidf(x)`` alone (``ranker_input: tfidf``, Table 5 row 0)
  or ``phi_tfidf(x) ⊕ phi_neural(x)`` (``tfidf+neural``); each block is L2-normalised
  and the neural block is scaled by ``neural_weight`` (1 by default: blocks of equal norm);
* negatives (:mod:`xmc_steps.negatives`): TFN = ``Y C`` (instances with a positive in
  the label's cluster), MAN = the matcher's top-``b`` clusters on the training data
  (``M_hat``), or TFN+MAN (``M' = YC + M_hat``);
* the solver is the foundation's :func:`xmc_steps.ranker.train_rankers` (L2-regularised
  squared hinge, weights below ``threshold`` dropped), one per label;
* prediction (Eq. 2): labels outside the matcher's top-``b`` clusters get no score
  (the paper's ``-inf``); inside, ``f(x, l) = sigma(g(x, c_l), h(x, l))`` with the
  combiner ``sigma`` chosen by ``combiner``:

  - ``ranker`` (default): ``T(h)``; the matcher decides which clusters are searched
    (labels outside them are ``-inf``), the ranker orders the labels inside;
  - ``product``: ``T(g) * T(h)``, the product of the transformed matcher and ranker
    scores, as the XR-Linear beam search scores a path;
  - ``mean``: ``(T(g) + T(h)) / 2``;

  where ``T`` is ``transform`` (l3-hinge ``exp(-max(0, 1 - z)^3)`` by default: both the
  matcher (Eq. 3) and the rankers are squared-hinge models, whose margin is 1).  The
  paper leaves sigma open ("a non-linear activation function to combine the final
  scores").  We default to ``ranker``: on the debtags *validation* split (rankers fit
  on train only, MiniLM matcher over 64 clusters) it gave P@1 92.9 against 91.8 for
  ``product`` and 92.3 for ``mean`` — the fine-tuned matcher's squared-hinge scores are
  over-confident, and multiplying them in demotes good labels of a runner-up cluster.

CLI::

    python -m xmc_steps.xtransformer train --tfidf X_train.npz X_valid.npz \\
        [--emb emb_train.npz emb_valid.npz] --labels Y_train.npz Y_valid.npz \\
        --clusters clusters_train.npz clusters_valid.npz --tree tree.npz --out DIR --params JSON
    python -m xmc_steps.xtransformer predict --model DIR --tfidf X_test.npz [--emb emb_test.npz] \\
        --clusters clusters_test.npz --out predictions.parquet --params JSON
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.preprocessing import normalize

from . import io
from .cluster import ClusterTree
from .negatives import combine
from .params import Params
from .ranker import RankerParams, append_bias, train_rankers
from .stage import StageError, add_common_args, cli_main, stage_run
from .xr_linear import TRANSFORMS, expand_children, masked_product, topk_per_row, transform

FORMAT = "xmc-xtransformer-ranker-v1"
COMBINERS = ("product", "ranker", "mean")
RANKER_INPUTS = ("tfidf", "tfidf+neural")


@dataclass
class XTransformerRankerParams(Params):
    ranker_input: str = "tfidf+neural"
    neural_weight: float = 1.0
    negatives: str = "tfn+man"
    C: float = 1.0
    threshold: float = 0.1
    tol: float = 0.1
    max_iter: int = 100
    bias: float = 1.0
    threads: int = 1
    seed: int = 0
    topb: int = 10                 # matcher clusters searched at prediction time
    topk: int = 100
    combiner: str = "ranker"
    transform: str = "l3-hinge"

    def __post_init__(self) -> None:
        if self.ranker_input not in RANKER_INPUTS:
            raise ValueError(f"ranker_input must be one of {RANKER_INPUTS}, got {self.ranker_input!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")
        self.ranker()  # validates the solver settings and the negatives

    _what = "xtransformer ranker parameter"

    def ranker(self) -> RankerParams:
        return RankerParams(**self.pick(RankerParams))


def ranker_features(X_tfidf: sp.spmatrix, emb: np.ndarray | None, ranker_input: str, neural_weight: float = 1.0) -> sp.csr_matrix:
    """``phi_tfidf ⊕ phi_neural`` (each block L2-normalised) or ``phi_tfidf`` alone."""
    X = normalize(sp.csr_matrix(X_tfidf, dtype=np.float32))
    if ranker_input == "tfidf":
        return X
    if emb is None:
        raise StageError("ranker_input tfidf+neural needs the matcher's embeddings (--emb)")
    if emb.shape[0] != X.shape[0]:
        raise StageError(f"embeddings have {emb.shape[0]} rows but TF-IDF has {X.shape[0]}")
    E = normalize(np.asarray(emb, dtype=np.float32)) * np.float32(neural_weight)
    out = sp.hstack([X, sp.csr_matrix(E)], format="csr", dtype=np.float32)
    out.sort_indices()
    return out


def train(Xr: sp.csr_matrix, Y: sp.csr_matrix, C: sp.csr_matrix, M_hat: sp.csr_matrix | None,
          params: XTransformerRankerParams, progress=None) -> sp.csr_matrix:
    """Rankers ``W`` ((d+1) x L) with the configured negatives; ``C`` is L x K, 0/1."""
    C = sp.csr_matrix(C)
    cluster_of_label = np.asarray(C.argmax(axis=1)).ravel()
    mask = combine(params.negatives, Y, C, M_hat)
    return train_rankers(Xr, Y, cluster_of_label, mask, params.ranker(), progress=progress)


def predict(Xr: sp.csr_matrix, W: sp.spmatrix, C: sp.csr_matrix, matcher_scores: sp.csr_matrix,
            params: XTransformerRankerParams) -> sp.csr_matrix:
    """Eq. 2: scores of the labels inside the matcher's top-``b`` clusters (top-k per row)."""
    g = topk_per_row(sp.csr_matrix(matcher_scores, dtype=np.float32), params.topb)
    g.data = transform(g.data, params.transform)
    g.eliminate_zeros()
    cand = expand_children(g, sp.csr_matrix(C))          # N x L, data = T(g(x, c_l))
    Xa = append_bias(Xr, params.bias)
    h = transform(masked_product(Xa, sp.csc_matrix(W), cand), params.transform)
    out = cand.copy()
    if params.combiner == "product":
        out.data = (cand.data * h).astype(np.float32)
    elif params.combiner == "ranker":
        out.data = h.astype(np.float32)
    else:
        out.data = (0.5 * (cand.data + h)).astype(np.float32)
    return topk_per_row(out, params.topk)


def save(folder: Path, W: sp.spmatrix, C: sp.spmatrix, params: XTransformerRankerParams, meta: dict[str, Any]) -> None:
    io.save_csr(folder / "W.npz", W)
    io.save_csr(folder / "C.npz", C)
    io.write_json(folder / "ranker.json", {"format": FORMAT, "params": params.to_dict(), **meta})


def load(folder: str | Path) -> tuple[sp.csr_matrix, sp.csr_matrix, XTransformerRankerParams, dict[str, Any]]:
    folder = Path(folder)
    meta = io.read_json(folder / "ranker.json")
    if meta.get("format") != FORMAT:
        raise StageError(f"{folder}: not an X-Transformer ranker (format {meta.get('format')!r})")
    return io.load_csr(folder / "W.npz"), io.load_csr(folder / "C.npz"), XTransformerRankerParams.from_dict(meta["params"]), meta


def _stack_csr(paths: list[str]) -> sp.csr_matrix:
    return sp.vstack([io.load_csr(p) for p in paths], format="csr")


def _stack_emb(paths: list[str] | None) -> np.ndarray | None:
    return np.vstack([io.load_arrays(p)["emb"] for p in paths]) if paths else None


def _params(st) -> XTransformerRankerParams:
    try:
        return XTransformerRankerParams.from_dict(st.params)
    except (TypeError, ValueError) as e:
        raise StageError(str(e)) from e


def _train_cli(args) -> None:
    out = Path(args.out)
    with stage_run("xtransformer_ranker", args, outputs=[str(out)]) as st:
        p = _params(st)
        st.params.clear()
        st.params.update(p.to_dict())
        with st.timed("load"):
            X = _stack_csr(args.tfidf)
            Y = _stack_csr(args.labels)
            M_hat = _stack_csr(args.clusters)
            emb = _stack_emb(args.emb)
            C = ClusterTree.load(args.tree).label_to_cluster(-1)
        if not (X.shape[0] == Y.shape[0] == M_hat.shape[0]):
            raise StageError(f"row counts differ: TF-IDF {X.shape[0]}, labels {Y.shape[0]}, matcher clusters {M_hat.shape[0]}")
        if M_hat.shape[1] != C.shape[1]:
            raise StageError(f"the matcher predicts {M_hat.shape[1]} clusters but the tree's finest level has {C.shape[1]}")
        Xr = ranker_features(X, emb, p.ranker_input, p.neural_weight)
        st.log.info("training %d rankers on %d instances x %d features (%s, %s negatives)",
                    Y.shape[1], Xr.shape[0], Xr.shape[1], p.ranker_input, p.negatives)
        every = max(1, C.shape[1] // 10)
        prog = lambda d, n: st.log.info("rankers: %d/%d clusters", d, n) if d % every == 0 or d == n else None  # noqa: E731
        with st.timed("train"):
            W = train(Xr, Y, C, M_hat, p, progress=prog)
        tmp = out.parent / f".{out.name}.tmp"
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save(tmp, W, C, p, {"n_features": int(Xr.shape[1]), "n_tfidf": int(X.shape[1]),
                            "n_neural": 0 if emb is None else int(emb.shape[1])})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        st.output("model", out)
        st.extra["model_paths"] = [str(out)]
        st.metric("ranker_nnz", W.nnz)
        st.metric("train_s", st.timings["train"])


def _predict_cli(args) -> None:
    with stage_run("xtransformer_predict", args, outputs=[args.out]) as st:
        W, C, p, meta = load(args.model)
        for k, v in st.params.items():          # prediction-time settings may be overridden
            if k in ("topb", "topk", "combiner", "transform"):
                setattr(p, k, v)
        p.__post_init__()
        st.params.update(p.to_dict())
        X = _stack_csr(args.tfidf)
        emb = _stack_emb(args.emb)
        G = _stack_csr(args.clusters)
        Xr = ranker_features(X, emb, p.ranker_input, p.neural_weight)
        if Xr.shape[1] != meta["n_features"]:
            raise StageError(f"features have {Xr.shape[1]} columns, the rankers expect {meta['n_features']}")
        t0 = time.perf_counter()
        P = predict(Xr, W, C, G, p)
        # the ranker part only; the matcher's encoder time is in the matcher stage's record
        st.predictions(args.out, P, p.topk, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.xtransformer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = add_common_args(sub.add_parser("train", help="train the rankers"))
    t.add_argument("--tfidf", nargs="+", required=True)
    t.add_argument("--emb", nargs="+", default=None, help="matcher embeddings (needed for tfidf+neural)")
    t.add_argument("--labels", nargs="+", required=True)
    t.add_argument("--clusters", nargs="+", required=True, help="the matcher's top-b cluster scores (MAN)")
    t.add_argument("--tree", required=True, help="cluster tree; its finest level is the matcher's K clusters")
    t.add_argument("--out", required=True)
    q = add_common_args(sub.add_parser("predict", help="Eq. 2 scores of the test documents"))
    q.add_argument("--model", required=True)
    q.add_argument("--tfidf", nargs="+", required=True)
    q.add_argument("--emb", nargs="+", default=None)
    q.add_argument("--clusters", nargs="+", required=True)
    q.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    (_train_cli if args.cmd == "train" else _predict_cli)(args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
