"""ELIAS++: the sparse ranker over ELIAS candidates and the decision-tree calibration."""

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps.elias_plus import (EliasPlusParams, apply_tree, calibration_features, candidates, fit_calibration,
                                  ranker_scores, train, uncalibrated_scores)
from xmc_steps.ranker import ranker_features


def test_apply_tree_matches_sklearn():
    from sklearn.tree import DecisionTreeClassifier

    rng = np.random.default_rng(0)
    F = rng.normal(size=(500, 3))
    y = ((F[:, 0] + 0.5 * F[:, 1] ** 2 - F[:, 2]) > 0.3).astype(int)
    tree = fit_calibration(F, y, max_depth=5)
    ref = DecisionTreeClassifier(max_depth=5, random_state=0).fit(F, y).predict_proba(F)[:, 1]
    assert apply_tree(tree, F) == pytest.approx(ref)


def test_calibration_needs_both_classes():
    with pytest.raises(Exception, match="both positive and negative"):
        fit_calibration(np.zeros((3, 3)), np.zeros(3, int), 5)


def test_ranker_reranks_candidates():
    rng = np.random.default_rng(1)
    n, L, d = 300, 8, 16
    Y = sp.random(n, L, density=0.2, random_state=1, format="csr")
    Y.data[:] = 1
    X = sp.csr_matrix(Y.toarray() @ rng.normal(size=(L, d)) + 0.1 * rng.normal(size=(n, d)))
    E = rng.normal(size=(n, 4)).astype(np.float32)                 # uninformative "neural" block
    Xr = ranker_features(X, E, "tfidf+neural")
    # ELIAS candidates: all labels, with a noisy ELIAS score
    S = sp.csr_matrix(np.clip(Y.toarray() * 0.3 + rng.random((n, L)) * 0.7, 1e-3, 1).astype(np.float32))
    cand = candidates(S, 5)
    assert np.all(np.diff(cand.indptr) == 5)
    p = EliasPlusParams(n_candidates=5)
    W = train(Xr, Y, cand, p)
    h = ranker_scores(Xr, W, cand, p.solver.bias)
    # the ranker separates true from false candidates better than the noisy ELIAS score
    rows = np.repeat(np.arange(n), np.diff(cand.indptr))
    truth = np.asarray(Y[rows, cand.indices]).ravel() > 0

    def auc(s):
        pos, neg = s[truth], s[~truth]
        return (pos[:, None] > neg[None, :]).mean()

    assert auc(h) > auc(cand.data) + 0.1
    assert uncalibrated_scores(cand.data, h, p) == pytest.approx(
        cand.data * np.exp(-np.maximum(0, 1 - h) ** 3), rel=1e-5)
    F = calibration_features(h, cand.data, cand.indices, np.arange(L, dtype=float))
    assert F.shape == (cand.nnz, 3) and np.all(F[:, 2] == cand.indices)


