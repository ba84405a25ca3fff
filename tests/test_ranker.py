"""Negative sampling masks (TFN/MAN) and the linear one-vs-all rankers."""

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps.negatives import combine, label_instance_mask, man, tfn
from xmc_steps.ranker import RankerParams, append_bias, train_rankers

# X-Transformer Figure 4: N=6 instances, L=20 labels, K=4 clusters of 5 consecutive labels.
FIG4_LABELS = [[0, 7], [3], [6, 12], [17], [11], [4, 19]]


def _fig4():
    rows = [i for i, r in enumerate(FIG4_LABELS) for _ in r]
    cols = [j for r in FIG4_LABELS for j in r]
    Y = sp.csr_matrix((np.ones(len(cols), np.float32), (rows, cols)), shape=(6, 20))
    cluster = np.arange(20) // 5
    C = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), cluster)), shape=(20, 4))
    return Y, C, cluster


def test_tfn_figure4():
    Y, C, cluster = _fig4()
    M = tfn(Y, C).toarray()
    expected = np.zeros((6, 4))
    for i, ks in enumerate([[0, 1], [0], [1, 2], [3], [2], [0, 3]]):
        expected[i, ks] = 1
    np.testing.assert_array_equal(M, expected)
    assert np.flatnonzero(M[:, 0]).tolist() == [0, 1, 5]  # {x1, x2, x6} as in the paper
    np.testing.assert_array_equal(tfn(Y, cluster).toarray(), expected)  # int assignment accepted


def test_man_and_combination():
    Y, C, _ = _fig4()
    scores = sp.csr_matrix(np.array([[0.9, 0.1, 0, 0], [0, 0, 0, 0.3], [0.5, 0.4, 0, 0],
                                     [0.2, 0, 0, 0], [0, 0, 0.7, 0], [0, 0, 0, 0.6]], dtype=np.float32))
    Mh = man(scores).toarray()
    assert set(np.unique(Mh)) == {0.0, 1.0} and Mh.sum() == 8
    both = combine("tfn+man", Y, C, scores).toarray()
    np.testing.assert_array_equal(both, np.maximum(tfn(Y, C).toarray(), Mh))
    np.testing.assert_array_equal(combine("man", Y, C, scores).toarray(), Mh)
    np.testing.assert_array_equal(combine("tfn", Y, C).toarray(), tfn(Y, C).toarray())
    with pytest.raises(ValueError):
        combine("man", Y, C)
    with pytest.raises(ValueError):
        combine("bogus", Y, C, scores)


def test_label_instance_mask():
    Y, C, cluster = _fig4()
    mask = label_instance_mask(tfn(Y, C), C, Y).toarray()
    assert np.flatnonzero(mask[:, 2]).tolist() == [0, 1, 5]  # label 3 of cluster 1
    assert np.flatnonzero(mask[:, 12]).tolist() == [2, 4]
    # MAN only: instances predicted in the cluster plus the label's own positives
    Mh = sp.csr_matrix(np.array([[0, 0, 0, 1], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0],
                                 [0, 0, 0, 1], [0, 0, 0, 1]], dtype=np.float32))
    m2 = label_instance_mask(Mh, cluster, Y).toarray()
    assert np.flatnonzero(m2[:, 0]).tolist() == [0, 2, 3]


def _separable(seed=0, N=200, d=20, L=6):
    rng = np.random.default_rng(seed)
    X = sp.csr_matrix(np.abs(rng.normal(size=(N, d))).astype(np.float32) * (rng.random((N, d)) < 0.5))
    # label j is on iff feature j is the larger of features (j, j + L)
    Xd = X.toarray()
    Y = sp.csr_matrix((Xd[:, :L] > Xd[:, L:2 * L]).astype(np.float32))
    return X, Y


def test_ranker_learns_separable_problem():
    X, Y = _separable()
    W = train_rankers(X, Y, np.zeros(Y.shape[1], int), None, RankerParams(C=10.0, threshold=0.0, tol=1e-3,
                                                                         max_iter=1000), threads=2)
    assert W.shape == (X.shape[1] + 1, Y.shape[1])
    S = (append_bias(X) @ W).toarray()
    acc = ((S > 0) == (Y.toarray() > 0)).mean()
    assert acc > 0.97


