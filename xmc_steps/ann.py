"""Nearest-neighbour search over label embeddings (faiss), for the dual-encoder methods.

A dual encoder scores a document against every label by the inner product of their
L2-normalised embeddings (cosine similarity); its prediction is the top-``k`` labels of that
score.  This module holds the label side: :func:`build_index` over the ``L x d`` label
embedding, :func:`search` / :func:`topk_csr` for batches of query (document) embeddings, and
:func:`save_index` / :func:`load_index` to keep the index next to a model.

Two kinds of index:

* ``"exact"``: ``faiss.IndexFlatIP``, brute force (a BLAS matrix product per batch of
  queries); exact top-``k``, memory ``4 L d`` bytes;
* ``"hnsw"``: ``faiss.IndexHNSWFlat`` with ``METRIC_INNER_PRODUCT`` (graph search; the full
  vectors are kept, so scores are exact inner products, only the candidate set is approximate);
  memory ``4 L d`` plus about ``8 M L`` bytes of links;
* ``"auto"`` (the default): exact up to :data:`EXACT_MAX` labels, HNSW above.

Contracts
---------
* ``search`` returns ``(scores, ids)``, both ``N x min(k, L)`` (``float32``, ``int64``), each
  row best first.  ``k`` is capped at ``L``.  No ``-1`` id is ever returned: faiss's HNSW may
  return fewer than ``k`` hits for a query (``-1`` ids, ``-inf`` scores) when its graph walk
  reaches fewer than ``k`` labels; such a row is answered again by exact search over the same
  vectors (the index keeps them), so every row holds ``min(k, L)`` distinct valid label ids
  (padding by the exact answer, never by a placeholder).  Ties in score are ordered as faiss
  leaves them (not necessarily lower id first); :func:`xmc_steps.io.csr_to_topk` re-ranks a
  CSR with ties to the lower id.
* ``topk_csr`` returns the pipeline's prediction format: an ``N x n_labels`` CSR matrix with
  ``min(k, L)`` entries per row, sorted indices, the inner products as ``float32`` data.  An
  inner product can be ``<= 0``: it is stored as an explicit entry (don't ``eliminate_zeros``).
* Label embeddings must be 2-D and finite, each row of unit L2 norm (within 1e-3) or all zero
  (a label without an embedding: it scores 0 against every query): the index scores by inner
  product, which is the cosine only for unit rows.  Queries must be finite and of the same
  ``d``; their norm scales the scores but does not change the ranking.
* HNSW searches with ``efSearch = max(ef_search, k)``: faiss 1.15 itself walks with
  ``efSearch`` even when it is below ``k``, which loses recall (measured: recall@100 0.65 at
  ``efSearch=16`` against 0.96 at 100).

Threads and determinism
-----------------------
``threads`` sets faiss's OpenMP thread count (``faiss.omp_set_num_threads``; the OpenMP build
of OpenBLAS inside the faiss wheel follows it) around each build and search, with
:data:`BLAS_MIN_QUERIES`, and restores both process-wide settings afterwards.  What holds
(faiss 1.15.1; the cheap ones are checked by tests/test_ann.py):

* exact: the answer is a deterministic function of the inputs, the batch and the thread
  count.  A call of fewer than :data:`BLAS_MIN_QUERIES` queries takes faiss's SIMD path, a
  larger one BLAS, and BLAS blocks the product by the batch's shape, so the *scores* of one
  query can differ in the last bits between batch sizes (4e-7 seen), which can swap near-ties.
  One against two threads gave identical answers here; faiss does not promise it (with more
  threads than queries it splits the labels across threads and merges their heaps);
* HNSW build: ``seed`` seeds the draw of each label's level (``hnsw.rng``; faiss's own default
  seed is 12345; its shuffle of the insertion order uses a fixed seed of its own).  With
  ``threads=1`` the graph is a deterministic function of ``(emb, seed, hnsw_m,
  ef_construction)`` (tested).  With more threads faiss inserts in parallel under per-node
  locks and does not promise the same graph from run to run (the runs tried here happened to
  agree): build on one thread for a reproducible index, and search with any count;
* HNSW search: each query walks the graph on its own (queries are split over threads), so a
  given graph answers the same whatever the thread count or batch (tested).

A saved index answers as the index that was saved (``efSearch`` is stored with an HNSW index;
the thread count is the loader's).

Measured defaults (:data:`EXACT_MAX`, :data:`EF_SEARCH`, the runs behind them): docs/ann.md.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Literal

import faiss
import numpy as np
import scipy.sparse as sp

from .io import atomic_path

__all__ = ["EXACT_MAX", "EF_SEARCH", "BLAS_MIN_QUERIES", "Index", "build_index", "search", "topk_csr", "save_index", "load_index"]

#: ``kind="auto"`` builds an exact index up to this many labels, HNSW above (measured: runs A-C above).
EXACT_MAX = 180_000
#: HNSW ``efSearch`` by default; a search walks with ``max(ef_search, k)`` (measured: runs A-C and E above).
EF_SEARCH = 256

#: Exact search multiplies a batch of at least this many queries by the label matrix with BLAS
#: (below it, one SIMD pass over the labels per query).  faiss 1.15 switches only at
#: ``queries * d >= 128000`` (334 queries at d=384); measured here at L=100000, d=384, one
#: thread, CPU ms per query: 1 query 11.6 (SIMD) / 29.5 (BLAS), 2: 11.5 / 15.2, 4: 11.5 / 7.7,
#: 16: 11.4 / 2.3, 256: 11.4 / 0.63.
BLAS_MIN_QUERIES = 4

#: Largest tolerated deviation of a label embedding's L2 norm from 1.
NORM_TOL = 1e-3

Kind = Literal["exact", "hnsw", "auto"]


@dataclass
class Index:
    """A built (or loaded) index: the faiss index, its kind, and the threads it runs with."""

    faiss_index: faiss.Index
    kind: Literal["exact", "hnsw"]
    threads: int = 1

    @property
    def n_labels(self) -> int:
        return int(self.faiss_index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.faiss_index.d)

    @property
    def ef_search(self) -> int | None:
        """HNSW's ``efSearch`` (``None`` for an exact index); settable."""
        return int(self.faiss_index.hnsw.efSearch) if self.kind == "hnsw" else None

    @ef_search.setter
    def ef_search(self, value: int) -> None:
        if self.kind != "hnsw":
            raise ValueError("ef_search applies to an HNSW index only")
        self.faiss_index.hnsw.efSearch = _positive_int(value, "ef_search")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@contextlib.contextmanager
