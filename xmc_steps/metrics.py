"""XMC ranking metrics: P@k, nDCG@k, PSP@k, PSnDCG@k, R@k and per-decile recall.

A small functional API (same spirit as pyxclib): every metric takes ``scores`` and
``truth`` and returns a 1-D ``float64`` array holding the metric at cut-offs
``1..k`` (``result[j - 1]`` is the metric @j), as a **fraction in [0, 1]**.
:func:`all_metrics` turns them into the flat, MLflow-safe dictionary that the
evaluate stage writes, as **percentages (0-100)**, the unit of the papers' tables.

Inputs
------
``scores``
    ``N x L`` scipy sparse matrix (any format; CSR is used as-is) or dense array.
    *Sparse*: every stored entry is a prediction; a missing entry means "not
    predicted" (so a row with 3 stored entries has a top-k list of length 3 for any
    k >= 3, and the missing ranks count as misses).  *Dense*: every entry is a
    prediction (zeros and negative scores are ranked too), except ``NaN`` and
    ``-inf`` which mean "not predicted".  A stored ``NaN``/``-inf`` in a sparse
    matrix also means "not predicted".  Consequently a sparse matrix and its dense
    counterpart give identical results whenever the dense matrix has ``-inf`` (or
    ``NaN``) where the sparse one has no entry (or when every row has at least
    ``k`` stored entries, and the implicit zeros never outrank them).
``truth``
    ``N x L`` sparse or dense 0/1 relevance matrix; any non-zero counts as relevant.

Conventions
-----------
* **Ranking and ties.**  Each row is ranked by score, highest first; equal scores
  are ordered by label index, lower index first (the same rule as
  :func:`xmc_steps.io.csr_to_topk`).  The rule is deterministic and independent of
  the input format.
* **Documents without any true label** are excluded from every average (the
  denominators count only documents with at least one relevant label);
  :func:`n_docs_without_labels` gives their number, which the results file
  reports.  If no document has a label, the metric functions return ``NaN``.
* **P@k** = (1/k) * #relevant in the top k, averaged over documents: it divides by
  k even when a document has fewer than k relevant labels (the standard XMC
  convention, so P@5 <= |y|/5 for such a document).
* **nDCG@k** = DCG@k / IDCG@k with DCG@k = sum_{j<=k} rel_j / log2(j + 1) and the
  ideal IDCG@k = sum_{j <= min(k, |y|)} 1 / log2(j + 1): a document with fewer than
  k relevant labels can still reach 1.
* **R@k** = #relevant in the top k / |y|, averaged over documents.
* **Propensity-scored metrics** weigh a relevant label l by its inverse propensity
  w_l (:func:`inverse_propensity`).  Following pyxclib / the Extreme Classification
  Repository, they are **normalised by the best achievable value**: the dataset
  mean of the weighted metric for the predictions divided by the dataset mean of
  the same weighted metric for the ideal ranking (the document's relevant labels
  ordered by decreasing w_l).  So a perfect ranking gives 1 (100 %).

  - PSP@k = sum_i (1/k) sum_{j<=k} rel_ij w_{r_ij}  /  sum_i (1/k) sum_{j<=k} w*_ij
  - PSnDCG@k = sum_i PSDCG_i@k / IDCG_i@k  /  sum_i PSDCG*_i@k / IDCG_i@k,
    with PSDCG_i@k = sum_{j<=k} rel_ij w_{r_ij} / log2(j + 1) (Jain et al. 2016),
    IDCG_i@k the unweighted ideal DCG above, and ``*`` the ideal ranking.

* **Labels unseen in training** have training frequency N_l = 0 and therefore the
  largest inverse propensity, 1 + C * B^(-A); they are ranked and counted like any
  other label.  In :func:`decile_recall` they fall into the last (tail) decile.

Memory
------
Nothing of size ``N x L`` is ever built.  Rows are processed in chunks; for each
chunk only the top-k label indices (``n x k``) and the chunk's rows of ``truth``
are materialised, so N = 800k, L = 500k with top-100 sparse scores works in a few
hundred MiB.  A dense ``scores`` array is processed a few rows at a time.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import scipy.sparse as sp

__all__ = [
    "precision",
    "ndcg",
    "psprecision",
    "psndcg",
    "recall",
    "inverse_propensity",
    "propensity_constants",
    "label_deciles",
    "decile_recall",
    "n_docs_without_labels",
    "all_metrics",
    "METRIC_KEYS",
    "DECILE_KEY",
]

#: Scalar keys produced by :func:`all_metrics`, in order.
METRIC_KEYS: tuple[str, ...] = (
    "p_at_1", "p_at_3", "p_at_5",
    "ndcg_at_1", "ndcg_at_3", "ndcg_at_5",
    "psp_at_1", "psp_at_3", "psp_at_5",
    "psndcg_at_1", "psndcg_at_3", "psndcg_at_5",
    "recall_at_10", "recall_at_20", "recall_at_100",
)
#: List-valued key of :func:`all_metrics`: per-decile contribution to recall@100.
DECILE_KEY = "decile_recall_at_100"

#: what the metric names mean, one paragraph (MLflow has no metric descriptions: the dataset's experiment and
#: each target's parent run carry it, :mod:`xmc_steps.tracking`)
GLOSSARY = (
    "Metrics (percent, on the test split): p_at_k: precision@k, the share of the top k that are true labels; "
    "ndcg_at_k: nDCG@k; psp_at_k: propensity-scored precision@k (Jain et al., KDD 2016), precision where each "
    "true label counts by its inverse propensity 1 + C (N_l + B)^-A (rare labels count more), normalised by the "
    "best achievable: it rewards finding tail labels; psndcg_at_k: the same weighting on nDCG@k; recall_at_k: "
    "the share of a document's true labels in its top k; decile_recall_at_100_dNN: recall@100 over the labels of "
    "frequency decile NN (d01 the rarest).  Costs: train_s (seconds of the target's training stages), "
    "predict_ms_per_doc (end to end from raw text, batched), model_mb (the trained files).")

CURVE_KEY = "recall_curve"

_WIKI_SETS = frozenset({"wikilshtc-325k", "wiki500k"})
_AMAZON_SETS = frozenset({"amazoncat13k", "amazon670k", "amazon3m", "lf-amazontitles131k"})

# Target number of elements (rows x columns) materialised per chunk.
_CHUNK_ELEMS = 1 << 21


# --------------------------------------------------------------------------- propensity


def propensity_constants(dataset_name: str) -> tuple[float, float]:
    """The (A, B) propensity constants of Jain et al. 2016 for a canonical dataset name.

    (0.5, 0.4) for the large Wikipedia sets (``wikilshtc-325k``, ``wiki500k``); (0.6, 2.6)
    for the Amazon sets (``amazoncat13k``, ``amazon670k``, ``amazon3m``,
    ``lf-amazontitles131k``); (0.55, 1.5) for everything else, Wiki10-31K included (it
    uses the default in Jain et al. 2016 and pyxclib).  Case-insensitive, exact names
    only (no prefix guessing); a dataset under another name sets its own constants with
    ``evaluate.propensity: {A, B}`` in config.yaml.
    """
    name = (dataset_name or "").strip().lower()
    if name in _WIKI_SETS:
        return 0.5, 0.4
    if name in _AMAZON_SETS:
        return 0.6, 2.6
    return 0.55, 1.5


def inverse_propensity(Y_train: Any, n_train: int | None = None, A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Inverse propensity per label (Jain et al. 2016): ``1 + C * (N_l + B)^(-A)``.

    ``C = (log N - 1) * (B + 1)^A`` with the natural log, ``N`` the number of training
    instances and ``N_l`` the number of training instances that carry label l.

    ``Y_train`` is either the ``N x L`` training label matrix (sparse or dense; any
    non-zero counts) or a 1-D array of per-label training frequencies, in which case
    ``n_train`` is required.  ``n_train`` overrides ``N`` (e.g. when ``Y_train`` is a
    subset).  Labels unseen in training have ``N_l = 0`` and get the largest weight
    ``1 + C * B^(-A)`` (``B`` must be > 0).  Returns a ``float64`` array of length L.
    """
    if B <= 0:
        raise ValueError("B must be > 0 (labels unseen in training would get an infinite weight)")
    if sp.issparse(Y_train) or np.ndim(Y_train) == 2:
        freq = label_frequency(Y_train)
        n = Y_train.shape[0] if n_train is None else int(n_train)
    else:
        freq = np.asarray(Y_train, dtype=np.float64).ravel()
        if n_train is None:
            raise ValueError("n_train is required when Y_train is a frequency vector")
        n = int(n_train)
    if n < 1:
        raise ValueError("the number of training instances must be >= 1")
    c = (math.log(n) - 1.0) * (B + 1.0) ** A
    return 1.0 + c * np.power(freq.astype(np.float64) + B, -A)


