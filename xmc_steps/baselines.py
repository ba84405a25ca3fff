"""The trivial baselines every learned index is compared with (the guards of the X-Transformer
matcher and of both ELIAS stages): always answering the most frequent training targets, and the
recall of a top-k answer against the truth.  Targets are clusters (the matcher) or labels (ELIAS)."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .negatives import binarize


def row_recalls(top: sp.spmatrix, truth: sp.spmatrix) -> np.ndarray:
    """Each row's recall of a top-k matrix against ``truth`` (the share of its positives among its
    stored entries); NaN for a row without positives."""
    T, Y = binarize(top), binarize(truth)
    if T.shape != Y.shape:
        raise ValueError(f"top-k matrix {T.shape} and targets {Y.shape} differ in shape")
    hits = np.asarray(T.multiply(Y).sum(axis=1)).ravel()
    npos = np.diff(sp.csr_matrix(Y).indptr).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(npos > 0, hits / npos, np.nan)


def recall_of_top(top: sp.spmatrix, truth: sp.spmatrix) -> float:
    """Recall of a top-k matrix against ``truth``: :func:`row_recalls` averaged over the rows with a positive."""
    r = row_recalls(top, truth)
    return float(np.nanmean(r)) if np.isfinite(r).any() else 0.0


def most_frequent_top(train: sp.spmatrix, n_rows: int, k: int) -> sp.csr_matrix:
    """The trivial answer: the ``k`` targets with most training rows, for every one of ``n_rows``
    rows (data: the targets' training counts; ties -> lower id)."""
    counts = np.asarray(binarize(train).sum(axis=0)).ravel()
    n_targets = len(counts)
    k = min(int(k), n_targets)
    top = np.sort(np.argsort(-counts, kind="stable")[:k]).astype(np.int32)
    data = np.tile(counts[top].astype(np.float32), n_rows)
    return sp.csr_matrix((data, np.tile(top, n_rows), np.arange(n_rows + 1, dtype=np.int64) * k),
                         shape=(n_rows, n_targets))
