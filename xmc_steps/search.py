"""Tree search: the pieces every method uses to score candidates and walk a cluster tree.

A cluster tree (:class:`~xmc_steps.cluster_tree.ClusterTree`) is given by matrices ``C[0..T-1]``
(``C[t]`` maps the nodes of level ``t+1`` to their parents at level ``t``).  Prediction walks it
by beam search: :func:`expand_children` ("children of the beam"), a per-level scorer, and
:func:`topk_per_row` ("top-b per row", also a matcher's top-b clusters).  :func:`beam_search`
takes any per-level scorer; :func:`linear_scorer` is the one of linear rankers (XR-Linear,
X-Transformer §3.4): ``parent * transform(w . [x; bias])`` over the candidates only
(:func:`masked_product`).  :func:`matcher_scores` is a neural matcher's ``w_k . phi(x)`` on a
candidate pattern (X-Transformer Eq. 3).

Transforms: ``sigmoid``, ``l2-hinge`` = ``exp(-max(0, 1-z)^2)``, ``l3-hinge`` =
``exp(-max(0, 1-z)^3)``, ``identity``.
"""

from __future__ import annotations

from typing import Callable, Literal, get_args

import numpy as np
import scipy.sparse as sp

from . import io
from .errors import StageError

#: the score transforms a parameter class accepts (the ``transform`` of XR-Linear, the X-Transformer rankers
#: and ELIAS++); :func:`transform` also takes ``identity``
Transform = Literal["sigmoid", "l2-hinge", "l3-hinge"]
TRANSFORMS = (*get_args(Transform), "identity")


def transform(z: np.ndarray, kind: str = "l3-hinge") -> np.ndarray:
    """Map raw ranker scores to (0, 1] (``identity`` leaves them as they are)."""
    z = np.asarray(z, dtype=np.float32)
    if kind == "l3-hinge":
        h = np.maximum(0.0, 1.0 - z)
        return np.exp(-(h * h * h))
    if kind == "l2-hinge":
        h = np.maximum(0.0, 1.0 - z)
        return np.exp(-(h * h))
    if kind == "sigmoid":
        return (1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))).astype(np.float32)
    if kind == "identity":
        return z
    raise ValueError(f"unknown transform {kind!r}; expected one of {TRANSFORMS}")


def topk_per_row(M: sp.spmatrix, k: int | np.ndarray) -> sp.csr_matrix:
    """Keep the ``k`` largest entries of each row of ``M`` (ties -> lower column index);
    ``k`` may be one count per row (a CSR ``M`` then).

    Works on a CSR score matrix (e.g. a matcher's cluster scores) or a dense array; the
    result is CSR with sorted indices.  This is the "top-b clusters" of a matcher.
    """
    per_row = np.ndim(k) > 0
    if not sp.issparse(M) and not per_row:
        A = np.asarray(M, dtype=np.float32)
        n, m = A.shape
        k = min(k, m)
        if k <= 0:
            return sp.csr_matrix((n, m), dtype=np.float32)
        part = np.argpartition(-A, k - 1, axis=1)[:, :k] if k < m else np.tile(np.arange(m), (n, 1))
        part.sort(axis=1)
        vals = np.take_along_axis(A, part, axis=1)
        out = sp.csr_matrix((vals.ravel(), part.ravel(), np.arange(0, n * k + 1, k)), shape=(n, m))
        return out
    M = sp.csr_matrix(M)
    lens = np.diff(M.indptr)
    if not per_row:
        if k <= 0:
            return sp.csr_matrix(M.shape, dtype=M.dtype)
        if lens.max(initial=0) <= k:
            out = M.copy()
            out.sort_indices()
            return out
    keep, indptr = top_entries(M, k)
    out = sp.csr_matrix((M.data[keep], M.indices[keep], indptr), shape=M.shape)
    out.sort_indices()
    return out


