"""XR-Linear: beam search, training with TFN/MAN, save/load, CLI, and debtags (slow)."""

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import io
from xmc_steps.cluster_tree import ClusterTree, hierarchical_kmeans
from xmc_steps.label_embedding import pifa
from xmc_steps.ranker import RankerParams, append_bias
from xmc_steps.search import beam_search, masked_product, topk_per_row, transform
from xmc_steps.stages.xr_linear import main as xr_main
from xmc_steps.xr_linear import XRLinearModel, XRLinearParams

DEBTAGS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "debtags-bookworm"


def _toy(seed=0, N=300, d=60, L=40):
    """Labels driven by features: label j fires with feature j (plus noise)."""
    rng = np.random.default_rng(seed)
    X = sp.random(N, d, density=0.15, format="csr", random_state=rng, dtype=np.float32)
    Xd = X.toarray()
    Y = (Xd[:, :L] > 0.5).astype(np.float32)
    Y[np.arange(N), rng.integers(0, L, N)] = 1  # every instance has a label
    return X, sp.csr_matrix(Y)


def _model(seed=0, **kw):
    X, Y = _toy(seed)
    tree = hierarchical_kmeans(pifa(X, Y), branching=2, leaf_size=5, seed=0, max_iter=5)
    params = {"solver": {"threshold": 0.0}, "threads": 2}
    params.update(kw)
    return X, Y, tree, XRLinearModel.train(X, Y, tree, params)


def test_transforms():
    z = np.array([-1.0, 0.0, 1.0, 2.0])
    np.testing.assert_allclose(transform(z, "l3-hinge"), np.exp(-np.array([8, 1, 0, 0.0])), rtol=1e-6)
    np.testing.assert_allclose(transform(z, "l2-hinge"), np.exp(-np.array([4, 1, 0, 0.0])), rtol=1e-6)
    np.testing.assert_allclose(transform(z, "sigmoid"), 1 / (1 + np.exp(-z)), rtol=1e-6)
    with pytest.raises(ValueError):
        transform(z, "relu")


def test_topk_per_row_sparse_and_dense():
    rng = np.random.default_rng(0)
    A = np.round(rng.random((20, 15)), 1).astype(np.float32) * (rng.random((20, 15)) < 0.6)
    A[3] = 0  # an empty row
    A[4, :6] = 0.5  # ties -> lower column index
    T = topk_per_row(sp.csr_matrix(A), 3).toarray()
    for i in range(20):
        cand = np.flatnonzero(A[i])
        best = cand[np.lexsort((cand, -A[i][cand]))][:3]
        assert np.flatnonzero(T[i]).tolist() == sorted(best.tolist())
        np.testing.assert_array_equal(T[i][best], A[i][best])
    assert np.flatnonzero(T[4]).tolist() == [0, 1, 2] or A[4, 6:].max() > 0.5
    D = topk_per_row(A + 1.0, 4).toarray()  # dense input: exactly k per row
    assert np.all((D != 0).sum(axis=1) == 4)
    np.testing.assert_allclose(np.sort(D, axis=1)[:, -4:], np.sort(A + 1.0, axis=1)[:, -4:])