def test_ranker_threshold_sparsifies_and_groups_by_cluster():
    X, Y = _separable(1)
    cl = np.array([0, 0, 1, 1, 2, 2])
    mask = sp.csr_matrix(np.ones((X.shape[0], 3), np.float32))
    # liblinear shuffles with a process-wide RNG: the parallel clusters run in forked processes,
    # so even at the loose default tolerance (far from the optimum) the weights do not depend
    # on the worker count
    loose = {"threshold": 0.0, "tol": 0.1, "max_iter": 3}
    W1 = train_rankers(X, Y, cl, mask, loose, threads=1)
    for threads in (2, 3):
        W2 = train_rankers(X, Y, cl, mask, loose, threads=threads)
        assert (W1 != W2).nnz == 0 and W1.nnz == W2.nnz
    W3 = train_rankers(X, Y, cl, mask, {"threshold": 0.1})
    assert W3.nnz < W1.nnz and np.all(np.abs(W3.data) >= 0.1)


def test_ranker_weights_do_not_depend_on_the_worker_count():
    """Many small clusters solved concurrently, far from the optimum (where liblinear's visiting
    order shows in the weights): the same bytes with 1, 2 and 4 workers."""
    rng = np.random.default_rng(0)
    X = sp.random(600, 80, density=0.1, random_state=1, format="csr", dtype=np.float64)
    Y = sp.csr_matrix((rng.random((600, 48)) < 0.1).astype(np.float32))
    cl = np.repeat(np.arange(24), 2)
    loose = {"threshold": 0.0, "tol": 0.5, "max_iter": 4}
    W1 = train_rankers(X, Y, cl, None, loose, threads=1)
    for threads in (2, 4):
        W = train_rankers(X, Y, cl, None, loose, threads=threads)
        assert W.nnz == W1.nnz and np.array_equal(W.indices, W1.indices) and np.array_equal(W.data, W1.data), threads


def test_ranker_degenerate_clusters():
    X, Y = _separable(2, N=40)
    Yd = Y.toarray()[:, :2]
    Yd[:, 1] = 0  # label 1 has no positives
    Y = sp.csr_matrix(Yd)
    # cluster 0 = label 0 restricted to its positives only (mask empty) -> all positives
    mask = sp.csr_matrix((X.shape[0], 2), dtype=np.float32)
    W = train_rankers(X, Y, np.array([0, 1]), mask, {})
    assert W[:-1, 0].nnz == 0 and W[-1, 0] == pytest.approx(1.0)
    assert W[:, 1].nnz == 1 and W[-1, 1] == pytest.approx(-1.0)  # no instances at all


def test_ranker_cluster_whose_instances_have_no_features():
    """Short texts can have empty TF-IDF rows; a cluster of only such rows learns its bias."""
    X = sp.csr_matrix(np.array([[0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0.5]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0], [0, 0], [1, 0], [0, 1]], np.float32))
    mask = sp.csr_matrix(np.array([[1, 0], [1, 0], [1, 0], [0, 1]], np.float32))
    W = train_rankers(X, Y, np.array([0, 1]), mask, {"threshold": 0.0})
    assert W[:-1, 0].nnz == 0 and W[-1, 0] == pytest.approx(2 * 2 / 3 - 1)


def test_mask_restricts_training_instances():
    X, Y = _separable(3)
    cl = np.zeros(Y.shape[1], int)
    keep = np.zeros((X.shape[0], 1), np.float32)
    keep[:50] = 1
    W_mask = train_rankers(X, Y, cl, sp.csr_matrix(keep), {"threshold": 0.0})
    pos = np.flatnonzero(np.asarray(Y.sum(axis=1)).ravel() > 0)
    rows = np.union1d(np.arange(50), pos)  # the mask plus the positives of the cluster's labels
    assert len(rows) < X.shape[0]
    for j in range(Y.shape[1]):
        Wj = train_rankers(X[rows], Y[rows][:, [j]], np.zeros(1, int), None, {"threshold": 0.0})
        np.testing.assert_allclose(W_mask[:, j].toarray(), Wj.toarray(), atol=1e-5)


def test_params_roundtrip_and_validation():
    p = RankerParams(C=2.0, seed=3)
    assert RankerParams.from_json(p.to_json()) == p
    assert RankerParams.from_dict({"C": "0.5", "max_iter": 10.0}).C == 0.5
    with pytest.raises(ValueError, match="unknown"):
        RankerParams.from_dict({"Cee": 1})
    with pytest.raises(ValueError, match="unknown"):      # the negatives belong to the method, not the solver
        RankerParams.from_dict({"negatives": "tfn"})
    with pytest.raises(ValueError):
        RankerParams(C=0.0)