def top_entries(M: sp.csr_matrix, k: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keep, indptr)``: the stored positions of each row's ``k`` largest entries of the CSR ``M``
    (ascending, so in ``M``'s order; ties -> lower column index) and the row pointer of the CSR they
    make.  :func:`topk_per_row`'s selection, for callers that cut arrays aligned with ``M``'s entries."""
    rows, order, rank = io.row_ranks(M)
    keep = np.sort(order[rank < (np.asarray(k)[rows] if np.ndim(k) > 0 else k)])
    indptr = np.zeros(M.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows[keep], minlength=M.shape[0]), out=indptr[1:])
    return keep, indptr


def expand_children(beam: sp.csr_matrix, C_t: sp.csr_matrix) -> sp.csr_matrix:
    """Candidates at level ``t+1``: the children of each row's beam nodes at level ``t``.

    ``beam`` is ``N x n_t`` (scores of the kept nodes), ``C_t`` is ``n_{t+1} x n_t``; the
    result is ``N x n_{t+1}``, each child carrying its parent's score.
    """
    out = (sp.csr_matrix(beam) @ C_t.T.tocsr()).tocsr()
    out.sort_indices()
    return out


def masked_product(Xa: sp.csr_matrix, Wc: sp.csc_matrix, cand: sp.csr_matrix,
                   batch_entries: int = 1 << 21, dense_budget: int = 1 << 24,
                   dense_share: float = 0.5) -> np.ndarray:
    """``(Xa @ Wc)[i, j]`` for every stored entry ``(i, j)`` of ``cand``, in ``cand``'s order.

    Features stored in at least ``dense_share`` of the rows (the neural block of ``TF-IDF ⊕
    neural`` features, the bias) are scored per candidate: ``x_dense(i) . w_dense(j)`` for the
    candidates only, ``O(candidates x dense features)``, where a row-block product would cost
    ``rows x labels x dense features``.  The other (sparse) features go by row batches of about
    ``batch_entries`` candidates: a batch multiplies only the columns of ``Wc`` its candidates
    use (all of ``Wc`` when they cover most of it) and gathers the candidates from a dense
    block when it has at most ``dense_budget`` cells, else by :func:`_gather`.
    """
    cand = sp.csr_matrix(cand)
    Xa = sp.csr_matrix(Xa)
    Wc = sp.csc_matrix(Wc)
    n, m = cand.shape
    out = np.zeros(cand.nnz, dtype=np.float32)
    if cand.nnz == 0:
        return out
    lens = np.diff(cand.indptr)
    dense = _dense_features(Xa, dense_share)
    if len(dense) >= 8:
        Xd = Xa[:, dense].toarray()                              # n x k
        Wd = sp.csr_matrix(Wc[dense, :].T)                       # m x k
        rows_all = np.repeat(np.arange(n, dtype=np.int64), lens)
        step = max(1, (1 << 24) // len(dense))
        for a in range(0, cand.nnz, step):
            r, c = rows_all[a:a + step], cand.indices[a:a + step]
            out[a:a + len(r)] = np.einsum("ek,ek->e", Xd[r], Wd[c].toarray())
        Xa = Xa.copy()                                           # the sparse rest: the dense columns dropped
        Xa.data[np.isin(Xa.indices, dense)] = 0
        Xa.eliminate_zeros()
        if Xa.nnz == 0:
            return out
    # batch boundaries: consecutive rows with about batch_entries candidates each
    cuts = np.searchsorted(cand.indptr, np.arange(0, cand.nnz, batch_entries), side="right") - 1
    bounds = np.unique(np.concatenate([cuts, [n]]))
    bounds = bounds[(bounds >= 0)]
    if bounds[0] != 0:
        bounds = np.concatenate([[0], bounds])
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        a, b = cand.indptr[r0], cand.indptr[r1]
        if b == a:
            continue
        idx = cand.indices[a:b]
        cols, local = np.unique(idx, return_inverse=True)
        if len(cols) > 0.5 * m:
            Wsub, local = Wc, idx
        else:
            Wsub = Wc[:, cols]
        # (W^T X^T): the CSC weights transposed are CSR for free, so only the batch's rows change
        # layout; X @ W would convert the weight columns to CSR on every call (most of a
        # one-document prediction)
        Zt = (Wsub.T @ Xa[r0:r1].T).tocsr()                          # labels x rows
        rows = np.repeat(np.arange(r1 - r0), lens[r0:r1])
        if (r1 - r0) * Wsub.shape[1] <= dense_budget:
            out[a:b] += Zt.toarray()[local, rows]
        else:
            out[a:b] += _gather(Zt, local, rows)
    return out


def _dense_features(Xa: sp.csr_matrix, dense_share: float = 0.5) -> np.ndarray:
    """The features :func:`masked_product` scores per candidate: stored in at least ``dense_share`` of
    the rows, for 8 rows or more (none otherwise)."""
    n = Xa.shape[0]
    if n >= 8 and Xa.nnz:
        return np.flatnonzero(np.bincount(Xa.indices, minlength=Xa.shape[1]) >= dense_share * n)
    return np.zeros(0, dtype=np.int64)


def uses_dense_block(Xa: sp.csr_matrix) -> bool:
    """Whether :func:`masked_product` scores ``Xa``'s rows with a dense block (8 features or more in
    half the rows or more: the neural block of ``TF-IDF ⊕ neural``), which sums in another order."""
    return len(_dense_features(sp.csr_matrix(Xa))) >= 8


def _gather(Z: sp.csr_matrix, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``Z[rows[e], cols[e]]`` (0 where ``Z`` stores nothing) by one vectorised binary search over
    the row-major keys of the sorted entries.  (scipy's ``Z[rows, cols]`` scans each requested
    row linearly unless the request is a tenth of ``Z``'s entries: 41 of the 45 s of an
    xr-linear prediction of 2,000 yso-finna-sv-50k documents.)"""
    Z = sp.csr_matrix(Z)
    Z.sum_duplicates()          # sorted column ids, no duplicates
    ncol = np.int64(Z.shape[1])
    keys = np.repeat(np.arange(Z.shape[0], dtype=np.int64), np.diff(Z.indptr)) * ncol + Z.indices
    q = np.asarray(rows, dtype=np.int64) * ncol + np.asarray(cols, dtype=np.int64)
    if not len(keys):
        return np.zeros(len(q), dtype=np.float32)
    pos = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
    return np.where(keys[pos] == q, Z.data[pos], 0).astype(np.float32)


