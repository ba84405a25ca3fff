"""NGAME's batches (Dahiya et al., WSDM 2023, §3): the training texts are clustered in the current
embedding space into clusters of about ``cluster_size`` close texts, and an epoch's order is its clusters
in a random order, each cluster's texts together; the trainer cuts that order into consecutive batches
(:class:`xmc_steps.trainer.Trainer`), so a batch is a few whole clusters and its texts' positives are
one another's hard in-batch negatives.

Clustering (:func:`balanced_clusters`): recursive balanced spherical 2-means, as NGAME clusters the texts
(and as :mod:`xmc_steps.cluster_tree` clusters labels, there on sparse rows): a node is split into two
exact halves by the difference of its rows' cosines to two unit centroids (seeded from two random
members, ``iters`` rounds or until the split stops changing), until every node holds at most ``size``
texts (so between ``size / 2`` and ``size``).  Everything is drawn from ``numpy.random.default_rng(seed)``:
the same embeddings and seed give the same clusters.

Order (:func:`cluster_order`): the clusters shuffled by ``default_rng([seed, epoch])`` and, within a
cluster, its texts shuffled by the same generator; every text appears exactly once per epoch.
"""

from __future__ import annotations

import numpy as np

#: 2-means rounds per split at most (the split stops earlier when it no longer changes)
ITERS = 8


def _unit(v: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(v)
    return v / n if n > 0 else v


def balanced_clusters(emb: np.ndarray, size: int, seed: int | list[int] = 0, iters: int = ITERS) -> np.ndarray:
    """Each row's cluster id (``int64``, ``0 .. n_clusters - 1``) for rows ``emb`` (``N x d``, unit norm or
    not: cosines are taken on the normalised rows); clusters hold at most ``size`` rows (module docstring)."""
    X = np.asarray(emb, dtype=np.float32)
    n = X.shape[0]
    size = max(1, int(size))
    out = np.zeros(n, dtype=np.int64)
    if n <= size:
        return out
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    X = X / np.where(norms > 0, norms, 1.0)
    rng = np.random.default_rng(seed)
    leaves: list[np.ndarray] = []
    stack = [np.arange(n, dtype=np.int64)]
    while stack:                                    # depth first, left child first: a fixed order of draws
        rows = stack.pop()
        m = len(rows)
        if m <= size:
            leaves.append(rows)
            continue
        Xn = X[rows]
        a, b = rng.choice(m, 2, replace=False)
        c0, c1 = Xn[a].copy(), Xn[b].copy()
        half = (m + 1) // 2
        first = None
        for _ in range(max(1, int(iters))):
            score = Xn @ (c0 - c1)
            order = np.argsort(-score, kind="stable")
            left = np.zeros(m, dtype=bool)
            left[order[:half]] = True
            if first is not None and np.array_equal(left, first):
                break
            first = left
            c0, c1 = _unit(Xn[left].sum(0)), _unit(Xn[~left].sum(0))
        stack.append(rows[~first])
        stack.append(rows[first])
    for j, rows in enumerate(leaves):
        out[rows] = j
    return out


def cluster_order(clusters: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """An epoch's permutation of the texts: the clusters in a random order, each cluster's texts
    together (in a random order), from ``default_rng([seed, epoch])``."""
    clusters = np.asarray(clusters, dtype=np.int64)
    n = len(clusters)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    k = int(clusters.max()) + 1
    rank = rng.permutation(k)                        # the clusters' places in the epoch
    within = rng.random(n)                           # the texts' places within their cluster
    return np.lexsort((within, rank[clusters])).astype(np.int64)


def batches_of(order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """The consecutive batches the trainer cuts from an epoch's order (the last may be shorter)."""
    return [order[a:a + batch_size] for a in range(0, len(order), int(batch_size))]
