"""XR-Linear: a linear model per level of a label tree, beam search to predict.

PECOS XR-Linear / X-Transformer §3.4 with TF-IDF features.  Given a
:class:`~xmc_steps.cluster_tree.ClusterTree` with matrices ``C[0..T-1]`` (``C[t]`` maps the
nodes of level ``t+1`` to their parents at level ``t``; level 0 is the root, level ``T``
the labels), the model holds one ranker matrix ``W[t]`` (``(d+1) x n_{t+1}``, last row the
bias) per level:

* ``W[0]`` scores the coarsest clusters and is trained on all instances;
* ``W[t]`` (t >= 1) scores the children of each level-``t`` node, each node's children
  trained on the instances the negative-sampling mask selects for that node
  (:mod:`xmc_steps.negatives`): TFN = ``Y C_t`` (instances with a positive label under
  the node), MAN = the model's own top-``beam`` beam-search predictions at level ``t``
  on the training data, or both ("tfn+man", the default, as PECOS).

Prediction is beam search: a node's score is its parent's score times
``transform(w . [x; bias])``; ``beam`` nodes per level are kept, and the labels under the
final beam are ranked, ``topk`` per document.  Transforms: ``sigmoid``,
``l2-hinge`` = ``exp(-max(0, 1-z)^2)``, ``l3-hinge`` = ``exp(-max(0, 1-z)^3)``.

The beam search and the masked sparse product are shared with the other methods
(:mod:`xmc_steps.search`).  Prediction reads the rankers through
:class:`~xmc_steps.search.LinearTreeTables` (built on the first call and kept with the model): each
document looks up only its own features under its own beam nodes, with no sparse-matrix product per
call, and gets the bytes :func:`~xmc_steps.search.beam_search` with
:func:`~xmc_steps.search.linear_scorer` gives (the test compares them); rows with a dense block of
features (8 or more stored in half the rows) keep that path, which sums them in another order.

The stage (``train``, ``predict``, ``clusters``): :mod:`xmc_steps.stages.xr_linear`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from .. import io, resources
from ..cluster_tree import ClusterTree
from ..negatives import binarize, combine
from ..params import FIT_ON, NegativeKind, Params, Split, bounded
from ..prediction import SavedPredictParams
from ..ranker import SOLVER_MOVED, RankerParams, append_bias, train_rankers
from ..search import (PREDICT_BATCH, LinearTreeTables, Transform, beam_search, expand_children, linear_scorer,
                     topk_per_row, uses_dense_block)

FORMAT = "xmc-xr-linear-v1"

# --------------------------------------------------------------------------- model


@dataclass
class XRLinearParams(Params):
    """XR-Linear (xmc_steps.xr_linear): the ``xr_linear`` section, PECOS's linear tree: its negatives
    (X-Transformer §3.4), beam, score transform and the rankers' solver (:class:`RankerParams`, ``xr_linear.solver``)."""

    negatives: NegativeKind = "tfn+man"  # tfn | man | tfn+man: the instances each cluster's rankers train on (X-Transformer §3.4)
    beam: int = bounded(10, ge=1)  # beam width of the tree search: the predictions and the MAN negatives
    topk: int = bounded(100, ge=1)  # predictions kept per document
    transform: Transform = "l3-hinge"  # score transform along the tree (MAN and prediction)
    fit_on: list[Split] = bounded(default_factory=lambda: ["train", "valid"], schema=FIT_ON)  # the splits the model
                                    # fits on (linear baselines do no model selection: all training data)
    threads: int = bounded(1, ge=1, setting=False)  # clusters trained in parallel (the stage's --threads)
    solver: RankerParams = field(default_factory=RankerParams)  # each one-vs-all ranker's liblinear solve

    _moved = SOLVER_MOVED
    _what = "xr-linear parameter"


@dataclass
class PredictParams(SavedPredictParams):
    """What XR-Linear's beam search takes (:meth:`XRLinearModel.predict`; defaults :class:`XRLinearParams`'s):
    saved with the model (``params.json``'s ``predict``), read back by :func:`xmc_steps.xr_linear.serve.predict`."""

    beam: int = bounded(XRLinearParams.beam, ge=1)
    topk: int = bounded(XRLinearParams.topk, ge=1)
    transform: Transform = XRLinearParams.transform

    _what = "xr-linear prediction parameter"


