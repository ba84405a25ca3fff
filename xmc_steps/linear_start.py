"""The linear start of a neural head: a least-squares fit of the head's targets on the
*pre-trained* encoder's embeddings of the training texts, before fine-tuning begins.

A randomly initialised head over thousands of outputs, trained jointly with the encoder by a loss
averaged over the outputs (the X-Transformer matcher's squared hinge, LightXML's BCE), first drives
every output towards "negative"; the encoder's gradients are then noise and the model settles on
the label priors (the X-Transformer matcher at K = 2,048, LightXML on debtags).  Starting the head
from the closed-form ridge solution on the encoder's own features (XR-Transformer's "linear
bootstrap", the first half of linear-probe-then-fine-tune) gives fine-tuning a head that already
ranks.  Used by :mod:`xmc_steps.xtransformer.matcher` (``head_init: linear``) and :mod:`xmc_steps.lightxml`
(``head_init: linear``).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse as sp

from .negatives import binarize


def least_squares_bytes(n: int, d: int, k: int, chunk: int | None = None) -> int:
    """Memory of :func:`least_squares_head` on ``n x d`` embeddings for ``k`` outputs: the float64
    copy of the embeddings, the float64 right-hand side and solution of one block of outputs, and
    the float32 ``k x d`` result."""
    from .resources import dense_bytes

    block = k if chunk is None else min(k, max(1, int(chunk)))
    return dense_bytes(n, d, dtype=np.float64) + 2 * dense_bytes(block, d, dtype=np.float64) + dense_bytes(k, d)


def least_squares_head(emb: np.ndarray, targets: sp.spmatrix, l2: float = 0.001, scale: float = 1.0,
                       bias: bool = False, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W, b)``: the ridge fit of ``scale * (2T - 1)`` (``T`` = ``targets`` binarised, ``N x K``) on
    ``emb`` (``N x d``): ``W`` is ``K x d`` float32; ``b`` (``K``) is ``None`` unless ``bias``.

    Without bias: ``(E^T E + lam I) W^T = scale (2 E^T T - E^T 1)``.  With bias the embeddings are
    centred first (the bias is not penalised): ``W`` from the centred system, ``b = scale (2 mean(T)
    - 1) - W mean(E)``.  ``lam = l2 * trace(E^T E) / d`` (of the centred ``E`` with bias): ``l2`` is
    relative to the mean eigenvalue, so it means the same for any embedding scale.  One ``d x d``
    system for all outputs: ``O(N d^2 + nnz(T) d + K d^2)``; nothing is ``N x K``.  ``chunk``: solve
    for that many outputs at a time (one factorisation), so that beside ``W`` (float32) only a ``d x
    chunk`` block is held in float64 (LightXML's label embeddings: ``K`` = every label).
    """
    E = np.asarray(emb, dtype=np.float64)
    T = binarize(targets).astype(np.float64)
    if T.shape[0] != E.shape[0]:
        raise ValueError(f"targets have {T.shape[0]} rows but the embeddings {E.shape[0]}")
    d = E.shape[1]
    mu = E.mean(axis=0) if bias else np.zeros(d)
    if bias:
        E = E - mu
    G = E.T @ E
    G[np.diag_indices(d)] += float(l2) * max(np.trace(G) / d, 1e-12)
    factor = scipy.linalg.cho_factor(G)
    K = T.shape[1]
    step = K if chunk is None else max(1, int(chunk))
    Tc = T if step >= K else sp.csc_matrix(T)                      # column slices of CSC are cheap
    colsum = E.sum(axis=0)[:, None]                                  # 0 when centred
    t_mean = np.asarray(T.mean(axis=0)).ravel()
    W = np.empty((K, d), dtype=np.float32)
    b = np.empty(K, dtype=np.float32) if bias else None
    for a in range(0, K, step):
        z = min(K, a + step)
        Tk = Tc if step >= K else Tc[:, a:z]
        Wk = float(scale) * scipy.linalg.cho_solve(factor, 2.0 * np.asarray(Tk.T @ E).T - colsum).T   # chunk x d
        W[a:z] = Wk
        if bias:   # from the float64 block: no float64 copy of the whole W
            b[a:z] = float(scale) * (2.0 * t_mean[a:z] - 1.0) - Wk @ mu
    return W, b
