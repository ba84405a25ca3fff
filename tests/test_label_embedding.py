"""Label representations for semantic label indexing (X-Transformer §3.2)."""

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import io
from xmc_steps.label_embedding import pifa
from xmc_steps.stages.label_embedding import main
from xmc_steps.errors import StageError


def _labels_table(path, texts):
    io.write_table(path, {"label_id": [f"l{i}" for i in range(len(texts))], "label_text": texts,
                          "train_freq": np.ones(len(texts), np.int64)})


def test_pifa_neural_from_dense_embeddings(tmp_path):
    E = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]], np.float32)
    Y = sp.csr_matrix(np.array([[1, 0], [1, 1], [0, 1]], np.float32))
    io.save_arrays(tmp_path / "emb.npz", emb=E)
    io.save_csr(tmp_path / "Y.npz", Y)
    main(["--kind", "pifa-neural", "--features", str(tmp_path / "emb.npz"), "--labels", str(tmp_path / "Y.npz"),
          "--out", str(tmp_path / "le.npz")])
    Z = io.load_csr(tmp_path / "le.npz").toarray()
    # label 0: (1,0)+(0,2) = (1,2)/sqrt(5); label 1: (0,2)+(3,4) = (3,6)/sqrt(45)
    assert Z == pytest.approx(np.array([[1, 2], [3, 6]]) / np.array([[np.sqrt(5)], [np.sqrt(45)]]), rel=1e-6)
    assert Z == pytest.approx(pifa(sp.csr_matrix(E), Y).toarray())


def test_text_emb_needs_label_texts(tmp_path):
    io.write_table(tmp_path / "labels.parquet", {"label_id": ["a", "b"], "label_text": ["a", "b"],
                                                 "train_freq": np.array([1, 1])})
    with pytest.raises(StageError, match="text-emb needs label texts"):
        main(["--kind", "text-emb", "--label-table", str(tmp_path / "labels.parquet"), "--out", str(tmp_path / "le.npz")])
    assert not (tmp_path / "le.npz").exists()


def test_text_emb_with_minilm_puts_similar_labels_together(tmp_path):
    _labels_table(tmp_path / "labels.parquet", ["Games: strategy games", "Games: puzzle games",
                                                "Network: web server", "Network: mail server"])
    main(["--kind", "text-emb", "--label-table", str(tmp_path / "labels.parquet"), "--out", str(tmp_path / "le.npz"),
          "--params", '{"max_length": 16}'])
    Z = io.load_csr(tmp_path / "le.npz").toarray()
    assert Z.shape == (4, 384)
    assert np.linalg.norm(Z, axis=1) == pytest.approx(np.ones(4), rel=1e-5)
    S = Z @ Z.T
    assert S[0, 1] > S[0, 2] and S[2, 3] > S[1, 2]
