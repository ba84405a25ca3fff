"""Label embeddings for semantic label indexing (X-Transformer §3.2).

``pifa-tfidf`` (Positive Instance Feature Aggregation): the embedding of label ``l``
is the sum of the TF-IDF rows of the training instances that carry ``l``, L2-normalised,
i.e. ``normalize(Y^T X)``.  The result is a sparse ``L x d`` CSR matrix (float32).

Later issues add ``pifa-neural`` (the same aggregation over neural instance
embeddings) and ``text-emb`` (embeddings of label texts); the CLI keeps ``--kind``.

CLI::

    python -m xmc_steps.label_embedding --features X_train.npz --labels Y_train.npz \
        --out label_emb.npz [--kind pifa-tfidf] [common args]
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp

from . import io
from .stage import StageError, add_common_args, cli_main, stage_run

KINDS = ("pifa-tfidf",)


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


def _stack(paths: list[str]) -> sp.csr_matrix:
    mats = [io.load_csr(p) for p in paths]
    return mats[0] if len(mats) == 1 else sp.vstack(mats, format="csr")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.label_embedding", description=__doc__.split("\n")[0])
    p.add_argument("--features", required=True, action="extend", nargs="+", help="instance features (.npz CSR), rows stacked in order")
    p.add_argument("--labels", required=True, action="extend", nargs="+", help="label matrices (.npz CSR), aligned with --features")
    p.add_argument("--out", required=True, help="label embedding (.npz CSR, L x d)")
    p.add_argument("--kind", default="pifa-tfidf", choices=KINDS, help="label embedding kind")
    add_common_args(p)
    args = p.parse_args(argv)
    with stage_run("label_embedding", args, outputs=[args.out]) as st:
        if len(args.features) != len(args.labels):
            raise StageError("give as many --labels as --features")
        X = _stack(args.features)
        Y = _stack(args.labels)
        if X.shape[0] != Y.shape[0]:
            raise StageError(f"features have {X.shape[0]} rows but labels have {Y.shape[0]}")
        st.params.update(kind=args.kind)
        with st.timed("embed"):
            emb = pifa(X, Y)
        n_empty = int(np.sum(np.diff(emb.indptr) == 0))
        st.log.info("label embedding %s: %d labels x %d dims, nnz %d, %d labels without positives",
                    args.kind, emb.shape[0], emb.shape[1], emb.nnz, n_empty)
        st.metric("n_labels", emb.shape[0])
        st.metric("nnz", emb.nnz)
        st.metric("labels_without_positives", n_empty)
        io.save_csr(args.out, emb)
        st.output("label_emb", args.out)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
