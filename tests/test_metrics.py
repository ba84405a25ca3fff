"""Hand-worked checks of xmc_steps.metrics.

The running example (N = 4 documents, L = 5 labels):

    scores (sparse; "-" = not predicted)        truth
    doc0: l0=.9 l1=.5 l2=.5 l3=.2 l4=-          {1, 3}
    doc1: l0=.7 l2=.3                           {0}
    doc2: l0=1.                                 {}        <- no label: excluded
    doc3: l0=.6 l4=.6                           {4}       <- l4 unseen in training

Ranking (higher score first, ties -> lower label index):
    doc0: 0, 1, 2, 3        (l1/l2 tie at .5 -> l1 first)   hits 0 1 0 1 -
    doc1: 0, 2              (only two predictions)           hits 1 0 - - -
    doc3: 0, 4              (l0/l4 tie at .6 -> l0 first)    hits 0 1 - - -
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import metrics as M

D = [1.0 / math.log2(r + 1) for r in range(1, 7)]  # D[j-1] = discount at rank j
d1, d2, d3, d4, d5 = D[:5]  # 1, .63093, .5, .43068, .38685

NEG = -np.inf
DENSE = np.array([
    [0.9, 0.5, 0.5, 0.2, NEG],
    [0.7, NEG, 0.3, NEG, NEG],
    [1.0, NEG, NEG, NEG, NEG],
    [0.6, NEG, NEG, NEG, 0.6],
])


def _sparse_scores():
    rows = [0, 0, 0, 0, 1, 1, 2, 3, 3]
    cols = [0, 1, 2, 3, 0, 2, 0, 0, 4]
    vals = [0.9, 0.5, 0.5, 0.2, 0.7, 0.3, 1.0, 0.6, 0.6]
    return sp.csr_matrix((vals, (rows, cols)), shape=(4, 5))


TRUTH = sp.csr_matrix(np.array([
    [0, 1, 0, 1, 0],
    [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1],
]))
# Hand-chosen inverse propensities; l4 (unseen in training) has the largest.
W = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
TRAIN_FREQ = np.array([3, 1, 0, 2, 0])


@pytest.fixture(params=["sparse", "dense"])
def scores(request):
    return _sparse_scores() if request.param == "sparse" else DENSE.copy()


def test_precision(scores):
    # cumulative hits per evaluated doc (doc2 excluded, 3 docs):
    #   doc0 [0,1,1,2,2]  doc1 [1,1,1,1,1]  doc3 [0,1,1,1,1]
    # P@1 = (0+1+0)/3 = 1/3
    # P@2 = (1/2+1/2+1/2)/3 = 1/2      (tie l1/l2 -> l1 first, a hit; the other
    #                                   rule would give (0+1/2+1/2)/3 = 1/3)
    # P@3 = (1/3+1/3+1/3)/3 = 1/3
    # P@4 = (2/4+1/4+1/4)/3 = 1/3
    # P@5 = (2/5+1/5+1/5)/3 = 4/15     (divides by 5 although |y| <= 2)
    np.testing.assert_allclose(M.precision(scores, TRUTH, k=5), [1 / 3, 1 / 2, 1 / 3, 1 / 3, 4 / 15])


def test_ndcg(scores):
    # doc0 |y|=2: DCG@1=0, DCG@2=DCG@3=d2, DCG@4=DCG@5=d2+d4; IDCG@j>=2 = d1+d2
    # doc1 |y|=1: DCG=1 at every j, IDCG=1 -> 1
    # doc3 |y|=1: DCG@1=0, DCG@j>=2 = d2, IDCG=1
    exp = [
        (0 + 1 + 0) / 3,
        (d2 / (d1 + d2) + 1 + d2) / 3,
        (d2 / (d1 + d2) + 1 + d2) / 3,
        ((d2 + d4) / (d1 + d2) + 1 + d2) / 3,
        ((d2 + d4) / (d1 + d2) + 1 + d2) / 3,
    ]
    np.testing.assert_allclose(M.ndcg(scores, TRUTH, k=5), exp)
    # nDCG@3 numerically: (.38685 + 1 + .63093)/3 = .67259
    assert M.ndcg(scores, TRUTH, k=3)[2] == pytest.approx(0.672594, abs=1e-6)


def test_recall(scores):
    # doc0: [0, 1/2, 1/2, 1, 1]; doc1: [1]*5; doc3: [0, 1, 1, 1, 1]
    exp = [1 / 3, (0.5 + 1 + 1) / 3, (0.5 + 1 + 1) / 3, 1, 1]
    np.testing.assert_allclose(M.recall(scores, TRUTH, k=5), exp)
    # beyond the end of the prediction lists recall stays flat
    np.testing.assert_allclose(M.recall(scores, TRUTH, k=100)[-1], 1.0)


def test_psprecision(scores):
    # weighted gains in rank order (W = [1,2,3,4,10]):
    #   doc0 [0,2,0,4,0] cum [0,2,2,6,6]; doc1 [1,0,..] cum 1; doc3 [0,10,..] cum [0,10,...]
    # ideal (relevant weights sorted desc): doc0 [4,2] cum [4,6,6,..]; doc1 [1]; doc3 [10]
    # PSP@1 = (0+1+0)/1 / ((4+1+10)/1) = 1/15
    # PSP@2 = (2+1+10)/2 / ((6+1+10)/2) = 13/17
    # PSP@3 = 13/17, PSP@4 = PSP@5 = 17/17 = 1 (best achievable reached)
    np.testing.assert_allclose(M.psprecision(scores, TRUTH, W, k=5), [1 / 15, 13 / 17, 13 / 17, 1, 1])


def test_psndcg(scores):
    # per doc PSDCG / IDCG (unweighted IDCG over min(j,|y|) ranks), summed, over the
    # same for the ideal ranking:
    # j=1: (0 + 1 + 0) / (4/1 + 1 + 10) = 1/15
    # j=3: (2 d2/(1+d2) + 1 + 10 d2) / ((4 + 2 d2)/(1+d2) + 1 + 10)
    # j=5: ((2 d2 + 4 d4)/(1+d2) + 1 + 10 d2) / ((4 + 2 d2)/(1+d2) + 11)
    got = M.psndcg(scores, TRUTH, W, k=5)
    assert got[0] == pytest.approx(1 / 15)
    assert got[2] == pytest.approx((2 * d2 / (1 + d2) + 1 + 10 * d2) / ((4 + 2 * d2) / (1 + d2) + 11))
    assert got[4] == pytest.approx(((2 * d2 + 4 * d4) / (1 + d2) + 1 + 10 * d2) / ((4 + 2 * d2) / (1 + d2) + 11))


def test_perfect_ranking_scores_one():
    # relevant labels scored by their weight (the ideal PS order), the rest not
    # predicted: every metric that can reach 1 does.
    t = TRUTH.toarray()
    s = np.where(t > 0, W[None, :], -np.inf)
    for fn in (M.psprecision, M.psndcg):
        np.testing.assert_allclose(fn(s, TRUTH, W, k=5), 1.0)
    np.testing.assert_allclose(M.ndcg(s, TRUTH, k=5), 1.0)
    # P@1 = 1 but P@2 = (2/2 + 1/2 + 1/2)/3 = 2/3: P@k divides by k
    np.testing.assert_allclose(M.precision(s, TRUTH, k=2), [1.0, 2 / 3])
    # equal scores for doc0's {l1 (w=2), l3 (w=4)}: tie -> l1 first, so PSP@1 is
    # (2 + 1 + 10) / (4 + 1 + 10) = 13/15, not 1
    s_tied = np.where(t > 0, 1.0, -np.inf)
    assert M.psprecision(s_tied, TRUTH, W, k=1)[0] == pytest.approx(13 / 15)


def test_doc_without_labels_excluded():
    # Adding more label-less documents changes nothing; they are only counted.
    s = sp.vstack([_sparse_scores(), sp.csr_matrix(np.ones((3, 5)))]).tocsr()
    t = sp.vstack([TRUTH, sp.csr_matrix((3, 5))]).tocsr()
    np.testing.assert_allclose(M.precision(s, t, 5), M.precision(_sparse_scores(), TRUTH, 5))
    assert M.n_docs_without_labels(t) == 4
    assert M.n_docs_without_labels(TRUTH) == 1
    # no labelled document at all: undefined -> NaN / ValueError
    empty = sp.csr_matrix((2, 5))
    assert np.isnan(M.precision(np.ones((2, 5)), empty, 3)).all()
    with pytest.raises(ValueError):
        M.all_metrics(np.ones((2, 5)), empty, W, TRAIN_FREQ)


def test_ties_dense_with_many_equal_scores():
    # All 6 scores equal: ranking is 0,1,2,... (lower index first), also when the
    # top-k threshold falls inside the tie.
    s = np.zeros((1, 6))
    t = sp.csr_matrix(np.array([[0, 0, 1, 0, 0, 1]]))
    # hits at ranks 3 and 6: P@1..3 = [0, 0, 1/3]
    np.testing.assert_allclose(M.precision(s, t, 3), [0, 0, 1 / 3])
    np.testing.assert_allclose(M.precision(sp.csr_matrix(np.full((1, 6), 0.5)), t, 3), [0, 0, 1 / 3])


def test_dense_zeros_are_predictions_sparse_missing_are_not():
    # dense: a 0 score is ranked; sparse: a missing entry is "not predicted".
    t = sp.csr_matrix(np.array([[0, 1, 0]]))
    dense = np.array([[0.5, 0.0, -1.0]])  # ranking 0, 1, 2 -> hit at rank 2
    np.testing.assert_allclose(M.recall(dense, t, 2), [0, 1])
    sparse = sp.csr_matrix(dense)  # drops the 0 -> label 1 never predicted
    np.testing.assert_allclose(M.recall(sparse, t, 2), [0, 0])


def _brute(scores_dense, truth_dense, w, k):
    """Straightforward per-document reference (same conventions)."""
    P, N, R, PSn, PSd, PSNn, PSNd = (np.zeros(k) for _ in range(7))
    n = 0
    for s, y in zip(scores_dense, truth_dense):
        rel = set(np.flatnonzero(y))
        if not rel:
            continue
        n += 1
        cand = [(-v, l) for l, v in enumerate(s) if np.isfinite(v)]
        ranked = [l for _, l in sorted(cand)][:k]
        ideal_w = sorted((w[l] for l in rel), reverse=True)
        for j in range(1, k + 1):
            top = ranked[:j]
            hits = [1.0 if l in rel else 0.0 for l in top]
            idcg = sum(D_[r] for r in range(min(j, len(rel))))
            P[j - 1] += sum(hits) / j
            R[j - 1] += sum(hits) / len(rel)
            N[j - 1] += sum(h * D_[r] for r, h in enumerate(hits)) / idcg
            PSn[j - 1] += sum(h * w[l] for h, l in zip(hits, top)) / j
            PSd[j - 1] += sum(ideal_w[:j]) / j
            PSNn[j - 1] += sum(h * w[l] * D_[r] for r, (h, l) in enumerate(zip(hits, top))) / idcg
            PSNd[j - 1] += sum(v * D_[r] for r, v in enumerate(ideal_w[:j])) / idcg
    return P / n, N / n, R / n, PSn / PSd, PSNn / PSNd


D_ = [1.0 / math.log2(r + 2) for r in range(200)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_against_reference_and_dense_equals_sparse(seed):
    rng = np.random.default_rng(seed)
    n, L, k = 40, 30, 8
    truth = (rng.random((n, L)) < 0.08).astype(np.int8)
    # integer scores -> many ties; keep ~10 predictions per row, -inf elsewhere
    dense = rng.integers(1, 6, size=(n, L)).astype(np.float64)
    dense[rng.random((n, L)) > 0.35] = -np.inf
    sparse = sp.csr_matrix(np.where(np.isfinite(dense), dense, 0.0))
    w = 1.0 + rng.random(L) * 5
    ref = _brute(dense, truth, w, k)
    for s in (dense, sparse, sparse.tocoo(), sparse.tocsc()):
        got = (M.precision(s, truth, k), M.ndcg(s, truth, k), M.recall(s, truth, k),
               M.psprecision(s, truth, w, k), M.psndcg(s, truth, w, k))
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-12)
    # truth given dense or sparse: identical
    np.testing.assert_allclose(M.precision(sparse, sp.csr_matrix(truth), k), ref[0])


def test_inverse_propensity_hand_computed():
    # N = 4 training docs, L = 5 labels, frequencies N_l = [3, 1, 0, 2, 0] (l2, l4 unseen)
    Y = sp.csr_matrix(np.array([
        [1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0],
    ]))
    A, B = 0.55, 1.5
    # C = (ln 4 - 1)(1.5 + 1)^0.55 = 0.386294 * 1.655267 = 0.639419
    C = (math.log(4) - 1) * 2.5 ** 0.55
    assert C == pytest.approx(0.6394188, abs=1e-7)
    w = M.inverse_propensity(Y, A=A, B=B)
    # N_l = 1: 1 + C * 2.5^-0.55 = 1 + (ln 4 - 1) = ln 4 = 1.386294
    assert w[1] == pytest.approx(math.log(4))
    # N_l = 3: 1 + 0.639419 * 4.5^-0.55 = 1.279588
    assert w[0] == pytest.approx(1.2795880, abs=1e-7)
    # unseen (N_l = 0): 1 + 0.639419 * 1.5^-0.55 = 1.511605, the largest weight
    assert w[2] == w[4] == pytest.approx(1.5116055, abs=1e-7)
    assert w.argmax() == 2
    np.testing.assert_allclose(w, 1 + C * (np.array([3, 1, 0, 2, 0]) + B) ** -A)
    # dense input and frequency-vector input agree; n_train overrides N
    np.testing.assert_allclose(M.inverse_propensity(Y.toarray(), A=A, B=B), w)
    np.testing.assert_allclose(M.inverse_propensity(np.array([3, 1, 0, 2, 0]), n_train=4, A=A, B=B), w)
    with pytest.raises(ValueError):
        M.inverse_propensity(np.array([3, 1]), A=A, B=B)


def test_inverse_propensity_wikipedia_constants():
    # N = 10, A, B = 0.5, 0.4 (wiki): unseen label -> 1 + (ln 10 - 1) * sqrt(1.4 / 0.4)
    #   = 1 + 1.302585 * 1.870829 = 3.436914; N_l = 1 -> ln 10 = 2.302585
    A, B = M.propensity_constants("wiki500k")
    w = M.inverse_propensity(np.array([0, 1]), n_train=10, A=A, B=B)
    np.testing.assert_allclose(w, [3.4369136, math.log(10)], rtol=1e-7)


def test_propensity_constants():
    assert M.propensity_constants("WikiLSHTC-325K") == (0.5, 0.4)
    assert M.propensity_constants("Wiki500K") == (0.5, 0.4)
    assert M.propensity_constants("wiki10-31k") == (0.55, 1.5)    # Jain et al. 2016: the default
    for name in ("amazoncat13k", "amazon670k", "amazon3m", "lf-amazontitles131k"):
        assert M.propensity_constants(name) == (0.6, 2.6)
    for name in ("eurlex4k", "debtags", ""):
        assert M.propensity_constants(name) == (0.55, 1.5)


def test_label_deciles_and_decile_recall(scores):
    # train freq [3,1,0,2,0] sorted desc (ties -> lower index): l0, l3, l1, l2, l4
    # two bins of equal label count (array_split 5 -> 3 + 2): head {l0,l3,l1}, tail {l2,l4}
    np.testing.assert_array_equal(M.label_deciles(TRAIN_FREQ, 2), [0, 0, 1, 0, 1])
    # @5: doc0 hits l1, l3 (head) -> 2/|y|=2/2; doc1 hit l0 (head) -> 1/1;
    #     doc3 hit l4 (tail, unseen) -> 1/1.  Means over 3 docs: head 2/3, tail 1/3
    got = M.decile_recall(scores, TRUTH, TRAIN_FREQ, k=5, n_bins=2)
    np.testing.assert_allclose(got, [2 / 3, 1 / 3])
    assert got.sum() == pytest.approx(M.recall(scores, TRUTH, 5)[-1])  # contributions sum to R@k
    # @1 only doc1's l0 is found: [1/3, 0]
    np.testing.assert_allclose(M.decile_recall(scores, TRUTH, TRAIN_FREQ, k=1, n_bins=2), [1 / 3, 0])
    # 10 bins over 5 labels: one label per bin for the first 5 bins, empty bins after
    d10 = M.decile_recall(scores, TRUTH, TRAIN_FREQ, k=5, n_bins=10)
    assert d10.shape == (10,)
    # bin0 = l0 (doc1: 1/3), bin1 = l3 (doc0: (1/2)/3), bin2 = l1 (doc0: (1/2)/3), bin4 = l4 (1/3)
    np.testing.assert_allclose(d10, [1 / 3, 1 / 6, 1 / 6, 0, 1 / 3, 0, 0, 0, 0, 0])


def test_all_metrics_keys_percentages_and_chunking(scores):
    out = M.all_metrics(scores, TRUTH, W, TRAIN_FREQ)
    assert list(out) == list(M.METRIC_KEYS) + [M.DECILE_KEY]
    assert all("@" not in key for key in out)
    assert out["p_at_1"] == pytest.approx(100 / 3)
    assert out["p_at_5"] == pytest.approx(100 * 4 / 15)
    assert out["psp_at_1"] == pytest.approx(100 / 15)
    assert out["recall_at_100"] == pytest.approx(100.0)
    assert len(out[M.DECILE_KEY]) == 10
    assert sum(out[M.DECILE_KEY]) == pytest.approx(out["recall_at_100"])
    one_row_chunks = M.all_metrics(scores, TRUTH, W, TRAIN_FREQ, chunk_rows=1)
    for key in M.METRIC_KEYS:
        assert one_row_chunks[key] == pytest.approx(out[key])


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        M.precision(np.zeros((2, 5)), TRUTH, 1)
    with pytest.raises(ValueError):
        M.psprecision(DENSE, TRUTH, W[:3], 1)


def test_zero_shot_counts_only_the_labels_training_never_saw():
    import scipy.sparse as sp

    from xmc_steps import metrics as xm

    freq = np.array([5, 3, 0, 0])                       # labels 2 and 3: never in training
    truth = sp.csr_matrix(np.array([[1, 0, 1, 0],       # one seen, one unseen label
                                    [0, 1, 0, 0],       # seen only: not a zero-shot document
                                    [0, 0, 0, 1]]))     # unseen only
    seen_only = sp.csr_matrix(np.array([[0.9, 0.5, 0, 0], [0.1, 0.9, 0, 0], [0.8, 0.7, 0, 0]]))
    zs = xm.zero_shot(seen_only, truth, freq)
    assert zs["n_docs"] == 2 and zs["n_labels"] == 2
    assert zs["p_at_1"] == 0.0 and zs["recall_at_100"] == 0.0         # a classifier of seen labels scores 0
    ranks_unseen = sp.csr_matrix(np.array([[0.1, 0, 0.9, 0.2], [0, 0, 0, 0], [0.5, 0, 0.2, 0.4]]))
    zs = xm.zero_shot(ranks_unseen, truth, freq)
    assert zs["p_at_1"] == pytest.approx(50.0)          # doc 0: label 2 first; doc 2: label 0 first
    assert zs["recall_at_10"] == pytest.approx(100.0)
    assert xm.zero_shot(ranks_unseen, truth, np.array([1, 1, 1, 1])) is None
