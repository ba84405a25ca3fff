"""The columns a set of sparse rows uses, renumbered in their order.

Clustering (a node's label embeddings) and the rankers (a cluster's training instances) both work on
a few rows of a wide matrix and renumber its columns to those that occur, so that their cost follows
the rows' entries, not the width ``d``.  :func:`occurring_columns` does it in one of two ways with the
same result: where the entries are few for the width it sorts their columns (``np.unique``,
O(nnz log nnz)); otherwise it marks the columns that occur and counts them (O(nnz + d)).  The
rankers' renumbering sorted every time before; at a Wiki-500K-shaped set's upper levels (25 M entries
per cluster, 2.1 M columns) that sort was 29% of the training's time.
"""

from __future__ import annotations

import numpy as np

#: sort the entries' columns where the columns outnumber the entries this many times (else mark the
#: columns that occur and count them: two passes over all ``d`` columns)
LOCAL_COLUMNS_SORT = 16


def occurring_columns(indices: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cols, new_id)``: the distinct values of ``indices`` (column ids below ``d``) in increasing
    order, and each entry's position among them (int32, one per entry): what ``np.unique(indices,
    return_inverse=True)`` gives, either way."""
    indices = np.asarray(indices).reshape(-1)
    if LOCAL_COLUMNS_SORT * len(indices) < d:
        cols, new_id = np.unique(indices, return_inverse=True)
        return cols.astype(np.int64), new_id.astype(np.int32).reshape(-1)
    present = np.zeros(d, dtype=bool)
    present[indices] = True
    rank = np.cumsum(present, dtype=np.int64) - 1
    return np.flatnonzero(present), rank[indices].astype(np.int32)
