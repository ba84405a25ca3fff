import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from xmc_steps import io


def _per_row_topk(M, k):
    """The reference: each row's top-k, best first, ties -> lower label id, one row at a time."""
    out = []
    for i in range(M.shape[0]):
        a, b = M.indptr[i], M.indptr[i + 1]
        idx, val = M.indices[a:b], M.data[a:b]
        o = np.lexsort((idx, -val))[:k]
        out.append((idx[o].tolist(), val[o].tolist()))
    return out


def test_read_table_gives_the_columns_asked_in_their_order_and_names_a_missing_one(tmp_path):
    io.write_table(tmp_path / "t.parquet", {"a": np.arange(3), "b": ["x", "y", "z"], "c": np.ones(3)})
    assert io.read_table(tmp_path / "t.parquet").column_names == ["a", "b", "c"]
    t = io.read_table(tmp_path / "t.parquet", ["c", "a"])
    assert t.column_names == ["c", "a"] and t.column("a").to_pylist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"t\.parquet: no column d \(it has a, b, c\)"):
        io.read_table(tmp_path / "t.parquet", ["a", "d"])


def test_numeric_column_is_to_numpys_array():
    t = pa.table({"f": pa.chunked_array([pa.array([1.5, 2.5], pa.float32()), pa.array([3.5], pa.float32())]),
                  "d": np.array([0.1, 0.2], np.float64)[[0, 1, 1]], "i": np.array([1, -2, 3], np.int64),
                  "u": pa.array([1, 2, 3], pa.uint16()), "n": pa.array([1.0, None, 2.0]), "s": ["a", "b", "c"]})
    for name in t.column_names:
        got, want = io.numeric_column(t, name), t.column(name).to_numpy()
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=name == "n"), name
    sliced = t.slice(1, 2)
    assert np.array_equal(io.numeric_column(sliced, "i"), [-2, 3]) and io.numeric_column(t.slice(0, 0), "f").shape == (0,)


def test_prediction_table_round_trip_without_per_row_objects(tmp_path):
    rng = np.random.default_rng(0)
    M = sp.random(60, 40, density=0.3, format="lil", random_state=rng, dtype=np.float32)
    M[3] = 0                                            # a document without predictions
    M[5, :4] = 0.5                                      # ties -> the lower label id first
    M = M.tocsr()
    M.eliminate_zeros()
    io.write_predictions(tmp_path / "p.parquet", M, 5)
    t = io.read_table(tmp_path / "p.parquet").to_pydict()
    ref = _per_row_topk(M, 5)
    assert t["doc"] == list(range(60))
    assert t["labels"] == [r[0] for r in ref] and t["labels"][3] == []
    assert all(np.allclose(s, r[1]) for s, r in zip(t["scores"], ref))
    R = io.read_predictions(tmp_path / "p.parquet", 40)
    assert R.shape == (60, 40) and R.has_sorted_indices
    kept = sp.csr_matrix(M.shape, dtype=np.float32).tolil()
    for i, (lab, val) in enumerate(ref):
        kept[i, lab] = val
    assert abs(R - kept.tocsr()).max() == 0


def test_read_predictions_names_the_file_on_bad_label_ids(tmp_path):
    io.write_table(tmp_path / "bad.parquet", {"doc": [0, 1], "labels": [[0, 7], [1]], "scores": [[0.5, 0.4], [0.3]]})
    with pytest.raises(ValueError, match=r"bad.parquet: label ids must lie in 0..4"):
        io.read_predictions(tmp_path / "bad.parquet", 5)
    io.write_table(tmp_path / "uneven.parquet", {"doc": [0], "labels": [[0, 1]], "scores": [[0.5]]})
    with pytest.raises(ValueError, match="differ in length"):
        io.read_predictions(tmp_path / "uneven.parquet", 5)
    io.write_table(tmp_path / "null.parquet", {"doc": pa.array([0, 1]), "labels": pa.array([[0], None], pa.list_(pa.int32())),
                                               "scores": pa.array([[0.5], None], pa.list_(pa.float32()))})
    with pytest.raises(ValueError, match="no label list"):
        io.read_predictions(tmp_path / "null.parquet", 5)


def test_row_ranks_one_key_sort_equals_the_three_key_lexsort():
    """The float32 fast path orders entries exactly as lexsort((column, -score, row)) does:
    ties, signed zeros, subnormal and negative scores included."""
    import numpy as np
    import scipy.sparse as sp

    from xmc_steps import io

    rng = np.random.default_rng(0)
    vals = np.array([0.0, -0.0, 1e-38, 1e-45, 1e-30, 0.5, 0.5, 1.0, -1.0, -1e-40, 3.0], np.float32)
    for trial in range(20):
        n, m = int(rng.integers(1, 200)), int(rng.integers(1, 300))
        M = sp.random(n, m, density=float(rng.random()) * 0.5, format="csr", random_state=trial, dtype=np.float32)
        if trial % 2:
            M.data = rng.choice(vals, size=M.nnz).astype(np.float32)
        M.sort_indices()
        rows = np.repeat(np.arange(n), np.diff(M.indptr))
        _, order, _ = io.row_ranks(M)
        assert np.array_equal(order, np.lexsort((M.indices, -M.data, rows))), trial


def test_atomic_dir_replaces_a_folder_only_when_complete(tmp_path):
    out = tmp_path / "model"
    with io.atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    assert (out / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError):
        with io.atomic_dir(out) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("killed half-way")
    assert (out / "a.txt").read_text() == "1"                     # the old folder is untouched
    with io.atomic_dir(out) as tmp:
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]      # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left behind
