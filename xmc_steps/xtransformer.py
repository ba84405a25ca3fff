"""X-Transformer rankers (§3.4) and the final score of Eq. 2.

The matcher (:mod:`xmc_steps.matcher`) maps a text to the top-``b`` of ``K`` label
clusters and gives the instance embedding ``phi_neural``; this module trains the linear
one-vs-all rankers ``h(x, l) = w_l^T phi(x)`` and combines both:

* ranker input ``phi(x)``: ``phi_tfidf(x)`` alone (``ranker_input: tfidf``, Table 5 row 0)
  or ``phi_tfidf(x) ⊕ phi_neural(x)`` (``tfidf+neural``); each block is L2-normalised
  and the neural block is scaled by ``neural_weight`` (1 by default: blocks of equal norm);
* candidate clusters (``candidates``, :func:`candidate_clusters`): the clusters Eq. 2
  searches for a document —

  - ``matcher``: the matcher's top-``b`` (the paper: labels outside them are ``-inf``);
  - ``union`` (default): the matcher's top-``b`` together with the top-``b`` of the
    linear tree's beam over the same clusters (XR-Linear over the matcher's tree,
    ``python -m xmc_steps.xr_linear clusters``).  *An addition the paper lacks*: a
    matcher that misses a document's clusters can then cost no recall that the
    linear path would have had, whatever the matcher learnt.  XR-Transformer, the
    paper's successor, likewise ranks with a linear model on ``TF-IDF ⊕ neural``
    features over its whole tree rather than inside the matcher's clusters only;
  - ``linear``: the linear tree's top-``b`` alone (a reference row);

* negatives (:mod:`xmc_steps.negatives`): TFN = ``Y C`` (instances with a positive in
  the label's cluster), MAN = the candidate clusters on the training data (``M_hat``:
  the matcher's top-``b``, as the paper, or the union), or TFN+MAN (``M' = YC + M_hat``);
  the rankers are trained on the negatives of the clusters they will be asked about;
* the solver is the foundation's :func:`xmc_steps.ranker.train_rankers` (L2-regularised
  squared hinge, weights below ``threshold`` dropped), one per label;
* prediction (Eq. 2): labels outside the candidate clusters get no score; inside,
  ``f(x, l) = sigma(g(x, c_l), h(x, l))`` with ``g`` the matcher's score of the label's
  cluster (:func:`matcher_scores`: ``w_k . phi(x)`` from the matcher's head and the
  stored embeddings, so linear-only candidates have a matcher score too) and the
  combiner ``sigma`` chosen by ``combiner``:

  - ``product`` (default): ``T(g) * T(h)``, as the XR-Linear beam search scores a path;
  - ``ranker``: ``T(h)``; the candidates decide which clusters are searched, the ranker
    orders the labels inside;
  - ``mean``: ``(T(g) + T(h)) / 2``;

  where ``T`` is ``transform`` (l3-hinge ``exp(-max(0, 1 - z)^3)`` by default: both the
  matcher (Eq. 3) and the rankers are squared-hinge models, whose margin is 1), floored
  at ``1e-30`` so that no candidate underflows to a dropped zero.  The paper leaves sigma
  open ("a non-linear activation function to combine the final scores").

Both defaults are chosen on the validation split: ``python -m xmc_steps.xtransformer
select`` (the ``xtransformer-selection`` target) fits the rankers on train and writes the
table of every candidate set x combiner on valid to
``results/<dataset>/xtransformer-selection.{md,csv,json}``, so the choice can be
regenerated on any dataset.  The tables of the default config at dc5879b (2-core CPU,
2026-11-28), union candidates, valid P@1 / R@100:

=========================  =============  =============  =============
dataset (K clusters)       product        ranker         mean
=========================  =============  =============  =============
debtags (8)                92.61 / 97.23  92.74 / 96.73  92.65 / 95.34
reuters-all5 (4)           97.69 / 98.77  97.43 / 98.73  97.69 / 98.59
yso-finna-sv-50k (256)     19.88 / 31.45  18.92 / 31.01  19.52 / 28.16
=========================  =============  =============  =============

``product`` has the best mean P@1 over the three (70.06 against 69.70 for ``ranker``), is
ahead on the one set where the gap is larger than a handful of documents (yso: +0.96 P@1,
+0.46 P@3, +0.28 P@5, +0.44 R@100) and has the best R@100 on all three; ``ranker``
leads on debtags by 3 of 2,423 documents.  ``ranker`` was the default until then, chosen
on the debtags table of the first X-Transformer stop (older matcher and candidates: 92.86
against 91.79).  On test the switch moved P@1 / R@100 from 92.69 / 97.03 to 92.79 / 97.51
(debtags), 97.12 / 99.02 to 97.25 / 98.49 (reuters-all5) and 18.05 / 27.97 to 18.17 / 28.33
(yso-finna-sv-50k), the same rankers.  Union candidates lead the paper's matcher-only ones on yso (19.88 against 16.58
P@1, 31.45 against 23.01 R@100) and equal them where K <= b (debtags, reuters).

CLI::

    python -m xmc_steps.xtransformer train --tfidf X_train.npz X_valid.npz \\
        [--emb emb_train.npz emb_valid.npz] --labels Y_train.npz Y_valid.npz \\
        --clusters clusters_train.npz clusters_valid.npz [--linear lin_train.npz lin_valid.npz] \\
        --tree tree.npz [--guard guard.json] --out DIR --params JSON
    python -m xmc_steps.xtransformer predict --model DIR --matcher-model model.safetensors \\
        --tfidf X_test.npz --emb emb_test.npz --clusters clusters_test.npz [--linear lin_test.npz] \\
        --out predictions.parquet --params JSON
    python -m xmc_steps.xtransformer select --tfidf X_train.npz X_valid.npz --emb ... --labels ... \\
        --clusters ... --linear ... --matcher-model model.safetensors --tree tree.npz \\
        --out-csv T.csv --out-md T.md --out-json T.json --params JSON

``train --guard`` is the matcher's ``guard.json``: with ``candidates: matcher`` the rankers search
the matcher's top-b alone, and the stage fails unless the matcher beat the trivial baselines on
its own (:func:`xmc_steps.matcher.alone_failure`; a matcher trained with ``allow_weak`` only
warns).  The matcher stage's guard also passes a matcher through the union with the linear tree,
which that mode never searches.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from . import io, resources
from .cluster_tree import ClusterTree
from .negatives import binarize, check_kind, combine
from .params import Params
from .ranker import SOLVER_MOVED, RankerParams, append_bias, ranker_features, train_rankers
from .search import SCORE_FLOOR, TRANSFORMS, expand_children, masked_product, matcher_scores, topk_per_row, transform
from .stage import StageError, add_common_args, cli_main, stage_run

FORMAT = "xmc-xtransformer-ranker-v1"
COMBINERS = ("product", "ranker", "mean")
RANKER_INPUTS = ("tfidf", "tfidf+neural")
CANDIDATES = ("matcher", "union", "linear")


@dataclass
class XTransformerRankerParams(Params):
    """The rankers of Eq. 2 (the ``xtransformer.ranker`` section): their input and negatives, the
    candidate clusters and combiner at prediction, and the solver (:class:`RankerParams`,
    ``xtransformer.ranker.solver``)."""

    ranker_input: str = "tfidf+neural"
    neural_weight: float = 1.0
    negatives: str = "tfn+man"     # tfn | man | tfn+man: the instances each cluster's rankers train on
    topb: int = 10                 # clusters taken from each candidate source
    topk: int = 100
    candidates: str = "union"      # matcher (the paper) | union (matcher top-b + linear tree beam) | linear
    combiner: str = "product"
    transform: str = "l3-hinge"
    threads: int = 1               # clusters trained in parallel (the stage's --threads)
    solver: RankerParams = field(default_factory=RankerParams)

    def __post_init__(self) -> None:
        if self.ranker_input not in RANKER_INPUTS:
            raise ValueError(f"ranker_input must be one of {RANKER_INPUTS}, got {self.ranker_input!r}")
        check_kind(self.negatives)
        if self.combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.candidates not in CANDIDATES:
            raise ValueError(f"candidates must be one of {CANDIDATES}, got {self.candidates!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    _what = "xtransformer ranker parameter"
    _moved = SOLVER_MOVED


def candidate_clusters(matcher_top: sp.spmatrix | None, linear_top: sp.spmatrix | None, candidates: str,
                       topb: int) -> sp.csr_matrix:
    """The clusters searched per document (0/1 CSR ``N x K``): the top-``b`` of the matcher, of
    the linear tree's beam, or their union."""
    parts = []
    if candidates in ("matcher", "union"):
        if matcher_top is None:
            raise StageError(f"candidates {candidates!r} need the matcher's clusters")
        parts.append(binarize(topk_per_row(sp.csr_matrix(matcher_top, dtype=np.float32), topb)))
    if candidates in ("linear", "union"):
        if linear_top is None:
            raise StageError(f"candidates {candidates!r} need the linear tree's clusters (--linear)")
        parts.append(binarize(topk_per_row(sp.csr_matrix(linear_top, dtype=np.float32), topb)))
    if len(parts) == 2 and parts[0].shape != parts[1].shape:
        raise StageError(f"matcher clusters {parts[0].shape} and linear clusters {parts[1].shape} differ in shape")
    out = binarize(parts[0] + parts[1]) if len(parts) == 2 else parts[0]
    out.sort_indices()
    return out


