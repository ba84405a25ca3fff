"""Balanced hierarchical k-means and the ClusterTree conventions."""

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import io
from xmc_steps.stages.cluster import main as cluster_main
from xmc_steps.cluster_tree import ClusterTree, balanced_2means, hierarchical_kmeans, tree_levels
from xmc_steps.label_embedding import l2_normalize_rows, pifa
from xmc_steps.stages.label_embedding import main as emb_main
from xmc_steps.errors import StageError


def _random_emb(L, d=50, density=0.2, seed=0):
    rng = np.random.default_rng(seed)
    return l2_normalize_rows(sp.random(L, d, density=density, format="csr", random_state=rng, dtype=np.float32))


def test_pifa_rows_are_normalised_sums():
    X = sp.csr_matrix(np.array([[1, 0, 0], [0, 3, 4], [1, 1, 0]], dtype=np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0]], dtype=np.float32))
    E = pifa(X, Y).toarray()
    s0 = np.array([1, 3, 4.0]) / np.sqrt(26)
    s1 = np.array([1, 4, 4.0]) / np.sqrt(33)
    np.testing.assert_allclose(E[0], s0, rtol=1e-6)
    np.testing.assert_allclose(E[1], s1, rtol=1e-6)
    np.testing.assert_array_equal(E[2], 0)  # label without positives


def test_balanced_2means_splits_halves_and_separates_groups():
    rng = np.random.default_rng(0)
    a = np.abs(rng.normal(size=(7, 6))) * [1, 1, 1, 0, 0, 0]
    b = np.abs(rng.normal(size=(6, 6))) * [0, 0, 0, 1, 1, 1]
    E = l2_normalize_rows(sp.csr_matrix(np.vstack([a, b]) + 1e-3))
    side = balanced_2means(E, np.random.default_rng(1), max_iter=10)
    assert np.bincount(side).tolist() == [7, 6]
    assert len(set(side[:6])) == 1 and len(set(side[7:])) == 1 and side[0] != side[12]


def test_tree_levels_and_branching_validation():
    assert tree_levels(572, 16, 100) == (3, [3])
    assert tree_levels(300, 4, 20) == (4, [2, 4])
    assert tree_levels(500_000, 16, 100) == (13, [1, 5, 9, 13])
    assert tree_levels(50, 16, 100) == (1, [1])
    with pytest.raises(ValueError, match="power of 2"):
        tree_levels(100, 12, 10)


def test_tree_shape_conventions_and_balance():
    E = _random_emb(300)
    tree = hierarchical_kmeans(E, branching=4, leaf_size=20, seed=0, max_iter=5)
    assert tree.level_sizes == [1, 4, 16, 300]
    assert [c.shape for c in tree.C] == [(4, 1), (16, 4), (300, 16)]
    sizes = tree.cluster_sizes(-1)
    assert sizes.min() >= 18 and sizes.max() <= 19  # exact halving: 300/16
    assert np.bincount(tree.assignment(1)).tolist() == [75] * 4
    # label -> cluster at a level equals the composition of the parent maps
    np.testing.assert_array_equal(tree.assignment(1), tree.parents(2)[tree.leaf_assignment()])
    M = tree.label_to_cluster(-1)
    assert M.shape == (300, 16) and np.all(np.diff(M.indptr) == 1)
    np.testing.assert_array_equal(tree.assignment(0), 0)
    np.testing.assert_array_equal(tree.assignment(3), np.arange(300))


def test_572_labels_leaf_100_b16_gives_one_level_of_8():
    tree = hierarchical_kmeans(_random_emb(572, d=40), 16, 100, seed=0, max_iter=3)
    assert tree.level_sizes == [1, 8, 572]
    assert sorted(set(tree.cluster_sizes(-1))) == [71, 72]


def test_seeded_and_save_load(tmp_path):
    E = _random_emb(200, seed=3)
    t1 = hierarchical_kmeans(E, 4, 10, seed=7, max_iter=5)
    t2 = hierarchical_kmeans(E, 4, 10, seed=7, max_iter=5, threads=2)
    np.testing.assert_array_equal(t1.leaf_assignment(), t2.leaf_assignment())
    t1.save(tmp_path / "tree.npz")
    t3 = ClusterTree.load(tmp_path / "tree.npz")
    assert t3.level_sizes == t1.level_sizes
    for a, b in zip(t1.C, t3.C):
        assert (a != b).nnz == 0


def test_tiny_leaf_size_drops_empty_nodes():
    tree = hierarchical_kmeans(_random_emb(5), 2, 1, seed=0)
    assert tree.n_labels == 5
    assert all(np.all(np.bincount(c.indices, minlength=c.shape[1]) > 0) for c in tree.C)