def test_masked_product_matches_dense():
    rng = np.random.default_rng(1)
    X = sp.random(50, 30, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    W = sp.random(30, 40, density=0.3, format="csc", random_state=rng, dtype=np.float32)
    cand = sp.csr_matrix((rng.random((50, 40)) < 0.2).astype(np.float32))
    full = (X @ W).toarray()
    rows = np.repeat(np.arange(50), np.diff(cand.indptr))
    for kw in ({}, {"batch_entries": 7, "dense_budget": 10}):
        np.testing.assert_allclose(masked_product(X, W, cand, **kw), full[rows, cand.indices], rtol=1e-5)


def test_masked_product_scores_a_dense_block_per_candidate():
    """TF-IDF ⊕ a dense block ⊕ bias (the rankers' features): the dense columns are scored for the
    candidates only, the sparse ones by row blocks; the sum equals the full product."""
    from xmc_steps.ranker import append_bias

    rng = np.random.default_rng(2)
    n, d_sparse, d_dense, m = 40, 50, 12, 30
    Xs = sp.random(n, d_sparse, density=0.1, format="csr", random_state=rng, dtype=np.float32)
    E = rng.normal(size=(n, d_dense)).astype(np.float32)
    X = append_bias(sp.hstack([Xs, sp.csr_matrix(E)], format="csr"))
    X = sp.vstack([X[:-1], sp.csr_matrix((1, X.shape[1]), dtype=np.float32)], format="csr")   # an empty last row
    W = sp.random(X.shape[1], m, density=0.4, format="csc", random_state=rng, dtype=np.float32)
    cand = sp.csr_matrix((rng.random((n, m)) < 0.3).astype(np.float32))
    full = (X @ W).toarray()
    rows = np.repeat(np.arange(n), np.diff(cand.indptr))
    for kw in ({}, {"batch_entries": 5, "dense_budget": 4}):
        np.testing.assert_allclose(masked_product(X, W, cand, **kw), full[rows, cand.indices], rtol=1e-4, atol=1e-5)


def test_gather_reads_unsorted_products_and_missing_entries():
    from xmc_steps.search import _gather

    Z = sp.csr_matrix((np.array([5., 1., 7., 2.], np.float32), np.array([3, 0, 2, 1]), np.array([0, 2, 2, 4])),
                      shape=(3, 4))
    assert not Z.has_sorted_indices
    rows, cols = np.array([0, 0, 0, 1, 2, 2, 2]), np.array([0, 3, 1, 2, 1, 2, 0])
    np.testing.assert_array_equal(_gather(Z, rows, cols), Z.toarray()[rows, cols])
    assert _gather(sp.csr_matrix((2, 2), dtype=np.float32), np.array([1]), np.array([0])).tolist() == [0.0]


def test_deep_tree_scores_do_not_underflow():
    """40 levels, each multiplying a path by about 1e-3: float32 products reach 0 after ~13
    levels, and scipy would drop every candidate; the rescaled beam keeps them, in order."""
    depth = 40
    parents = [np.zeros(2, np.int64)] + [np.arange(2)] * (depth - 2) + [np.array([0, 0, 1, 1])]
    tree = ClusterTree.from_parents(parents)
    d = 3
    W = []
    for t, n in enumerate(tree.level_sizes[1:]):
        w = np.zeros((d + 1, n), np.float32)
        w[d] = -0.9 if t < depth - 1 else np.array([-0.95, -0.9, -0.85, -0.8])[:n]   # bias feature only
        W.append(sp.csr_matrix(w))
    model = XRLinearModel(tree, W)
    X = sp.csr_matrix(np.ones((3, d), np.float32))
    P = model.predict(X, beam=2, topk=4)
    assert (np.diff(P.indptr) == 4).all() and (P.data > 0).all()
    # same path prefix for labels 0, 1 and for 2, 3: the order is the last level's, 3 > 2 > 1 > 0
    assert (np.argsort(-P.toarray(), axis=1)[:, :4] == [3, 2, 1, 0]).all()


def test_tree_levels_and_model_shapes():
    X, Y, tree, model = _model()
    assert tree.level_sizes == [1, 2, 4, 8, 40]
    assert [w.shape for w in model.W] == [(61, 2), (61, 4), (61, 8), (61, 40)]


@pytest.mark.parametrize("kind", ["l3-hinge", "sigmoid"])
def test_beam_search_exact_when_beam_covers_tree(kind):
    X, Y, tree, model = _model()
    P = model.predict(X, beam=8, topk=10, transform=kind).toarray()
    Xa = append_bias(X)
    S = np.ones((X.shape[0], tree.n_labels), dtype=np.float64)
    for t, W in enumerate(model.W):
        Z = transform((Xa @ W).toarray(), kind)
        S *= Z[:, tree.assignment(t + 1)]
    for i in range(X.shape[0]):
        top = np.argsort(-S[i], kind="stable")[:10]
        got = np.flatnonzero(P[i])
        assert len(got) == 10
        np.testing.assert_allclose(np.sort(P[i][got]), np.sort(S[i][top]), rtol=1e-4)


def test_training_fits_and_beam_narrows():
    X, Y, tree, model = _model()
    P = model.predict(X, beam=2, topk=5)
    assert np.all(np.diff(P.indptr) <= 5)
    top1 = np.asarray(P.argmax(axis=1)).ravel()
    assert Y.toarray()[np.arange(X.shape[0]), top1].mean() > 0.8
    C = model.predict_clusters(X, beam=2)
    assert C.shape == (X.shape[0], tree.n_clusters) and np.all(np.diff(C.indptr) == 2)
    # keep: the same search, a longer list whose first entries are the top-beam
    C4 = model.predict_clusters(X, beam=2, keep=4)
    assert np.all(np.diff(C4.indptr) <= 4) and np.all(np.diff(C4.indptr) >= 2)
    assert (topk_per_row(C4, 2) != C).nnz == 0


def test_tfn_only_and_generic_beam_search():
    X, Y, tree, model = _model(negatives="tfn")
    # beam_search with a user scorer: constant scores keep the first nodes (ties -> lower index)
    def const(t, cand):
        return cand
    P = beam_search(tree.C, const, 3, beam=1, topk=4)
    assert P.shape == (3, tree.n_labels) and np.all(np.diff(P.indptr) == 4)


def test_params():
    p = XRLinearParams.from_dict({"solver": {"C": 2}, "beam": 5, "negatives": "tfn"})
    assert p.solver.C == 2.0 and p.beam == 5 and p.negatives == "tfn"
    with pytest.raises(ValueError):
        XRLinearParams.from_dict({"nope": 1})
    with pytest.raises(ValueError, match="negatives must be one of"):
        XRLinearParams(negatives="random")
    # the flat solver keys of an earlier version: an error naming the new key, and upgraded when read from a model
    with pytest.raises(ValueError, match="C is now solver.C"):
        XRLinearParams.from_dict({"C": 2})
    old = {"C": 2.0, "threshold": 0.0, "tol": 0.1, "max_iter": 100, "negatives": "tfn", "threads": 2, "bias": 1.0,
           "seed": 0, "beam": 5, "transform": "l3-hinge"}
    up = XRLinearParams.from_dict(XRLinearParams.upgrade(old))
    assert up.solver == RankerParams(C=2.0, threshold=0.0) and up.negatives == "tfn" and up.threads == 2


def test_save_load_roundtrip(tmp_path):
    X, Y, tree, model = _model()
    model.save(tmp_path / "m")
    m2 = XRLinearModel.load(tmp_path / "m")
    # threads change the speed, not the model: not saved
    assert m2.params == dataclasses.replace(model.params, threads=1)
    a, b = model.predict(X, beam=3, topk=7), m2.predict(X, beam=3, topk=7)
    assert abs(a - b).max() == 0


def test_cli_train_predict(tmp_path):
    X, Y = _toy(1)
    io.save_csr(tmp_path / "X1.npz", X[:200])
    io.save_csr(tmp_path / "X2.npz", X[200:])
    io.save_csr(tmp_path / "Y1.npz", Y[:200])
    io.save_csr(tmp_path / "Y2.npz", Y[200:])
    tree = hierarchical_kmeans(pifa(X, Y), 4, 10, seed=0)
    tree.save(tmp_path / "tree.npz")
    xr_main(["train", "--features", str(tmp_path / "X1.npz"), "--features", str(tmp_path / "X2.npz"),
             "--labels", str(tmp_path / "Y1.npz"), "--labels", str(tmp_path / "Y2.npz"),
             "--tree", str(tmp_path / "tree.npz"), "--out", str(tmp_path / "model"),
             "--params", '{"threads": 2, "solver": {"C": 1.0}}', "--no-tracking"])
    xr_main(["predict", "--model", str(tmp_path / "model"), "--features", str(tmp_path / "X2.npz"),
             "--out", str(tmp_path / "pred.parquet"), "--params", '{"beam": 4, "topk": 5}', "--no-tracking"])
    P = io.read_predictions(tmp_path / "pred.parquet", Y.shape[1])
    assert P.shape == (100, Y.shape[1]) and np.all(np.diff(P.indptr) == 5)
    ref = XRLinearModel.load(tmp_path / "model").predict(X[200:], beam=4, topk=5)
    np.testing.assert_allclose(P.toarray(), ref.toarray(), rtol=1e-6)
    # the tree as a matcher: its test clusters count as prediction cost only when they serve prediction (the
    # tree fit on the rankers' splits, fit_on), and the train split's tree keeps 2 topb (the matcher guard's)
    for fit, online, keep in (("train+valid", True, 3), ("train", False, 6)):   # 6: capped at the tree's 4
        rec = tmp_path / f"clusters_{online}.record.json"
        xr_main(["clusters", "--model", str(tmp_path / "model"), "--features", str(tmp_path / "X2.npz"),
                 "--out", str(tmp_path / f"clusters_{online}_test.npz"), "--record", str(rec), "--params",
                 json.dumps({"topb": 3, "scorer": "head", "fit_on": ["train", "valid"], "fit": fit}), "--no-tracking"])
        assert ("online_ms_per_doc" in io.read_json(rec)["metrics"]) is online
        S = io.load_csr(tmp_path / f"clusters_{online}_test.npz")
        assert np.all(np.diff(S.indptr) == min(keep, S.shape[1]))       # the toy tree's 4 clusters


def _stage_predictions(tmp_path, model_dir, X, params, name, n_labels=40):
    """The predictions the xr_linear predict stage writes for ``X`` with the rule's ``params`` (None: none)."""
    io.save_csr(tmp_path / f"{name}_X.npz", X)
    argv = ["predict", "--model", str(model_dir), "--features", str(tmp_path / f"{name}_X.npz"),
            "--out", str(tmp_path / f"{name}.parquet"), "--no-tracking"]
    xr_main(argv + (["--params", json.dumps(params)] if params is not None else []))
    return io.read_predictions(tmp_path / f"{name}.parquet", n_labels)


def test_one_prediction_path_gives_the_stage_its_former_bytes(tmp_path):
    """Issue 51: the predict stage and serving call xr_linear.serve.predict, its PredictParams saved with the
    model (params.json's predict) and overridden by the rule's section: the stage writes the scores its former
    code computed (XRLinearModel.predict with the section's beam, topk, transform over the model's), bit for bit."""
    from xmc_steps.xr_linear.serve import PredictParams, predict

    X, Y, tree, model = _model(beam=6, topk=20, transform="sigmoid")
    model.save(tmp_path / "m")
    saved = io.read_json(tmp_path / "m" / "params.json")["predict"]
    assert saved == {"beam": 6, "topk": 20, "transform": "sigmoid"}
    section = {**XRLinearParams().to_dict(), "beam": 4, "topk": 7}          # what the rule passes: the section
    for params, want in ((section, dict(beam=4, topk=7, transform="l3-hinge")),
                         ({"topk": 5}, dict(beam=6, topk=5, transform="sigmoid")),
                         (None, dict(beam=6, topk=20, transform="sigmoid"))):
        ref = model.predict(X, **want)
        P = _stage_predictions(tmp_path, tmp_path / "m", X, params, "p")
        assert (P != ref).nnz == 0, params
        r = predict(tmp_path / "m", X, params and {k: params[k] for k in PredictParams.keys() if k in params})
        assert (r["scores"] != ref).nnz == 0 and r["params"] == PredictParams(**want)


def test_a_model_saved_before_its_predict_params_predicts_with_its_training_ones(tmp_path):
    from xmc_steps.xr_linear.serve import PredictParams, predict

    X, Y, tree, model = _model(beam=3, topk=9)
    model.save(tmp_path / "m")
    meta = io.read_json(tmp_path / "m" / "params.json")
    del meta["predict"]
    io.write_json(tmp_path / "m" / "params.json", meta)
    r = predict(tmp_path / "m", X)
    assert r["params"] == PredictParams(beam=3, topk=9, transform="l3-hinge")
    assert (r["scores"] != model.predict(X, beam=3, topk=9)).nnz == 0
    P = _stage_predictions(tmp_path, tmp_path / "m", X, {"beam": 5}, "old")
    assert (P != model.predict(X, beam=5, topk=9)).nnz == 0


def test_the_linear_clusters_stage_derives_what_its_rule_derived():
    """The xtransformer_linear_clusters rule passes the matcher's topb and scorer, fit_on and the tree's {fit}
    unchanged; the stage derives the beam, the clusters kept and whether the test split's are online exactly as
    the rule's reshaping did (its copy below), for every fit and scorer; a key of the old shape is an error."""
    import copy

    import yaml

    from xmc_steps import config
    from xmc_steps.stage import StageError
    from xmc_steps.stages.xr_linear import clusters_settings

    def old(s, fit):        # workflow/rules/xtransformer.smk's xt_clusters_params before
        m = s["xtransformer"]["matcher"]
        online = fit == "+".join(s["xtransformer"]["fit_on"]) or m["scorer"] == "head+linear"
        return {"beam": m["topb"], "keep": m["topb"] * (2 if fit == "train" else 1), "online": online}

    root = config.SCHEMA_PATH.parents[2]
    base = yaml.safe_load((root / "config.yaml").read_text())
    paper = config.deep_merge(base, yaml.safe_load((root / "config.paper.yaml").read_text()))
    checked = 0
    for c in (base, paper):
        for dataset in ["debtags", *sorted(c.get("datasets") or {})]:
            s0 = config.dataset_settings(c, dataset)
            for scorer, fit_on in (("head", None), ("head+linear", None), ("head", ["train"])):
                s = copy.deepcopy(s0)
                s["xtransformer"]["matcher"]["scorer"] = scorer
                s["xtransformer"]["fit_on"] = fit_on or s["xtransformer"]["fit_on"]
                for fit in dict.fromkeys(["train", "+".join(s["xtransformer"]["fit_on"])]):
                    payload = {**config.rule_payload(s, "xtransformer_linear_clusters"), "fit": fit}   # PASS's given
                    got = clusters_settings(payload)
                    assert {k: got[k] for k in ("beam", "keep", "online")} == old(s, fit), (dataset, scorer, fit)
                    checked += 1
    assert checked >= 20
    with pytest.raises(StageError, match="unknown clusters parameter"):
        clusters_settings({"beam": 3})


def _read_split(base, split, label_index):
    texts = (base / f"{split}_texts.txt").read_text(encoding="utf-8").splitlines()
    rows = [[label_index[t] for t in line.split()] for line in
            (base / f"{split}_labels.txt").read_text(encoding="utf-8").splitlines()]
    ind = np.array([j for r in rows for j in r], dtype=np.int32)
    ptr = np.cumsum([0] + [len(r) for r in rows])
    Y = sp.csr_matrix((np.ones(len(ind), np.float32), ind, ptr), shape=(len(rows), len(label_index)))
    return texts, Y


@pytest.mark.slow
@pytest.mark.skipif(not DEBTAGS.is_dir(), reason="debtags data not available")
def test_debtags_precision():
    from sklearn.feature_extraction.text import TfidfVectorizer

    ids = (DEBTAGS / "label_ids.txt").read_text(encoding="utf-8").split()
    index = {x: i for i, x in enumerate(ids)}
    tr, Ytr = _read_split(DEBTAGS, "train", index)
    te, Yte = _read_split(DEBTAGS, "test", index)
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, norm="l2", dtype=np.float32)
    Xtr, Xte = vec.fit_transform(tr), vec.transform(te)
    t0 = time.perf_counter()
    tree = hierarchical_kmeans(pifa(Xtr, Ytr), 16, 100, seed=0, max_iter=20)
    model = XRLinearModel.train(Xtr, Ytr, tree, {"threads": 2})
    train_s = time.perf_counter() - t0
    P = model.predict(Xte, beam=10, topk=5)
    top1 = np.asarray(P.argmax(axis=1)).ravel()
    p1 = Yte.toarray()[np.arange(Xte.shape[0]), top1].mean()
    assert p1 >= 0.89, f"P@1 {p1:.4f} (train {train_s:.0f} s)"