def train(Xr: sp.csr_matrix, Y: sp.csr_matrix, C: sp.csr_matrix, M_hat: sp.csr_matrix | None,
          params: XTransformerRankerParams, progress=None) -> sp.csr_matrix:
    """Rankers ``W`` ((d+1) x L) with the configured negatives; ``C`` is L x K, 0/1.

    ``M_hat`` is the MAN source: the clusters searched at prediction time on the training
    documents (:func:`candidate_clusters`)."""
    C = sp.csr_matrix(C)
    cluster_of_label = np.asarray(C.argmax(axis=1)).ravel()
    mask = combine(params.negatives, Y, C, M_hat)
    return train_rankers(Xr, Y, cluster_of_label, mask, params.solver, progress=progress, threads=params.threads)


def predict(Xr: sp.csr_matrix, W: sp.spmatrix, C: sp.csr_matrix, G: sp.csr_matrix,
            params: XTransformerRankerParams, batch_entries: int = 1 << 20) -> sp.csr_matrix:
    """Eq. 2 over the candidate clusters: ``G`` holds the matcher's raw scores ``g(x, k)`` at
    every candidate cluster (:func:`candidate_clusters`, :func:`matcher_scores`); labels of
    other clusters get no score.  Top-``topk`` per row.

    Rows go in blocks of about ``batch_entries`` candidate labels, so the candidate matrix of
    the whole split (at Wiki-500K about 10^9 entries) never exists at once; smaller blocks are
    also faster (yso-finna-sv-50k, 2,000 documents: 3.3-3.8 ms/document at 2^18-2^20 against
    5.4-5.9 at 2^22)."""
    G = sp.csr_matrix(G, dtype=np.float32)
    C = sp.csr_matrix(C)
    Wc = sp.csc_matrix(W)
    Xa = append_bias(Xr, params.solver.bias)
    n = G.shape[0]
    # labels per candidate row: the sizes of its candidate clusters
    per_row = np.asarray(G.astype(bool).astype(np.float32) @ np.asarray(C.sum(axis=0), np.float32).ravel()).ravel()
    cum = np.concatenate([[0.0], np.cumsum(per_row)])
    cuts = np.searchsorted(cum, np.arange(batch_entries, cum[-1], batch_entries))
    bounds = np.unique(np.concatenate([[0], cuts, [n]]).astype(np.int64))
    parts = [_predict_block(Xa[r0:r1], Wc, C, G[r0:r1], params) for r0, r1 in zip(bounds[:-1], bounds[1:])]
    if not parts:
        return sp.csr_matrix((n, C.shape[0]), dtype=np.float32)
    return sp.vstack(parts, format="csr")


