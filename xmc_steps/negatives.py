"""Negative sampling for rankers: Teacher Forcing (TFN) and Matcher-aware (MAN) negatives.

X-Transformer §3.4.  With ``Y`` (``N x L`` 0/1) and a label-to-cluster matrix ``C``
(``L x K`` 0/1, one nonzero per row):

* ``tfn(Y, C)``: ``M = YC`` binarised, the instance-to-cluster mask of the ground truth;
* ``man(M_hat)``: the matcher's top-b cluster predictions (``N x K``, any scores)
  binarised;
* ``combine(kind, Y, C, M_hat)``: ``kind`` one of :data:`NegativeKind` (``tfn``, ``man``, ``tfn+man``)
  (``M' = YC + M_hat`` binarised for the combination);
* ``label_instance_mask(M, C, Y)``: ``N x L`` mask of the (instance, label) pairs a
  ranker trains on: instance ``i`` for label ``l`` iff ``M[i, cluster(l)]``, plus every
  label's own positives.  It materialises ``N x L`` pairs; at scale prefer passing the
  ``N x K`` mask and the cluster of every label to :func:`xmc_steps.ranker.train_rankers`,
  which slices each cluster's instances once.

Shared by xr-linear, X-Transformer, ELIAS++ and the other ranker users.
"""

from __future__ import annotations

import typing

import numpy as np
import scipy.sparse as sp

from .params import NegativeKind, check_choice

#: the methods' ``negatives`` setting: :data:`NegativeKind` (declared in xmc_steps.params with the other
#: choices that name a part of an artifact path, the rules' ``{neg}``)
KINDS: tuple[str, ...] = typing.get_args(NegativeKind)


def binarize(m: sp.spmatrix) -> sp.csr_matrix:
    """0/1 float32 CSR with the nonzero pattern of ``m`` (explicit zeros dropped)."""
    m = sp.csr_matrix(m, copy=True)
    m.eliminate_zeros()
    m.data = np.ones(len(m.data), dtype=np.float32)
    m = m.astype(np.float32)
    m.sort_indices()
    return m


def as_label_cluster_matrix(C, n_clusters: int | None = None) -> sp.csr_matrix:
    """Accept an ``L x K`` CSR matrix or an int array (label -> cluster); return CSR."""
    if sp.issparse(C):
        return sp.csr_matrix(C, dtype=np.float32)
    a = np.asarray(C, dtype=np.int64)
    K = int(a.max()) + 1 if n_clusters is None else n_clusters
    return sp.csr_matrix((np.ones(len(a), np.float32), a, np.arange(len(a) + 1)), shape=(len(a), K))


def tfn(Y: sp.spmatrix, C) -> sp.csr_matrix:
    """Teacher-forcing mask ``M = YC`` (binarised), ``N x K``."""
    C = as_label_cluster_matrix(C)
    Y = binarize(Y)
    if Y.shape[1] != C.shape[0]:
        raise ValueError(f"Y has {Y.shape[1]} labels but C has {C.shape[0]} rows")
    return binarize(Y @ C)


def man(pred_cluster_topb: sp.spmatrix) -> sp.csr_matrix:
    """Matcher-aware mask: the matcher's top-b predicted clusters, binarised (``N x K``)."""
    return binarize(pred_cluster_topb)


def check_kind(kind: NegativeKind) -> None:
    """``ValueError`` unless ``kind`` is one of :data:`KINDS` (the methods' ``negatives`` setting)."""
    check_choice(kind, NegativeKind, "negatives")


def combine(kind: NegativeKind, Y: sp.spmatrix, C, M_hat: sp.spmatrix | None = None) -> sp.csr_matrix:
    """Instance-to-cluster training mask for ``kind`` (:data:`NegativeKind`)."""
    check_kind(kind)
    if kind == "tfn":
        return tfn(Y, C)
    if M_hat is None:
        raise ValueError(f"negatives {kind!r} need the matcher's predictions M_hat")
    M = man(M_hat)
    if kind == "man":
        return M
    T = tfn(Y, C)
    if T.shape != M.shape:
        raise ValueError(f"TFN mask {T.shape} and MAN mask {M.shape} differ in shape")
    return binarize(T + M)


def label_instance_mask(M_cluster: sp.spmatrix, C, Y: sp.spmatrix | None = None) -> sp.csr_matrix:
    """``N x L`` 0/1 mask: ``M_cluster @ C^T`` (instances of each label's cluster) ∪ ``Y``."""
    C = as_label_cluster_matrix(C, n_clusters=M_cluster.shape[1])
    mask = binarize(M_cluster) @ C.T.tocsr()
    if Y is not None:
        mask = mask + binarize(Y)
    return binarize(mask)