def label_frequency(Y: Any) -> np.ndarray:
    """Number of rows of ``Y`` (sparse or dense) in which each label is non-zero."""
    if sp.issparse(Y):
        Y = sp.csc_matrix(Y)
        Y.eliminate_zeros()
        return np.diff(Y.indptr).astype(np.int64)
    return (np.asarray(Y) != 0).sum(axis=0).astype(np.int64)


# --------------------------------------------------------------------------- ranking core


def _as_scores(scores: Any) -> sp.csr_matrix | np.ndarray:
    if sp.issparse(scores):
        s = scores.tocsr() if scores.format != "csr" else scores
        return s
    s = np.asarray(scores)
    if s.ndim != 2:
        raise ValueError("scores must be 2-D (N x L)")
    return s


def _as_truth(truth: Any) -> sp.csr_matrix:
    t = sp.csr_matrix(truth, copy=True)
    t.data = (t.data != 0).astype(np.float32)
    t.eliminate_zeros()
    t.sum_duplicates()
    t.sort_indices()
    t.data[:] = 1.0
    return t


def _topk_from_entries(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, k: int) -> np.ndarray:
    """Top-k label indices per row from (row, col, value) triples; -1 pads short rows.

    Order: higher value first, ties to the lower label index.  NaN and -inf entries
    are dropped (not predicted).
    """
    keep = ~np.isnan(vals) & (vals != -np.inf)
    if not keep.all():
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
    top = np.full((n, k), -1, dtype=np.int64)
    if rows.size == 0 or k == 0:
        return top
    order = np.lexsort((cols, -vals.astype(np.float64), rows))
    r = rows[order]
    counts = np.bincount(r, minlength=n)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    rank = np.arange(r.size, dtype=np.int64) - starts[r]
    sel = rank < k
    top[r[sel], rank[sel]] = cols[order][sel]
    return top