def _with_64bit_indices(X):
    X = sp.csr_matrix(X, copy=True)
    X.indices, X.indptr = X.indices.astype(np.int64), X.indptr.astype(np.int64)
    return X


def test_liblinear_csr_converts_64bit_indices():
    """scipy stores matrices above 2^31 non-zeros with 64-bit indices (kept by slicing), which
    liblinear rejects: a cluster's subset is handed over with 32-bit indices, same content."""
    from xmc_steps.ranker import liblinear_csr

    X, Y = _separable(4)
    X64 = _with_64bit_indices(X)
    assert X64.indices.dtype == np.int64
    X32 = liblinear_csr(X64)
    assert X32.indices.dtype == np.int32 and X32.indptr.dtype == np.int32 and (X32 != X).nnz == 0
    assert liblinear_csr(X) is X
    W = train_rankers(X, Y, np.arange(Y.shape[1]) % 2, None, {"threshold": 0.0})
    assert (W != train_rankers(X64, Y, np.arange(Y.shape[1]) % 2, None, {"threshold": 0.0})).nnz == 0


def test_rankers_name_a_cluster_too_large_for_liblinear(monkeypatch):
    import xmc_steps.ranker as ranker

    monkeypatch.setattr(ranker, "LIBLINEAR_MAX_NNZ", 10)
    X, Y = _separable(5)
    with pytest.raises(ValueError, match=r"cluster 0's \d+ training instances hold [\d,]+ non-zeros, more than liblinear"):
        train_rankers(_with_64bit_indices(X), Y, np.zeros(Y.shape[1], int), None, {"threshold": 0.0})


@pytest.mark.parametrize("threshold", [0.0, 0.1])
def test_rankers_equal_a_label_by_label_reference_byte_for_byte(threshold):
    """train_rankers (local columns, one-class labels without a solve, the bias kept apart) against the
    plainest reading: per label, its cluster's masked rows plus its positives, every column, the
    solver, then the weights and the bias above the threshold: the same bytes.  Labels without a
    positive, labels positive on every row of their cluster, clusters without rows, all included."""
    from xmc_steps.liblinear_direct import fit_ranker

    rng = np.random.default_rng(4)
    N, d, L, K = 160, 300, 14, 4
    X = sp.random(N, d, density=0.03, random_state=2, format="csr", dtype=np.float64)
    Yd = (rng.random((N, L)) < 0.15).astype(np.float32)
    Yd[:, 3] = 0                                  # no positive
    cl = np.arange(L) % K
    maskd = (rng.random((N, K)) < 0.3).astype(np.float32)
    maskd[:, 3] = 0                               # cluster 3 (labels 3, 7, 11): only its positives
    Yd[:, 7] = 0
    Yd[:, 11] = 0                                 # ... and none: a cluster without rows
    Yd[:, 9] = maskd[:, 1] + (Yd[:, [1, 5, 13]].sum(axis=1) > 0)   # positive on every row of cluster 1
    Y = sp.csr_matrix(np.minimum(Yd, 1))
    mask = sp.csr_matrix(maskd)
    p = RankerParams.from_dict({"threshold": threshold})
    W = train_rankers(X, Y, cl, mask, p).tocsc()
    Yc = Y.tocsc()
    for lab in range(L):
        k = cl[lab]
        pos = np.unique(Yc[:, np.flatnonzero(cl == k)].indices)
        rows = np.union1d(np.flatnonzero(maskd[:, k]), pos)
        if len(rows) == 0:
            full = np.array([-1.0])
            ids = np.array([d])
        else:
            y = np.where(Y[rows][:, lab].toarray().ravel() > 0, 1.0, -1.0)
            w, b = fit_ranker(X[rows].astype(np.float64), y, p)
            full, ids = np.append(w, b), np.arange(d + 1)
        nz = np.flatnonzero(np.abs(full) >= threshold) if threshold > 0 else np.flatnonzero(full)
        col = W[:, lab]
        assert np.array_equal(col.indices, ids[nz].astype(np.int32)), lab
        assert np.array_equal(col.data, full[nz].astype(np.float32)), lab
    assert W[-1, 9] == 1.0 and W[:-1, 9].nnz == 0 and W[-1, 3] == -1.0 and W[-1, 7] == -1.0