def with_bias(X: sp.spmatrix, bias: float) -> sp.csr_matrix:
    """:func:`~xmc_steps.ranker.append_bias` (the same matrix: float32, sorted indices, the bias
    stored in every row even when 0) built from the arrays, without ``sp.hstack``'s cost per call."""
    X = X if sp.isspmatrix_csr(X) and X.dtype == np.float32 else sp.csr_matrix(X, dtype=np.float32)
    if not X.has_sorted_indices:
        X = X.copy()
        X.sort_indices()
    n, d = X.shape
    lens = np.diff(X.indptr).astype(np.int64)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens + 1, out=indptr[1:])
    last = indptr[1:] - 1                          # each row's bias slot
    indices = np.empty(X.nnz + n, dtype=np.int32)
    data = np.empty(X.nnz + n, dtype=np.float32)
    body = np.ones(X.nnz + n, dtype=bool)
    body[last] = False
    indices[body], data[body] = X.indices, X.data
    indices[last], data[last] = d, np.float32(bias)
    out = sp.csr_matrix((data, indices, indptr), shape=(n, d + 1))
    out.has_sorted_indices = True
    return out


class XRLinearModel:
    """A :class:`ClusterTree` and one ranker matrix per level (``W[t]``: ``(d+1) x n_{t+1}``)."""

    def __init__(self, tree: ClusterTree, W: list[sp.spmatrix], params: XRLinearParams | None = None):
        if len(W) != tree.depth:
            raise ValueError(f"need {tree.depth} weight matrices, got {len(W)}")
        for t, w in enumerate(W):
            if w.shape[1] != tree.level_sizes[t + 1]:
                raise ValueError(f"W[{t}] has {w.shape[1]} columns, level {t + 1} has {tree.level_sizes[t + 1]} nodes")
        self.tree = tree
        # held in the layout the scorer reads (column slices per candidate set), converted once
        # here rather than on every prediction call: at batch size 1 the conversion was most of it
        self.W = [sp.csc_matrix(w, dtype=np.float32) for w in W]
        self.params = params or XRLinearParams()
        self._tables: LinearTreeTables | None = None

    @property
    def tables(self) -> LinearTreeTables:
        """The rankers laid out for beam search (:class:`~xmc_steps.search.LinearTreeTables`), built on
        first use and kept: every later call, one document or many, reads them as they are."""
        if self._tables is None:
            self._tables = LinearTreeTables(self.tree.C, self.W)
        return self._tables

    @property
    def n_features(self) -> int:
        return self.W[0].shape[0] - 1

    @property
    def n_labels(self) -> int:
        return self.tree.n_labels

    # -- training
    @classmethod
    def train(cls, X: sp.spmatrix, Y: sp.spmatrix, tree: ClusterTree,
              params: XRLinearParams | dict | None = None, log=None) -> "XRLinearModel":
        p = params if isinstance(params, XRLinearParams) else XRLinearParams.from_dict(params)
        X = sp.csr_matrix(X, dtype=np.float32)
        Y = binarize(Y)
        N = X.shape[0]
        if Y.shape[0] != N:
            raise ValueError(f"X has {N} rows but Y has {Y.shape[0]}")
        if Y.shape[1] != tree.n_labels:
            raise ValueError(f"Y has {Y.shape[1]} labels but the tree has {tree.n_labels}")
        Xa = append_bias(X, p.solver.bias)
        T = tree.depth
        W: list[sp.csr_matrix] = []
        beam_t = sp.csr_matrix((np.ones(N, np.float32), np.zeros(N, np.int32), np.arange(N + 1)), shape=(N, 1))
        need_man = p.negatives in ("man", "tfn+man")
        for t in range(T):
            t0 = time.perf_counter()
            Y_next = Y if t + 1 == T else binarize(Y @ tree.label_to_cluster(t + 1))
            parent = tree.parents(t + 1)
            if t == 0:
                mask = None
            else:
                if need_man:
                    # the model's own top-b predictions at level t (extend last level's beam)
                    scorer = linear_scorer(Xa, [W[t - 1]], p.transform)
                    cand = expand_children(beam_t, tree.C[t - 1])
                    beam_t = topk_per_row(scorer(0, cand), p.beam)
                mask = combine(p.negatives, Y, tree.label_to_cluster(t), beam_t if need_man else None)
            W.append(train_rankers(X, Y_next, parent, mask, p.solver, threads=p.threads))
            if log:
                avg = mask.sum() / max(N, 1) if mask is not None else 1.0
                log.info("level %d/%d: %d nodes, %.1f clusters/instance in mask, W nnz %d, %.1f s",
                         t + 1, T, Y_next.shape[1], avg, W[-1].nnz, time.perf_counter() - t0)
        return cls(tree, W, p)

    # -- prediction
    def _search(self, X: sp.spmatrix, levels: int, beam: int, keep: int, transform: str | None,
                batch_size: int = PREDICT_BATCH) -> sp.csr_matrix:
        """Beam search down the first ``levels`` levels, ``batch_size`` rows at a time; CSR with
        at most ``keep`` scores per row, sorted indices."""
        kind = transform or self.params.transform
        Xa = with_bias(X, self.params.solver.bias)
        parts = []
        for r0 in range(0, X.shape[0], batch_size):
            Xb = Xa[r0:r0 + batch_size]
            if uses_dense_block(Xb):
                # features stored in most rows are scored in another order there: that path, as it was
                parts.append(beam_search(self.tree.C[:levels], linear_scorer(Xb, self.W, kind), Xb.shape[0], beam, keep))
            else:
                parts.append(self.tables.search(Xb, levels, beam, keep, kind))
        if not parts:
            return sp.csr_matrix((0, self.tree.level_sizes[levels]), dtype=np.float32)
        out = parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")
        out.sort_indices()
        return out

    def predict(self, X: sp.spmatrix, beam: int = 10, topk: int = 100, transform: str | None = None,
                batch_size: int = PREDICT_BATCH) -> sp.csr_matrix:
        """Beam search; CSR ``N x L`` with at most ``topk`` scores per row, ``batch_size`` rows at a time."""
        if X.shape[1] != self.n_features:
            raise ValueError(f"X has {X.shape[1]} features, the model {self.n_features}")
        return self._search(X, self.tree.depth, beam, topk, transform, batch_size)

    def predict_clusters(self, X: sp.spmatrix, level: int = -1, beam: int = 10, transform: str | None = None,
                         keep: int | None = None) -> sp.csr_matrix:
        """Top-``beam`` nodes at cluster ``level`` (default the finest): the matcher output.
        ``keep`` (>= ``beam``) keeps that many of the last level's candidates instead; their
        first ``beam`` are the top-``beam`` (the same search, a longer list)."""
        lev = self.tree.depth + level if level < 0 else level
        return self._search(X, lev, beam, max(beam, keep or beam), transform)

    # -- persistence
    def save(self, path) -> None:
        """The tree, the rankers and ``params.json`` (the training parameters and the saved :class:`PredictParams`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tree.save(path / "tree.npz")
        for t, w in enumerate(self.W):
            io.save_csr(path / f"W_{t}.npz", w)
        io.write_json(path / "params.json", {
            "format": FORMAT, "depth": self.tree.depth, "n_features": self.n_features,
            "n_labels": self.n_labels, "level_sizes": self.tree.level_sizes,
            # threads change the speed, not the model: left out, so a model is the same file for any
            "params": {k: v for k, v in self.params.to_dict().items() if k != "threads"},
            "predict": PredictParams.of(self.params).to_dict()})

    @classmethod
    def load(cls, path) -> "XRLinearModel":
        path = Path(path)
        meta = io.read_json(path / "params.json")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an xr-linear model ({FORMAT})")
        tree = ClusterTree.load(path / "tree.npz")
        W = [io.load_csr(path / f"W_{t}.npz") for t in range(int(meta["depth"]))]
        return cls(tree, W, XRLinearParams.from_dict(XRLinearParams.upgrade(meta["params"])))

    def size_bytes(self) -> int:
        return int(sum(w.data.nbytes + w.indices.nbytes + w.indptr.nbytes for w in self.W))


# --------------------------------------------------------------------------- memory estimates


def max_children(tree: ClusterTree) -> int:
    """The most children any node of ``tree`` has (a leaf cluster's labels, or B)."""
    return max((int(np.bincount(tree.parents(t)).max()) for t in range(1, tree.depth + 1)), default=1)


def train_bytes(n: int, nnz: int, tree: ClusterTree, p: XRLinearParams) -> int:
    """Memory :meth:`XRLinearModel.train` allocates in proportion to N x (candidates): the features
    with their bias column, and with MAN negatives each level's candidates (the children of the
    top-``beam`` nodes of every document) and their scores."""
    cand = float(n) * p.beam * max_children(tree) if p.negatives in ("man", "tfn+man") else 0.0
    return resources.csr_bytes(n, nnz + n) + 2 * resources.csr_bytes(n, cand)


def predict_bytes(n: int, tree: ClusterTree, beam: int, keep: int, batch_size: int = PREDICT_BATCH,
                  W: list[sp.spmatrix] | None = None) -> int:
    """Memory of :meth:`XRLinearModel._search` over ``n`` documents: the kept ``n x keep`` scores (the
    batches' parts and their stack), one batch's candidates at the widest level (candidates,
    scores and transformed scores) and, given the weights ``W``, the search tables built from them
    (:meth:`~xmc_steps.search.LinearTreeTables.nbytes_for`)."""
    rows = min(n, batch_size)
    tables = LinearTreeTables.nbytes_for(W) if W is not None else 0
    return (2 * resources.csr_bytes(n, float(n) * keep) + 3 * resources.csr_bytes(rows, float(rows) * beam * max_children(tree))
            + tables)
