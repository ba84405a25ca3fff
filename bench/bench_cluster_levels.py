"""Clustering's time per label at each depth of the binary splitting, beside an earlier revision:

    python bench/bench_cluster_levels.py --emb results/yso-finna-sv-50k/index/pifa-tfidf/label_emb.npz \
        [--leaf-size 100] [--branching 16] [--baseline REV] [--repeat 3]

Runs :func:`xmc_steps.cluster_tree.hierarchical_kmeans` (one thread, seed 0, 20 iterations) on a label
embedding, the codes alternating, ``--repeat`` times, and prints one JSON object per run: the total, the
microseconds per label of every depth (its nodes and their sizes), the ratio of the deepest depth's cost
per label to the median of the depths above it, and whether the tree equals the first code's; the
``cpu_`` figures are the same in the process's CPU time (the ones to read on a shared machine, where
the wall times follow the share of a core this process gets).  A
Wiki-500K-shaped embedding comes from ``bench/bench_scale.py`` (``results/<name>/index/pifa-tfidf/
label_emb.npz`` under its ``--work`` folder).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(pkg: str, emb, a) -> tuple[dict, list]:
    import numpy as np

    ct = importlib.import_module(f"{pkg}.cluster_tree")
    stamps, cpu, msgs = [time.perf_counter()], [time.process_time()], []

    def progress(m: str) -> None:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        msgs.append(m)

    t0, c0 = time.perf_counter(), time.process_time()
    tree = ct.hierarchical_kmeans(emb, a.branching, a.leaf_size, 0, 20, 1, progress=progress)
    total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    L = emb.shape[0]
    out = {"seconds": round(total, 3), "cpu_seconds": round(total_cpu, 3), "depths": msgs}
    for name, st in (("", stamps), ("cpu_", cpu)):
        per = [round(1e6 * (st[i + 1] - st[i]) / L, 3) for i in range(len(msgs))]
        deep = per[-1]
        top = statistics.median(per[:-1]) if len(per) > 1 else deep
        out[f"{name}us_per_label_by_depth"] = per
        out[f"{name}deepest_over_median_above"] = round(deep / top, 3) if top else None
    parents = [np.asarray(tree.parents(t)) for t in range(1, tree.depth + 1)]
    return out, parents


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emb", required=True)
    ap.add_argument("--leaf-size", type=int, default=100)
    ap.add_argument("--branching", type=int, default=16)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = "1"
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from xmc_steps import io

    emb = io.load_csr(a.emb)
    codes = {"current": "xmc_steps"}
    if a.baseline:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_predict import _package_at

        codes = {a.baseline: _package_at(a.baseline), **codes}
    ref = None
    for rep in range(a.repeat):
        for code, pkg in codes.items():
            out, parents = run(pkg, emb, a)
            same = None if ref is None else all(np.array_equal(p, q) for p, q in zip(parents, ref))
            ref = parents if ref is None else ref
            print(json.dumps({"emb": a.emb, "labels": emb.shape[0], "code": code, "repetition": rep + 1,
                              **out, **({} if same is None else {"same_tree": same})}), flush=True)


if __name__ == "__main__":
    main()