#: documents per beam search in prediction: each level's candidate block of that many rows stays
#: small enough to gather from a dense array (yso-finna-sv-50k, 4,000 documents, 1 thread: 1.1-1.8
#: ms/document at 256 against 3.3-4.0 at 8,192; debtags 0.45 against 0.57; bench/bench_predict.py)
PREDICT_BATCH = 256


def linear_scorer(Xa: sp.csr_matrix, Ws: list[sp.spmatrix], kind: str = "l3-hinge") -> Callable:
    """A :func:`beam_search` scorer for linear rankers: ``parent * transform(w . x)``."""
    Wcs = [sp.csc_matrix(W) for W in Ws]

    def score(t: int, cand: sp.csr_matrix) -> sp.csr_matrix:
        z = masked_product(Xa, Wcs[t], cand)
        out = cand.copy()
        # floored so that a path score never becomes 0 (scipy drops zeros: the candidate would
        # vanish); beam_search rescales rows before their best path gets near the floor
        out.data = np.maximum(cand.data * np.maximum(transform(z, kind), SCORE_FLOOR), PATH_FLOOR).astype(np.float32)
        return out

    return score


#: the smallest value a transformed score takes (a level's factor in a path score, a matcher's or a
#: ranker's score in Eq. 2): ``exp(-(1 - z)^3)`` is 0 in float32 from ``z`` of about -3.5, and scipy
#: drops stored zeros, so the candidate would vanish; and the smallest path score (float32's smallest
#: normal number).  Rows whose best path falls below ``RESCALE_BELOW`` are divided by that best
#: score, which leaves every ranking within the row unchanged
SCORE_FLOOR = np.float32(1e-30)
PATH_FLOOR = np.finfo(np.float32).tiny
RESCALE_BELOW = np.float32(1e-15)


