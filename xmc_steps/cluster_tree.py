"""Balanced hierarchical spherical k-means: the semantic label index (X-Transformer §3.2).

Algorithm (as the PECOS hierarchical k-means indexer with ``nr_splits = B``):

1. Recursive *balanced spherical 2-means* on the label-embedding rows: a node's labels
   are split in two exact halves (sizes ``ceil(n/2)`` and ``floor(n/2)``) by sorting the
   difference of their cosine scores to the two unit-norm centroids; a few
   iterations per node, seeded, stopping early when the split no longer changes.
2. Binary splitting goes to depth ``D = max(1, ceil(log2(L / leaf_size)))`` so every
   leaf is at depth ``D`` and holds about ``L / 2^D <= leaf_size`` labels.
3. For branching factor ``B = 2^k`` the binary levels ``D, D-k, D-2k, ... (> 0)`` are kept
   as the levels of the ``B``-ary tree (``L=572``, leaf 100, ``B=16`` gives one level of
   8 clusters).  Empty nodes (possible only when ``leaf_size`` is tiny) are dropped.

Memory: the embedding stays sparse; a node's two centroids are dense only over the
columns that occur in that node's rows, so the cost is bounded by the node's nnz,
never by ``L x d``.

Tree layout (:class:`ClusterTree`)
----------------------------------
Levels are numbered ``0 .. T``: level 0 is the root (one node), levels ``1 .. T-1`` are
the cluster levels from coarse to fine, level ``T`` is the labels.  ``C`` holds ``T``
CSR 0/1 matrices; ``C[t]`` has shape ``(n_{t+1}, n_t)`` and maps each node at level
``t+1`` to its parent at level ``t``.  So ``C[0]`` is ``n_1 x 1`` (every first-level
cluster under the root) and ``C[-1]`` is ``L x n_{T-1}`` (label -> finest cluster).
A linear/neural model has one scorer per matrix: scorer ``t`` ranks the nodes of level
``t+1`` (the rows of ``C[t]``); the last scorer ranks labels.

Helpers: ``tree.assignment(level)`` (label -> node id at ``level``, int array),
``tree.label_to_cluster(level)`` (the same as an ``L x n_level`` CSR),
``tree.leaf_assignment()`` (the flat K-cluster assignment a matcher uses,
``K = n_{T-1}``), ``tree.parents(level)``.

The stage that builds and saves the tree is :mod:`xmc_steps.stages.cluster`.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp

from . import io
from .columns import occurring_columns

FORMAT = "xmc-cluster-tree-v1"


# --------------------------------------------------------------------------- tree


def assignment_matrix(parent: np.ndarray, n_parent: int) -> sp.csr_matrix:
    """``n x n_parent`` CSR 0/1 matrix with one 1 per row, at column ``parent[i]`` (a label-to-cluster
    or child-to-parent assignment as a matrix)."""
    n = len(parent)
    parent = np.asarray(parent)
    if n and (parent.min() < 0 or parent.max() >= n_parent):
        # scipy does not check column ids on construction, and a product with an
        # out-of-range id writes past its buffers: refuse it here
        raise ValueError(f"parent ids must lie in 0..{n_parent - 1}, got {int(parent.min())}..{int(parent.max())}")
    return sp.csr_matrix(
        (np.ones(n, dtype=np.float32), np.asarray(parent, dtype=np.int32), np.arange(n + 1, dtype=np.int64)),
        shape=(n, n_parent),
    )


@dataclass
class ClusterTree:
    """A rooted tree over labels; see the module docstring for the layout of ``C``."""

    C: list[sp.csr_matrix] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.C = [sp.csr_matrix(c, dtype=np.float32) for c in self.C]
        self.validate()

    # -- construction
    @classmethod
    def from_parents(cls, parents: list[np.ndarray]) -> "ClusterTree":
        """Build from ``parents[t]`` = parent id (at level ``t``) of each node at level ``t+1``."""
        C, n_prev = [], 1
        for par in parents:
            par = np.asarray(par, dtype=np.int64)
            C.append(assignment_matrix(par, n_prev))
            n_prev = len(par)
        return cls(C)

    @classmethod
    def from_assignments(cls, assignments: list[np.ndarray]) -> "ClusterTree":
        """Build from per-level label assignments, coarse to fine (each of length L).

        ``assignments[j][l]`` is label ``l``'s node id at cluster level ``j+1``; ids are
        compacted (empty ids dropped) and each level must nest inside the previous one.
        """
        if not assignments:
            raise ValueError("need at least one cluster level")
        L = len(assignments[0])
        compact = []
        for a in assignments:
            a = np.asarray(a, dtype=np.int64)
            if len(a) != L:
                raise ValueError("all assignments must have length L")
            _, inv = np.unique(a, return_inverse=True)
            compact.append(inv.astype(np.int64))
        parents = [np.zeros(int(compact[0].max()) + 1 if L else 0, dtype=np.int64)]
        for coarse, fine in zip(compact[:-1], compact[1:]):
            n_fine = int(fine.max()) + 1
            par = np.full(n_fine, -1, dtype=np.int64)
            par[fine] = coarse
            # nesting check: every label of a fine node has the same coarse node
            if np.any(par[fine] != coarse):
                raise ValueError("cluster levels do not nest")
            parents.append(par)
        parents.append(compact[-1])
        return cls.from_parents(parents)

    def validate(self) -> None:
        n_prev = 1
        for t, c in enumerate(self.C):
            if c.shape[1] != n_prev:
                raise ValueError(f"C[{t}] has {c.shape[1]} columns, expected {n_prev}")
            if np.any(np.diff(c.indptr) != 1):
                raise ValueError(f"C[{t}]: every node needs exactly one parent")
            if c.shape[0] and np.any(np.bincount(c.indices, minlength=c.shape[1]) == 0):
                raise ValueError(f"C[{t}]: a node at level {t} has no children")
            n_prev = c.shape[0]

    # -- shape
    @property
    def depth(self) -> int:
        """``T``: number of matrices in ``C`` (cluster levels + 1)."""
        return len(self.C)

    @property
    def n_labels(self) -> int:
        return self.C[-1].shape[0] if self.C else 0

    @property
    def level_sizes(self) -> list[int]:
        """``[n_0 = 1, n_1, ..., n_T = L]``."""
        return [1] + [c.shape[0] for c in self.C]

    @property
    def n_clusters(self) -> int:
        """Number of finest clusters (``K`` of a matcher)."""
        return self.C[-1].shape[1]

    # -- navigation
    def parents(self, level: int) -> np.ndarray:
        """Parent id (at ``level - 1``) of every node at ``level`` (1 <= level <= T)."""
        if not 1 <= level <= self.depth:
            raise IndexError(f"level must be in 1..{self.depth}")
        return self.C[level - 1].indices.astype(np.int64)

    def assignment(self, level: int = -1) -> np.ndarray:
        """Label -> node id at ``level`` (0 = root ... T = the label itself).

        Negative levels count from the labels: ``-1`` is the finest cluster level.
        """
        T = self.depth
        if level < 0:
            level = T + level
        if not 0 <= level <= T:
            raise IndexError(f"level must be in 0..{T}")
        a = np.arange(self.n_labels, dtype=np.int64)
        for t in range(T, level, -1):
            a = self.parents(t)[a]
        return a

    def leaf_assignment(self) -> np.ndarray:
        """Label -> finest cluster id: the flat K-cluster assignment a matcher uses."""
        return self.assignment(-1)

    def label_to_cluster(self, level: int = -1) -> sp.csr_matrix:
        """``L x n_level`` CSR 0/1 matrix of :meth:`assignment`."""
        T = self.depth
        lev = T + level if level < 0 else level
        return assignment_matrix(self.assignment(lev), self.level_sizes[lev])

    def cluster_sizes(self, level: int = -1) -> np.ndarray:
        lev = self.depth + level if level < 0 else level
        return np.bincount(self.assignment(lev), minlength=self.level_sizes[lev])

    # -- persistence
    def save(self, path) -> None:
        arrays = {"format": np.array(FORMAT), "depth": np.array(self.depth)}
        for t in range(1, self.depth + 1):
            arrays[f"parent_{t}"] = self.parents(t).astype(np.int32)
        io.save_arrays(path, **arrays)

    @classmethod
    def load(cls, path) -> "ClusterTree":
        z = io.load_arrays(path)
        if str(z.get("format", "")) != FORMAT:
            raise ValueError(f"{path}: not a cluster tree file ({FORMAT})")
        depth = int(z["depth"])
        return cls.from_parents([z[f"parent_{t}"] for t in range(1, depth + 1)])


# --------------------------------------------------------------------------- k-means


def _local_columns(E: sp.csr_matrix) -> sp.csr_matrix:
    """Re-index ``E``'s columns to those that occur, in their order (keeps per-node work
    nnz-bounded): :func:`xmc_steps.columns.occurring_columns`, O(nnz + d) time and one int32 array of
    nnz where the entries are many for the width, where ``np.unique(..., return_inverse)`` sorted a
    copy of the indices and held two int64 arrays of nnz (at the root of a Wiki-500K-shaped tree, 82 M
    entries: about 1.6 GB of temporaries), and a sort of the entries' columns in a deep node's few."""
    if E.nnz == 0:
        return sp.csr_matrix((E.shape[0], 1), dtype=np.float32)
    cols, new_id = occurring_columns(E.indices, E.shape[1])
    return sp.csr_matrix((E.data, new_id, E.indptr), shape=(E.shape[0], len(cols)))


def _side_sums(E: sp.csr_matrix, side: np.ndarray) -> np.ndarray:
    """``2 x m`` float32: row ``s`` the sum of ``E``'s rows on side ``s``, what ``(ind.T @ E).toarray()``
    of the 0/1 side indicator ``ind`` (``n x 2`` CSR) gave, bit for bit and in the same memory layout
    (Fortran order: the product is a CSC matrix; the norms that follow reduce over that layout, and a
    C-ordered copy would sum in another order).  Each entry is summed in float32 over the rows in
    ascending order, as the sparse product sums it (column by column of ``E`` after a CSC conversion);
    here one pass over ``E``'s CSR arrays (``E.T`` is a CSC view of them: scipy's ``csc_matvecs`` adds
    ``E[i, c] * onehot[i, s]`` row after row, the other side's term an exact zero) without the
    conversion, the symbolic product and the sparse result (two thirds of the clustering's time on
    yso-finna-sv-full)."""
    onehot = np.zeros((E.shape[0], 2), dtype=np.float32)
    onehot[np.arange(E.shape[0]), side] = 1.0
    return (E.T @ onehot).T


def balanced_2means(E: sp.csr_matrix, rng: np.random.Generator, max_iter: int = 20) -> np.ndarray:
    """Balanced spherical 2-means of the rows of ``E`` (unit-norm rows expected).

    Returns a 0/1 int8 array: ``ceil(n/2)`` rows in side 0 (those most similar to
    centroid 0 relative to centroid 1) and ``floor(n/2)`` in side 1.
    """
    n = E.shape[0]
    side = np.zeros(n, dtype=np.int8)
    if n < 2:
        return side
    E = _local_columns(sp.csr_matrix(E, dtype=np.float32))
    n0 = (n + 1) // 2
    i0, i1 = rng.choice(n, size=2, replace=False)
    cent = E[[i0, i1]].toarray()
    prev = None
    for _ in range(max(1, max_iter)):
        diff = cent[0] - cent[1]
        score = E @ diff
        order = np.argsort(-score, kind="stable")
        side = np.ones(n, dtype=np.int8)
        side[order[:n0]] = 0
        if prev is not None and np.array_equal(side, prev):
            break
        prev = side
        cent = _side_sums(E, side)
        norms = np.linalg.norm(cent, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        cent /= norms
    return side


#: a depth with at least this many nodes to split, of at most ``LEVEL_BATCH_SIZE`` labels on average, is
#: split by :func:`_split_level` (all its nodes in one set of array operations), else by
#: :func:`balanced_2means` node by node: the same splits either way.  Large nodes gain nothing from it
#: (their own arrays are large already); small ones spent most of their time in per-node overhead
#: (a Wiki-500K-shaped tree's deepest depth, 4,096 nodes of 122 labels, 3-5x the top depths' time per label)
LEVEL_BATCH_NODES = 16
LEVEL_BATCH_SIZE = 512
#: ... and of fewer than this many stored entries per node on average: with its centroid sums in one pass
#: (:func:`_side_sums`) and a deep node's columns sorted (:func:`_local_columns`), the node-by-node
#: split costs less per label than the level at once on nodes of more entries (CPU time: yso-finna-sv-full's
#: depths 7-8, 36,000 and 18,000 entries per node: 18 and 15 us per label node by node, 52 and 34 at once;
#: a Wiki-500K-shaped embedding's nodes of 61 labels, 2,456 entries: 6.1 node by node, 5.4 at once, 7.7 at
#: its root)
LEVEL_BATCH_NODE_NNZ = 4096
#: stored entries of the embedding split together at most (unless one node has more): bounds the dense
#: centroids (2 x the group's columns) and the group's copies
LEVEL_BATCH_NNZ = 1 << 22


def _node_norms(cent: np.ndarray, col_ptr: np.ndarray) -> np.ndarray:
    """``np.linalg.norm(cent[:, a:b], axis=1)`` of each column segment ``a:b`` of ``col_ptr``
    (``2 x segments``), computed as :func:`balanced_2means` computes it on a node's own ``2 x m``
    block: segments of one length are stacked and reduced along that last axis (the same sums)."""
    m = np.diff(col_ptr)
    out = np.zeros((2, len(m)), dtype=np.float32)
    for length in np.unique(m):
        if length == 0:
            continue
        sel = np.flatnonzero(m == length)
        cols = col_ptr[sel][:, None] + np.arange(length)[None, :]
        out[:, sel] = np.linalg.norm(cent[:, cols], axis=2)
    return out


def _keep_nodes(E: sp.csr_matrix, node: np.ndarray, col_ptr: np.ndarray, nodes: np.ndarray, keep: np.ndarray):
    """The rows and columns of the nodes ``nodes[keep]`` only (``nodes``: the nodes of ``E``'s rows in
    order, one column segment of ``col_ptr`` each): the kept rows' positions, ``E``'s rows of those
    nodes with their columns renumbered in the same order, their node ids, and the new column pointer.
    What a step then costs follows the nodes still splitting, not the whole depth."""
    wanted = np.zeros(int(node.max(initial=-1)) + 1 if len(node) else 0, dtype=bool)
    wanted[nodes[keep]] = True
    rows = np.flatnonzero(wanted[node]) if len(node) else np.zeros(0, dtype=np.int64)
    lens = np.diff(col_ptr)
    new_id = np.cumsum(np.repeat(keep, lens)) - 1
    Ek = E[rows] if len(rows) < E.shape[0] else E
    n_cols = int(lens[keep].sum())
    Ek = sp.csr_matrix((Ek.data, new_id[Ek.indices].astype(np.int32), Ek.indptr), shape=(len(rows), max(n_cols, 1)))
    ptr = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(lens[keep], out=ptr[1:])
    return rows, Ek, node[rows], ptr


def _entry_ranges(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions of the stored entries of ``rows`` (a CSR ``indptr``), row after row."""
    a = indptr[rows].astype(np.int64)
    n = indptr[rows + 1].astype(np.int64) - a
    if not n.sum():
        return np.zeros(0, dtype=np.int64)
    first = np.repeat(a - np.r_[0, np.cumsum(n)[:-1]], n)
    return first + np.arange(int(n.sum()), dtype=np.int64)