def test_from_assignments_rejects_non_nested():
    with pytest.raises(ValueError, match="nest"):
        ClusterTree.from_assignments([np.array([0, 0, 1, 1]), np.array([0, 1, 1, 2])])


def test_from_parents_rejects_a_parent_id_beyond_the_level():
    # 256 leaves hung directly under a 16-node level: ids 16..255 name no node (scipy would
    # build the matrix and a later product would write out of bounds)
    with pytest.raises(ValueError, match="parent ids must lie in 0..15"):
        ClusterTree.from_parents([np.zeros(16, dtype=np.int64), np.arange(256)])


def test_cli(tmp_path):
    rng = np.random.default_rng(0)
    X = sp.random(60, 30, density=0.2, format="csr", random_state=rng, dtype=np.float32)
    Y = sp.csr_matrix((rng.random((60, 40)) < 0.1).astype(np.float32))
    io.save_csr(tmp_path / "X.npz", X)
    io.save_csr(tmp_path / "Y.npz", Y)
    emb_main(["--features", str(tmp_path / "X.npz"), "--labels", str(tmp_path / "Y.npz"),
              "--out", str(tmp_path / "emb.npz"), "--no-tracking"])
    cluster_main(["--label-emb", str(tmp_path / "emb.npz"), "--out", str(tmp_path / "tree.npz"),
                  "--branching", "2", "--leaf-size", "10", "--record", str(tmp_path / "rec.json"), "--no-tracking"])
    tree = ClusterTree.load(tmp_path / "tree.npz")
    assert tree.level_sizes == [1, 2, 4, 40]
    assert io.read_json(tmp_path / "rec.json")["metrics"]["n_clusters"] == 4
    # the scheduler's --threads (any stage's common argument) is the stage's thread count, over --params;
    # the tree does not depend on it
    cluster_main(["--label-emb", str(tmp_path / "emb.npz"), "--out", str(tmp_path / "tree2.npz"),
                  "--branching", "2", "--leaf-size", "10", "--record", str(tmp_path / "rec2.json"), "--no-tracking",
                  "--threads", "2", "--params", '{"threads": 5}'])
    assert io.read_json(tmp_path / "rec2.json")["params"]["threads"] == 2
    assert np.array_equal(ClusterTree.load(tmp_path / "tree2.npz").assignment(-1), tree.assignment(-1))
    with pytest.raises(StageError, match="--threads must be >= 1"):
        cluster_main(["--label-emb", str(tmp_path / "emb.npz"), "--out", str(tmp_path / "tree3.npz"), "--threads", "0",
                      "--no-tracking"])
    assert not (tmp_path / "tree3.npz").exists()


@pytest.mark.parametrize("sort", [0, 16, 10**9])
def test_local_columns_keeps_the_occurring_columns_in_order(sort, monkeypatch):
    """Both ways (marking the columns, sorting the entries' columns) give the same matrix."""
    import xmc_steps.columns as columns
    from xmc_steps.cluster_tree import _local_columns

    monkeypatch.setattr(columns, "LOCAL_COLUMNS_SORT", sort)
    rng = np.random.default_rng(3)
    for d in (1000, 100000):
        E = sp.random(50, d, density=10 / d, format="csr", random_state=rng, dtype=np.float32)
        loc = _local_columns(E)
        cols = np.unique(E.indices)
        assert loc.shape == (50, len(cols)) and loc.indices.dtype == np.int32 and loc.indices.ndim == 1
        assert np.array_equal(loc.toarray(), E.toarray()[:, cols])
    assert _local_columns(sp.csr_matrix((3, 7), dtype=np.float32)).shape == (3, 1)


