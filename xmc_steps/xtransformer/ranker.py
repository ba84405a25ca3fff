"""X-Transformer's rankers (§3.4) and the final score of Eq. 2: their parameters
(:class:`XTransformerRankerParams`, the ``xtransformer.ranker`` section), the candidate clusters
(:func:`candidate_clusters`), the one-vs-all rankers (:func:`train`, on the foundation's
:func:`xmc_steps.ranker.train_rankers`), Eq. 2 over the candidates (:func:`predict`), the matcher's
head (:func:`load_head`) and the model folder (:func:`save`, :func:`load`).  No torch here: the
rankers' stage reads the matcher's head from its safetensors file.  The readings and the
validation tables behind the defaults: docs/methods/xtransformer.md; the
stage (``train``, ``predict``, ``select``): :mod:`xmc_steps.stages.xtransformer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, get_args

import numpy as np
import scipy.sparse as sp

from .. import io, resources
from ..errors import StageError
from ..negatives import binarize, combine
from ..params import Candidates, Combiner, NegativeKind, Params, RankerInput, bounded
from ..ranker import SOLVER_MOVED, RankerParams, append_bias, train_rankers
from ..search import SCORE_FLOOR, Transform, expand_children, masked_product, topk_per_row, transform

FORMAT = "xmc-xtransformer-ranker-v1"
COMBINERS = get_args(Combiner)
RANKER_INPUTS = get_args(RankerInput)
CANDIDATES = get_args(Candidates)


@dataclass
class XTransformerRankerParams(Params):
    """The rankers of Eq. 2 (the ``xtransformer.ranker`` section): their input and negatives, the
    candidate clusters and combiner at prediction, and the solver (:class:`RankerParams`,
    ``xtransformer.ranker.solver``)."""

    ranker_input: RankerInput = "tfidf+neural"  # tfidf | tfidf+neural: the rankers' features (Eq. 2's phi)
    neural_weight: float = bounded(1.0, gt=0)  # the L2-normalised embedding's weight beside the TF-IDF block
    negatives: NegativeKind = "tfn+man"  # the instances each cluster's rankers train on
    topb: int = bounded(10, setting=False)  # clusters taken from each candidate source (xtransformer.matcher.topb)
    topk: int = bounded(100, setting=False)  # labels written per document (evaluate.topk)
    candidates: Candidates = "union"  # matcher (the paper) | union (matcher top-b + linear tree beam) | linear
    combiner: Combiner = "product"  # Eq. 2's sigma: how the matcher's and the rankers' scores combine
    transform: Transform = "l3-hinge"  # the rankers' margin transform before combining
    threads: int = bounded(1, ge=1, setting=False)  # clusters trained in parallel (the stage's --threads)
    solver: RankerParams = field(default_factory=RankerParams)  # each ranker's liblinear solve (as xr_linear.solver)

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
    every candidate cluster (:func:`candidate_clusters`, :func:`~xmc_steps.search.matcher_scores`); labels of
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



#: the saved ranker parameters a prediction may set (the predict rule's settings, serving's); the others
#: cannot differ from training
PREDICT_KEYS = ("topb", "topk", "candidates", "combiner", "transform")


def predict_params(saved: XTransformerRankerParams, overrides: Mapping[str, Any] | None = None
                   ) -> XTransformerRankerParams:
    """The rankers' saved parameters with ``overrides`` (:data:`PREDICT_KEYS` only: another key is a
    ``ValueError`` naming it)."""
    over = dict(overrides or {})
    unknown = set(over) - set(PREDICT_KEYS)
    if unknown:
        raise ValueError(f"prediction parameter(s) {sorted(unknown)} cannot differ from training; "
                         f"allowed: {', '.join(PREDICT_KEYS)}")
    return type(saved).from_dict({**saved.to_dict(), **over})


def predict_model(model_dir: str | Path, tfidf: sp.spmatrix, emb: np.ndarray, head: np.ndarray,
                  matcher_top: sp.spmatrix | None, linear_top: sp.spmatrix | None,
                  overrides: Mapping[str, Any] | None = None, model: tuple | None = None
                  ) -> tuple[sp.csr_matrix, XTransformerRankerParams, sp.csr_matrix]:
    """X-Transformer's one prediction path over a trained ranker folder (the predict stage's and serving's):
    the candidate clusters (:func:`candidate_clusters` of the matcher's and the linear tree's top clusters),
    the matcher's scores there (``head``, ``emb``: :func:`~xmc_steps.search.matcher_scores`) and Eq. 2 of
    the rankers on [TF-IDF ⊕ ``emb``] (:func:`predict`), with the saved parameters overridden
    (:func:`predict_params`).  Returns the scores, the parameters used and the matcher's scores ``G``.
    ``model``: the folder's :func:`load` when the caller has it."""
    from ..ranker import ranker_features
    from ..search import matcher_scores

    W, C, saved, meta = model if model is not None else load(model_dir)
    p = predict_params(saved, overrides)
    Xr = ranker_features(tfidf, emb, p.ranker_input, p.neural_weight)
    if Xr.shape[1] != meta["n_features"]:
        raise StageError(f"features have {Xr.shape[1]} columns, the rankers expect {meta['n_features']}")
    G = matcher_scores(candidate_clusters(matcher_top, linear_top, p.candidates, p.topb), emb, head)
    return predict(Xr, W, C, G, p), p, G


def ranker_bytes(n: int, nnz_tfidf: int, d: int, n_labels: int, topk: int = 0) -> int:
    """Memory of the rankers' input and weights: ``TF-IDF ⊕ neural`` as CSR (the ``n x d`` neural block
    stored entry by entry, built by a stack: twice), the weights (up to ``d`` neural weights in every
    label's ranker, beside its TF-IDF ones: ``L x d`` at least) and, when predicting, the ``n x topk``
    scores kept."""
    X = 2 * resources.csr_bytes(n, float(nnz_tfidf) + float(n) * d)
    W = resources.csr_bytes(n_labels, float(n_labels) * d) if d else 0
    return X + W + 2 * resources.csr_bytes(n, float(n) * topk)
