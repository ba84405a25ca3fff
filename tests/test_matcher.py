import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tiny_encoder import make_tiny_encoder, toy_tokens
from xmc_steps import encoders, io, layout, neural, trainer
from xmc_steps import xtransformer as xt
from xmc_steps.stages import matcher as matcher_stage
from xmc_steps.trainer import TrainParams
from xmc_steps.stage import cli_main


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("tiny_m") / "bert")


def test_squared_hinge_matches_hand_computation():
    scores = torch.tensor([[2.0, -0.5, 0.3], [0.0, 1.5, -2.0]])
    M = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    # row 1: M~ = (+1, -1, +1): max(0, 1-2)^2 = 0, max(0, 1-0.5)^2 = .25, max(0, 1-.3)^2 = .49
    # row 2: M~ = (-1, +1, +1): max(0, 1+0)^2 = 1, max(0, 1-1.5)^2 = 0, max(0, 1+2)^2 = 9
    expected = ((0 + 0.25 + 0.49) / 3 + (1 + 0 + 9) / 3) / 2
    assert xt.squared_hinge_loss(scores, M).item() == pytest.approx(expected)
    assert xt.squared_hinge_loss(scores.bfloat16(), M).dtype == torch.float32


def test_cluster_targets_binarise_YC():
    Y = sp.csr_matrix(np.array([[1, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=np.float32))
    C = sp.csr_matrix(np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=np.float32))
    M = xt.cluster_targets(Y, C)
    assert M.toarray().tolist() == [[1, 0], [0, 1], [0, 0]]


def _write_toy(tmp_path, tiny, n=40, L=6, K=3, width=16):
    """40 documents (24/8/8), label l in cluster l % K, each document's labels from its topic."""
    tok = encoders.load_tokenizer(tiny)
    words = ["apple banana cherry", "engine wheel brake", "violin piano drum"]
    rng = np.random.default_rng(0)
    texts, rows = [], []
    for i in range(n):
        t = i % K
        texts.append(f"{words[t]} document {i} " + " ".join(rng.choice(words[t].split(), 3)))
        rows.append(sorted({t, t + K} if i % 2 else {t}))
    from xmc_steps.encoders import tokenize

    ids, lengths = tokenize(texts, tok, width)
    Y = sp.lil_matrix((n, L), dtype=np.float32)
    for i, r in enumerate(rows):
        Y[i, r] = 1
    Y = Y.tocsr()
    C = sp.csr_matrix((np.ones(L, np.float32), np.arange(L) % K, np.arange(L + 1)), shape=(L, K))
    d = tmp_path / "in"
    for s, sl in (("train", slice(0, 24)), ("valid", slice(24, 32)), ("test", slice(32, 40))):
        io.save_arrays(d / f"tokens_{s}.npz", input_ids=ids[sl], lengths=lengths[sl])
        io.save_csr(d / f"Y_{s}.npz", Y[sl])
    io.save_csr(d / "C.npz", C)
    return d


def _args(d, out, params):
    return ["--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"), "--labels-valid", str(d / "Y_valid.npz"),
            "--cluster-assign", str(d / "C.npz"), "--out", str(out), "--params", json.dumps(params),
            "--no-tracking", "--record", str(out / layout.RECORD)]


