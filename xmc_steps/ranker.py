"""Linear one-vs-all rankers trained per cluster on a masked instance subset.

X-Transformer §3.4 / PECOS XR-Linear: for every label ``l`` a linear scorer
``w_l^T [x; bias]`` trained with the L2-regularised squared hinge loss, solved in the
dual by liblinear's coordinate descent (``L2R_L2LOSS_SVC_DUAL`` through scikit-learn's
:class:`~sklearn.svm.LinearSVC`), on only the instances the negative-sampling mask
selects for the label's cluster (plus the label's own positives).  Weights with
``|w| < threshold`` are then zeroed so ``W`` stays sparse.

Generic on purpose: ``cluster_of_label`` groups the "labels" (they may be tree nodes,
real labels, or one label per group for arbitrary per-label candidate sets as ELIAS++
needs) and ``instance_cluster_mask`` (``N x K``) says which instances each group
trains on.  Each group's instance subset is sliced once and its labels are trained
one after the other; groups run in forked worker processes (``threads`` of them), never
in threads of one process: liblinear's coordinate order comes from the process's one
``rand()`` state, so solves in concurrent threads would change each other's results.
The weights are thus the same for any ``threads`` (a test compares them byte for byte).

``W`` has shape ``(d + 1) x L``: rows ``0..d-1`` the feature weights, row ``d`` the bias
weight (the feature value of the bias is ``params.bias``, 1.0 by default, and the bias
is regularised like the other weights, as in liblinear/PECOS).  Score:
``X @ W[:-1] + bias * W[-1]`` — see :func:`append_bias`.
"""

from __future__ import annotations

import logging
import time
import warnings
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import scipy.sparse as sp

from .columns import occurring_columns
from .params import Params, bounded
from .errors import StageError

log = logging.getLogger("xmc.ranker")


@dataclass
class RankerParams(Params):
    """The solver of each one-vs-all linear ranker (PECOS defaults): the ``solver`` section of
    every method that trains rankers (``xr_linear.solver``, ``xtransformer.ranker.solver``,
    ``elias.plus.solver``).  Which instances a ranker sees (the negatives) is not a solver
    setting: the method builds the instance mask and passes it to :func:`train_rankers`."""

    C: float = bounded(1.0, gt=0)  # inverse regularisation strength
    threshold: float = bounded(0.1, ge=0)  # weights with |w| < threshold are zeroed
    tol: float = bounded(0.1, gt=0)  # liblinear stopping tolerance
    max_iter: int = bounded(100, ge=1)  # liblinear max passes over the data
    bias: float = bounded(1.0, ge=0)  # value of the appended bias feature (0 disables the bias)
    seed: int = bounded(0, ge=0)  # liblinear shuffling seed

    _what = "ranker solver parameter"


def append_bias(X: sp.spmatrix, bias: float = 1.0) -> sp.csr_matrix:
    """``[X, bias]``: ``X`` with a constant column appended (CSR, float32)."""
    X = sp.csr_matrix(X, dtype=np.float32)
    N, d = X.shape
    col = sp.csr_matrix((np.full(N, bias, np.float32), np.full(N, 0, np.int32), np.arange(N + 1)), shape=(N, 1))
    out = sp.hstack([X, col], format="csr", dtype=np.float32)
    out.sort_indices()
    return out


LIBLINEAR_MAX_NNZ = 2**31 - 1   # liblinear (through scikit-learn) takes 32-bit sparse indices only


def liblinear_csr(Xs: sp.csr_matrix, what: str = "a cluster's training instances") -> sp.csr_matrix:
    """``Xs`` with 32-bit ``indices``/``indptr``, as liblinear requires.  scipy switches a matrix
    to 64-bit indices above 2^31 non-zeros (and keeps them in every slice of it), so at
    Wiki-500K's size the full feature matrix is 64-bit while each cluster's instance subset
    fits 32 bits: it is converted here.  A subset that itself exceeds 2^31 non-zeros cannot
    be solved by liblinear: a clear error says so."""
    if Xs.nnz > LIBLINEAR_MAX_NNZ:
        raise ValueError(f"{what} hold {Xs.nnz:,} non-zeros, more than liblinear's 32-bit indices address "
                         f"({LIBLINEAR_MAX_NNZ:,}): use more clusters (a smaller cluster leaf_size) or a "
                         "negative sampling that restricts each cluster to its own instances (tfn, man)")
    if Xs.indices.dtype == np.int32 and Xs.indptr.dtype == np.int32:
        return Xs
    return sp.csr_matrix((Xs.data, Xs.indices.astype(np.int32), Xs.indptr.astype(np.int32)), shape=Xs.shape)


# where an earlier version's flat solver keys live now, for the methods' ``_moved``
SOLVER_MOVED = {k: f"solver.{k}" for k in ("C", "threshold", "tol", "max_iter", "bias", "seed")}


