"""ELIAS++ (§3.5): a sparse ranker over ELIAS's top predictions, and score calibration.

* **Sparse ranker.** The foundation's linear one-vs-all ranker
  (:func:`xmc_steps.ranker.train_rankers`, L2-regularised squared hinge, small weights
  dropped) on ``[phi_neural(x) ⊕ phi_tfidf(x)]`` (each block L2-normalised), trained for
  each label on the training points whose top-``n_candidates`` ELIAS predictions
  contain it, plus its own positives (each label is its own "cluster" of the ranker's
  instance mask).  At prediction it scores the same top-``n_candidates`` candidates (300; the
  paper's 100: "How deep" below).
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

How deep: ``n_candidates`` and ``calibrate_top``
------------------------------------------------
``n_candidates`` (300; the paper's 100, config.paper.yaml; the dual encoder's ranker keeps 100,
:class:`xmc_steps.dual_encoder.params.DualEncoderRankerParams`): the depth of stage 2's predictions the
ranker trains on and scores.  ``calibrate_top`` (100): the calibration tree orders each row's top
100 candidates by the uncalibrated score, and the answer is those (so it holds at most
``calibrate_top`` labels).  At ``n_candidates`` <= ``calibrate_top`` this is the paper's ELIAS++: the
tree scores all 100 candidates.  The reading chosen: the paper evaluates the ranker and the
calibration on one list of 100; at a deeper list the tree's coarse leaves (at most 32 at depth 5)
would order the deep candidates it barely separates, and the answer's recall would fall.

Chosen on the validation split (stage 2 and the ranker of each set's default chain, ``predict.yhat_power``
0.75; the ranker trained on the train split's top-N; the calibration cross-fitted on 5 folds as
``bench/elias_plus_valid.py`` does, averaged over 5 draws of the folds on yso; 2 CPU cores,
2026-12-02; scripts of the session, not kept).  yso-finna-sv-50k (18,056 labels, 5,000 documents;
stage 2 alone P@1 10.16, R@100 33.61):

=====  ============================  =================================  ===========================  ==============
depth  ranker P@1 / P@5 / R@100      ELIAS++, the tree on all N:         ELIAS++, the tree on the     ranker train s
                                     P@1 / R@100                        ranker's top 100: P@1/R@100
=====  ============================  =================================  ===========================  ==============
100    18.18 / 8.06 / 33.61          18.65 (sd 0.19) / 33.61            the same                     49
200    19.46 / 8.60 / 34.56          20.10 (one draw) / 32.89           --                           96
300    19.96 / 8.82 / 34.81          20.10 (sd 0.19) / 33.19            **20.06** (sd 0.11) / 34.81  134
500    20.50 / 8.92 / 34.92          20.18 (sd 0.27) / 33.61            20.56 (sd 0.19) / 34.92      210
=====  ============================  =================================  ===========================  ==============

On the two small label spaces stage 2's shortlist holds K = 200 labels, so a depth of 300 is 200 (one
draw of the folds; valid P@1 / R@100):

============  ==============================  ==============================  ================================
set           ranker, depth 100 -> 200        ELIAS++, depth 100              ELIAS++, depth 200, top 100
============  ==============================  ==============================  ================================
debtags       92.53 / 98.86 -> 92.53 / 98.49  92.90 / 98.86                   92.65 / 98.49
reuters-all5  97.04 / 99.31 -> 97.04 / 99.24  97.17 / 99.31                   96.53 / 99.24
============  ==============================  ==============================  ================================

- **Why deeper helps on yso**: stage 2's top 100 hold 29 % of the truth there, its top 300 38 %; a ranker
  that trained on 300 candidates a row has seen each label's documents that held it that deep, so it
  can lift them.  A ranker trained on the top 100 and applied to the top 300 could not: it ranks the
  deeper labels too high (ELIAS++ P@1 17.80 on the same split, the ranker 11.78).  On debtags and
  reuters the top 100 already hold 99 % of the truth.
- **300, not 500**: 500 adds 0.5 of P@1 (the ranker's and ELIAS++'s alike) and 0.1 of R@100, for 1.6x
  the ranker's training: its instances are depth x documents, so its time and the candidates' memory
  grow linearly with the depth (yso at 300: 126 s and 1.1 GB peak against 85 s and 0.8 GB at 100; at
  Wiki-500K's 1.78 M documents, 530 M candidate entries at 300).  The gains shrink with depth (per 100
  more: +1.3, +0.5, +0.27 of the ranker's P@1), so 300 is the cost-aware choice on validation, not
  the best P@1 measured; set 500 where the ranker's time is cheap.
- **The cost on the small sets is within one run's noise**: debtags -0.25 of ELIAS++ P@1 (6 of 2,423
  documents), reuters -0.64 (5 of 778); R@100 -0.37 and -0.07.  The gain on yso is +1.4 of P@1 (70 of
  5,000) and +1.2 of R@100.  Chosen on yso's validation split; a default that only the larger label
  space asked for, as said.
- **The tree on the ranker's top 100**, not on all 300: the same P@1 within the noise of the fold draws,
  and R@100 34.81 against 33.19.

The ranker's other settings, checked at depth 300 on the same split (ELIAS++ averaged over 3 draws of
the folds): they stay.

=================================  =======================  ===============
``neural_weight`` / ``solver.C``   ranker P@1 / R@100       ELIAS++ P@1
=================================  =======================  ===============
1.0 / 1.0 (the defaults)           19.96 / 34.81            20.06 (5 draws)
0.5 / 1.0                          18.94 / 35.02            19.01
2.0 / 1.0                          19.06 / 33.95            19.18
1.0 / 0.5                          19.26 / 35.15            20.16
1.0 / 2.0                          19.72 / 34.44            20.02
=================================  =======================  ===============

The stage-2 prediction files that feed ELIAS++ hold ``max(evaluate.topk, n_candidates)`` labels a row
(rule ``elias_predict``).

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