def test_matcher_cli_end_to_end(tiny, tmp_path):
    d = _write_toy(tmp_path, tiny)
    out = tmp_path / "out"
    params = {"encoder": tiny, "max_length": 16, "lr_head": 1e-2, "topb": 2, "eval_every": 2, "device": "cpu",
              "threads": 1, "allow_weak": True,   # 4 steps learn little
              "train": {"steps": 4, "batch_size": 8, "lr": 1e-3, "warmup_steps": 1, "checkpoint_every": 2,
                        "log_every": 1, "seed": 0}}
    matcher_stage.main(_args(d, out, params))
    meta = io.read_json(out / "matcher.json")
    assert meta["K"] == 3 and meta["dim"] == 32 and meta["pooling"] == "cls" and meta["encoder"] == tiny
    assert meta["params"]["train"]["steps"] == 4 and meta["params"]["train"]["length_bucket"] == 50
    for s, n in (("train", 24), ("valid", 8), ("test", 8)):
        emb = io.load_arrays(out / f"emb_{s}.npz")["emb"]
        assert emb.shape == (n, 32) and emb.dtype == np.float32
        cl = io.load_csr(out / f"clusters_{s}.npz")
        assert cl.shape == (n, 3) and (np.diff(cl.indptr) == 2).all()
    assert not (out / "checkpoints").exists()
    rec = io.read_json(out / layout.RECORD)
    assert rec["metrics"]["train_steps"] == 4 and rec["metrics"]["train_seq_per_s"] > 0
    assert 0 <= rec["metrics"]["valid_cluster_p_at_1"] <= 1
    assert rec["extra"]["model_paths"][0] == str(out / layout.WEIGHTS)
    # the saved model loads back and reproduces the written embeddings
    m = xt.load_matcher(out)
    scores, emb = xt.predict_clusters(m, neural.TokenData.load(d / "tokens_test.npz"), 2, device="cpu",
                                           progress=None)
    np.testing.assert_allclose(emb, io.load_arrays(out / "emb_test.npz")["emb"], atol=1e-5)


def test_guard_failure_keeps_the_validation_curve_for_the_rerun(tiny, tmp_path):
    """A matcher stopped by the guard keeps its checkpoints and its validation curve; the
    allow_weak rerun (no training again) writes that curve into guard.json."""
    d = _write_toy(tmp_path, tiny)
    out = tmp_path / "out"
    params = {"encoder": tiny, "max_length": 16, "lr_head": 1e-12, "head_init": "random", "head_refit": False,
              "topb": 1, "eval_every": 2, "device": "cpu", "threads": 1, "allow_weak": False,
              "train": {"steps": 4, "batch_size": 8, "lr": 1e-12, "warmup_steps": 1, "checkpoint_every": 2, "seed": 0}}
    # a baseline that cannot be beaten: the true clusters of every validation document
    M_valid = (io.load_csr(d / "Y_valid.npz") @ io.load_csr(d / "C.npz")).tocsr()
    M_valid.data[:] = 1.0
    io.save_csr(d / "perfect.npz", M_valid)
    args = _args(d, out, params) + ["--baseline-clusters", str(d / "perfect.npz")]
    assert cli_main(matcher_stage.main, args) != 0
    assert sorted(io.read_json(out / "checkpoints" / "curve.json")) == ["0", "2", "4"]
    matcher_stage.main(_args(d, out, {**params, "allow_weak": True}) + ["--baseline-clusters", str(d / "perfect.npz")])
    guard = io.read_json(out / "guard.json")
    assert sorted(guard["curve"], key=int) == ["0", "2", "4"] and guard["allow_weak"] is True


@pytest.mark.parametrize("case, message", [
    ("k1", "K >= 2"),
    ("k_gt_l", "more clusters"),
    ("max_length", "max_length = 32"),
    ("too_long", "exceeds the 128 positions"),
    ("encoder", "cannot be loaded offline"),
])
def test_matcher_cli_errors_before_training(tiny, tmp_path, capsys, case, message):
    d = _write_toy(tmp_path, tiny)
    params = {"encoder": tiny, "train": {"steps": 2, "batch_size": 8}, "device": "cpu"}
    if case == "k1":
        io.save_csr(d / "C.npz", sp.csr_matrix(np.ones((6, 1), np.float32)))
    elif case == "k_gt_l":
        io.save_csr(d / "C.npz", sp.csr_matrix(np.eye(6, 7, dtype=np.float32)))
    elif case == "max_length":
        params["max_length"] = 32
    elif case == "too_long":
        for s in ("train", "valid", "test"):
            t = io.load_arrays(d / f"tokens_{s}.npz")
            io.save_arrays(d / f"tokens_{s}.npz", input_ids=np.pad(t["input_ids"], ((0, 0), (0, 120))),
                           lengths=t["lengths"])
    else:
        params["encoder"] = "no-such-org/no-such-encoder-xyz"
    out = tmp_path / "out"
    assert cli_main(matcher_stage.main, _args(d, out, params)) == 2
    assert message in capsys.readouterr().err
    assert not (out / layout.WEIGHTS).exists() and not (out / "checkpoints").exists()