def _faiss_settings(threads: int, d: int) -> Iterator[None]:
    """faiss's OpenMP thread count, and its BLAS switch (BLAS from :data:`BLAS_MIN_QUERIES`
    queries a call), set for the block and restored after it (both are process-wide)."""
    before = faiss.omp_get_max_threads(), faiss.cvar.distance_compute_blas_threshold
    faiss.omp_set_num_threads(threads)
    faiss.cvar.distance_compute_blas_threshold = BLAS_MIN_QUERIES * d
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before[0])
        faiss.cvar.distance_compute_blas_threshold = before[1]


def _as_matrix(x: np.ndarray, name: str, dim: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows x d), got shape {a.shape}")
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name} must be numeric, got {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dim is not None and a.shape[1] != dim:
        raise ValueError(f"{name} has d={a.shape[1]}, the index d={dim}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has non-finite values")
    return a


def build_index(emb: np.ndarray, kind: Kind = "auto", exact_max: int = EXACT_MAX, threads: int = 1,
                seed: int = 0, hnsw_m: int = 32, ef_construction: int = 200,
                ef_search: int = EF_SEARCH) -> Index:
    """An index over the label embedding ``emb`` (``L x d``, rows L2-normalised).

    ``kind``: ``"exact"`` (``IndexFlatIP``), ``"hnsw"`` (``IndexHNSWFlat``, inner product) or
    ``"auto"``: exact when ``L <= exact_max``, else HNSW.  ``threads``: OpenMP threads for the
    build and, kept on the index, for its searches.  ``seed``, ``hnsw_m``, ``ef_construction``,
    ``ef_search``: HNSW only (``seed`` draws the graph's levels; see the module docstring for
    what is reproducible)."""
    emb = _as_matrix(emb, "emb")
    L, d = emb.shape
    if L < 1 or d < 1:
        raise ValueError(f"emb must have at least one row and one column, got shape {emb.shape}")
    norms = np.linalg.norm(emb, axis=1)
    bad = np.flatnonzero((np.abs(norms - 1.0) > NORM_TOL) & (norms != 0))
    if len(bad):
        raise ValueError(f"emb rows must be L2-normalised (or all zero): {len(bad)} row(s) are not, the first is row "
                         f"{bad[0]} with norm {norms[bad[0]]:.6g} (divide by np.linalg.norm(emb, axis=1, keepdims=True))")
    threads = _positive_int(threads, "threads")
    exact_max = int(exact_max)
    if kind == "auto":
        kind = "exact" if L <= exact_max else "hnsw"
    if kind == "exact":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, _positive_int(hnsw_m, "hnsw_m"), faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = _positive_int(ef_construction, "ef_construction")
        index.hnsw.efSearch = _positive_int(ef_search, "ef_search")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
        index.hnsw.rng = faiss.RandomGenerator(int(seed))
    else:
        raise ValueError(f"kind must be 'exact', 'hnsw' or 'auto', got {kind!r}")
    with _faiss_settings(threads, d):
        index.add(emb)
    return Index(index, kind, threads)


def _exact_rows(index: Index, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` of ``q`` over the vectors the index holds (an HNSW index's storage)."""
    flat = index.faiss_index if index.kind == "exact" else faiss.downcast_index(index.faiss_index.storage)
    return flat.search(q, k)


def _complete(index: Index, q: np.ndarray, D: np.ndarray, I: np.ndarray, k: int) -> None:
    """Answer again, by exact search, every row with a ``-1`` id (in place)."""
    short = np.flatnonzero((I < 0).any(axis=1))
    if len(short):
        D[short], I[short] = _exact_rows(index, q[short], k)
        if (I[short] < 0).any():
            raise RuntimeError("faiss returned -1 ids from an exact search with k <= L")


def search(index: Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` labels of each query: ``(scores float32, ids int64)``, both ``N x min(k, L)``,
    best first, every id valid (see the module docstring)."""
    k = int(k)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    q = _as_matrix(queries, "queries", index.dim)
    k = min(k, index.n_labels)
    if k == 0 or len(q) == 0:
        return np.zeros((len(q), k), np.float32), np.zeros((len(q), k), np.int64)
    params = None
    if index.kind == "hnsw":                # faiss 1.15 searches with efSearch even when it is below k
        params = faiss.SearchParametersHNSW()
        params.efSearch = max(index.ef_search, k)
    with _faiss_settings(_positive_int(index.threads, "index.threads"), index.dim):
        D, I = index.faiss_index.search(q, k, params=params)
        _complete(index, q, D, I, k)
    return D.astype(np.float32, copy=False), I.astype(np.int64, copy=False)


def topk_csr(index: Index, queries: np.ndarray, k: int, n_labels: int) -> sp.csr_matrix:
    """The top-``k`` of each query as an ``N x n_labels`` CSR score matrix (the pipeline's
    prediction format): ``min(k, L)`` entries a row, sorted indices, inner products as data."""
    n_labels = int(n_labels)
    if n_labels < index.n_labels:
        raise ValueError(f"n_labels={n_labels} is smaller than the index's {index.n_labels} labels")
    D, I = search(index, queries, k)
    n, kk = I.shape
    idx_dtype = np.int32 if n_labels < 2**31 else np.int64
    indptr = np.arange(n + 1, dtype=np.int64) * kk
    m = sp.csr_matrix((D.reshape(-1), I.reshape(-1).astype(idx_dtype), indptr), shape=(n, n_labels))
    m.sort_indices()
    return m


def save_index(index: Index, path: str | os.PathLike) -> None:
    """Write the faiss index to ``path`` (``faiss.write_index``), atomically."""
    with atomic_path(path) as tmp:
        faiss.write_index(index.faiss_index, str(tmp))


def load_index(path: str | os.PathLike, threads: int = 1) -> Index:
    """Read an index written by :func:`save_index`; ``threads`` for its searches."""
    index = faiss.read_index(str(path))             # already of its concrete class (and owning it)
    if isinstance(index, faiss.IndexHNSWFlat) and index.metric_type == faiss.METRIC_INNER_PRODUCT:
        kind = "hnsw"
    elif isinstance(index, faiss.IndexFlatIP):
        kind = "exact"
    else:
        raise ValueError(f"{path}: not an index of this module ({type(index).__name__}, metric {index.metric_type})")
    return Index(index, kind, _positive_int(threads, "threads"))
