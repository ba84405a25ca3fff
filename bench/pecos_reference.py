"""The reference library's XR-Linear (PECOS, ``libpecos`` 1.2.8) on a DAG's TF-IDF features: run by
``bench/bench_predict.py --pecos PYTHON`` with the Python of a virtual environment of its own
(libpecos pins numpy<2 and scipy<1.14, so it stays out of the project's requirements)::

    python3.11 -m venv ~/pecos-venv && ~/pecos-venv/bin/pip install "numpy<2" "scipy<1.14" scikit-learn \
        && ~/pecos-venv/bin/pip install --no-deps libpecos==1.2.8

(``--no-deps``: libpecos's declared dependencies pull torch and transformers, with a multi-GB CUDA build,
for its neural models; XR-Linear needs numpy and scipy only.)

Imports nothing from the project.  Fits on train + valid with the project's xr-linear settings
(PIFA label embedding, 16-way tree with leaves of at most 100 labels, TFN+MAN negatives, C 1,
weight threshold 0.1, bias 1) and prints one JSON object: training seconds, prediction seconds
and ms/document on the first ``--docs`` test documents (beam 10, top 100), and P@1.  ``train_seconds``
includes the label embedding and the indexing (``index_seconds`` of it), as ``XLinearModel.train`` after
``Indexer.gen``; ``*_cpu_seconds`` and ``cpu_ms_per_doc`` are the same spans in the process's CPU time.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    root = Path(a.results) / a.dataset
    load = lambda p: sp.load_npz(p).tocsr().astype(np.float32)   # noqa: E731
    X = sp.vstack([load(root / "features/tfidf/X_train.npz"), load(root / "features/tfidf/X_valid.npz")]).tocsr()
    Y = sp.vstack([load(root / "ingest/Y_train.npz"), load(root / "ingest/Y_valid.npz")]).tocsr()
    Xt = load(root / "features/tfidf/X_test.npz")[: a.docs]
    Yt = load(root / "ingest/Y_test.npz")[: a.docs]
    t0, c0 = time.perf_counter(), time.process_time()
    feat = LabelEmbeddingFactory.create(Y, X, method="pifa")
    chain = Indexer.gen(feat, nr_splits=16, max_leaf_size=100, threads=a.threads)
    index_s, index_c = time.perf_counter() - t0, time.process_time() - c0
    model = XLinearModel.train(X, Y, C=chain, threshold=0.1, negative_sampling_scheme="tfn+man", Cp=1.0, Cn=1.0,
                               bias=1.0, threads=a.threads)
    train_s, train_c = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    P = model.predict(Xt, beam_size=10, only_topk=100, threads=a.threads)
    pred_s, pred_c = time.perf_counter() - t0, time.process_time() - c0
    P = sp.csr_matrix(P)
    top1 = np.asarray(P.argmax(axis=1)).ravel()
    p1 = float(np.asarray(Yt[np.arange(Xt.shape[0]), top1]).ravel().mean())
    print(json.dumps({"dataset": a.dataset, "model": "xr-linear", "code": "pecos 1.2.8", "docs": Xt.shape[0],
                      "train_seconds": round(train_s, 3), "index_seconds": round(index_s, 3), "seconds": round(pred_s, 3),
                      "ms_per_doc": round(1000 * pred_s / Xt.shape[0], 3), "p_at_1": round(100 * p1, 2),
                      "train_cpu_seconds": round(train_c, 3), "index_cpu_seconds": round(index_c, 3),
                      "cpu_ms_per_doc": round(1000 * pred_c / Xt.shape[0], 3)}), flush=True)


if __name__ == "__main__":
    main()