def rescale_small_rows(M: sp.csr_matrix) -> sp.csr_matrix:
    """Divide each row whose largest entry is below ``RESCALE_BELOW`` by that entry (in place):
    products of per-level probabilities down a deep tree would otherwise underflow float32."""
    if M.nnz == 0:
        return M
    lens = np.diff(M.indptr)
    nz = lens > 0
    mx = np.zeros(M.shape[0], dtype=np.float32)
    mx[nz] = np.maximum.reduceat(M.data, M.indptr[:-1][nz])
    small = nz & (mx < RESCALE_BELOW)
    if small.any():
        f = np.ones(M.shape[0], dtype=np.float32)
        f[small] = 1.0 / mx[small]
        M.data = np.maximum(M.data * np.repeat(f, lens), PATH_FLOOR).astype(np.float32)
    return M


def beam_search(C: list[sp.csr_matrix], score_level: Callable[[int, sp.csr_matrix], sp.csr_matrix],
                n: int, beam: int = 10, topk: int = 100, levels: int | None = None,
                start: sp.csr_matrix | None = None) -> sp.csr_matrix:
    """Beam search down a tree given by ``C`` (see :class:`~xmc_steps.cluster_tree.ClusterTree`).

    ``score_level(t, cand)`` receives the ``N x n_{t+1}`` candidates (children of the
    beam, data = parent score) and returns the same pattern with the nodes' scores.
    ``levels`` stops after that many levels (default: all, down to the labels) and
    ``start`` resumes from a beam at level ``T0`` (then ``C`` should begin at ``T0``).
    The last level keeps ``topk`` per row, the others ``beam``.  A row whose best kept score
    falls below ``RESCALE_BELOW`` is divided by it after each level (:func:`rescale_small_rows`),
    so a deep tree cannot underflow a document's scores to zeros that scipy would drop.
    """
    T = len(C) if levels is None else levels
    cur = start if start is not None else sp.csr_matrix(
        (np.ones(n, np.float32), np.zeros(n, np.int32), np.arange(n + 1)), shape=(n, 1))
    for t in range(T):
        cand = expand_children(cur, C[t])
        scored = score_level(t, cand)
        cur = rescale_small_rows(topk_per_row(scored, topk if t == len(C) - 1 else beam))
    return cur


def matcher_scores(pattern: sp.csr_matrix, emb: np.ndarray, head: np.ndarray, batch_entries: int = 1 << 20) -> sp.csr_matrix:
    """``g(x, k) = w_k . phi(x)`` (Eq. 3's matcher score, fp32) at every stored entry of ``pattern``."""
    pattern = sp.csr_matrix(pattern, dtype=np.float32)
    emb = np.asarray(emb, dtype=np.float32)
    head = np.asarray(head, dtype=np.float32)
    if emb.shape[0] != pattern.shape[0] or head.shape[0] != pattern.shape[1] or head.shape[1] != emb.shape[1]:
        raise StageError(f"matcher scores: embeddings {emb.shape}, head {head.shape} and candidates {pattern.shape} do not fit")
    rows = np.repeat(np.arange(pattern.shape[0]), np.diff(pattern.indptr))
    data = np.empty(pattern.nnz, dtype=np.float32)
    for a in range(0, pattern.nnz, batch_entries):
        r, c = rows[a:a + batch_entries], pattern.indices[a:a + batch_entries]
        data[a:a + len(r)] = np.einsum("ij,ij->i", emb[r], head[c])
    out = pattern.copy()
    out.data = data
    return out


def padded_to_csr(labels: np.ndarray, vals: np.ndarray, n_labels: int) -> sp.csr_matrix:
    """Per-row label ids and scores (``N x k``, ``-1`` = padding) as a CSR ``N x n_labels`` with sorted
    indices (a neural model's top-k, written by :func:`xmc_steps.io.write_predictions`)."""
    n = labels.shape[0]
    keep = labels >= 0
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(keep.sum(1), out=indptr[1:])
    m = sp.csr_matrix((vals[keep].astype(np.float32), labels[keep].astype(np.int32), indptr), shape=(n, n_labels))
    m.sort_indices()
    return m