def _fit_one(Xs: sp.csr_matrix, y: np.ndarray, p: RankerParams) -> tuple[np.ndarray, float]:
    """One squared-hinge SVM; returns (feature weights, bias weight).  The solve itself is
    :func:`xmc_steps.liblinear_direct.fit_ranker` (liblinear without LinearSVC's per-call checks,
    the same bytes); this is the reference it is tested against."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.svm import LinearSVC

    n_pos = int((y > 0).sum())
    if n_pos == 0 or n_pos == len(y):
        # degenerate: a constant scorer (+1 if every instance is positive, -1 if none is)
        return np.zeros(Xs.shape[1]), (1.0 if n_pos else -1.0)
    if Xs.shape[1] == 0 or Xs.nnz == 0:
        # no instance has a feature (empty TF-IDF rows): only the bias can be learnt; the
        # squared-hinge optimum of a constant scorer is the label balance 2 p - 1 (no margin)
        return np.zeros(Xs.shape[1]), float(2.0 * n_pos / len(y) - 1.0) / (p.bias if p.bias > 0 else 1.0)
    clf = LinearSVC(loss="squared_hinge", dual=True, C=p.C, tol=p.tol, max_iter=p.max_iter,
                    fit_intercept=p.bias > 0, intercept_scaling=p.bias if p.bias > 0 else 1.0,
                    random_state=p.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(Xs, y)
    w = clf.coef_.ravel()
    # intercept_ = bias * w_bias; store the weight of the bias *feature*
    b = float(clf.intercept_[0]) / p.bias if p.bias > 0 else 0.0
    return w, b


#: the feature weights of a ranker without a solve (one class only)
_NO_WEIGHTS = np.zeros(0)

#: the per-cluster solve the forked workers of :func:`train_rankers` call (set just before the fork)
_FORKED: dict[str, Callable[[int], Any]] = {}


def _run_forked(k: int):
    return _FORKED["run"](k)


def _collect(results: Iterable[Any], total: int, progress: Callable[[int, int], None] | None) -> list[Any]:
    """The clusters' results in order, reporting ``progress(done, total)`` after each."""
    out = []
    for r in results:
        out.append(r)
        if progress:
            progress(len(out), total)
    return out


def _groups(cluster_of_label: np.ndarray, K: int) -> list[np.ndarray]:
    order = np.argsort(cluster_of_label, kind="stable")
    bounds = np.searchsorted(cluster_of_label[order], np.arange(K + 1))
    return [order[bounds[k]:bounds[k + 1]] for k in range(K)]