def _topk_chunk(chunk: sp.csr_matrix | np.ndarray, k: int) -> np.ndarray:
    n = chunk.shape[0]
    if sp.issparse(chunk):
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(chunk.indptr))
        return _topk_from_entries(rows, chunk.indices.astype(np.int64), np.asarray(chunk.data), n, k)
    s = np.array(chunk, dtype=np.float64)
    s[np.isnan(s)] = -np.inf
    L = s.shape[1]
    if L > k:
        # Threshold = k-th largest value per row; keep everything >= it (ties at the
        # boundary included), then rank the survivors exactly.
        thr = np.partition(s, L - k, axis=1)[:, L - k]
        mask = s >= thr[:, None]
    else:
        mask = np.ones_like(s, dtype=bool)
    rows, cols = np.nonzero(mask)
    return _topk_from_entries(rows.astype(np.int64), cols.astype(np.int64), s[rows, cols], n, k)


def _hits(top: np.ndarray, t: sp.csr_matrix) -> np.ndarray:
    """Boolean ``n x k``: is ``top[i, j]`` a relevant label of row i (``t`` sorted CSR)."""
    n, k = top.shape
    L = np.int64(t.shape[1])
    t_rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(t.indptr))
    t_keys = t_rows * L + t.indices.astype(np.int64)  # sorted: rows ascending, indices sorted
    keys = np.arange(n, dtype=np.int64)[:, None] * L + top
    if t_keys.size == 0:
        return np.zeros((n, k), dtype=bool)
    pos = np.searchsorted(t_keys, keys)
    pos_c = np.minimum(pos, t_keys.size - 1)
    return (top >= 0) & (pos < t_keys.size) & (t_keys[pos_c] == keys)