def _node_columns(E: sp.csr_matrix, node_of_row: np.ndarray, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's column renumbered within its row's node: node ``j``'s columns that occur get the
    ids ``col_ptr[j] .. col_ptr[j+1]-1`` in column order (what :func:`_local_columns` gives each node
    on its own).  One sort of the entries' (node, column) keys: a key's rank among the distinct keys
    is the new id (3-6x faster than the two counting sorts and four gathers over all entries this did
    before: a CSC conversion, then a stable sort by node)."""
    nnz = E.nnz
    if nnz == 0:
        return np.zeros(0, dtype=np.int32), np.zeros(n_nodes + 1, dtype=np.int64)
    d = max(int(E.shape[1]), 1)
    key = np.repeat(np.asarray(node_of_row, dtype=np.int64) * d, np.diff(E.indptr)) + E.indices
    uniq, inv = np.unique(key, return_inverse=True)
    col_ptr = np.searchsorted(uniq, np.arange(n_nodes + 1, dtype=np.int64) * d).astype(np.int64)
    return inv.astype(np.int32).reshape(-1), col_ptr


def _top_half(score: np.ndarray, node: np.ndarray, half: np.ndarray) -> np.ndarray:
    """Side 0 for the ``half[j]`` best rows of each node ``j`` (rows of a node together, in order), 1
    for the others: a stable ``argsort(-score)`` per node, as :func:`balanced_2means` splits, ties
    going to the earlier row.  Each node's threshold is its ``half``-th best score, from one partition
    of a nodes x rows block; only the rows tied with it are counted in order."""
    n = len(score)
    starts = np.flatnonzero(np.concatenate(([True], node[1:] != node[:-1])))
    ids = node[starts]
    cnt = np.diff(np.append(starts, n))
    pos = np.arange(n) - np.repeat(starts, cnt)
    block = np.full((len(starts), int(cnt.max())), -np.inf, dtype=np.float32)
    block[np.repeat(np.arange(len(starts)), cnt), pos] = score
    h = half[ids]
    ks = np.unique(h)
    part = -np.partition(-block, ks - 1, axis=1)
    thr = part[np.arange(len(starts)), h - 1]                  # each node's half-th best score
    t = np.repeat(thr, cnt)
    above = score > t
    tied = np.flatnonzero(score == t)                          # in (node, row) order already
    room = h - np.add.reduceat(above, starts)                  # ties a node takes: the earliest
    seg = np.repeat(np.arange(len(starts)), cnt)[tied]
    first_tie = np.searchsorted(seg, seg, side="left")
    side = np.ones(n, dtype=np.int8)
    side[above] = 0
    side[tied[(np.arange(len(tied)) - first_tie) < room[seg]]] = 0
    return side


def _split_level(emb: sp.csr_matrix, order: np.ndarray, bounds: list[tuple[int, int]],
                 rngs: list[np.random.Generator | None], max_iter: int) -> np.ndarray:
    """:func:`balanced_2means` of every node of one depth at once: node ``j`` holds the rows
    ``order[a:b]`` (``(a, b) = bounds[j]``) and draws its two seeds from ``rngs[j]``; returns the side
    of each row of ``order`` (int8), equal to the node-by-node result.

    The nodes' rows are stacked with their columns re-indexed per node (node ``j``'s used columns get
    ids of their own, in order: :func:`_node_columns`), so one sparse product scores every row against
    its own node's centroids, one partition finds each node's better half (:func:`_top_half`), and one
    product sums each node's new centroids; every sum runs over the same entries in the same order as
    the node's own product did, and each centroid's norm is taken over the node's own columns
    (:func:`_node_norms`).  A node stops when its split repeats, as :func:`balanced_2means` does; once
    most rows belong to stopped nodes they are left out (:func:`_keep_nodes`)."""
    n_nodes = len(bounds)
    starts = np.array([a for a, _ in bounds] + [len(order)], dtype=np.int64)
    sizes = np.diff(starts)
    node_of_row = np.repeat(np.arange(n_nodes, dtype=np.int64), sizes)
    E = emb[order]
    cols, col_ptr = _node_columns(E, node_of_row, n_nodes)
    E = sp.csr_matrix((E.data, cols, E.indptr), shape=(E.shape[0], max(int(col_ptr[-1]), 1)))
    side = np.zeros(len(order), dtype=np.int8)
    active = np.flatnonzero(sizes >= 2)
    if not len(active):
        return side
    # the nodes that split (2 rows or more) and their columns only
    rows, Ea, node, col_ptr = _keep_nodes(E, node_of_row, col_ptr, np.arange(n_nodes), sizes >= 2)
    # the seeds: rows i0, i1 of each node as its two centroids
    cent = np.zeros((2, Ea.shape[1]), dtype=np.float32)
    seeds = np.array([rngs[j].choice(int(sizes[j]), size=2, replace=False) for j in active], dtype=np.int64)
    pos = np.zeros(n_nodes + 1, dtype=np.int64)                   # a node's first row within Ea
    np.cumsum(np.bincount(node, minlength=n_nodes), out=pos[1:])
    for c in range(2):
        e = _entry_ranges(Ea.indptr, pos[active] + seeds[:, c])
        cent[c, Ea.indices[e]] = Ea.data[e]
    half = (sizes + 1) // 2
    present = active                       # the nodes whose rows Ea holds (some may be done)
    is_active = np.zeros(n_nodes, dtype=bool)
    is_active[active] = True
    prev = None
    last = max(1, max_iter) - 1
    for it in range(last + 1):
        score = Ea @ (cent[0] - cent[1])
        new = _top_half(score, node, half)
        live = is_active[node]                        # rows of the nodes still splitting
        side[rows[live]] = new[live]
        if prev is not None:
            changed = np.zeros(n_nodes, dtype=bool)
            changed[node[(new != prev) & live]] = True
            done = active[~changed[active]]           # a node whose split repeated is done
            if len(done):
                is_active[done] = False
                active = active[changed[active]]
                if 2 * int(sizes[active].sum()) < len(rows):     # most rows are done: leave them out
                    kept, Ea, node, col_ptr = _keep_nodes(Ea, node, col_ptr, present, is_active[present])
                    rows, new, present = rows[kept], new[kept], active
        if not len(active) or it == last:
            break
        prev = new
        cent = _side_sums(Ea, new)
        norms = _node_norms(cent, col_ptr)
        norms[norms == 0] = 1.0
        full = np.ones((2, cent.shape[1]), dtype=np.float32)
        full[:, :col_ptr[-1]] = np.repeat(norms, np.diff(col_ptr), axis=1)
        cent /= full
    return side


def tree_levels(n_labels: int, branching: int, leaf_size: int, min_leaves: int = 1) -> tuple[int, list[int]]:
    """Binary depth ``D`` and the binary levels kept for a ``branching``-ary tree (ascending).

    ``min_leaves``: a floor on the finest level's cluster count, ``D >= ceil(log2(min_leaves))``
    (never deeper than one label per leaf): a small label space keeps that many clusters where
    ``leaf_size`` alone would give it a handful (ELIAS's ``cluster.min_clusters``)."""
    if branching < 2 or branching & (branching - 1):
        raise ValueError(f"branching factor must be a power of 2 (>= 2), got {branching}")
    if leaf_size < 1:
        raise ValueError(f"leaf size must be >= 1, got {leaf_size}")
    if min_leaves < 1:
        raise ValueError(f"the minimum number of leaf clusters must be >= 1, got {min_leaves}")
    D = max(1, math.ceil(math.log2(max(n_labels, 1) / leaf_size))) if n_labels > leaf_size else 1
    if min_leaves > 1:
        D = max(D, min(math.ceil(math.log2(min_leaves)), max(1, math.floor(math.log2(max(n_labels, 2))))))
    k = int(round(math.log2(branching)))
    levels = sorted(lv for lv in range(D, 0, -k))
    return D, levels


def hierarchical_kmeans(
    emb: sp.spmatrix,
    branching: int = 16,
    leaf_size: int = 100,
    seed: int = 0,
    max_iter: int = 20,
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
    min_leaves: int = 1,
) -> ClusterTree:
    """Balanced hierarchical spherical k-means over the rows of ``emb`` (``L x d``); at least
    ``min_leaves`` finest clusters (:func:`tree_levels`)."""
    emb = sp.csr_matrix(emb, dtype=np.float32)
    L = emb.shape[0]
    if L < 1:
        raise ValueError("no labels to cluster")
    D, keep = tree_levels(L, branching, leaf_size, min_leaves)
    codes = np.zeros(L, dtype=np.int64)
    kept: dict[int, np.ndarray] = {}
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    try:
        for depth in range(D):
            order = np.argsort(codes, kind="stable")
            uniq, starts = np.unique(codes[order], return_index=True)
            bounds = list(zip(starts, list(starts[1:]) + [L]))

            def split(j: int, depth: int = depth, order=order, uniq=uniq, bounds=bounds):
                a, b = bounds[j]
                idx = order[a:b]
                rng = np.random.default_rng([seed, depth, int(uniq[j])])
                return idx, balanced_2means(emb[idx], rng, max_iter)

            new = codes * 2
            if (len(uniq) >= LEVEL_BATCH_NODES and L <= LEVEL_BATCH_SIZE * len(uniq)
                    and emb.nnz < LEVEL_BATCH_NODE_NNZ * len(uniq)):
                rngs = [np.random.default_rng([seed, depth, int(u)]) if b - a >= 2 else None
                        for u, (a, b) in zip(uniq, bounds)]
                # consecutive nodes in groups of at most LEVEL_BATCH_NNZ entries (one node at least):
                # a group's dense centroids span its nodes' columns only
                nnz = np.zeros(len(order) + 1, dtype=np.int64)
                np.cumsum(np.diff(emb.indptr)[order], out=nnz[1:])
                ends = nnz[[b for _, b in bounds]]
                j = 0
                while j < len(bounds):
                    k = max(j + 1, int(np.searchsorted(ends, nnz[bounds[j][0]] + LEVEL_BATCH_NNZ, side="right")))
                    a0, b0 = bounds[j][0], bounds[k - 1][1]
                    new[order[a0:b0]] += _split_level(emb, order[a0:b0], [(a - a0, b - a0) for a, b in bounds[j:k]],
                                                      rngs[j:k], max_iter)
                    j = k
            else:
                results = pool.map(split, range(len(uniq))) if pool else map(split, range(len(uniq)))
                for idx, side in results:
                    new[idx] += side
            codes = new
            if depth + 1 in keep:
                kept[depth + 1] = codes.copy()
            if progress:
                sizes = np.bincount(codes)
                progress(f"depth {depth + 1}/{D}: {len(uniq) * 2} nodes, sizes {sizes.min()}..{sizes.max()}")
    finally:
        if pool:
            pool.shutdown()
    return ClusterTree.from_assignments([kept[lv] for lv in keep])
