"""bench/elias_head_fits.py: the guard's shortlist recall on embeddings, and the cross-entropy fit of W_C."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from conftest import load_bench

from xmc_steps import elias
from xmc_steps.baselines import recall_of_top
from xmc_steps.elias.model import adjacency_from_assignment, partition_targets

fits = load_bench("elias_head_fits")


def _model(assign: np.ndarray, C: int, dim: int, b: int, K: int) -> elias.EliasModel:
    index, value = adjacency_from_assignment(assign, C)
    m = elias.EliasModel(None, C, len(assign), index.shape[1], dim=dim, b=b, K=K, fixed_edges=True)
    m.set_adjacency(index, value)
    return m


def test_shortlist_recall_is_the_labels_of_the_top_clusters():
    # 4 clusters of 2 labels; W_C = identity on 4-d embeddings, so a document's top cluster is its argmax
    assign = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    m = _model(assign, 4, 4, b=1, K=2)
    with torch.no_grad():
        m.Wc.copy_(torch.eye(4))
    emb = np.array([[5, 0, 0, 0], [0, 0, 5, 0], [0, 5, 0, 0]], dtype=np.float32)
    Y = sp.csr_matrix(np.array([[1, 0, 1, 0, 0, 0, 0, 0],      # cluster 0 holds label 0, not label 2
                                [0, 0, 0, 0, 1, 1, 0, 0],      # cluster 2 holds both
                                [0, 0, 0, 0, 0, 0, 1, 0]]))    # cluster 1 holds neither
    r = fits.shortlist_recall(m, emb, Y, width=2, batch=2)
    top = sp.csr_matrix(np.array([[1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]]))
    assert r == recall_of_top(top, Y) == (0.5 + 1.0 + 0.0) / 3


def test_cross_entropy_head_learns_separable_clusters():
    rng = np.random.default_rng(0)
    C, L, d, n = 8, 32, 16, 400
    assign = np.repeat(np.arange(C), L // C)
    centres = rng.normal(size=(C, d)).astype(np.float32) * 3
    c_doc = rng.integers(0, C, n)
    emb = (centres[c_doc] + rng.normal(size=(n, d)).astype(np.float32)).astype(np.float32)
    labels = np.array([rng.choice(np.flatnonzero(assign == c)) for c in c_doc])
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), labels)), shape=(n, L))
    m = _model(assign, C, d, b=1, K=L // C)
    with torch.no_grad():               # the model starts W_C random from torch's global RNG, which other
        m.Wc.zero_()                    # tests move: zero it so every cluster ties, whatever ran before
    prior = fits.shortlist_recall(m, emb, Y, width=L // C)        # one tied cluster: about 1/C of the truth
    M = partition_targets(Y, m.A_index.numpy(), C)
    W = fits.cross_entropy_head(emb, M, epochs=20, lr=0.05, batch=64)
    with torch.no_grad():
        m.Wc.copy_(torch.from_numpy(W))
    learned = fits.shortlist_recall(m, emb, Y, width=L // C)
    assert prior < 0.3 and learned > 0.95, (prior, learned)