def test_matcher_learns_a_separable_toy_problem(tiny, tmp_path):
    ids, lengths, cls = toy_tokens(160, 16, 4, seed=1)
    tr, va = slice(0, 120), slice(120, 160)
    M = sp.csr_matrix(np.eye(4, dtype=np.float32)[cls])
    params = {"encoder": tiny, "lr_head": 3e-2, "eval_every": 30, "device": "cpu",
              "train": {"steps": 60, "batch_size": 16, "lr": 3e-3, "warmup_steps": 5, "log_every": 10,
                        "checkpoint_every": 0, "seed": 0}}
    curve = {}

    def on_step(step, logs):
        if "valid_cluster_p_at_1" in logs:
            curve[step] = logs["valid_cluster_p_at_1"]

    valid = (neural.TokenData(ids[va], lengths[va]), M[va])
    model, trainer = xt.train_matcher(neural.TokenData(ids[tr], lengths[tr]), M[tr], params, tmp_path / "ck",
                                           on_step=on_step, valid=valid)
    assert trainer.step == 60 and set(curve) == {0, 30, 60}   # 0: the starting point
    assert curve[60] >= 0.9, curve  # chance is 0.25 (at step 30 it is usually still near chance)
    scores, _ = xt.predict_clusters(model, valid[0], topb=2, device="cpu", progress=None)
    assert xt.top1_precision(scores, valid[1]) == pytest.approx(curve[60])


def test_cluster_assignment_from_csr_or_cluster_tree(tmp_path):
    from xmc_steps.cluster_tree import ClusterTree

    tree = ClusterTree.from_parents([np.zeros(3, dtype=np.int32), np.arange(6, dtype=np.int32) % 3])
    tree.save(tmp_path / "tree.npz")
    C = xt.load_cluster_assignment(tmp_path / "tree.npz")
    assert C.shape == (6, 3) and (C.toarray().argmax(1) == np.arange(6) % 3).all()
    io.save_csr(tmp_path / "C.npz", C)
    assert (xt.load_cluster_assignment(tmp_path / "C.npz") != C).nnz == 0