def test_calibration_counts_label_frequency_on_the_training_labels_only(tmp_path, monkeypatch):
    """The calibration tree's frequency feature must not see the validation split it is fitted on:
    it is the ranker's training-label count, for fitting and for prediction alike."""
    from xmc_steps import elias_plus, io
    from xmc_steps.stages import elias_plus as elias_plus_stage

    rng = np.random.default_rng(2)
    n, L, d = 120, 6, 10
    split = {}
    for name in ("train", "valid"):
        Y = sp.random(n, L, density=0.3, random_state=int(rng.integers(1 << 30)), format="csr")
        Y.data[:] = 1
        X = sp.csr_matrix(Y.toarray() @ rng.normal(size=(L, d)) + 0.1 * rng.normal(size=(n, d)))
        S = sp.csr_matrix(np.clip(Y.toarray() * 0.3 + rng.random((n, L)) * 0.7, 1e-3, 1).astype(np.float32))
        io.save_csr(tmp_path / f"Y_{name}.npz", Y)
        io.save_csr(tmp_path / f"X_{name}.npz", X)
        io.save_arrays(tmp_path / f"emb_{name}.npz", emb=rng.normal(size=(n, 4)).astype(np.float32))
        io.write_predictions(tmp_path / f"cand_{name}.parquet", S, L)
        split[name] = Y
    seen = []
    real = elias_plus.calibration_features
    monkeypatch.setattr(elias_plus, "calibration_features",
                        lambda h, e, idx, freq: seen.append(np.array(freq)) or real(h, e, idx, freq))

    def run(cmd, name, *extra):
        elias_plus_stage.main([cmd, "--tfidf", str(tmp_path / f"X_{name}.npz"), "--emb", str(tmp_path / f"emb_{name}.npz"),
                               "--candidates", str(tmp_path / f"cand_{name}.parquet"), "--no-tracking",
                               "--params", '{"n_candidates": 5}', *extra])

    run("train", "train", "--labels", str(tmp_path / "Y_train.npz"), "--out", str(tmp_path / "ranker"))
    run("calibrate", "valid", "--labels", str(tmp_path / "Y_valid.npz"), "--model", str(tmp_path / "ranker"),
        "--out", str(tmp_path / "cal"))
    run("predict", "valid", "--model", str(tmp_path / "ranker"), "--calibration", str(tmp_path / "cal"),
        "--out", str(tmp_path / "pred.parquet"))
    train_freq = np.asarray(split["train"].sum(axis=0)).ravel()
    # the calibrate stage's fits (out of fold on the two halves, scored on the others, then on every row) and the
    # prediction: 6 calls, each with the training-label counts
    assert len(seen) == 6
    for freq in seen:
        assert freq == pytest.approx(train_freq)
        assert not np.allclose(freq, train_freq + np.asarray(split["valid"].sum(axis=0)).ravel())
    assert io.read_predictions(tmp_path / "pred.parquet", L).shape == (n, L)
    # calibrate_top below the depth: the tree is fit on, and answers, each row's top 3 by the ranker (the
    # calibration forced, as paper mode does: on this random problem the validation split keeps the input)
    run("calibrate", "valid", "--labels", str(tmp_path / "Y_valid.npz"), "--model", str(tmp_path / "ranker"),
        "--out", str(tmp_path / "cal3"), "--params", '{"n_candidates": 5, "calibrate_top": 3, "combine": "calibrated", '
                                                     '"allow_weak": true}')
    run("predict", "valid", "--model", str(tmp_path / "ranker"), "--calibration", str(tmp_path / "cal3"),
        "--out", str(tmp_path / "pred3.parquet"), "--params", '{"n_candidates": 5, "calibrate_top": 3}')
    meta = io.read_json(tmp_path / "cal3" / "calibration.json")
    assert meta["calibrate_top"] == 3 and meta["n_fit"] == 3 * n
    assert np.all(np.diff(io.read_predictions(tmp_path / "pred3.parquet", L).indptr) == 3)
    assert io.read_json(tmp_path / "cal" / "calibration.json")["n_fit_docs"] == n   # calibrate_docs null: all
    # calibrate_docs (ELIAS §3.5: 5,000 points) fits on that many validation documents; max_depth null: sklearn's
    # default tree, grown until its leaves are pure (§3.5's "standard decision tree")
    run("calibrate", "valid", "--labels", str(tmp_path / "Y_valid.npz"), "--model", str(tmp_path / "ranker"),
        "--out", str(tmp_path / "cal40"), "--params", '{"n_candidates": 5, "calibrate_docs": 40, "max_depth": null, '
                                                      '"combine": "calibrated", "allow_weak": true}')
    meta = io.read_json(tmp_path / "cal40" / "calibration.json")
    assert meta["n_fit_docs"] == 40 and meta["n_fit"] == 5 * 40 and meta["max_depth"] is None
    # --valid-out: every validation document scored by the kept combination without its labels: the 40
    # calibration rows out of fold (their measured figures are the record's), the other 80 by the final fit
    run("calibrate", "valid", "--labels", str(tmp_path / "Y_valid.npz"), "--model", str(tmp_path / "ranker"),
        "--out", str(tmp_path / "cal40v"), "--valid-out", str(tmp_path / "valid40.parquet"),
        "--params", '{"n_candidates": 5, "calibrate_docs": 40, "max_depth": null, "combine": "calibrated", '
                    '"allow_weak": true}')
    run("predict", "valid", "--model", str(tmp_path / "ranker"), "--calibration", str(tmp_path / "cal40v"),
        "--out", str(tmp_path / "pred40.parquet"), "--params", '{"n_candidates": 5}')
    V = io.read_predictions(tmp_path / "valid40.parquet", L)
    final = io.read_predictions(tmp_path / "pred40.parquet", L)
    rows = elias_plus.calibration_rows(n, 40, EliasPlusParams().seed)
    rest = np.setdiff1d(np.arange(n), rows)
    assert V.shape == (n, L) and np.all(np.diff(V.indptr) <= 5) and V.nnz > 4 * n   # (a zero score is not stored)
    assert abs(V[rest] - final[rest]).max() < 1e-6
    from xmc_steps import second_stage

    record = io.read_json(tmp_path / "cal40v" / "calibration.json")["second_stage"]
    assert second_stage.measure(V[rows], split["valid"][rows]).figures == pytest.approx(record["valid"]["chosen"])
    assert abs(V[rows] - final[rows]).max() > 1e-6      # out of fold, not the fit that saw these rows


def test_calibration_rows_are_a_seeded_sample():
    from xmc_steps.elias_plus import calibration_rows

    assert calibration_rows(100, None) is None and calibration_rows(100, 100) is None and calibration_rows(10, 5000) is None
    r = calibration_rows(100, 30, seed=1)
    assert len(r) == 30 and len(set(r.tolist())) == 30 and np.all(np.diff(r) > 0)
    assert np.array_equal(r, calibration_rows(100, 30, seed=1)) and not np.array_equal(r, calibration_rows(100, 30, seed=2))
    assert EliasPlusParams().calibrate_docs is None and EliasPlusParams().max_depth == 5


