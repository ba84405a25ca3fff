"""TF-IDF stage: documents -> L2-normalised sparse TF-IDF features (NPZ).

Fitted on the training documents only (train + valid: the validation split is carved
from the upstream train file and TF-IDF is unsupervised; test never contributes to the
vocabulary or the idf).  Word n-grams (default uni+bigrams), minimum document
frequency and vocabulary cap from config; sublinear tf (1 + log tf); smoothed idf;
rows L2-normalised.  For a BoW-layout dataset the given features are used as they are,
rows L2-normalised (their vocabulary is not known; ``vocab.parquet`` then lists
feature indices with idf 1).

Outputs in ``--out``: ``X_{train,valid,test}.npz`` (CSR float32, sorted indices),
``vocab.parquet`` (``term``, ``idf`` in feature-index order).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.preprocessing import normalize

from . import io
from .stage import add_common_args, cli_main, stage_run

SPLITS = ("train", "valid", "test")


def make_vectorizer(params: dict[str, Any]):
    from sklearn.feature_extraction.text import TfidfVectorizer

    lo, hi = params.get("ngram_range", [1, 2])
    return TfidfVectorizer(
        ngram_range=(int(lo), int(hi)),
        min_df=int(params.get("min_df", 2)),
        max_features=params.get("max_features"),
        sublinear_tf=bool(params.get("sublinear_tf", True)),
        lowercase=bool(params.get("lowercase", True)),
        norm="l2",
        dtype=np.float32,
    )


def fit_transform(train_texts: list[str], other: dict[str, list[str]], params: dict[str, Any]):
    """Fit on ``train_texts``; return (vectorizer, {"train": X, **{name: X}})."""
    vec = make_vectorizer(params)
    out = {"train": vec.fit_transform(train_texts)}
    for name, texts in other.items():
        out[name] = vec.transform(texts)
    return vec, out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.tfidf", description=__doc__.splitlines()[0])
    p.add_argument("--ingest", required=True, help="the ingest stage's output folder")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    src, out = Path(args.ingest), Path(args.out)
    names = [f"X_{s}.npz" for s in SPLITS] + ["vocab.parquet"]
    with stage_run("tfidf", args, outputs=[str(out / n) for n in names]) as st:
        if (src / "X_bow_train.npz").exists():
            st.log.info("BoW dataset: L2-normalising the given features")
            mats = {s: normalize(io.load_csr(src / f"X_bow_{s}.npz").astype(np.float32)) for s in SPLITS}
            d = mats["train"].shape[1]
            io.write_table(out / "vocab.parquet", {"term": [str(i) for i in range(d)], "idf": np.ones(d, np.float32)})
        else:
            texts = {s: io.read_table(src / f"docs_{s}.parquet", ["text"]).column("text").to_pylist() for s in SPLITS}
            st.log.info("fitting TF-IDF on %d train+valid documents", len(texts["train"]) + len(texts["valid"]))
            with st.timed("fit"):
                vec, mats = fit_transform(texts["train"] + texts["valid"], {}, st.params)
            t0 = time.perf_counter()
            mats["test"] = vec.transform(texts["test"])
            st.online_cost(time.perf_counter() - t0, len(texts["test"]))
            n_tr = len(texts["train"])
            full = mats.pop("train")
            mats = {"train": full[:n_tr], "valid": full[n_tr:], "test": mats["test"]}
            vocab = vec.get_feature_names_out()
            io.write_table(out / "vocab.parquet", {"term": vocab.astype(str), "idf": vec.idf_.astype(np.float32)})
        for s in SPLITS:
            io.save_csr(out / f"X_{s}.npz", sp.csr_matrix(mats[s], dtype=np.float32))
            st.metric(f"nnz_per_doc_{s}", mats[s].nnz / max(1, mats[s].shape[0]))
        st.metric("n_features", mats["train"].shape[1])
        st.log.info("%d features; %.1f non-zeros per train document", mats["train"].shape[1], st.metrics["nnz_per_doc_train"])
        for n in names:
            st.output(n, out / n)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