def _chunks(scores: Any, truth: Any, k: int, chunk_rows: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, sp.csr_matrix]]:
    s = _as_scores(scores)
    t = _as_truth(truth)
    if s.shape != t.shape:
        raise ValueError(f"scores {s.shape} and truth {t.shape} differ in shape")
    if k < 1:
        raise ValueError("k must be >= 1")
    n_rows, L = s.shape
    if chunk_rows is None:
        width = max(k, L if not sp.issparse(s) else 1, 1)
        chunk_rows = max(1, min(65536, _CHUNK_ELEMS // width))
    for a in range(0, n_rows, chunk_rows):
        b = min(n_rows, a + chunk_rows)
        tc = t[a:b]
        top = _topk_chunk(s[a:b], k)
        yield top, _hits(top, tc), tc


def _disc(k: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(2, k + 2, dtype=np.float64))


def _ideal_weights(tc: sp.csr_matrix, w: np.ndarray, k: int) -> np.ndarray:
    """``n x k``: each row's relevant-label weights sorted decreasingly, zero-padded."""
    n = tc.shape[0]
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(tc.indptr))
    vals = w[tc.indices]
    out = np.zeros((n, k), dtype=np.float64)
    if rows.size == 0:
        return out
    order = np.lexsort((-vals, rows))
    r = rows[order]
    starts = tc.indptr[:-1].astype(np.int64)
    rank = np.arange(r.size, dtype=np.int64) - starts[r]
    sel = rank < k
    out[r[sel], rank[sel]] = vals[order][sel]
    return out


def _accumulate(
    scores: Any,
    truth: Any,
    k: int,
    inv_propensity: np.ndarray | None = None,
    label_bins: np.ndarray | None = None,
    n_bins: int = 0,
    chunk_rows: int | None = None,
) -> dict[str, Any]:
    """One pass over the rows; sums of every per-document quantity at cut-offs 1..k."""
    L = truth.shape[1]
    if inv_propensity is not None:
        w = np.asarray(inv_propensity, dtype=np.float64).ravel()
        if w.shape[0] != L:
            raise ValueError(f"inv_propensity has {w.shape[0]} entries, expected {L}")
    if label_bins is not None:
        label_bins = np.asarray(label_bins, dtype=np.int64).ravel()
        if label_bins.shape[0] != L:
            raise ValueError(f"label_bins has {label_bins.shape[0]} entries, expected {L}")
    disc = _disc(k)
    idcg_table = np.cumsum(disc)
    js = np.arange(1, k + 1, dtype=np.float64)
    acc: dict[str, Any] = {
        "n_docs": 0, "n_empty": 0,
        "p": np.zeros(k), "ndcg": np.zeros(k), "recall": np.zeros(k),
        "psp_num": np.zeros(k), "psp_den": np.zeros(k),
        "psndcg_num": np.zeros(k), "psndcg_den": np.zeros(k),
        "decile": np.zeros(n_bins),
    }
    for top, hits, tc in _chunks(scores, truth, k, chunk_rows):
        n_true = np.diff(tc.indptr).astype(np.int64)
        m = n_true > 0
        acc["n_empty"] += int((~m).sum())
        acc["n_docs"] += int(m.sum())
        if not m.any():
            continue
        top, hits, n_true_m = top[m], hits[m], n_true[m]
        hits_f = hits.astype(np.float64)
        cum_hits = np.cumsum(hits_f, axis=1)
        acc["p"] += (cum_hits / js).sum(axis=0)
        acc["recall"] += (cum_hits / n_true_m[:, None]).sum(axis=0)
        idcg = idcg_table[np.minimum(np.arange(k)[None, :], n_true_m[:, None] - 1)]
        acc["ndcg"] += (np.cumsum(hits_f * disc, axis=1) / idcg).sum(axis=0)
        if inv_propensity is not None:
            gains = np.where(hits, w[np.maximum(top, 0)], 0.0)
            ideal = _ideal_weights(tc[np.flatnonzero(m)], w, k)
            acc["psp_num"] += (np.cumsum(gains, axis=1) / js).sum(axis=0)
            acc["psp_den"] += (np.cumsum(ideal, axis=1) / js).sum(axis=0)
            acc["psndcg_num"] += (np.cumsum(gains * disc, axis=1) / idcg).sum(axis=0)
            acc["psndcg_den"] += (np.cumsum(ideal * disc, axis=1) / idcg).sum(axis=0)
        if label_bins is not None and n_bins > 0:
            r, c = np.nonzero(hits)
            acc["decile"] += np.bincount(label_bins[top[r, c]], weights=1.0 / n_true_m[r], minlength=n_bins)[:n_bins]
    return acc


def _mean(total: np.ndarray, n: int) -> np.ndarray:
    if n == 0:
        return np.full(np.shape(total), np.nan)
    return np.asarray(total, dtype=np.float64) / n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


# --------------------------------------------------------------------------- public metrics


def precision(scores: Any, truth: Any, k: int = 5) -> np.ndarray:
    """P@1..k (fractions): mean over labelled documents of #relevant in top j / j.

    Divides by j even when a document has fewer than j relevant labels.  Documents
    without labels are excluded.  Ties: higher score first, then lower label index.
    """
    acc = _accumulate(scores, truth, k)
    return _mean(acc["p"], acc["n_docs"])


def ndcg(scores: Any, truth: Any, k: int = 5) -> np.ndarray:
    """nDCG@1..k (fractions): DCG@j / IDCG@j with IDCG over min(j, |y|) ideal hits.

    Gains are binary, discount 1/log2(rank + 1).  Documents without labels are
    excluded.  Ties: higher score first, then lower label index.
    """
    acc = _accumulate(scores, truth, k)
    return _mean(acc["ndcg"], acc["n_docs"])


def psprecision(scores: Any, truth: Any, inv_propensity: Any, k: int = 5) -> np.ndarray:
    """PSP@1..k (fractions), normalised by the best achievable PSP@j.

    ``sum_i (1/j) sum_{r<=j} rel_ir w_r`` divided by the same sum for the ideal
    ranking (each document's relevant labels by decreasing inverse propensity), so a
    perfect ranking scores 1.  ``inv_propensity``: length-L array
    (:func:`inverse_propensity`).  Documents without labels are excluded.
    """
    acc = _accumulate(scores, truth, k, inv_propensity=inv_propensity)
    return _ratio(acc["psp_num"], acc["psp_den"])


def psndcg(scores: Any, truth: Any, inv_propensity: Any, k: int = 5) -> np.ndarray:
    """PSnDCG@1..k (fractions), normalised by the best achievable PSnDCG@j.

    Per document PSDCG@j / IDCG@j (Jain et al. 2016; IDCG the unweighted ideal DCG
    over min(j, |y|) ranks), summed over documents and divided by the same sum for
    the ideal ranking (relevant labels by decreasing inverse propensity).  Documents
    without labels are excluded.
    """
    acc = _accumulate(scores, truth, k, inv_propensity=inv_propensity)
    return _ratio(acc["psndcg_num"], acc["psndcg_den"])


def recall(scores: Any, truth: Any, k: int = 100) -> np.ndarray:
    """R@1..k (fractions): mean over labelled documents of #relevant in top j / |y|."""
    acc = _accumulate(scores, truth, k)
    return _mean(acc["recall"], acc["n_docs"])


def document_hits(scores: Any, truth: Any, k: int = 5) -> np.ndarray:
    """Boolean ``n x k``: whether each document's ``j``-th ranked label is relevant (ties: higher score
    first, then the lower label index), for per-document comparisons of two rankings (paired tests)."""
    return _hits(_topk_chunk(_as_scores(scores), k), _as_truth(truth))


def label_deciles(train_freq: Any, n_bins: int = 10) -> np.ndarray:
    """Bin id (0 = head .. n_bins-1 = tail) of every label, ELIAS Fig. 5 style.

    Labels are sorted by training frequency, most frequent first (ties: lower label
    index first), and the sorted list is cut into ``n_bins`` groups of (as nearly as
    possible) **equal numbers of labels** (``numpy.array_split``: the first
    ``L mod n_bins`` groups get one label more).  Labels unseen in training
    (frequency 0) therefore end up in the last, tail bins.
    """
    f = np.asarray(train_freq).ravel()
    L = f.shape[0]
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    order = np.lexsort((np.arange(L), -f.astype(np.float64)))
    bins = np.empty(L, dtype=np.int64)
    for b, part in enumerate(np.array_split(order, n_bins)):
        bins[part] = b
    return bins


def decile_recall(scores: Any, truth: Any, train_freq: Any, k: int = 100, n_bins: int = 10) -> np.ndarray:
    """Per-label-decile contribution to recall@k (fractions), as in ELIAS Fig. 5 (right).

    Reading of the paper (Fig. 5 caption and Sec. 4: "decile wise contribution to
    recall@100"; "1st decile represents labels with most training points ... 10th
    decile ... least training points"):

    * **binning** (:func:`label_deciles`): all L labels sorted by training frequency,
      descending, split into ``n_bins`` groups with equal numbers of labels (not equal
      training mass); bin 0 = head, last bin = tail; unseen labels are in the tail;
    * **value**: "contribution", i.e. for bin d the mean over labelled documents of
      ``#(relevant labels of bin d in the top k) / |y|``, where |y| counts *all* the
      document's relevant labels.  The bins therefore sum to R@k exactly (it is not
      recall restricted to the bin's labels).

    Returns an array of length ``n_bins``.  Documents without labels are excluded.
    """
    bins = label_deciles(train_freq, n_bins)
    acc = _accumulate(scores, truth, k, label_bins=bins, n_bins=n_bins)
    return _mean(acc["decile"], acc["n_docs"])


def n_docs_without_labels(truth: Any) -> int:
    """Number of rows of ``truth`` without any relevant label (excluded from metrics)."""
    t = _as_truth(truth)
    return int((np.diff(t.indptr) == 0).sum())


def zero_shot(scores: Any, truth: Any, train_freq: Any, k: int = 100) -> dict[str, Any] | None:
    """Metrics over the labels training never saw, as **percentages (0-100)**; None when the test
    split has none.

    The reading (the dual-encoder issue: "the test documents whose labels never occur in training"):
    the unseen labels are those with ``train_freq == 0`` (the training labels the caller counts: train,
    and valid where a method fits on it); the documents are the test documents with at least one
    unseen label, and their truth is restricted to the unseen labels.  The rankings are the methods'
    own, unchanged: P@j counts the unseen relevant labels among a document's top j (a method that
    scores only labels it was trained on gets 0), R@j the share of a document's unseen labels in its
    top j.  Keys: ``n_docs``, ``n_labels`` (unseen labels that occur in test), ``p_at_{1,3,5}``,
    ``recall_at_{10,100}``.
    """
    freq = np.asarray(train_freq).ravel()
    t = _as_truth(truth)
    unseen = freq == 0
    tz = t.multiply(sp.csr_matrix(unseen.astype(np.float32))).tocsr()
    tz.eliminate_zeros()
    rows = np.flatnonzero(np.diff(tz.indptr) > 0)
    if rows.size == 0:
        return None
    S = _as_scores(scores)
    acc = _accumulate(S[rows], tz[rows], k)
    n = acc["n_docs"]
    p, rec = _mean(acc["p"], n), _mean(acc["recall"], n)
    out: dict[str, Any] = {"n_docs": int(rows.size), "n_labels": int(np.unique(tz.indices).size)}
    out.update({f"p_at_{j}": float(100.0 * p[j - 1]) for j in (1, 3, 5)})
    out.update({f"recall_at_{j}": float(100.0 * rec[j - 1]) for j in (10, 100)})
    return out


def all_metrics(
    scores: Any,
    truth: Any,
    inv_propensity: Any,
    train_freq: Any,
    n_bins: int = 10,
    chunk_rows: int | None = None,
    curve: bool = False,
) -> dict[str, Any]:
    """Every reported metric in one pass, as **percentages (0-100)**.

    Keys (no ``@``: MLflow rejects it): ``p_at_{1,3,5}``, ``ndcg_at_{1,3,5}``,
    ``psp_at_{1,3,5}``, ``psndcg_at_{1,3,5}``, ``recall_at_{10,20,100}`` (floats) and
    ``decile_recall_at_100`` (list of ``n_bins`` floats, head decile first; they sum
    to ``recall_at_100``); with ``curve=True`` also ``recall_curve``, R@1..100 (a list, for
    the recall@k plots).  Conventions as in the module docstring.  Raises ``ValueError`` when
    no document has a relevant label.
    """
    k = 100
    bins = label_deciles(train_freq, n_bins)
    acc = _accumulate(scores, truth, k, inv_propensity=inv_propensity, label_bins=bins,
                      n_bins=n_bins, chunk_rows=chunk_rows)
    n = acc["n_docs"]
    if n == 0:
        raise ValueError("no document has a relevant label: metrics are undefined")
    p = _mean(acc["p"], n)
    nd = _mean(acc["ndcg"], n)
    psp = _ratio(acc["psp_num"], acc["psp_den"])
    psn = _ratio(acc["psndcg_num"], acc["psndcg_den"])
    rec = _mean(acc["recall"], n)
    out: dict[str, Any] = {}
    for name, arr, ks in (("p", p, (1, 3, 5)), ("ndcg", nd, (1, 3, 5)), ("psp", psp, (1, 3, 5)),
                          ("psndcg", psn, (1, 3, 5)), ("recall", rec, (10, 20, 100))):
        for j in ks:
            out[f"{name}_at_{j}"] = float(100.0 * arr[j - 1])
    out[DECILE_KEY] = [float(100.0 * v) for v in _mean(acc["decile"], n)]
    if curve:
        out[CURVE_KEY] = [float(100.0 * v) for v in rec]
    return out
