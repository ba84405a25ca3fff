"""Benchmark the XR-Linear path on a dataset in the AttentionXML layout (default: debtags).

Prints each stage's wall time and the process's peak memory after it, then P@1/3/5:

    python bench/bench_linear.py [--data ../shared/data/debtags-bookworm] [--threads 2]

TF-IDF: sklearn TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True,
norm='l2', dtype=float32) fitted on the training texts; PIFA; B=16, leaf 100;
TFN+MAN rankers; beam 10.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps.cluster import hierarchical_kmeans  # noqa: E402
from xmc_steps.label_embedding import pifa  # noqa: E402
from xmc_steps.xr_linear import XRLinearModel  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "debtags-bookworm"


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def read_split(base: Path, split: str, index: dict[str, int]):
    texts = (base / f"{split}_texts.txt").read_text(encoding="utf-8").splitlines()
    rows = [[index[t] for t in line.split()]
            for line in (base / f"{split}_labels.txt").read_text(encoding="utf-8").splitlines()]
    ind = np.array([j for r in rows for j in r], dtype=np.int32)
    ptr = np.cumsum([0] + [len(r) for r in rows])
    Y = sp.csr_matrix((np.ones(len(ind), np.float32), ind, ptr), shape=(len(rows), len(index)))
    return texts, Y


def precision_at(P: sp.csr_matrix, Y: sp.csr_matrix, ks=(1, 3, 5)) -> dict[int, float]:
    """P@k in percent; ranking ties broken by the lower label index."""
    P, Y = sp.csr_matrix(P), sp.csr_matrix(Y)
    hits = {k: 0 for k in ks}
    for i in range(P.shape[0]):
        a, b = P.indptr[i], P.indptr[i + 1]
        idx = P.indices[a:b][np.lexsort((P.indices[a:b], -P.data[a:b]))]
        truth = set(Y.indices[Y.indptr[i]:Y.indptr[i + 1]].tolist())
        for k in ks:
            hits[k] += sum(1 for j in idx[:k] if j in truth)
    return {k: 100.0 * hits[k] / (k * P.shape[0]) for k in ks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--branching", type=int, default=16)
    ap.add_argument("--leaf-size", type=int, default=100)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--params", default="{}", help="extra XR-Linear training parameters (JSON)")
    args = ap.parse_args()
    from sklearn.feature_extraction.text import TfidfVectorizer

    times: dict[str, float] = {}
    mem: dict[str, float] = {}

    def stage(name, t0):
        times[name] = time.perf_counter() - t0
        mem[name] = peak_mib()
        print(f"{name:>10s}: {times[name]:7.2f} s   peak {mem[name]:7.0f} MiB", flush=True)

    t = time.perf_counter()
    ids = (args.data / "label_ids.txt").read_text(encoding="utf-8").split()
    index = {x: i for i, x in enumerate(ids)}
    tr, Ytr = read_split(args.data, "train", index)
    te, Yte = read_split(args.data, "test", index)
    stage("read", t)
    t = time.perf_counter()
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, norm="l2", dtype=np.float32)
    Xtr = vec.fit_transform(tr).tocsr()
    Xte = vec.transform(te).tocsr()
    stage("tfidf", t)
    t = time.perf_counter()
    emb = pifa(Xtr, Ytr)
    stage("pifa", t)
    t = time.perf_counter()
    tree = hierarchical_kmeans(emb, args.branching, args.leaf_size, seed=0, max_iter=20)
    stage("cluster", t)
    t = time.perf_counter()
    params = {"threads": args.threads, "beam": args.beam}
    params.update(json.loads(args.params))
    model = XRLinearModel.train(Xtr, Ytr, tree, params)
    stage("rankers", t)
    t = time.perf_counter()
    P = model.predict(Xte, beam=args.beam, topk=100)
    stage("predict", t)
    p = precision_at(P, Yte)
    print(f"data {args.data.name}: train {Xtr.shape[0]} x {Xtr.shape[1]}, test {Xte.shape[0]}, labels {len(ids)}, "
          f"tree {tree.level_sizes}")
    print(f"index+rankers: {times['pifa'] + times['cluster'] + times['rankers']:.1f} s "
          f"(threads {args.threads}), model nnz {sum(w.nnz for w in model.W)}, peak {peak_mib():.0f} MiB")
    print("P@1 {:.2f}  P@3 {:.2f}  P@5 {:.2f}".format(p[1], p[3], p[5]))


if __name__ == "__main__":
    main()