def train_rankers(
    X: sp.spmatrix,
    Y: sp.spmatrix,
    cluster_of_label: np.ndarray,
    instance_cluster_mask: sp.spmatrix | None,
    params: RankerParams | dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    threads: int = 1,
    direct: bool = True,
) -> sp.csr_matrix:
    """Train one linear ranker per column of ``Y``; returns ``W`` ``(d+1) x L`` CSR float32.

    ``X``: ``N x d`` features.  ``Y``: ``N x L`` 0/1 targets.  ``cluster_of_label``: length
    ``L`` ints in ``0..K-1``.  ``instance_cluster_mask``: ``N x K`` 0/1; label ``l`` trains
    on the instances ``i`` with ``mask[i, cluster_of_label[l]]`` plus its own positives;
    ``None`` trains every label on all instances.  ``progress(done, total)`` is called
    after each cluster (in the calling process).  ``threads``: clusters trained in parallel (forked processes; the
    result does not depend on it).  ``direct``: solve with :func:`xmc_steps.liblinear_direct.fit_ranker`
    (``False``: through scikit-learn's ``LinearSVC``, :func:`_fit_one`; the same weights, slower).
    """
    p = params if isinstance(params, RankerParams) else RankerParams.from_dict(params)
    X = sp.csr_matrix(X)
    Y = sp.csr_matrix(Y)
    N, d = X.shape
    L = Y.shape[1]
    if Y.shape[0] != N:
        raise ValueError(f"X has {N} rows but Y has {Y.shape[0]}")
    col = np.asarray(cluster_of_label, dtype=np.int64)
    if col.shape != (L,):
        raise ValueError(f"cluster_of_label must have length L={L}")
    K = int(col.max()) + 1 if L else 0
    if instance_cluster_mask is not None:
        mask = sp.csc_matrix(instance_cluster_mask)
        if mask.shape[0] != N or mask.shape[1] < K:
            raise ValueError(f"instance_cluster_mask {mask.shape} does not fit N={N}, K={K}")
        mask.eliminate_zeros()
        K = max(K, mask.shape[1])
    else:
        mask = None
    X = X.copy() if not X.has_sorted_indices else X
    X.sort_indices()
    # the solver wants float64: a full-size copy only when every label trains on every instance;
    # with a mask each cluster converts just its own rows
    X64 = X.astype(np.float64) if mask is None else None
    if X64 is not None and X64.nnz <= LIBLINEAR_MAX_NNZ:
        X64 = liblinear_csr(X64)    # 32-bit indices once, not again for every cluster
    Yc = sp.csc_matrix(Y)
    Yc.eliminate_zeros()
    Yc.sum_duplicates()         # a label's positives are counted from its column's entries
    groups = _groups(col, K)
    todo = [k for k in range(K) if len(groups[k])]

    from .liblinear_direct import fit_ranker

    fit = fit_ranker if direct else _fit_one

    def run(k: int):
        labels = groups[k]
        Yk = Yc[:, labels]  # CSC column slice: cost bounded by these labels' positives
        Yk.sort_indices()
        pos_rows = np.unique(Yk.indices)
        if mask is not None:
            m_rows = mask.indices[mask.indptr[k]:mask.indptr[k + 1]]
            rows = np.union1d(m_rows, pos_rows)
        else:
            rows = np.arange(N)
        out_idx, out_val, out_cnt = [], [], []
        # the cluster's instances, restricted to the features they use (weights of the
        # other features are 0 anyway): per-label cost scales with the subset, not with d
        Xs = X64 if mask is None else X[rows].astype(np.float64)
        feat, local = occurring_columns(Xs.indices, d) if len(rows) else (np.zeros(0, np.int64), None)
        if len(rows) and len(feat) < 0.8 * d:
            Xs = sp.csr_matrix((Xs.data, local, Xs.indptr), shape=(len(rows), len(feat)))
        else:
            feat = np.arange(d)
        Xs = liblinear_csr(Xs, f"cluster {k}'s {len(rows):,} training instances")
        kept = (lambda v: np.abs(v) >= p.threshold) if p.threshold > 0 else (lambda v: v != 0)
        for j in range(len(labels)):
            n_pos = int(Yk.indptr[j + 1] - Yk.indptr[j])
            if len(rows) == 0 or n_pos == 0 or n_pos == len(rows):
                # one class only: no solve, the constant scorer fit_ranker returns (its zero feature
                # weights, which no threshold keeps, are not built)
                w, b = _NO_WEIGHTS, (1.0 if len(rows) and n_pos else -1.0)
            else:
                y = -np.ones(len(rows))
                y[np.searchsorted(rows, Yk.indices[Yk.indptr[j]:Yk.indptr[j + 1]])] = 1.0
                w, b = fit(Xs, y, p)
            nz = np.flatnonzero(kept(w))
            idx = feat[nz].astype(np.int32)
            val = w[nz].astype(np.float32)
            if kept(np.float64(b)):              # the bias row
                idx = np.append(idx, np.int32(d))
                val = np.append(val, np.float32(b))
            out_idx.append(idx)
            out_val.append(val)
            out_cnt.append(len(idx))
        return labels, out_idx, out_val, out_cnt

    t0 = time.perf_counter()
    if threads > 1 and len(todo) > 1 and "fork" in multiprocessing.get_all_start_methods():
        # largest clusters first for better load balance.  Worker *processes*, not threads:
        # liblinear draws its coordinate order from the C library's one rand() state per
        # process, which sklearn re-seeds before each solve; two solves in threads of one
        # process interleave their draws, so the weights would depend on the scheduling (and
        # the thread count).  A forked worker inherits X and the masks without a copy and runs
        # its solves one after another: every ranker is the same whatever ``threads`` is.
        sizes = {k: len(groups[k]) for k in todo}
        _FORKED["run"] = run
        try:
            with ProcessPoolExecutor(max_workers=threads, mp_context=multiprocessing.get_context("fork")) as pool:
                results = _collect(pool.map(_run_forked, sorted(todo, key=lambda k: -sizes[k])), len(todo), progress)
        finally:
            _FORKED.pop("run", None)
    else:
        results = _collect(map(run, todo), len(todo), progress)
    # assemble a CSC (d+1) x L matrix
    counts = np.zeros(L, dtype=np.int64)
    idx_of = [None] * L
    val_of = [None] * L
    for labels, idxs, vals, cnts in results:
        for j, l in enumerate(labels):
            counts[l] = cnts[j]
            idx_of[l] = idxs[j]
            val_of[l] = vals[j]
    indptr = np.zeros(L + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    empty_i, empty_v = np.zeros(0, np.int32), np.zeros(0, np.float32)
    indices = np.concatenate([i if i is not None else empty_i for i in idx_of]) if L else empty_i
    data = np.concatenate([v if v is not None else empty_v for v in val_of]) if L else empty_v
    W = sp.csc_matrix((data, indices, indptr), shape=(d + 1, L)).tocsr()
    W.sort_indices()
    log.debug("trained %d rankers in %.1f s", L, time.perf_counter() - t0)
    return W


def ranker_features(X_tfidf: sp.spmatrix, emb: np.ndarray | None, ranker_input: str, neural_weight: float = 1.0) -> sp.csr_matrix:
    """``phi_tfidf ⊕ phi_neural`` (each block L2-normalised) or ``phi_tfidf`` alone."""
    from sklearn.preprocessing import normalize

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
