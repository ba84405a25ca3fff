"""bench/bench_scale.py's solver accounting: every liblinear call counted per level, the weights untouched."""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp
from conftest import load_bench

from xmc_steps import liblinear_direct
from xmc_steps.cluster_tree import hierarchical_kmeans
from xmc_steps.label_embedding import pifa
from xmc_steps.xr_linear import XRLinearModel, XRLinearParams


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    n, d, L, live = 240, 60, 48, 36             # labels 36..47 have no training positive
    X = sp.random(n, d, density=0.15, format="csr", random_state=seed, dtype=np.float64)
    X.data[:] = rng.random(X.nnz) + 0.1
    rows = np.repeat(np.arange(n), 2)
    cols = np.concatenate([rng.choice(live, 2, replace=False) for _ in range(n)])
    Y = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, L))
    X = X.tolil()
    for i in range(n):                           # a label's documents share a feature: something to learn
        X[i, int(cols[2 * i]) % d] = 3.0
    return sp.csr_matrix(X), Y


def test_solver_log_counts_every_call_per_level_and_changes_nothing():
    bench = load_bench("bench_scale")
    X, Y = _data()
    tree = hierarchical_kmeans(pifa(X, Y), 4, 4, 0, 20, 1)
    plain = XRLinearModel.train(X, Y, tree, XRLinearParams(threads=1))

    log = logging.getLogger("test_bench_scale")
    log.setLevel(logging.INFO)
    log.propagate = False
    orig = liblinear_direct._ll.train_wrap
    with bench.SolverLog() as solver:
        log.addHandler(lines := bench.LevelLines(solver.calls))
        counted = XRLinearModel.train(X, Y, tree, XRLinearParams(threads=1), log=log)
        log.removeHandler(lines)
    bounds, seconds = lines.calls_at_end, lines.seconds
    assert liblinear_direct._ll.train_wrap is orig                  # restored on exit

    for a, b in zip(plain.W, counted.W):                             # the wrapper only watches
        a, b = sp.csr_matrix(a), sp.csr_matrix(b)
        assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
        assert np.array_equal(a.data, b.data)

    depth = len(tree.level_sizes) - 1
    assert len(bounds) == depth and bounds == sorted(bounds) and bounds[-1] == len(solver.calls)
    # the finest level solves one ranker per label with both classes among its instances: the 36 live labels
    assert bounds[-1] - bounds[-2] == 36
    secs, its, rows, cols, nnz, pos = np.asarray(solver.calls, dtype=float).T
    assert (its >= 1).all() and (rows > pos).all() and (pos >= 1).all() and (nnz > 0).all()

    work = bench.level_work(solver.calls, bounds, seconds)
    assert [w["calls"] for w in work] == list(np.diff([0] + bounds))
    assert sum(w["work"] for w in work) == int(np.sum(nnz * its))
    assert all(w["ns_per_work"] > 0 for w in work if w["calls"])

    live = bench.live_structure(Y, tree)
    assert live["labels_with_positive"] == 36
    assert len(live["live_clusters_by_level"]) == depth - 1
    assert all(1 <= c <= n for c, n in zip(live["live_clusters_by_level"], tree.level_sizes[1:-1]))
