"""ELIAS++ (§3.5): a sparse ranker over ELIAS's top predictions, and score calibration.

* **Sparse ranker.** The foundation's linear one-vs-all ranker
  (:func:`xmc_steps.ranker.train_rankers`, L2-regularised squared hinge, small weights
  dropped) on ``[phi_neural(x) ⊕ phi_tfidf(x)]`` (each block L2-normalised), trained for
  each label on the training points whose top-``n_candidates`` (100) ELIAS predictions
  contain it, plus its own positives (each label is its own "cluster" of the ranker's
  instance mask).  At prediction it scores the same top-100 candidates.
* **Without calibration** (Table 3, "+ Sparse ranker w/o calibration") the final score is
  ``uncalibrated``: ``product`` (default) = ELIAS score x ``T(h)`` with ``T`` the
  l3-hinge transform, as a path product in a tree search; ``ranker`` = ``T(h)`` alone.
  The paper does not say how the two are combined before calibration; the product
  keeps both signals.
* **Score calibration** (Table 3, "+ Score calibration"): a decision tree classifier
  (scikit-learn, ``max_depth`` 5 by default) on ``[ranker score h, ELIAS score, label
  training frequency]`` fitted on the *validation* split's candidates (never on test),
  the frequency counted over the labels ELIAS and the ranker were trained on (stored
  with the ranker as ``label_freq.npz``; counting the validation split too would hand
  the tree a feature that is one higher on exactly its own positives),
  target = the candidate is a true label; the calibrated score is the tree's
  probability of the positive class.  A depth-5 tree has at most 32 leaves, so many
  candidates share a score: ties are broken by adding ``1e-6`` x the uncalibrated
  score, which only orders candidates within one leaf.  The fitted tree is stored as
  plain arrays (``calibration.npz``) and applied by :func:`apply_tree`, no pickle.

``n_candidates`` (100, the paper's): the candidates' depth at prediction, the ranker trained on the
top 100 as ever, measured on yso-finna-sv-50k's validation split (stage 2 and ranker of the default
chain at ``predict.yhat_power`` 0.75, 5,000 documents, the calibration cross-fitted on 5 folds as
``bench/elias_plus_valid.py``; 2 CPU cores, 2026-12-02).  Stage 2 alone: P@1 10.14, R@100 33.56.

=====  ====================  ===================  ================================
depth  ranker P@1 / R@100    ELIAS++ P@1 / R@100  share of the truth in candidates
=====  ====================  ===================  ================================
100    18.16 / 33.56         19.02 / 33.56        29.2 %
200    13.76 / 33.70         17.74 / 33.92        34.5 %
300    11.78 / 32.60         17.80 / 33.26        37.8 %
500    10.56 / 28.10         17.56 / 32.99        42.3 %
1,000  10.26 / 19.08         17.40 / 31.65        48.9 %
=====  ====================  ===================  ================================

Deeper candidates hold more of the truth, but a ranker trained on the top 100 ranks the ones below
them too high (each label's ranker never saw documents that held it deeper): 100 stays.  Training the
ranker on as deep a list is not measured (its cost grows with the depth).  The stage-2 prediction files
that feed ELIAS++ hold ``max(evaluate.topk, n_candidates)`` labels a row (rule ``elias_predict``).

The stage (train, calibrate, predict) is :mod:`xmc_steps.stages.elias_plus`; this module is the
scoring it and :mod:`xmc_steps.serving` share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import scipy.sparse as sp

from . import io
from .errors import StageError
from .params import Params, bounded
from .ranker import SOLVER_MOVED, RankerParams, append_bias, train_rankers
from .search import Transform, masked_product, topk_per_row, transform

FORMAT = "xmc-elias-plus-v1"


@dataclass
class EliasPlusParams(Params):
    """ELIAS++ (the ``elias.plus`` section): the candidates re-ranked, the ranker features, the
    calibration tree, and the rankers' solver (:class:`RankerParams`, ``elias.plus.solver``).
    Each label's ranker trains on the documents whose candidates hold it (the candidates play the
    role of TFN negatives), so there is no negatives setting."""

    n_candidates: int = bounded(100, ge=1)
    neural_weight: float = bounded(1.0, gt=0)
    transform: Transform = "l3-hinge"
    uncalibrated: Literal["product", "ranker"] = "product"
    max_depth: int = bounded(5, ge=1)
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


def calibration_features(h: np.ndarray, elias: np.ndarray, label_idx: np.ndarray, train_freq: np.ndarray) -> np.ndarray:
    return np.column_stack([h, elias, train_freq[label_idx]]).astype(np.float64)


def fit_calibration(F: np.ndarray, y: np.ndarray, max_depth: int, seed: int = 0) -> dict[str, np.ndarray]:
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
    probability (ties broken by the uncalibrated score) when ``calibration`` is given, else the
    uncalibrated combination (``p.uncalibrated``)."""
    h = ranker_scores(Xr, W, cand, p.solver.bias)
    score = uncalibrated_scores(cand.data, h, p)
    if calibration is not None:
        score = apply_tree(calibration, calibration_features(h, cand.data, cand.indices, train_freq)) + 1e-6 * score
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