def _predict_block(Xa: sp.csr_matrix, Wc: sp.csc_matrix, C: sp.csr_matrix, G: sp.csr_matrix,
                   params: XTransformerRankerParams) -> sp.csr_matrix:
    g = G.copy()
    g.data = np.maximum(transform(g.data, params.transform), SCORE_FLOOR)
    cand = expand_children(g, C)                          # rows x L, data = T(g(x, c_l))
    h = np.maximum(transform(masked_product(Xa, Wc, cand), params.transform), SCORE_FLOOR)
    out = cand.copy()
    if params.combiner == "product":
        out.data = np.maximum(cand.data * h, SCORE_FLOOR).astype(np.float32)
    elif params.combiner == "ranker":
        out.data = h.astype(np.float32)
    else:
        out.data = (0.5 * (cand.data + h)).astype(np.float32)
    return topk_per_row(out, params.topk)


def load_head(matcher_model: str | Path) -> np.ndarray:
    """The matcher's head ``W`` (``K x d``, float32) from its ``model.safetensors``."""
    from safetensors import safe_open

    try:
        with safe_open(str(matcher_model), framework="numpy") as f:
            return np.asarray(f.get_tensor("head.weight"), dtype=np.float32)
    except (OSError, KeyError, ValueError) as e:
        raise StageError(f"{matcher_model}: cannot read the matcher head 'head.weight' ({e})") from e


def save(folder: Path, W: sp.spmatrix, C: sp.spmatrix, params: XTransformerRankerParams, meta: dict[str, Any]) -> None:
    io.save_csr(folder / "W.npz", W)
    io.save_csr(folder / "C.npz", C)
    io.write_json(folder / "ranker.json", {"format": FORMAT, "params": params.to_dict(), **meta})