def test_valid_bench_scores_each_row_with_a_tree_fit_on_the_other_folds(monkeypatch):
    """bench/elias_plus_valid.py's ELIAS++ row: the calibration is cross-fitted, so no validation
    row is scored by a tree that saw it (each candidate scored once, by the tree of its row's fold)."""
    from conftest import load_bench

    from xmc_steps import elias_plus

    bench = load_bench("elias_plus_valid")
    rng = np.random.default_rng(3)
    n, L = 40, 12
    S = sp.csr_matrix(rng.random((n, L)).astype(np.float32) + 1e-3)
    cand = candidates(S, 4)
    y = rng.random(cand.nnz) < 0.3
    h = rng.normal(size=cand.nnz)
    fits, scored = [], []
    real_fit, real_apply = elias_plus.fit_calibration, elias_plus.apply_tree
    monkeypatch.setattr(elias_plus, "fit_calibration", lambda F, yy, d, s=0: fits.append(F[:, 0].copy()) or real_fit(F, yy, d, s))
    monkeypatch.setattr(elias_plus, "apply_tree", lambda t, F: scored.append(F[:, 0].copy()) or real_apply(t, F))
    out = bench.cross_fitted(h, cand, y, np.ones(L), EliasPlusParams(max_depth=3), folds=4)
    assert out.shape == (cand.nnz,) and np.all((out >= 0) & (out <= 1))
    assert len(fits) == len(scored) == 4
    assert sorted(np.concatenate(scored)) == pytest.approx(sorted(h))          # every candidate once
    for fit, sc in zip(fits, scored):
        assert not set(fit) & set(sc)                                           # never by its own tree
        assert len(fit) + len(sc) == cand.nnz


def test_calibration_orders_the_rankers_top_candidates_only():
    """``calibrate_top``: the tree scores each row's best ``calibrate_top`` candidates by the
    uncalibrated score; the answer is those, ordered by the tree; with ``calibrate_top`` at least
    the candidates' depth, every candidate is calibrated (the paper's ELIAS++, 100 of 100)."""
    from xmc_steps.elias_plus import calibration_subset, plus_scores

    rng = np.random.default_rng(4)
    n, L, d = 60, 30, 8
    Y = sp.random(n, L, density=0.1, random_state=4, format="csr")
    Y.data[:] = 1
    Xr = ranker_features(sp.csr_matrix(rng.normal(size=(n, d))), rng.normal(size=(n, 4)).astype(np.float32), "tfidf+neural")
    cand = candidates(sp.csr_matrix(rng.random((n, L)).astype(np.float32) + 1e-3), 12)
    p = EliasPlusParams(n_candidates=12, calibrate_top=5)
    W = train(Xr, Y, cand, p)
    h = ranker_scores(Xr, W, cand, p.solver.bias)
    unc = uncalibrated_scores(cand.data, h, p)
    top, h_top, unc_top = calibration_subset(cand, h, unc, 5)
    assert np.all(np.diff(top.indptr) == 5)
    for i in range(n):
        a, b = cand.indptr[i], cand.indptr[i + 1]
        best = set(cand.indices[a:b][np.argsort(-unc[a:b], kind="stable")[:5]])
        assert set(top.indices[top.indptr[i]:top.indptr[i + 1]]) == best
    # the kept entries carry their own margins and scores
    full = {(r, c): (hh, u) for r, c, hh, u in zip(np.repeat(np.arange(n), 12), cand.indices, h, unc)}
    for r, c, hh, u in zip(np.repeat(np.arange(n), 5), top.indices, h_top, unc_top):
        assert full[(r, c)] == pytest.approx((hh, u))
    # a tree that splits on the ELIAS score: the answer holds the top 5 by the ranker, ordered by the tree
    F = calibration_features(h_top, top.data, top.indices, np.ones(L))
    tree = fit_calibration(F, (rng.random(len(F)) < 0.3).astype(np.int64), 2)
    out = plus_scores(Xr, W, cand, p, tree, np.ones(L))
    assert np.all(np.diff(out.indptr) == 5)
    assert np.array_equal(out.indices, top.indices)
    assert out.data == pytest.approx(apply_tree(tree, F) + 1e-6 * unc_top, rel=1e-5)
    # calibrate_top >= the depth: all candidates, as before the setting existed
    same, h_all, _ = calibration_subset(cand, h, unc, 12)
    assert same is cand and h_all is h
    wide = plus_scores(Xr, W, cand, EliasPlusParams(n_candidates=12, calibrate_top=100, topk=12), tree, np.ones(L))
    assert wide.nnz == cand.nnz