# --------------------------------------------------------------------------- linear tree search by tables


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lens))`` without a Python loop."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if len(lens) == 1:
        return np.arange(int(starts[0]), int(starts[0]) + total, dtype=np.int64)
    ends = np.cumsum(lens)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lens), lens) + np.arange(total, dtype=np.int64)


def _topk_slots(row: np.ndarray, node: np.ndarray, score: np.ndarray, n: int, k: int, n_nodes: int) -> np.ndarray:
    """Positions of each row's ``k`` best candidates (ties -> lower node id), in (row, node) order;
    ``row`` is non-decreasing (each row's candidates together).  The ``k``-th best score of every row
    comes from one partition of a rows x candidates block; only the candidates tied with it are sorted."""
    cnt = np.bincount(row, minlength=n)
    if not len(row) or cnt.max() <= k:
        kept = np.arange(len(row))
    else:
        start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(cnt, out=start[1:])
        block = np.full((n, int(cnt.max())), -np.inf, dtype=np.float32)
        block[row, np.arange(len(row)) - start[row]] = score
        kth = -np.partition(-block, k - 1, axis=1)[:, k - 1]     # -inf where a row has fewer than k
        thr = kth[row]
        above = score > thr
        tied = np.flatnonzero(score == thr)
        if len(tied):
            room = k - np.bincount(row[above], minlength=n)        # how many of a row's ties fit
            tied = tied[np.lexsort((node[tied], row[tied]))]
            tr = row[tied]
            first = np.searchsorted(tr, tr, side="left")
            tied = tied[(np.arange(len(tied)) - first) < room[tr]]
        kept = np.concatenate([np.flatnonzero(above), tied])
    return kept[np.argsort(row[kept] * np.int64(n_nodes) + node[kept], kind="stable")]


