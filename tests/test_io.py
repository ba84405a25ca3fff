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
