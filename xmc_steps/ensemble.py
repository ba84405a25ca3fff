"""Ensembles of prediction tables (X-Transformer Table 5 rows 7-9; ELIAS's 3 models).

Each member is a prediction table (top-k labels and scores per document).  Scores of
different models are not on one scale, so the combination is configurable:

* ``average``: the mean of the members' scores (a label a member did not return
  counts as 0 for it);
* ``rank-average``: each member's ``r``-th label (0-based) scores ``1 - r / k``,
  then the mean (scale-free; a missing label counts as 0);
* ``softmax-average``: each member's top-k scores turned into a softmax over its own
  list (temperature 1), then the mean;
* ``sigmoid-average``: the mean of ``sigmoid(score)`` (for raw margins; scores already in
  (0, 1] are better averaged directly).

The result keeps the top ``topk`` labels per document; ties go to the lower label index.

The stage that writes an ensemble's prediction table is :mod:`xmc_steps.stages.ensemble`.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import scipy.sparse as sp

from .search import topk_per_row

#: how members' scores are combined
Method = Literal["average", "rank-average", "softmax-average", "sigmoid-average"]
METHODS = get_args(Method)


def _rank_scores(P: sp.csr_matrix) -> sp.csr_matrix:
    """Replace each row's scores by ``1 - rank / k`` (rank 0 = best; ties -> lower index)."""
    P = sp.csr_matrix(P, dtype=np.float32, copy=True)
    for i in range(P.shape[0]):
        a, b = P.indptr[i], P.indptr[i + 1]
        if b == a:
            continue
        order = np.lexsort((P.indices[a:b], -P.data[a:b]))
        r = np.empty(b - a, np.float32)
        r[order] = np.arange(b - a, dtype=np.float32)
        P.data[a:b] = 1.0 - r / (b - a)
    return P


def _softmax_rows(P: sp.csr_matrix) -> sp.csr_matrix:
    P = sp.csr_matrix(P, dtype=np.float32, copy=True)
    for i in range(P.shape[0]):
        a, b = P.indptr[i], P.indptr[i + 1]
        if b > a:
            z = P.data[a:b] - P.data[a:b].max()
            e = np.exp(z)
            P.data[a:b] = e / e.sum()
    return P


def combine(members: list[sp.csr_matrix], method: str = "average", topk: int = 100,
            weights: list[float] | None = None) -> sp.csr_matrix:
    """Combine score matrices (all N x L) by ``method``; top-``topk`` per row.  ``weights`` (one per member,
    summing to 1) replace the plain mean by a weighted one."""
    if method not in METHODS:
        raise ValueError(f"unknown ensemble method {method!r}; expected one of {METHODS}")
    if not members:
        raise ValueError("an ensemble needs at least one member")
    shape = members[0].shape
    for m in members:
        if m.shape != shape:
            raise ValueError(f"members differ in shape: {m.shape} vs {shape}")
    if weights is not None and len(weights) != len(members):
        raise ValueError(f"{len(weights)} weights for {len(members)} members")
    out = sp.csr_matrix(shape, dtype=np.float32)
    for i, m in enumerate(members):
        m = sp.csr_matrix(m, dtype=np.float32)
        if method == "rank-average":
            m = _rank_scores(m)
        elif method == "softmax-average":
            m = _softmax_rows(m)
        elif method == "sigmoid-average":
            m = m.copy()
            m.data = (1.0 / (1.0 + np.exp(-m.data))).astype(np.float32)
        out = out + (m if weights is None else m.multiply(np.float32(weights[i])).tocsr())
    if weights is None:
        out = out.multiply(np.float32(1.0 / len(members))).tocsr()
    return topk_per_row(out, topk)


def ranking(members: list[sp.csr_matrix], method: str, topk: int, weights: list[float] | None = None,
            member: int | None = None) -> sp.csr_matrix:
    """One :func:`candidates` entry's ranking: ``member`` alone (its top ``topk``), or the combination at
    ``weights``; the ensemble stage, its validation choice, serving and the bench all rank through it."""
    if member is not None:
        return topk_per_row(sp.csr_matrix(members[int(member)]), topk)
    return combine(members, method, topk, weights)


#: the first member's weights an ensemble of two is measured at on validation (the plain mean is 0.5)
WEIGHTS = (0.25, 0.5, 0.75)


def candidates(n_members: int) -> list[tuple[str, list[float] | None, int | None]]:
    """``(name, weights, member)`` of every ranking an ensemble stage measures on validation: each member
    alone (``member``), and the combination, at :data:`WEIGHTS` for two members, else the plain mean."""
    out: list[tuple[str, list[float] | None, int | None]] = [(f"member {i}", None, i) for i in range(n_members)]
    if n_members == 2:
        out += [("combined" if w == 0.5 else f"combined(w={w:g})", None if w == 0.5 else [w, 1.0 - w], None)
                for w in WEIGHTS]
    elif n_members > 2:
        out.append(("combined", None, None))
    return out