class LinearTreeTables:
    """A linear tree model's rankers laid out for beam search (:meth:`search`): per level, the
    weights of each parent's children grouped by (parent, feature), so a document's beam reads only
    the weights of its own features under its own beam nodes.

    :meth:`search` gives the same bytes as :func:`beam_search` with :func:`linear_scorer` on the same
    rows: a node's raw score is the float32 sum of ``w_kj x_k`` over the document's features ``k`` in
    ascending order (the order of scipy's sparse product in :func:`masked_product`), then the same
    transform, floors, top-k (ties -> lower node id) and rescaling.  Built once per model: the
    sparse-matrix machinery per call (column slices, products, conversions) was most of a
    one-document prediction.
    """

    def __init__(self, C: list[sp.csr_matrix], Ws: list[sp.spmatrix]):
        self.levels = []
        for C_t, W in zip(C, Ws):
            C_t = sp.csr_matrix(C_t)
            n_child, n_parent = C_t.shape
            parent = C_t.indices.astype(np.int64)                     # parent of each child
            # children of each parent, ascending; a child's place among its siblings
            by_parent = np.argsort(parent, kind="stable")
            child_ptr = np.zeros(n_parent + 1, dtype=np.int64)
            np.cumsum(np.bincount(parent, minlength=n_parent), out=child_ptr[1:])
            local = np.empty(n_child, dtype=np.int64)
            local[by_parent] = np.arange(n_child) - child_ptr[parent[by_parent]]
            Wr = sp.csr_matrix(W, dtype=np.float32)                   # features x children
            Wr.sort_indices()
            D = Wr.shape[0]
            # entries ordered by (parent, feature, child): a stable sort of the CSR order by parent
            # (a radix sort on 16-bit parent ids where they fit)
            small = np.uint16 if n_parent <= 1 << 16 else np.int32
            order = np.argsort(parent.astype(small)[Wr.indices], kind="stable")
            p_o = parent.astype(np.int32)[Wr.indices[order]]
            f_o = np.repeat(np.arange(D, dtype=np.int32), np.diff(Wr.indptr))[order]
            if len(order):
                starts = np.flatnonzero(np.r_[True, (p_o[1:] != p_o[:-1]) | (f_o[1:] != f_o[:-1])])
            else:
                starts = np.zeros(0, np.int64)
            self.levels.append({
                "D": D, "n_child": n_child, "child_ptr": child_ptr, "children": by_parent,
                "keys": p_o[starts].astype(np.int64) * D + f_o[starts], "ptr": np.r_[starts, len(order)].astype(np.int64),
                "local": local.astype(np.int32)[Wr.indices[order]], "val": Wr.data[order]})
            del order, p_o, f_o

    @staticmethod
    def nbytes_for(Ws: list[sp.spmatrix]) -> int:
        """Memory of the tables of rankers ``Ws`` at their largest while built: the tables (a child's
        place and a weight per stored weight, a key and an offset per (parent, feature)) and the sort's
        temporaries (about 20 bytes per stored weight of the level being laid out)."""
        nnz = [int(W.nnz) for W in Ws]
        return 24 * sum(nnz) + 20 * max(nnz, default=0)

    def search(self, Xa: sp.csr_matrix, levels: int, beam: int, keep: int, kind: str) -> sp.csr_matrix:
        """Beam search of the rows of ``Xa`` (features with the bias column, CSR float32, sorted
        indices) down the first ``levels`` levels; the last keeps ``keep`` nodes per row, the others
        ``beam``.  CSR ``n x n_levels``, sorted indices (:func:`beam_search`'s result)."""
        n = Xa.shape[0]
        fptr = Xa.indptr.astype(np.int64)
        flen = np.diff(fptr)
        b_row = np.arange(n, dtype=np.int64)
        b_node = np.zeros(n, dtype=np.int64)
        b_score = np.ones(n, dtype=np.float32)
        for t in range(levels):
            lv = self.levels[t]
            k = keep if t == levels - 1 else beam
            # candidates: each beam node's children (slots grouped by beam entry)
            cp = lv["child_ptr"]
            nch = cp[b_node + 1] - cp[b_node]
            slot0 = np.zeros(len(b_node) + 1, dtype=np.int64)
            np.cumsum(nch, out=slot0[1:])
            s_ent = np.repeat(np.arange(len(b_node), dtype=np.int64), nch)
            s_node = lv["children"][_ranges(cp[b_node], nch)]
            s_row = b_row[s_ent]
            # raw scores: for each beam entry, its row's features (ascending) looked up under its node
            qlen = flen[b_row]
            q_ent = np.repeat(np.arange(len(b_node), dtype=np.int64), qlen)
            q_f = _ranges(fptr[b_row], qlen)
            q = b_node[q_ent] * lv["D"] + Xa.indices[q_f]
            keys = lv["keys"]
            z = np.zeros(len(s_node), dtype=np.float32)
            if len(keys) and len(q):
                pos = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
                hit = np.flatnonzero(keys[pos] == q)
                pos = pos[hit]
                seg = lv["ptr"][pos + 1] - lv["ptr"][pos]
                e = _ranges(lv["ptr"][pos], seg)
                rep = np.repeat(hit, seg)
                slot = slot0[q_ent[rep]] + lv["local"][e]
                np.add.at(z, slot, lv["val"][e] * Xa.data[q_f[rep]])   # per slot in feature order
            s = np.maximum(b_score[s_ent] * np.maximum(transform(z, kind), SCORE_FLOOR), PATH_FLOOR).astype(np.float32)
            kept = _topk_slots(s_row, s_node, s, n, k, lv["n_child"])
            b_row, b_node, b_score = s_row[kept], s_node[kept], s[kept]
            # rescale rows whose best path is small (rescale_small_rows)
            bounds = np.flatnonzero(np.concatenate(([True], b_row[1:] != b_row[:-1])))
            mx = np.maximum.reduceat(b_score, bounds)
            small = mx < RESCALE_BELOW
            if small.any():
                f = np.ones(len(mx), dtype=np.float32)
                f[small] = 1.0 / mx[small]
                b_score = np.maximum(b_score * np.repeat(f, np.diff(np.append(bounds, len(b_row)))),
                                     PATH_FLOOR).astype(np.float32)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(b_row, minlength=n), out=indptr[1:])
        n_out = self.levels[levels - 1]["n_child"] if levels else 1
        return sp.csr_matrix((b_score, b_node.astype(np.int32), indptr), shape=(n, n_out))
