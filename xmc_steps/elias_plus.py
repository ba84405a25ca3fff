"""ELIAS++ (§3.5): a sparse ranker over ELIAS's top predictions, and score calibration.

Readings and measured choices: docs/methods/elias.md, "ELIAS++" (the sparse ranker, the calibration
and its features, how deep: ``n_candidates`` and ``calibrate_top``).

The stage (train, calibrate, predict) is :mod:`xmc_steps.stages.elias_plus`; this module is the
scoring it and :mod:`xmc_steps.serving` share: :func:`predict`, the one re-rank of a trained ranker
(ELIAS's and the dual encoder's), its prediction parameters saved with it (``ranker.json``'s
``params``) and overridable (:data:`PREDICT_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import scipy.sparse as sp

from . import io
from .errors import StageError
from .params import Params, bounded
from .ranker import SOLVER_MOVED, RankerParams, append_bias, ranker_features, train_rankers
from .search import Transform, masked_product, top_entries, topk_per_row, transform

FORMAT = "xmc-elias-plus-v1"


@dataclass
class EliasPlusParams(Params):
    """ELIAS++ (the ``elias.plus`` section): the candidates re-ranked, the ranker features, the
    calibration tree, and the rankers' solver (:class:`RankerParams`, ``elias.plus.solver``).
    Each label's ranker trains on the documents whose candidates hold it (the candidates play the
    role of TFN negatives), so there is no negatives setting."""

    n_candidates: int = bounded(300, ge=1)
    calibrate_top: int = bounded(100, ge=1)
    neural_weight: float = bounded(1.0, gt=0)
    transform: Transform = "l3-hinge"
    uncalibrated: Literal["product", "ranker"] = "product"
    max_depth: int | None = bounded(5, ge=1)   # the calibration tree's; None: grown until its leaves are pure
                                   # (scikit-learn's default, §3.5's "standard decision tree")
    calibrate_docs: int | None = bounded(None, ge=1)  # the calibration fits on this many validation documents
                                   # (a seeded sample, seed: ``seed``; §3.5: 5,000); None: every one
    topk: int = 100
    seed: int = 0                  # the calibration tree's
    threads: int = bounded(1, ge=1)  # labels' rankers trained in parallel (the stage's --threads)
    solver: RankerParams = field(default_factory=RankerParams)

    _what = "ELIAS++ parameter"
    _moved = {k: v for k, v in SOLVER_MOVED.items() if k != "seed"}


def candidates(scores: sp.csr_matrix, n: int) -> sp.csr_matrix:
    """The top-``n`` ELIAS predictions per row (scores kept)."""
    return topk_per_row(sp.csr_matrix(scores, dtype=np.float32), n)


def train(Xr: sp.csr_matrix, Y: sp.csr_matrix, cand: sp.csr_matrix, p: EliasPlusParams, progress=None) -> sp.csr_matrix:
    """Sparse rankers ``W`` ((d+1) x L): label ``l`` on the rows whose candidates hold ``l``."""
    L = Y.shape[1]
    return train_rankers(Xr, Y, np.arange(L), cand, p.solver, progress=progress, threads=p.threads)


def ranker_scores(Xr: sp.csr_matrix, W: sp.spmatrix, cand: sp.csr_matrix, bias: float) -> np.ndarray:
    """Raw ranker margins ``h`` for every stored candidate, in ``cand``'s order."""
    return masked_product(append_bias(Xr, bias), sp.csc_matrix(W), cand)


def uncalibrated_scores(elias: np.ndarray, h: np.ndarray, p: EliasPlusParams) -> np.ndarray:
    th = transform(h, p.transform)
    return (elias * th if p.uncalibrated == "product" else th).astype(np.float32)


def candidate_truth(cand: sp.csr_matrix, Y: sp.spmatrix) -> np.ndarray:
    """Whether each stored candidate (in ``cand``'s order) is a positive of its row in ``Y``."""
    rows = np.repeat(np.arange(cand.shape[0]), np.diff(cand.indptr))
    return np.asarray(sp.csr_matrix(Y)[rows, cand.indices]).ravel() > 0


def calibration_subset(cand: sp.csr_matrix, h: np.ndarray, score: np.ndarray, k: int
                       ) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """``(candidates, h, uncalibrated score)`` cut to each row's top-``k`` by the uncalibrated score
    (``calibrate_top``; ties -> lower label index); the whole of them when no row holds more than ``k``."""
    if np.diff(cand.indptr).max(initial=0) <= k:
        return cand, h, score
    keep, indptr = top_entries(sp.csr_matrix((np.asarray(score, dtype=np.float32), cand.indices, cand.indptr),
                                             shape=cand.shape), k)
    return sp.csr_matrix((cand.data[keep], cand.indices[keep], indptr), shape=cand.shape), h[keep], score[keep]


def calibration_features(h: np.ndarray, elias: np.ndarray, label_idx: np.ndarray, train_freq: np.ndarray) -> np.ndarray:
    return np.column_stack([h, elias, train_freq[label_idx]]).astype(np.float64)