def load(folder: str | Path) -> tuple[sp.csc_matrix, sp.csr_matrix, XTransformerRankerParams, dict[str, Any]]:
    folder = Path(folder)
    meta = io.read_json(folder / "ranker.json")
    if meta.get("format") != FORMAT:
        raise StageError(f"{folder}: not an X-Transformer ranker (format {meta.get('format')!r})")
    # W in the scorer's layout (CSC), once per load rather than per prediction call
    return (sp.csc_matrix(io.load_csr(folder / "W.npz")), io.load_csr(folder / "C.npz"),
            XTransformerRankerParams.from_dict(XTransformerRankerParams.upgrade(meta["params"])), meta)


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


def check_guard(guard_path: str | None, candidates: str, log) -> None:
    """With ``candidates: matcher``, the matcher must have beaten the trivial baselines on its own
    (its ``guard.json``, :func:`xmc_steps.matcher.alone_failure`): a ``StageError`` with the
    numbers, or a warning when the matcher was trained with ``allow_weak``."""
    if candidates != "matcher" or not guard_path:
        return
    from .matcher import alone_failure

    try:
        guard = io.read_json(guard_path)
        why = alone_failure(guard)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"cannot read the matcher's guard {guard_path}: {e}") from e
    if why is None:
        log.info("guard: the matcher beats the trivial baselines on its own (candidates: matcher)")
    elif guard.get("allow_weak"):
        log.warning("%s (continuing: xtransformer.matcher.allow_weak is true)", why)
    else:
        raise StageError(why)


def ranker_bytes(n: int, nnz_tfidf: int, d: int, n_labels: int, topk: int = 0) -> int:
    """Memory of the rankers' input and weights: ``TF-IDF ⊕ neural`` as CSR (the ``n x d`` neural block
    stored entry by entry, built by a stack: twice), the weights (up to ``d`` neural weights in every
    label's ranker, beside its TF-IDF ones: ``L x d`` at least) and, when predicting, the ``n x topk``
    scores kept."""
    X = 2 * resources.csr_bytes(n, float(nnz_tfidf) + float(n) * d)
    W = resources.csr_bytes(n_labels, float(n_labels) * d) if d else 0
    return X + W + 2 * resources.csr_bytes(n, float(n) * topk)


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


#: settings that may differ between training the rankers and predicting with them
PREDICT_KEYS = ("topb", "topk", "candidates", "combiner", "transform")


def _predict_cli(args) -> None:
    with stage_run("xtransformer_predict", args, outputs=[args.out]) as st:
        W, C, p, meta = load(args.model)
        unknown = set(st.params) - set(PREDICT_KEYS)
        if unknown:
            raise StageError(f"prediction parameter(s) {sorted(unknown)} cannot differ from training; "
                             f"allowed: {', '.join(PREDICT_KEYS)}")
        for k, v in st.params.items():
            setattr(p, k, v)
        try:
            p.__post_init__()
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
        t0 = time.perf_counter()
        Xr = ranker_features(X, emb, p.ranker_input, p.neural_weight)
        if Xr.shape[1] != meta["n_features"]:
            raise StageError(f"features have {Xr.shape[1]} columns, the rankers expect {meta['n_features']}")
        G = matcher_scores(_load_candidates(args, X.shape[0], "the test split"), emb, head)
        P = predict(Xr, W, C, G, p)
        # the index + ranker part; the matcher's encoder time is in the matcher stage's record
        st.predictions(args.out, P, p.topk, time.perf_counter() - t0)
        st.metric("candidate_clusters_per_doc", G.nnz / max(G.shape[0], 1))


def _select_cli(args) -> None:
    """Train the rankers on ``train`` and score the ``valid`` split under every candidate set
    and combiner: the table the defaults are chosen from."""
    from . import metrics

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
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.xtransformer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = add_common_args(sub.add_parser("train", help="train the rankers"))
    t.add_argument("--tfidf", nargs="+", required=True)
    t.add_argument("--emb", nargs="+", default=None, help="matcher embeddings (needed for tfidf+neural)")
    t.add_argument("--labels", nargs="+", required=True)
    t.add_argument("--clusters", nargs="+", default=None, help="the matcher's top-b cluster scores (MAN)")
    t.add_argument("--linear", nargs="+", default=None, help="the linear tree's top-b clusters (MAN of the union)")
    t.add_argument("--tree", required=True, help="cluster tree; its finest level is the matcher's K clusters")
    t.add_argument("--guard", default=None, help="the matcher's guard.json: with candidates: matcher, the matcher "
                                                 "must beat the trivial baselines on its own")
    t.add_argument("--out", required=True)
    q = add_common_args(sub.add_parser("predict", help="Eq. 2 scores of the test documents"))
    q.add_argument("--model", required=True)
    q.add_argument("--matcher-model", required=True, help="the matcher's model.safetensors (its head gives g)")
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
