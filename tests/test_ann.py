"""xmc_steps.ann: exact and HNSW label search over faiss (small synthetic sets, seconds)."""

import json
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
import scipy.sparse as sp

from conftest import load_bench
from xmc_steps import ann

ROOT = Path(__file__).resolve().parents[1]


def unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def clustered(L, d, n, seed=0, centres=None):
    """Labels around a few unit centres, queries near random labels (bench_ann's recipe)."""
    rng = np.random.default_rng(seed)
    c = unit(rng.standard_normal((centres or max(8, L // 25), d)))
    labels = unit(c[rng.integers(0, len(c), L)] + 0.75 * rng.standard_normal((L, d)) / np.sqrt(d))
    queries = unit(labels[rng.integers(0, L, n)] + 0.5 * rng.standard_normal((n, d)) / np.sqrt(d))
    return labels, queries


def recall(found, truth):
    return np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)])


def test_exact_equals_numpy_argsort():
    rng = np.random.default_rng(1)
    E, Q = unit(rng.standard_normal((300, 32))), unit(rng.standard_normal((50, 32)))
    idx = ann.build_index(E, kind="exact")
    assert idx.kind == "exact" and idx.ef_search is None
    for k in (1, 10, 300):
        D, I = ann.search(idx, Q, k)
        assert D.dtype == np.float32 and I.dtype == np.int64 and I.shape == D.shape == (50, k)
        S = Q.astype(np.float64) @ E.T.astype(np.float64)
        ref = np.argsort(-S, axis=1, kind="stable")[:, :k]
        ref_scores = np.take_along_axis(S, ref, axis=1)
        np.testing.assert_allclose(D, ref_scores, atol=1e-5)
        # same ids, except where two scores are too close for float32 to order (ties aside)
        s = -np.sort(-S, axis=1)
        close = np.abs(np.diff(s, axis=1)) < 1e-5                   # rank j ties with rank j + 1
        near_tie = np.zeros(S.shape, dtype=bool)
        near_tie[:, :-1] |= close
        near_tie[:, 1:] |= close
        near_tie = near_tie[:, :k]
        assert (I[~near_tie] == ref[~near_tie]).all()
        np.testing.assert_allclose(np.take_along_axis(S, I, axis=1), ref_scores, atol=1e-5)


def test_hnsw_recall_on_clustered_labels():
    E, Q = clustered(3000, 384, 200)
    exact, hnsw = ann.build_index(E, kind="exact"), ann.build_index(E, kind="hnsw")
    assert hnsw.kind == "hnsw" and hnsw.ef_search == ann.EF_SEARCH
    assert isinstance(hnsw.faiss_index, faiss.IndexHNSWFlat)
    assert hnsw.faiss_index.metric_type == faiss.METRIC_INNER_PRODUCT
    _, truth = ann.search(exact, Q, 10)
    D, found = ann.search(hnsw, Q, 10)
    assert recall(found, truth) >= 0.95
    # HNSW keeps the full vectors: its scores are the exact inner products of what it found
    np.testing.assert_allclose(D, np.einsum("nd,nkd->nk", Q, E[found]), atol=1e-5)
    assert (np.diff(D, axis=1) <= 1e-6).all()                     # best first


def test_hnsw_searches_with_at_least_k_candidates():
    E, Q = clustered(2000, 32, 40, seed=9)
    idx = ann.build_index(E, kind="hnsw", ef_search=1)
    low = ann.search(idx, Q, 60)
    idx.ef_search = 60
    assert all((a == b).all() for a, b in zip(low, ann.search(idx, Q, 60)))  # efSearch = max(ef_search, k)
    assert idx.faiss_index.hnsw.efSearch == 60


def test_auto_picks_by_size():
    rng = np.random.default_rng(2)
    small, big = unit(rng.standard_normal((50, 16))), unit(rng.standard_normal((150, 16)))
    assert ann.build_index(small, exact_max=100).kind == "exact"
    assert ann.build_index(big, exact_max=100).kind == "hnsw"
    assert ann.build_index(big, exact_max=150).kind == "exact"      # exact up to and including exact_max
    assert ann.build_index(big).kind == "exact"                     # 150 <= the measured default
    assert ann.build_index(small, kind="hnsw").kind == "hnsw"       # an explicit kind wins
    assert ann.EXACT_MAX >= 1000 and ann.EF_SEARCH >= 1


@pytest.mark.parametrize("kind", ["exact", "hnsw"])
def test_k_above_L_is_capped_and_no_minus_one(kind):
    rng = np.random.default_rng(3)
    E, Q = unit(rng.standard_normal((20, 8))), unit(rng.standard_normal((7, 8)))
    idx = ann.build_index(E, kind=kind)
    D, I = ann.search(idx, Q, 50)
    assert I.shape == D.shape == (7, 20)
    assert (np.sort(I, axis=1) == np.arange(20)).all()               # every label once, no -1
    assert ann.search(idx, Q, 0)[1].shape == (7, 0)
    assert ann.search(idx, Q[:0], 5)[1].shape == (0, 5)
    with pytest.raises(ValueError):
        ann.search(idx, Q, -1)


def test_rows_hnsw_leaves_short_are_answered_exactly():
    E, Q = clustered(500, 32, 10, seed=4)
    idx = ann.build_index(E, kind="hnsw")
    D, I = ann.search(idx, Q, 5)
    D2, I2 = D.copy(), I.copy()
    D2[[1, 7], 3:], I2[[1, 7], 3:] = -np.inf, -1                     # what faiss returns when short
    ann._complete(idx, Q, D2, I2, 5)
    De, Ie = ann.search(ann.build_index(E, kind="exact"), Q[[1, 7]], 5)
    assert (I2[[1, 7]] == Ie).all() and np.allclose(D2[[1, 7]], De)
    keep = [i for i in range(10) if i not in (1, 7)]
    assert (I2[keep] == I[keep]).all()


@pytest.mark.parametrize("kind", ["exact", "hnsw"])
def test_save_load_round_trip(tmp_path, kind):
    E, Q = clustered(800, 24, 30, seed=5)
    idx = ann.build_index(E, kind=kind, ef_search=77)
    path = tmp_path / "model" / "labels.faiss"
    ann.save_index(idx, path)
    assert [p.name for p in path.parent.iterdir()] == ["labels.faiss"]  # no temporary left
    back = ann.load_index(path, threads=2)
    assert back.kind == kind and back.n_labels == 800 and back.dim == 24 and back.threads == 2
    assert back.ef_search == (77 if kind == "hnsw" else None)
    (Da, Ia), (Db, Ib) = ann.search(idx, Q, 10), ann.search(back, Q, 10)
    # the same neighbours; the scores to the last bits only at one thread count (the loaded index searches
    # with 2 threads: faiss's BLAS path may then sum in another order, seen on a busy 2-core machine)
    assert (Ia == Ib).all()
    np.testing.assert_allclose(Db, Da, rtol=0, atol=1e-5)
    ann.save_index(back, path)                                      # over an existing file
    assert (ann.search(ann.load_index(path), Q, 10)[1] == Ia).all()


def test_topk_csr_shape_and_contents():
    E, Q = clustered(200, 16, 12, seed=6)
    idx = ann.build_index(E, kind="exact")
    M = ann.topk_csr(idx, Q, 5, n_labels=250)                       # labels beyond the index: allowed
    D, I = ann.search(idx, Q, 5)
    assert sp.isspmatrix_csr(M) and M.shape == (12, 250) and M.has_sorted_indices
    assert M.dtype == np.float32 and (np.diff(M.indptr) == 5).all()
    for r in range(12):
        row = M.getrow(r)
        assert dict(zip(row.indices, row.data)) == dict(zip(I[r], D[r]))
    assert (ann.topk_csr(idx, Q, 1000, 200).getnnz(axis=1) == 200).all()   # k capped at L
    with pytest.raises(ValueError):
        ann.topk_csr(idx, Q, 5, n_labels=199)


def test_hnsw_deterministic_for_seed_and_threads():
    E, Q = clustered(1500, 32, 60, seed=7)

    def graph(i):
        h = i.faiss_index.hnsw
        return faiss.vector_to_array(h.levels), faiss.vector_to_array(h.neighbors)

    a, b = ann.build_index(E, kind="hnsw", seed=3), ann.build_index(E, kind="hnsw", seed=3)
    c = ann.build_index(E, kind="hnsw", seed=4)
    assert all((x == y).all() for x, y in zip(graph(a), graph(b)))
    assert not (graph(a)[0] == graph(c)[0]).all()                   # the seed draws the levels
    before = faiss.omp_get_max_threads(), faiss.cvar.distance_compute_blas_threshold
    r1 = ann.search(a, Q, 10)
    a.threads = 2
    r2 = ann.search(a, Q, 10)
    assert all((x == y).all() for x, y in zip(r1, r2))              # search: same for any thread count
    # and faiss's process-wide settings are restored
    assert (faiss.omp_get_max_threads(), faiss.cvar.distance_compute_blas_threshold) == before


def test_refuses_bad_input():
    rng = np.random.default_rng(8)
    E = unit(rng.standard_normal((30, 8)))
    with pytest.raises(ValueError, match="L2-normalised"):
        ann.build_index(E * 2)
    with pytest.raises(ValueError, match="L2-normalised"):
        ann.build_index(np.vstack([E, np.full((1, 8), 1e-3, np.float32)]))
    # an all-zero row (a label without an embedding) is taken: it scores 0 against every query
    D, I = ann.search(ann.build_index(np.vstack([E, np.zeros((1, 8), np.float32)])), E[:3], 31)
    assert (D[I == 30] == 0).all() and (I == 30).sum() == 3
    with pytest.raises(ValueError, match="kind"):
        ann.build_index(E, kind="ivf")
    with pytest.raises(ValueError, match="threads"):
        ann.build_index(E, threads=0)
    idx = ann.build_index(E)
    idx.threads = 0
    with pytest.raises(ValueError, match="threads"):
        ann.search(idx, E[:2], 3)
    idx.threads = 1
    with pytest.raises(ValueError, match="d=9"):
        ann.search(idx, np.ones((2, 9), np.float32), 3)
    with pytest.raises(ValueError, match="non-finite"):
        ann.search(idx, np.full((2, 8), np.nan, np.float32), 3)
    with pytest.raises(ValueError, match="2-D"):
        ann.search(idx, E[0], 3)
    ann.search(idx, E.astype(np.float64)[:2], 3)                    # float64 queries are converted


def test_import_does_not_pull_torch():
    code = "import sys, xmc_steps.ann; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bench_runs_small(tmp_path, capsys):
    bench = load_bench("bench_ann")
    rows = bench.main(["--sizes", "300", "--queries", "64", "--single", "3", "--ef", "100", "--repeats", "1",
                       "--quick", "--out", str(tmp_path / "b.jsonl")])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == rows == [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [(r.get("L"), r.get("kind")) for r in rows[:2]] == [(300, "exact"), (300, "hnsw")]
    assert rows[1]["recall"] > 0.9 and rows[-1]["summary"]
    assert bench.crossing([(1000, 1.0), (4000, 4.0)]) == pytest.approx(2000)    # log-log between sizes
    assert bench.crossing([(1000, 0.0), (4000, 4.0)]) == 4000                   # 0: recall target missed
    assert bench.crossing([(1000, 1.0), (4000, 1.5)]) is None


def test_bench_reads_a_trained_models_embeddings(tmp_path, capsys):
    """``--real``: the label and test-text embeddings of a dual encoder's folder replace the synthetic set."""
    bench = load_bench("bench_ann")
    labels, queries = bench.synth(250, 32, 40, seed=3)
    np.savez(tmp_path / "label_emb.npz", emb=labels.astype(np.float16))
    np.savez(tmp_path / "emb_test.npz", emb=queries)
    rows = bench.main(["--real", str(tmp_path), "--queries", "30", "--single", "3", "--ef", "100",
                       "--repeats", "1", "--k", "20"])
    assert [(r["L"], r["kind"], r["source"]) for r in rows] == [(250, "exact", str(tmp_path)),
                                                                 (250, "hnsw", str(tmp_path))]
    assert rows[1]["recall"] > 0.9