def calibration_inputs(cand: sp.csr_matrix, h: np.ndarray, score: np.ndarray, p: EliasPlusParams,
                       train_freq: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """What the calibration tree sees, at fit (the calibrate stage) and at prediction (:func:`plus_scores`)
    alike: ``(candidates, features, uncalibrated score)`` of each row's top-``p.calibrate_top`` candidates."""
    cand, h, score = calibration_subset(cand, h, score, p.calibrate_top)
    return cand, calibration_features(h, cand.data, cand.indices, train_freq), score


def calibration_rows(n: int, docs: int | None, seed: int = 0) -> np.ndarray | None:
    """The validation rows the calibration fits on (``calibrate_docs``): ``docs`` of the ``n`` rows, a
    seeded sample in row order; ``None`` (every row) when ``docs`` is ``None`` or not below ``n``."""
    if docs is None or docs >= n:
        return None
    return np.sort(np.random.default_rng(seed).permutation(n)[:docs])


def fit_calibration(F: np.ndarray, y: np.ndarray, max_depth: int | None, seed: int = 0) -> dict[str, np.ndarray]:
    """Fit the decision tree; return its arrays (see :func:`apply_tree`)."""
    from sklearn.tree import DecisionTreeClassifier

    if len(np.unique(y)) < 2:
        raise StageError("score calibration needs both positive and negative candidates on the validation split")
    t = DecisionTreeClassifier(max_depth=max_depth, random_state=seed).fit(F, y)
    tr = t.tree_
    value = tr.value[:, 0, :]
    pos_col = int(np.where(t.classes_ == 1)[0][0])
    prob = value[:, pos_col] / np.maximum(value.sum(axis=1), 1e-12)
    return {"left": tr.children_left.astype(np.int64), "right": tr.children_right.astype(np.int64),
            "feature": tr.feature.astype(np.int64), "threshold": tr.threshold.astype(np.float64),
            "prob": prob.astype(np.float64)}


def apply_tree(tree: dict[str, np.ndarray], F: np.ndarray) -> np.ndarray:
    """Positive-class probability of each row of ``F`` (sklearn's ``x <= threshold`` goes left)."""
    node = np.zeros(len(F), dtype=np.int64)
    active = tree["left"][node] >= 0
    while active.any():
        i = np.where(active)[0]
        nd = node[i]
        go_left = F[i, tree["feature"][nd]] <= tree["threshold"][nd]
        node[i] = np.where(go_left, tree["left"][nd], tree["right"][nd])
        active = tree["left"][node] >= 0
    return tree["prob"][node]


def plus_scores(Xr: sp.csr_matrix, W: sp.spmatrix, cand: sp.csr_matrix, p: EliasPlusParams,
                calibration: dict[str, np.ndarray] | None = None, train_freq: np.ndarray | None = None) -> sp.csr_matrix:
    """ELIAS++'s scores of the candidates (top-``p.topk`` per row): the calibration tree's
    probability (ties broken by the uncalibrated score) of each row's top-``p.calibrate_top``
    candidates by the uncalibrated score when ``calibration`` is given (the answer then holds at
    most ``calibrate_top`` labels), else the uncalibrated combination (``p.uncalibrated``) of all."""
    h = ranker_scores(Xr, W, cand, p.solver.bias)
    score = uncalibrated_scores(cand.data, h, p)
    if calibration is not None:
        cand, F, score = calibration_inputs(cand, h, score, p, train_freq)
        score = apply_tree(calibration, F) + 1e-6 * score
    out = cand.copy()
    out.data = np.asarray(score, dtype=np.float32)
    return topk_per_row(out, p.topk)


def load_ranker(model: str | Path):
    """The sparse ranker a ``train`` call wrote: ``(W as CSC, its ranker.json)``."""
    meta = io.read_json(Path(model) / "ranker.json")
    if meta.get("format") != FORMAT:
        raise StageError(f"{model}: not an ELIAS++ ranker")
    return sp.csc_matrix(io.load_csr(Path(model) / "W.npz")), meta   # the scorer's layout, once


def label_train_freq(model: str | Path) -> np.ndarray:
    """Positives per label in the ranker's training labels (the calibration's third feature)."""
    path = Path(model) / "label_freq.npz"
    if not path.exists():
        raise StageError(f"{path}: missing; this ELIAS++ ranker predates the stored training frequencies, "
                         "train it again (rule elias_plus_ranker)")
    return io.load_arrays(path)["freq"].astype(np.float64)


#: the saved parameters a prediction may override (the predict rule's settings, serving's)
PREDICT_KEYS = ("topk", "uncalibrated", "calibrate_top")


def predict_params(meta: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> EliasPlusParams:
    """The ranker's saved parameters (``meta``: its ``ranker.json``) with ``overrides``' :data:`PREDICT_KEYS`."""
    over = {k: v for k, v in (overrides or {}).items() if k in PREDICT_KEYS and v is not None}
    return EliasPlusParams.from_dict({**EliasPlusParams.upgrade(meta["params"]), **over})


def predict(model: str | Path, tfidf: sp.spmatrix, emb: np.ndarray, scores: sp.spmatrix,
            overrides: Mapping[str, Any] | None = None, calibration: str | Path | None = None,
            ranker: tuple[sp.csc_matrix, Mapping[str, Any]] | None = None) -> tuple[sp.csr_matrix, EliasPlusParams]:
    """ELIAS++'s re-rank (the predict stage's and serving's, for ELIAS and the dual encoder alike): the
    ranker in ``model`` over each row's top-``n_candidates`` of ``scores`` (the first model's, N x L), on
    [``emb`` ⊕ ``tfidf``], calibrated by the tree in ``calibration`` when given (:func:`plus_scores`).
    Returns the scores and the parameters used (:func:`predict_params`).  ``ranker``: ``model``'s
    :func:`load_ranker` when the caller has loaded it."""
    W, meta = ranker if ranker is not None else load_ranker(model)
    p = predict_params(meta, overrides)
    Xr = ranker_features(tfidf, emb, "tfidf+neural", p.neural_weight)
    cand = candidates(sp.csr_matrix(scores), p.n_candidates)
    if cand.shape[0] != Xr.shape[0]:
        raise StageError(f"the candidates hold {cand.shape[0]} rows but the features {Xr.shape[0]}")
    tree = io.load_arrays(Path(calibration) / "calibration.npz") if calibration is not None else None
    return plus_scores(Xr, W, cand, p, tree, label_train_freq(model) if tree is not None else None), p
