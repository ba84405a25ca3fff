"""TF-IDF stage: documents -> L2-normalised sparse TF-IDF features (NPZ).

With ``tfidf.source: pipeline``, fitted on the train + valid documents (streamed in chunks,
:func:`xmc_steps.tfidf.fit_streaming`; the chunk and spill-partition sizes come from the text size,
:func:`xmc_steps.tfidf.chunk_rows`); with ``source: dataset``, and for a BoW-layout dataset (it has
no texts), the dataset's own features that ingest carried (``X_dataset_{split}.npz``), rows
L2-normalised.  See :mod:`xmc_steps.tfidf`.

Outputs in ``--out``: ``X_{train,valid,test}.npz`` (CSR float32, sorted indices),
``vocab.parquet`` (``term``, ``idf`` in feature-index order).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from .. import io, tfidf
from ..layout import DATASET_FEATURES
from ..stage import StageError, add_common_args, cli_main, stage_run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.tfidf", description=__doc__.splitlines()[0])
    p.add_argument("--ingest", required=True, help="the ingest stage's output folder")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    src, out = Path(args.ingest), Path(args.out)
    names = [f"X_{s}.npz" for s in tfidf.SPLITS] + ["vocab.parquet"]
    # the spill folder's name too: the stage removes the one a killed run left (io.remove_stale_temporaries)
    with stage_run("tfidf", args, outputs=[str(out / n) for n in names] + [str(out / tfidf.SPILL)]) as st:
        own = {s: src / DATASET_FEATURES.format(split=s) for s in tfidf.SPLITS}
        layout = io.read_json(src / "ingest.json").get("layout") if (src / "ingest.json").exists() else None
        source = st.params.get("source", "pipeline")
        if source == "dataset" and not own["train"].exists():
            raise StageError(f"{own['train']}: tfidf.source is dataset, but dataset '{args.dataset}' has no features "
                             f"of its own (layout {layout}; the xmc-base layout's tfidf-attnxml/ or the BoW layout "
                             "has them); set tfidf.source: pipeline for it")
        if layout == "bow" and not own["train"].exists():
            raise StageError(f"{own['train']}: missing; {src} was written by an earlier version (X_bow_*.npz): "
                             f"run ingest again (snakemake --forcerun ingest <target>)")
        if source == "dataset" or layout == "bow":
            st.log.info("the dataset's own features (%s), rows L2-normalised",
                        "tfidf.source: dataset" if source == "dataset" else "a BoW dataset has no texts")
            from sklearn.preprocessing import normalize

            mats = {s: normalize(io.load_csr(own[s]).astype(np.float32)) for s in tfidf.SPLITS}
            d = mats["train"].shape[1]
            io.write_table(out / "vocab.parquet", {"term": [str(i) for i in range(d)], "idf": np.ones(d, np.float32)})
        else:
            files = {s: src / f"docs_{s}.parquet" for s in tfidf.SPLITS}
            out.mkdir(parents=True, exist_ok=True)
            chunk, n_parts = tfidf.chunk_rows([files["train"], files["valid"]])

            def batches(*splits):
                for s in splits:
                    yield from io.iter_column(files[s], "text", chunk)

            st.log.info("fitting TF-IDF on the train+valid documents in chunks of %d documents, %d spill partition(s)",
                        chunk, n_parts)
            with st.timed("fit"):
                try:
                    model = tfidf.fit_streaming(batches("train", "valid"), st.params, n_parts, spill_dir=out, log=st.log)
                except ValueError as e:
                    raise StageError(f"{files['train']}: {e}") from None
            with st.timed("transform"):
                mats = {s: model.transform_batches(batches(s)) for s in ("train", "valid")}
            t0 = time.perf_counter()
            mats["test"] = model.transform_batches(batches("test"))
            st.online_cost(time.perf_counter() - t0, mats["test"].shape[0])
            io.write_table(out / "vocab.parquet", {"term": model.terms.astype(str), "idf": model.idf.astype(np.float32)})
        for s in tfidf.SPLITS:
            io.save_csr(out / f"X_{s}.npz", sp.csr_matrix(mats[s], dtype=np.float32))
            st.metric(f"nnz_per_doc_{s}", mats[s].nnz / max(1, mats[s].shape[0]))
        st.metric("n_features", mats["train"].shape[1])
        st.log.info("%d features; %.1f non-zeros per train document", mats["train"].shape[1], st.metrics["nnz_per_doc_train"])
        for n in names:
            st.output(n, out / n)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
