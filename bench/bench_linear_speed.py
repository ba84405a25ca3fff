"""xr-linear's speed beside the reference library's XR-Linear, and beside an earlier revision, in one run:

    python bench/bench_linear_speed.py --dataset yso-finna-sv-50k [--results results] [--baseline REV] \
        [--code DIR] [--pecos ~/pecos-venv/bin/python] [--docs 2000] [--docs-one 200] [--repeat 2] [--no-train]

On a finished DAG's features (``results/<d>/features/tfidf``: train + valid to fit, the first ``--docs``
test rows to predict), with one thread, for each code (the working tree's ``xmc_steps``, or the one under
``--code DIR``, and with ``--baseline REV`` the package as it was at that git revision):

* ``index_s``: the PIFA label embedding and the balanced 16-way tree with leaves of at most 100 labels
  (what the reference library's ``Indexer.gen`` does inside its training time);
* ``train_s``: :meth:`XRLinearModel.train` on that tree (TFN+MAN negatives, C 1, threshold 0.1, bias 1);
* ``batched_ms_per_doc``: beam 10, top 100 over the ``--docs`` rows at the default batch of 256 (the
  trained model in memory; ``first_call_s`` is the first call, which builds the search tables);
* ``one_doc_ms_per_doc``: the same model called once per document on ``--docs-one`` rows;
* ``service_ms_per_doc``: :func:`xmc_steps.serving.predict_scores` for one text at a time (TF-IDF of the
  raw text, xr-linear, top 10) with the DAG's trained target ``results/<d>/xr-linear``, the case of
  ``python -m xmc_steps.stages.predict`` and of a service answering one request at a time;
* ``same_weights`` / ``same_predictions``: whether the code's weights and predictions are the first
  code's, byte for byte.

Each code runs ``--repeat`` times, the codes alternating, and every figure is printed per repetition (a
shared machine's noise shows as their spread).  ``--pecos PYTHON`` runs ``bench/pecos_reference.py``
with that interpreter (a virtual environment of its own) the same number of times, between them, and a
last line gives the ratios (ours over the reference, medians): ``train`` compares ``index_s + train_s``
with the reference's training time, which includes its indexing.

Every time is given twice: wall (``*_s``, ``*_ms_per_doc``) and the process's CPU time (``*_cpu_s``,
``*_cpu_ms_per_doc``, ``time.process_time``; the ratios ``*_cpu_ratio``).  Everything runs on one
thread, so on an idle machine the two agree; on a shared one, where other jobs (at a higher priority)
take most of the cores for minutes at a time, the wall times measure the share this process got, and
the CPU times are the figures to compare.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _same(A, B) -> bool:
    import numpy as np
    import scipy.sparse as sp

    A, B = sp.csr_matrix(A), sp.csr_matrix(B)
    return bool(A.shape == B.shape and np.array_equal(A.indptr, B.indptr) and np.array_equal(A.indices, B.indices)
                and np.array_equal(A.data, B.data))


def run_code(pkg: str, root: Path, a, ref: dict) -> dict:
    import numpy as np
    import scipy.sparse as sp

    io = importlib.import_module(f"{pkg}.io")
    xr = importlib.import_module(f"{pkg}.xr_linear")
    ct = importlib.import_module(f"{pkg}.cluster_tree")
    le = importlib.import_module(f"{pkg}.label_embedding")
    X = sp.vstack([io.load_csr(root / "features/tfidf/X_train.npz"), io.load_csr(root / "features/tfidf/X_valid.npz")],
                  format="csr")
    Y = sp.vstack([io.load_csr(root / "ingest/Y_train.npz"), io.load_csr(root / "ingest/Y_valid.npz")], format="csr")
    Xt = io.load_csr(root / "features/tfidf/X_test.npz")[: a.docs]
    out: dict = {}
    if a.no_train:
        model = xr.XRLinearModel.load(root / "xr-linear" / "model")
    else:
        t0, c0 = time.perf_counter(), time.process_time()
        tree = ct.hierarchical_kmeans(le.pifa(X, Y), 16, 100, 0, 20, 1)
        out["index_s"], out["index_cpu_s"] = round(time.perf_counter() - t0, 2), round(time.process_time() - c0, 2)
        t0, c0 = time.perf_counter(), time.process_time()
        model = xr.XRLinearModel.train(X, Y, tree, {"threads": 1})
        out["train_s"], out["train_cpu_s"] = round(time.perf_counter() - t0, 2), round(time.process_time() - c0, 2)
        W = [sp.csr_matrix(w) for w in model.W]
        if "W" in ref:
            out["same_weights"] = all(_same(u, v) for u, v in zip(W, ref["W"])) and tree.level_sizes == ref["sizes"]
        else:
            ref["W"], ref["sizes"] = W, tree.level_sizes
    t0 = time.perf_counter()
    model.predict(Xt[:1], beam=10, topk=100)
    out["first_call_s"] = round(time.perf_counter() - t0, 3)
    t0, c0 = time.perf_counter(), time.process_time()
    P = model.predict(Xt, beam=10, topk=100)
    out["batched_ms_per_doc"] = round(1000 * (time.perf_counter() - t0) / Xt.shape[0], 4)
    out["batched_cpu_ms_per_doc"] = round(1000 * (time.process_time() - c0) / Xt.shape[0], 4)
    n1 = min(a.docs_one, Xt.shape[0])
    t0, c0 = time.perf_counter(), time.process_time()
    P1 = [model.predict(Xt[i:i + 1], beam=10, topk=100) for i in range(n1)]
    out["one_doc_ms_per_doc"] = round(1000 * (time.perf_counter() - t0) / n1, 4)
    out["one_doc_cpu_ms_per_doc"] = round(1000 * (time.process_time() - c0) / n1, 4)
    if "P" in ref:
        out["same_predictions"] = _same(P, ref["P"]) and all(_same(p, q) for p, q in zip(P1, ref["P1"]))
    else:
        ref["P"], ref["P1"] = P, P1
    try:                                   # the serving library (before the stages folder: its predict module)
        xp = importlib.import_module(f"{pkg}.serving")
    except ImportError:
        xp = importlib.import_module(f"{pkg}.predict")
    target_dir = root.parent / root.name / "xr-linear"
    texts_file = Path(a.texts) if a.texts else None
    if (root / "config" / "xr-linear.json").exists() and texts_file and texts_file.exists():
        target = xp.Target.load(target_dir)
        texts = [t for t in texts_file.read_text(encoding="utf-8").splitlines()[: n1 + 1] if t.strip()][:n1]
        xp.predict_scores(target, texts[:1], 10)               # the model loaded once, as a service does
        t0 = time.perf_counter()
        for t in texts:
            xp.predict_scores(target, [t], 10)
        out["service_ms_per_doc"] = round(1000 * (time.perf_counter() - t0) / len(texts), 4)
    return out


def _package_at(rev: str) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_predict import _package_at as at

    return at(rev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="yso-finna-sv-50k")
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--baseline", default=None, help="git revision of xmc_steps to compare with")
    ap.add_argument("--code", default=None, help="import xmc_steps from this folder instead of the checkout")
    ap.add_argument("--pecos", default=None, help="python of a virtual environment with libpecos==1.2.8")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--docs-one", type=int, default=200)
    ap.add_argument("--texts", default=None, help="raw test texts for service_ms_per_doc (default: the dataset's)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-train", action="store_true", help="time prediction only, with the DAG's trained model")
    a = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = "1"
    sys.path.insert(0, a.code or str(ROOT))
    import xmc_steps               # bound now: the baseline's extraction below puts the checkout first on the path
    if a.texts is None:
        for cand in (ROOT.parent / "shared" / "data" / a.dataset / "test_texts.txt",
                     ROOT / "data" / a.dataset / "test_texts.txt"):
            if cand.exists():
                a.texts = str(cand)
                break
    root = Path(a.results) / a.dataset
    codes = {"current" if not a.code else f"code {a.code}": "xmc_steps"}
    if a.baseline:
        codes = {a.baseline: _package_at(a.baseline), **codes}
    figures: dict[str, list[dict]] = {c: [] for c in codes}
    pecos: list[dict] = []
    ref: dict = {}
    for rep in range(a.repeat):
        for code, pkg in codes.items():
            r = run_code(pkg, root, a, ref)
            figures[code].append(r)
            where = str(Path(sys.modules[pkg].__file__).parent)
            _emit({"dataset": a.dataset, "code": code, "package": where, "repetition": rep + 1, "threads": 1, **r})
        if a.pecos:
            p = subprocess.run([a.pecos, str(ROOT / "bench" / "pecos_reference.py"), "--results", a.results,
                                "--dataset", a.dataset, "--docs", str(a.docs), "--threads", "1"],
                               check=True, capture_output=True, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
            pecos.append(json.loads(p.stdout.strip().splitlines()[-1]))
            _emit({**pecos[-1], "repetition": rep + 1})
    if pecos:
        med = lambda xs: statistics.median(xs)   # noqa: E731
        for code, rs in figures.items():
            ratio = {"dataset": a.dataset, "code": code, "vs": "pecos 1.2.8 (medians)",
                     "batched_ratio": round(med([r["batched_ms_per_doc"] for r in rs]) / med([p["ms_per_doc"] for p in pecos]), 3)}
            if "train_s" in rs[0]:
                ratio["train_ratio"] = round(med([r["index_s"] + r["train_s"] for r in rs])
                                             / med([p["train_seconds"] for p in pecos]), 3)
            if "train_cpu_s" in rs[0] and "train_cpu_seconds" in pecos[0]:
                ratio["train_cpu_ratio"] = round(med([r["index_cpu_s"] + r["train_cpu_s"] for r in rs])
                                                 / med([p["train_cpu_seconds"] for p in pecos]), 3)
                ratio["index_cpu_ratio"] = round(med([r["index_cpu_s"] for r in rs])
                                                 / med([p["index_cpu_seconds"] for p in pecos]), 3)
            if "batched_cpu_ms_per_doc" in rs[0] and "cpu_ms_per_doc" in pecos[0]:
                ratio["batched_cpu_ratio"] = round(med([r["batched_cpu_ms_per_doc"] for r in rs])
                                                   / med([p["cpu_ms_per_doc"] for p in pecos]), 3)
            _emit(ratio)


if __name__ == "__main__":
    main()