# --------------------------------------------------------------------------- same bytes as the reference paths


def _bytes_equal(A: sp.csr_matrix, B: sp.csr_matrix) -> bool:
    A, B = sp.csr_matrix(A), sp.csr_matrix(B)
    return (A.shape == B.shape and np.array_equal(A.indptr, B.indptr) and np.array_equal(A.indices, B.indices)
            and A.data.dtype == B.data.dtype == np.float32 and np.array_equal(A.data.view(np.int32), B.data.view(np.int32)))


def _reference_search(model, X, levels, beam, keep, kind, batch=256):
    """The scipy path the tables replace: beam_search with linear_scorer, batch by batch."""
    from xmc_steps.search import linear_scorer

    Xa = append_bias(X, model.params.solver.bias)
    parts = [beam_search(model.tree.C[:levels], linear_scorer(Xa[r:r + batch], model.W, kind),
                         min(batch, X.shape[0] - r), beam, keep) for r in range(0, X.shape[0], batch)]
    out = sp.vstack(parts, format="csr")
    out.sort_indices()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_table_search_gives_the_bytes_of_the_sparse_product_path(seed):
    """Beam search by tables (one document or a batch) against beam_search + linear_scorer: the same
    rows, node ids and float32 bits, for the labels and the clusters, with ties (a saturated
    transform) and with rows that have no feature."""
    X, Y, tree, model = _model(seed)
    X = sp.vstack([X[:40], sp.csr_matrix((2, X.shape[1]), dtype=np.float32), X[40:80]], format="csr")
    # ties: every score >= 1 is 1 under l3-hinge, so whole clusters tie at their parent's score
    big = XRLinearModel(model.tree, [w * 5.0 for w in model.W], model.params)
    for m in (model, big):
        for kind in ("l3-hinge", "sigmoid", "l2-hinge"):
            for beam, keep in ((1, 3), (2, 5), (3, 40), (8, 10)):
                ref = _reference_search(m, X, tree.depth, beam, keep, kind)
                assert _bytes_equal(m.predict(X, beam=beam, topk=keep, transform=kind), ref)
                assert _bytes_equal(m.predict(X, beam=beam, topk=keep, transform=kind, batch_size=7), ref)
                for i in (0, 5, 40, 41, 70):                      # one document at a time
                    assert _bytes_equal(m.predict(X[i:i + 1], beam=beam, topk=keep, transform=kind), ref[i])
                refc = _reference_search(m, X, tree.depth - 1, beam, max(beam, 4), kind)
                assert _bytes_equal(m.predict_clusters(X, beam=beam, transform=kind, keep=4), refc)