def test_cluster_recall_frequency_baseline_and_guard():
    M_valid = sp.csr_matrix(np.array([[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32))
    top = sp.csr_matrix(np.array([[0.9, 0.5, 0, 0], [0, 0.4, 0.3, 0], [0.1, 0.2, 0, 0]], np.float32))
    # row 1: 1 of 2 positives; row 2: 1 of 1; row 3 has no positive and does not count
    assert xt.cluster_recall(top, M_valid) == pytest.approx(0.75)
    M_train = sp.csr_matrix(np.array([[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 0]], np.float32))
    F = xt.frequency_topb(M_train, 3, 2)
    assert F.toarray().tolist() == [[0, 1, 3, 0]] * 3          # ties -> the lower cluster id
    assert xt.guard_width(10, 8) == 4 and xt.guard_width(10, 2048) == 10 and xt.guard_width(3, 2) == 1
    lin = sp.csr_matrix(np.array([[0, 0, 0, 0.5], [0.2, 0, 0, 0], [0, 0, 0, 0]], np.float32))
    g = xt.check_matcher(top, M_valid, M_train, 2, lin)
    assert g.baselines["linear_tree"] == pytest.approx(0.25) and g.passed
    assert g.to_dict()["best_baseline"] in ("most_frequent", "linear_tree")
    weak = xt.check_matcher(lin, M_valid, M_train, 2, top)
    assert not weak.passed
    msg = weak.message()
    assert "xtransformer.matcher.allow_weak" in msg and "xtransformer.matcher.epochs" in msg and "0.2500" in msg


def test_head_linear_scores_are_the_mean_of_the_transformed_head_and_the_beam():
    from xmc_steps.search import transform

    emb = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    W = np.array([[2.0, 0.0], [1.0, 0.5], [0.0, 0.0], [-1.0, 3.0]], np.float32)   # g = emb @ W.T
    g = emb @ W.T
    # the beam reached cluster 2 (head rank 3 of 4) in row 0 and clusters 0 and 1 in row 1
    lin = sp.csr_matrix(np.array([[0, 0, 0.9, 0], [0.6, 0.1, 0, 0]], np.float32))
    top = xt.head_linear_topb(emb, W, lin, b=2)
    T = transform(g, "l3-hinge")
    want = 0.5 * T + 0.5 * lin.toarray()
    assert (np.diff(top.indptr) == 2).all()
    for i in range(2):
        best = np.argsort(-want[i], kind="stable")[:2]
        row = top[i].toarray().ravel()
        assert set(np.flatnonzero(row)) == set(best)
        np.testing.assert_allclose(row[best], want[i, best], rtol=1e-6)
    # row 0: the linear tree lifts cluster 2 past the head's second choice
    assert 2 in top[0].indices
    with pytest.raises(Exception, match="shape"):
        xt.head_linear_topb(emb, W, lin[:1], b=2)


def test_guard_with_head_linear_needs_a_head_that_learned():
    base = {"most_frequent": 0.30, "linear_tree": 0.40}
    ok = xt.GuardReport(10, 256, 0.45, base, "head+linear", head=0.35)
    assert ok.passed and ok.to_dict()["scorer"] == "head+linear" and ok.to_dict()["head_recall_at_b"] == 0.35
    # the linear tree's half carries a head no better than the most frequent clusters: stop
    lazy = xt.GuardReport(10, 256, 0.45, base, "head+linear", head=0.30)
    assert not lazy.passed and "head alone" in lazy.message() and "0.3000" in lazy.message()
    assert not xt.GuardReport(10, 256, 0.40, base, "head+linear", head=0.35).passed
    assert xt.GuardReport(10, 256, 0.41, base).passed


def test_guard_counts_what_the_matcher_adds_to_the_linear_trees_clusters():
    """A matcher level with the tree at b passes when its top-b and the tree's together beat the
    tree's own top clusters at the same number per document; one that repeats the tree's next
    clusters, or learned no more than the cluster frequencies, does not."""
    K, b = 8, 2
    M_valid = sp.csr_matrix(np.array([[1, 0, 0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1, 0, 0]], np.float32))
    M_train = sp.csr_matrix(np.eye(K, dtype=np.float32)[[6, 6, 7, 7, 6, 7]])     # 6 and 7 most frequent
    # the tree: its top-2 finds one positive per row, its next two none (4 clusters listed)
    lin = sp.csr_matrix(np.array([[.9, .8, .7, .6, 0, 0, 0, 0], [.9, .8, 0, .6, .5, 0, 0, 0]], np.float32))
    adds = sp.csr_matrix(np.array([[0, 0, 0, 0, .9, .8, 0, 0], [0, 0, 0, 0, .9, .8, 0, 0]], np.float32))
    g = xt.check_matcher(adds, M_valid, M_train, b, lin)
    # at b the matcher ties the tree (one of two positives per row) ...
    assert g.matcher == pytest.approx(0.5) and g.baselines["linear_tree"] == pytest.approx(0.5)
    # ... but the union finds all four positives, the tree's own top-4 two
    assert g.union == pytest.approx(1.0) and g.linear_same_budget == pytest.approx(0.5) and g.union_clusters == 4
    assert g.adds_to_tree and g.passed and g.to_dict()["union"]["adds_to_tree"] is True
    same = sp.csr_matrix(np.array([[0, 0, .9, .8, 0, 0, 0, 0], [0, 0, .9, .8, 0, 0, 0, 0]], np.float32))
    bad = xt.check_matcher(same, M_valid, M_train, b, lin)
    assert not bad.passed and "not above the tree alone with as many clusters" in bad.message()
    freq = xt.check_matcher(xt.frequency_topb(M_train, 2, b), M_valid, M_train, b, lin)
    assert not freq.passed


def test_candidates_matcher_needs_a_matcher_that_beats_the_baselines_alone(tmp_path, caplog):
    """candidates: matcher (the paper's Eq. 2) searches the matcher's top-b alone: the union
    criterion, which lets a matcher pass the matcher stage's guard, does not count there; the
    rankers' stage reads guard.json and stops, or warns when the matcher was allowed to be weak."""
    import logging

    from xmc_steps import io
    from xmc_steps.errors import StageError
    from xmc_steps.xtransformer import check_guard

    K, b = 8, 2
    M_valid = sp.csr_matrix(np.array([[1, 0, 0, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1, 0, 0]], np.float32))
    M_train = sp.csr_matrix(np.eye(K, dtype=np.float32)[[6, 6, 7, 7, 6, 7]])
    lin = sp.csr_matrix(np.array([[.9, .8, .7, .6, 0, 0, 0, 0], [.9, .8, 0, .6, .5, 0, 0, 0]], np.float32))
    adds = sp.csr_matrix(np.array([[0, 0, 0, 0, .9, .8, 0, 0], [0, 0, 0, 0, .9, .8, 0, 0]], np.float32))
    union_only = xt.check_matcher(adds, M_valid, M_train, b, lin)     # ties the tree at b, adds to it
    assert union_only.passed and not union_only.passed_alone and union_only.to_dict()["passed_alone"] is False
    why = xt.alone_failure(union_only.to_dict())
    assert "candidates: matcher" in why and "only through the union" in why and "linear_tree 0.5000" in why
    better = xt.GuardReport(10, 256, 0.45, {"most_frequent": 0.30, "linear_tree": 0.40})
    assert better.passed_alone and xt.alone_failure(better.to_dict()) is None
    lazy = xt.GuardReport(10, 256, 0.45, {"most_frequent": 0.30, "linear_tree": 0.40}, "head+linear", head=0.30)
    assert "head alone" in xt.alone_failure(lazy.to_dict())
    # the rankers' stage: only candidates matcher reads the guard; allow_weak makes it a warning
    path = tmp_path / "guard.json"
    io.write_json(path, {**union_only.to_dict(), "allow_weak": False})
    log = logging.getLogger("test-guard")
    check_guard(str(path), "union", log)
    check_guard(None, "matcher", log)
    with pytest.raises(StageError, match="searches the matcher's top-2 alone"):
        check_guard(str(path), "matcher", log)
    io.write_json(path, {**union_only.to_dict(), "allow_weak": True})
    with caplog.at_level(logging.WARNING, logger="test-guard"):
        check_guard(str(path), "matcher", log)
    assert "continuing: xtransformer.matcher.allow_weak is true" in caplog.text
    io.write_json(path, {**better.to_dict(), "allow_weak": False})
    check_guard(str(path), "matcher", log)


def test_topk_per_row_varying():
    from xmc_steps.search import topk_per_row

    M = sp.csr_matrix(np.array([[.1, .5, .3, 0], [.2, .2, 0, .9], [0, 0, 0, 0]], np.float32))
    T = topk_per_row(M, np.array([2, 1, 3]))
    assert T.toarray().tolist() == [[0, pytest.approx(.5), pytest.approx(.3), 0], [0, 0, 0, pytest.approx(.9)], [0, 0, 0, 0]]


def test_matcher_cli_scorer_head_linear(tiny, tmp_path, capsys):
    """scorer head+linear: the stage reads the linear tree's clusters of every split, writes the
    fused top-b and both scorers' valid recall; head+linear without them is an error."""
    d = _write_toy(tmp_path, tiny)
    C = io.load_csr(d / "C.npz")
    for s in ("train", "valid", "test"):   # a linear tree that ranks each document's first cluster first
        M = (io.load_csr(d / f"Y_{s}.npz") @ C).tocsr()
        M.data[:] = 0.5
        io.save_csr(d / f"lin_{s}.npz", M)
    lin = ["--linear-clusters"] + [str(d / f"lin_{s}.npz") for s in ("train", "valid", "test")]
    params = {"encoder": tiny, "max_length": 16, "topb": 2, "device": "cpu", "threads": 1, "allow_weak": True,
              "scorer": "head+linear", "train": {"steps": 2, "batch_size": 8, "warmup_steps": 1, "seed": 0}}
    out = tmp_path / "out"
    assert cli_main(matcher_stage.main, _args(d, out, params) + ["--baseline-clusters", str(d / "lin_valid.npz")]) == 2
    assert "every split" in capsys.readouterr().err
    matcher_stage.main(_args(d, out, params) + lin)
    guard = io.read_json(out / "guard.json")
    assert guard["scorer"] == "head+linear" and set(guard["head"]["scorers"]) == {"head", "head+linear"}
    assert guard["matcher_recall_at_b"] == guard["head"]["scorers"]["head+linear"]
    top = io.load_csr(out / "clusters_test.npz")
    assert (np.diff(top.indptr) == 2).all() and 0 < top.data.min() and top.data.max() <= 1.0
    out2 = tmp_path / "out2"                 # the paper's scorer: kept, with both recalls on record
    matcher_stage.main(_args(d, out2, {**params, "scorer": "head"}) + lin)
    g2 = io.read_json(out2 / "guard.json")
    assert g2["scorer"] == "head" and g2["matcher_recall_at_b"] == g2["head"]["scorers"]["head"]
    assert g2["head"]["scorers"]["head+linear"] == guard["head"]["scorers"]["head+linear"]


def test_linear_head_solves_the_least_squares_of_eq3():
    rng = np.random.default_rng(0)
    E = rng.normal(size=(200, 6)).astype(np.float32)
    M = sp.random(200, 5, density=0.3, random_state=1, format="csr")
    M.data[:] = 1
    W = xt.linear_head(E, M, l2=1e-3)
    Mt = 2 * M.toarray() - 1
    lam = 1e-3 * np.trace(E.T.astype(np.float64) @ E) / 6
    ref = np.linalg.solve(E.T.astype(np.float64) @ E + lam * np.eye(6), E.T.astype(np.float64) @ Mt).T
    np.testing.assert_allclose(W, ref, rtol=1e-4, atol=1e-5)


def test_schedule_from_epochs_or_steps():
    def schedule(train, n):
        t = xt.MatcherParams.from_dict({"train": train}).train.resolved(n)
        return t.steps, t.warmup_steps

    assert schedule({"epochs": 2.0, "batch_size": 32, "warmup": 0.1}, 1000) == (63, 6)   # ceil(2 * 1000 / 32), 10 %
    assert schedule({"epochs": 2.0, "batch_size": 16, "grad_accum": 2}, 1000) == (63, 6)   # the matcher's warm-up kept
    assert schedule({"steps": 100, "warmup_steps": 7}, 10 ** 6) == (100, 7)
    with pytest.raises(ValueError, match="warmup"):
        xt.MatcherParams.from_dict({"train": {"warmup": 1.5}})
    with pytest.raises(ValueError, match="epochs is now train.epochs"):
        xt.MatcherParams.from_dict({"epochs": 2.0})
    with pytest.raises(ValueError, match="head_init"):
        xt.MatcherParams(head_init="zeros")
    with pytest.raises(ValueError, match="resolved"):     # the Trainer takes step counts, not epochs
        trainer.Trainer(torch.nn.Linear(2, 1), [], xt.MatcherParams().train, None)


def test_topb_from_emb_and_head_refit_keeps_the_better_head(tiny):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(300, 32)).astype(np.float32)
    W_true = rng.normal(size=(20, 32)).astype(np.float32)
    S = emb @ W_true.T
    top = xt.topb_from_emb(emb, W_true, 3, batch_rows=64)
    assert top.shape == (300, 20) and (np.diff(top.indptr) == 3).all()
    np.testing.assert_array_equal(np.sort(top.indices.reshape(300, 3), 1), np.sort(np.argsort(-S, 1)[:, :3], 1))
    # targets: each row's best cluster under W_true; a model whose head is noise
    M = sp.csr_matrix((np.ones(300, np.float32), S.argmax(1), np.arange(301)), shape=(300, 20))
    model = xt.build_model(xt.MatcherParams(encoder=tiny), 20, pretrained=False)
    assert model.encoder.dim == 32
    info = xt.refit_head(model, emb[:200], M[:200], emb[200:], M[200:], b=3)
    assert info["kept"] == "refit" and info["refit"] > info["trained"]
    W = model.head.weight.detach().numpy()
    np.testing.assert_allclose(W, xt.linear_head(emb[:200], M[:200], 0.001), rtol=1e-5)
    # a second refit is no better than the head it now has: the head stays
    info2 = xt.refit_head(model, emb[:200], M[:200], emb[200:], M[200:], b=3)
    assert info2["kept"] == "trained"


def _clustered_tokens(n=4000, K=1024, length=12, seed=0):
    """Documents of 1-2 clusters out of K, each cluster written as its own token three times."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2000, 3000, size=(n, length)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 101, 102
    rows, cols = [], []
    for i in range(n):
        for j, k in enumerate(rng.choice(K, size=rng.integers(1, 3), replace=False)):
            ids[i, 1 + 3 * j:4 + 3 * j] = 5000 + k
            rows.append(i)
            cols.append(k)
    M = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(n, K))
    return ids, np.full(n, length, np.int32), M


def test_matcher_learns_at_a_thousand_clusters(tiny):
    """K = 1,024 clusters, 3,500 training documents: within 100 steps the default recipe
    (least-squares head start, head learning rate = encoder's) is far above always answering
    the most frequent clusters; a random head at the old head learning rate is not."""
    ids, lengths, M = _clustered_tokens()
    tr, va = slice(0, 3500), slice(3500, 4000)
    T, V = neural.TokenData(ids[tr], lengths[tr]), neural.TokenData(ids[va], lengths[va])
    prior = xt.cluster_recall(xt.frequency_topb(M[tr], 500, 10), M[va])
    recall = {}
    for name, cfg in (("default", {"head_init": "linear"}), ("random", {"head_init": "random", "lr_head": 1e-2})):
        p = xt.MatcherParams(encoder=tiny, pooling="mean", device="cpu", eval_every=0, **cfg,
                                  train=TrainParams(steps=100, batch_size=32, lr=1e-3, warmup=0.1, checkpoint_every=0,
                                                    length_bucket=50))
        model, _ = xt.train_matcher(T, M[tr], p, None)
        top, _ = xt.predict_clusters(model, V, 10, device="cpu", progress=None)
        recall[name] = xt.cluster_recall(top, M[va])
    assert prior < 0.02
    assert recall["default"] > 10 * prior, (prior, recall)
    assert recall["default"] > 5 * recall["random"], (prior, recall)


@pytest.mark.parametrize("scorer", ["head", "head+linear"])
def test_serving_embeds_and_ranks_clusters_as_the_end_of_training_pass(tiny, tmp_path, scorer):
    """Issue 51: the matcher's PredictParams (topb, eval_batch_size, amp) are saved in matcher.json; serving's
    predict_matcher reads them back and calls what the stage's end-of-training pass calls (embed_texts,
    top_clusters): the test split's embeddings and top-b clusters as the stage wrote them, bit for bit; a
    matcher saved before its PredictParams falls back to its training params."""
    d = _write_toy(tmp_path, tiny)
    C = io.load_csr(d / "C.npz")
    for s in ("train", "valid", "test"):
        M = (io.load_csr(d / f"Y_{s}.npz") @ C).tocsr()
        M.data[:] = 0.5
        io.save_csr(d / f"lin_{s}.npz", M)
    lin = ["--linear-clusters"] + [str(d / f"lin_{s}.npz") for s in ("train", "valid", "test")]
    params = {"encoder": tiny, "max_length": 16, "topb": 2, "eval_batch_size": 3, "amp": "off", "device": "cpu",
              "threads": 1, "allow_weak": True, "scorer": scorer,
              "train": {"steps": 2, "batch_size": 8, "warmup_steps": 1, "seed": 0}}
    out = tmp_path / "out"
    matcher_stage.main(_args(d, out, params) + lin)
    meta = io.read_json(out / "matcher.json")
    assert meta["predict"] == {"topb": 2, "eval_batch_size": 3, "amp": "off"}
    tokens = neural.TokenData.load(d / "tokens_test.npz")
    lin_test = io.load_csr(d / "lin_test.npz")
    want_emb, want_top = io.load_arrays(out / "emb_test.npz")["emb"], io.load_csr(out / "clusters_test.npz")
    for name in ("saved", "old"):
        if name == "old":                   # a matcher saved before: its training params
            del meta["predict"]
            io.write_json(out / "matcher.json", meta)
        r = xt.predict_matcher(out, tokens, None, "cpu", linear_top=lin_test)
        assert r["params"] == xt.PredictParams(topb=2, eval_batch_size=3, amp="off") and r["scorer"] == scorer
        assert np.array_equal(r["emb"], want_emb), name
        assert (r["clusters"] != want_top).nnz == 0 and np.array_equal(r["clusters"].indices, want_top.indices), name
    assert xt.predict_matcher(out, tokens, {"topb": 1}, "cpu", linear_top=lin_test)["clusters"].nnz == len(tokens)