@pytest.mark.parametrize("sort", [0, 16, 10**9])
def test_occurring_columns_is_np_unique_with_its_inverse(sort, monkeypatch):
    """Marking the columns or sorting the entries' columns: np.unique's values and inverse, either way
    (the rankers' renumbering of a cluster's features and clustering's of a node's columns)."""
    import xmc_steps.columns as columns

    monkeypatch.setattr(columns, "LOCAL_COLUMNS_SORT", sort)
    rng = np.random.default_rng(5)
    for d, n in ((10, 40), (1000, 300), (100000, 50), (7, 0)):
        idx = rng.integers(0, d, n).astype(np.int32)
        cols, new_id = columns.occurring_columns(idx, d)
        want, inv = np.unique(idx, return_inverse=True)
        assert np.array_equal(cols, want) and np.array_equal(new_id, inv.reshape(-1))
        assert new_id.dtype == np.int32 and new_id.shape == (n,)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_depth_split_at_once_equals_the_node_by_node_splits(seed, monkeypatch):
    """hierarchical_kmeans splits a depth with many nodes in one set of array operations
    (_split_level): the tree is the node-by-node one, label for label; so are the sides of a level
    with tiny nodes (0, 1, 2 rows), rows without entries and nodes that never converge."""
    import xmc_steps.cluster_tree as ct

    E = _random_emb(700, d=40, density=0.08, seed=seed)
    E = sp.vstack([E[:650], sp.csr_matrix((50, 40), dtype=np.float32)], format="csr")     # empty rows
    monkeypatch.setattr(ct, "LEVEL_BATCH_NODES", 10**9)
    ref = hierarchical_kmeans(E, branching=4, leaf_size=6, seed=seed, max_iter=7)
    monkeypatch.setattr(ct, "LEVEL_BATCH_NODES", 1)
    monkeypatch.setattr(ct, "LEVEL_BATCH_SIZE", 10**9)
    monkeypatch.setattr(ct, "LEVEL_BATCH_NODE_NNZ", 10**9)
    for group_nnz in (1 << 22, 37):           # one group per depth, and groups of a few nodes
        monkeypatch.setattr(ct, "LEVEL_BATCH_NNZ", group_nnz)
        got = hierarchical_kmeans(E, branching=4, leaf_size=6, seed=seed, max_iter=7)
        assert got.level_sizes == ref.level_sizes
        for t in range(1, ref.depth + 1):
            np.testing.assert_array_equal(got.parents(t), ref.parents(t))
    rng = np.random.default_rng(seed)
    order = rng.permutation(E.shape[0])
    cuts = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, E.shape[0]), 60, replace=False)), E.shape[0]])
    cuts = np.unique(np.r_[cuts, cuts[:5] + 1, cuts[5:8] + 2])                  # nodes of 1 and 2 rows
    bounds = list(zip(cuts[:-1], cuts[1:]))
    for max_iter in (1, 3, 20):
        want = np.concatenate([balanced_2means(E[order[a:b]], np.random.default_rng([seed, 9, j]), max_iter)
                               for j, (a, b) in enumerate(bounds)])
        side = ct._split_level(E, order, bounds, [np.random.default_rng([seed, 9, j]) for j in range(len(bounds))],
                               max_iter)
        np.testing.assert_array_equal(side, want)


def _balanced_2means_sparse_product(E, rng, max_iter=20):
    """balanced_2means as it was before _side_sums: the centroids from the sparse product of the side
    indicator, ``(ind.T @ E).toarray()`` (the reference the faster sums must equal bit for bit)."""
    from xmc_steps.cluster_tree import _local_columns

    n = E.shape[0]
    E = _local_columns(sp.csr_matrix(E, dtype=np.float32))
    n0 = (n + 1) // 2
    i0, i1 = rng.choice(n, size=2, replace=False)
    cent = E[[i0, i1]].toarray()
    prev = None
    for _ in range(max(1, max_iter)):
        score = E @ (cent[0] - cent[1])
        order = np.argsort(-score, kind="stable")
        side = np.ones(n, dtype=np.int8)
        side[order[:n0]] = 0
        if prev is not None and np.array_equal(side, prev):
            break
        prev = side
        ind = sp.csr_matrix((np.ones(n, np.float32), side.astype(np.int32), np.arange(n + 1)), shape=(n, 2))
        cent = (ind.T @ E).toarray()
        norms = np.linalg.norm(cent, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        cent /= norms
    return side


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_side_sums_are_the_sparse_products_bits_and_layout(seed):
    """_side_sums (one pass over the CSR arrays) gives (ind.T @ E).toarray() bit for bit, in its memory
    layout too (Fortran order: the norms reduce over it, and another layout sums in another order); a
    node's split equals the one computed with the sparse product, on rows of many entries (long sums)."""
    from xmc_steps.cluster_tree import _side_sums

    rng = np.random.default_rng(seed)
    E = sp.random(300, 5000, density=0.05, format="csr", random_state=rng, dtype=np.float32)
    E.data -= 0.3                                              # negative entries too
    E.data[::17] = 0.0                                         # and explicit zeros
    side = rng.integers(0, 2, 300).astype(np.int8)
    ind = sp.csr_matrix((np.ones(300, np.float32), side.astype(np.int32), np.arange(301)), shape=(300, 2))
    want = (ind.T @ E).toarray()
    got = _side_sums(E, side)
    assert got.dtype == want.dtype and got.strides == want.strides and got.flags.f_contiguous
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1))
    Emb = l2_normalize_rows(sp.random(400, 20000, density=0.02, format="csr", random_state=rng, dtype=np.float32))
    for s in range(3):
        np.testing.assert_array_equal(balanced_2means(Emb, np.random.default_rng([seed, s])),
                                      _balanced_2means_sparse_product(Emb, np.random.default_rng([seed, s])))
