"""Prediction cost of the candidate gather in ``xr_linear.masked_product``: the pipeline's
vectorised binary search (``_gather``) against scipy's ``Z[rows, cols]``, on a trained
xr-linear model of the DAG, in one run (compare the ratio; the machine is shared):

    python bench/bench_gather.py [--dataset yso50k] [--docs 2000] [--threads 1]

Prints one JSON object per variant: seconds, ms/document, and whether the predictions are
identical.  Needs ``results/<dataset>/xr-linear/model`` (``snakemake results/<dataset>/xr-linear.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import io, xr_linear  # noqa: E402


def scipy_gather(Z, rows, cols):
    return np.asarray(Z[rows, cols]).ravel().astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="yso50k")
    ap.add_argument("--results", default="results")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(v, str(a.threads))
    root = Path(a.results) / a.dataset
    model = xr_linear.XRLinearModel.load(root / "xr-linear" / "model")
    X = io.load_csr(root / "features" / "tfidf" / "X_test.npz")[: a.docs]
    out = {}
    for name, fn in (("vectorised", xr_linear._gather), ("scipy", scipy_gather)):
        xr_linear._gather = fn
        t0 = time.perf_counter()
        out[name] = model.predict(X, beam=10, topk=100)
        s = time.perf_counter() - t0
        print(json.dumps({"dataset": a.dataset, "gather": name, "docs": X.shape[0], "labels": model.n_labels,
                          "seconds": round(s, 3), "ms_per_doc": round(1000 * s / X.shape[0], 3),
                          "identical": bool((out[name] != out["vectorised"]).nnz == 0)}), flush=True)


if __name__ == "__main__":
    main()