def test_table_search_on_a_deep_tree_rescales_as_beam_search():
    """The 40-level tree of test_deep_tree_scores_do_not_underflow: rows rescaled at the same levels."""
    depth = 40
    parents = [np.zeros(2, np.int64)] + [np.arange(2)] * (depth - 2) + [np.array([0, 0, 1, 1])]
    tree = ClusterTree.from_parents(parents)
    rng = np.random.default_rng(3)
    W = [sp.csr_matrix(np.where(rng.random((4, n)) < 0.7, rng.normal(-0.9, 0.3, (4, n)), 0).astype(np.float32))
         for n in tree.level_sizes[1:]]
    model = XRLinearModel(tree, W)
    X = sp.csr_matrix(rng.random((6, 3)).astype(np.float32))
    assert _bytes_equal(model.predict(X, beam=2, topk=4), _reference_search(model, X, tree.depth, 2, 4, "l3-hinge"))


def test_with_bias_is_append_bias():
    from xmc_steps.xr_linear import with_bias

    rng = np.random.default_rng(4)
    X = sp.random(30, 12, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    X = sp.vstack([X, sp.csr_matrix((2, 12), dtype=np.float32)], format="csr")
    Xu = X.copy()
    Xu.indices, Xu.data = Xu.indices.copy(), Xu.data.copy()
    for r in range(Xu.shape[0]):                   # unsorted columns within each row
        a, b = Xu.indptr[r], Xu.indptr[r + 1]
        Xu.indices[a:b], Xu.data[a:b] = Xu.indices[a:b][::-1], Xu.data[a:b][::-1]
    Xu.has_sorted_indices = False
    for M in (X, Xu, X.astype(np.float64)):
        for bias in (1.0, 0.0, 2.5):
            assert _bytes_equal(with_bias(M, bias), append_bias(M, bias))


def test_direct_liblinear_gives_the_bytes_of_linear_svc():
    """liblinear_direct.fit_ranker against ranker._fit_one (LinearSVC): the same float64 weights and bias,
    over C, bias, seeds, degenerate labels and instances without features."""
    from xmc_steps import liblinear_direct
    from xmc_steps.ranker import _fit_one, liblinear_csr

    rng = np.random.default_rng(5)
    for trial in range(12):
        n, d = int(rng.integers(10, 400)), int(rng.integers(3, 80))
        X = liblinear_csr(sp.random(n, d, density=rng.uniform(0.02, 0.4), format="csr", random_state=rng).astype(np.float64))
        y = np.where(rng.random(n) < rng.uniform(0.05, 0.6), 1.0, -1.0)
        if trial == 10:
            y[:] = -1.0
        if trial == 11:
            X = liblinear_csr(sp.csr_matrix((n, d), dtype=np.float64))
            y[0] = 1.0
        p = RankerParams(C=[1.0, 0.5, 4.0][trial % 3], bias=[1.0, 0.0, 2.0, 0.5][trial % 4], seed=trial % 3,
                         tol=[0.1, 0.01][trial % 2], max_iter=[100, 5][trial % 2])
        w0, b0 = _fit_one(X, y, p)
        w1, b1 = liblinear_direct.fit_ranker(X, y, p)
        assert w0.dtype == w1.dtype and np.array_equal(w0, w1) and b0 == b1 and type(b0) is type(b1), trial


def test_rows_with_a_dense_block_keep_the_sparse_product_path():
    """Features stored in most rows (a neural block) are summed in another order by masked_product:
    such batches keep that path, so the result is still its bytes."""
    from xmc_steps.search import uses_dense_block

    X, Y, tree, model = _model(0)
    rng = np.random.default_rng(6)
    dense = sp.csr_matrix(rng.random((X.shape[0], 10)).astype(np.float32))
    Xd = sp.hstack([X[:, :50], dense], format="csr")
    assert uses_dense_block(append_bias(Xd[:64])) and not uses_dense_block(append_bias(X[:64]))
    ref = _reference_search(model, Xd, tree.depth, 2, 5, "l3-hinge", batch=64)
    assert _bytes_equal(model.predict(Xd, beam=2, topk=5, batch_size=64), ref)


def test_rankers_solved_directly_give_the_bytes_of_linear_svc():
    """train_rankers with liblinear called directly (direct=True) against LinearSVC (direct=False): the
    same W, byte for byte, with a mask and without, 1 and 2 workers.  Skipped where train_rankers has no
    such choice."""
    import inspect

    from xmc_steps.ranker import train_rankers

    if "direct" not in inspect.signature(train_rankers).parameters:
        pytest.skip("train_rankers solves through LinearSVC only")
    X, Y, tree, _ = _model(0)
    col = tree.parents(tree.depth)
    mask = sp.csr_matrix(np.random.default_rng(7).random((X.shape[0], tree.n_clusters)) < 0.3, dtype=np.float32)
    for m in (None, mask):
        ref = train_rankers(X, Y, col, m, {"threshold": 0.05}, threads=1, direct=False)
        for threads in (1, 2):
            assert _bytes_equal(train_rankers(X, Y, col, m, {"threshold": 0.05}, threads=threads, direct=True), ref)
