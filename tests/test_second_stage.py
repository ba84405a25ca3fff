"""A second stage against its input on validation (xmc_steps.second_stage, elias_plus.select): the score
fusion on tiny synthetic problems where the classifier is noise (the input alone must be kept) or carries
the signal (the fusion or the classifier must be used), the forced stage's failure message, the ensemble's
validation choice."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_steps import elias_plus, metrics, second_stage
from xmc_steps.elias_plus import EliasPlusParams
from xmc_steps.errors import StageError

LOG = logging.getLogger("test")


def _problem(classifier: str, n: int = 800, L: int = 60, depth: int = 20, seed: int = 0):
    """``(candidates, margins, Y, train_freq)``: a shortlist that ranks a document's labels a little above the
    others, and a classifier whose margins are pure noise or separate the labels well."""
    rng = np.random.default_rng(seed)
    Y = sp.lil_matrix((n, L), dtype=np.float32)
    for i in range(n):
        Y[i, rng.choice(L, size=rng.integers(1, 4), replace=False)] = 1
    Y = Y.tocsr()
    dense = Y.toarray()
    shortlist = 0.6 * dense + rng.normal(0, 0.5, size=(n, L))
    top = np.argsort(-shortlist, axis=1)[:, :depth]
    rows = np.repeat(np.arange(n), depth)
    cand = sp.csr_matrix((shortlist[rows, top.ravel()].astype(np.float32), (rows, top.ravel())), shape=(n, L))
    truth = dense[np.repeat(np.arange(n), np.diff(cand.indptr)), cand.indices] > 0
    if classifier == "noise":
        h = rng.normal(0, 1, size=cand.nnz)
    else:
        h = np.where(truth, rng.normal(1.5, 0.5, size=cand.nnz), rng.normal(-1.0, 0.5, size=cand.nnz))
    return cand, h, Y, rng.integers(1, 50, size=L).astype(np.float64)


def _params(**kw) -> EliasPlusParams:
    return EliasPlusParams.from_dict({"choices": ["shortlist", "product", "ranker", "fusion"], "topk": 20,
                                      "n_candidates": 20, **kw})


def test_measure_agrees_with_the_metrics_module():
    cand, _, Y, _ = _problem("noise")
    m = second_stage.measure(cand, Y, k=20)
    p = metrics.precision(cand, Y, 5)
    assert m.figures["p_at_1"] == pytest.approx(100 * p[0])
    assert m.figures["p_at_5"] == pytest.approx(100 * p[4])
    assert m.figures["recall_at_100"] == pytest.approx(100 * metrics.recall(cand, Y, 20)[-1])


def test_a_noise_classifier_leaves_the_input_alone():
    cand, h, Y, freq = _problem("noise")
    c, choice = elias_plus.select(cand, h, Y, _params(), freq, "the ranker", "dual_encoder.ranker", LOG)
    assert choice.chosen == "shortlist" and choice.switched_off and c.kind == "shortlist"
    # every other combination was measured, out of fold, and none passed both guarded figures
    assert len(choice.table) == 1 + 2 + len(elias_plus.DEPTHS) * len(elias_plus.BETAS)
    assert choice.record()["valid"]["chosen"] == choice.table["shortlist"]


def test_a_classifier_with_the_signal_is_used_and_beats_the_input():
    cand, h, Y, freq = _problem("signal")
    c, choice = elias_plus.select(cand, h, Y, _params(), freq, "the ranker", "dual_encoder.ranker", LOG)
    assert not choice.switched_off and c.kind in ("fusion", "ranker", "product")
    chosen, inp = choice.table[choice.chosen], choice.table["shortlist"]
    assert chosen["p_at_1"] > inp["p_at_1"] + 10 and chosen["p_at_5"] > inp["p_at_5"]
    # the re-fit combination scores new rows as the stage's prediction will
    scores = elias_plus.combination_scores(c, cand, h, _params(), freq)
    assert scores.shape == cand.shape and scores.nnz == cand.nnz


def test_fusion_alone_uses_the_signal_through_its_tree():
    cand, h, Y, freq = _problem("signal", seed=1)
    c, choice = elias_plus.select(cand, h, Y, _params(choices=["shortlist", "fusion"]), freq, "r", "s", LOG)
    assert c.kind == "fusion" and c.tree is not None and c.depth in elias_plus.DEPTHS
    assert choice.table[choice.chosen]["p_at_1"] > choice.table["shortlist"]["p_at_1"] + 10


def test_a_forced_second_stage_that_loses_fails_naming_both_numbers():
    cand, h, Y, freq = _problem("noise")
    with pytest.raises(StageError) as e:
        elias_plus.select(cand, h, Y, _params(combine="ranker"), freq, "the dual encoder's ranker",
                          "dual_encoder.ranker", LOG)
    msg = str(e.value)
    assert "the dual encoder's ranker (ranker) loses to its input (shortlist)" in msg
    assert "valid p_at_1" in msg and "against the input's" in msg and "dual_encoder.ranker.allow_weak" in msg
    c, choice = elias_plus.select(cand, h, Y, _params(combine="ranker", allow_weak=True), freq, "r",
                                  "dual_encoder.ranker", LOG)
    assert c.kind == "ranker" and choice.forced and not choice.switched_off


def test_a_forced_stage_within_the_noise_passes():
    cand, h, Y, freq = _problem("signal")
    c, choice = elias_plus.select(cand, h, Y, _params(combine="fusion", fusion_beta=1.0, fusion_depth=7), freq,
                                  "r", "s", LOG)
    assert c.kind == "fusion" and c.beta == 1.0 and c.depth == 7 and choice.forced


def test_choose_never_picks_what_loses_on_a_guarded_figure():
    def m(p1, p5):
        return second_stage.Measured({"p_at_1": p1, "p_at_5": p5, "recall_at_100": 0.0},
                                     {k: np.zeros(3) for k in second_stage.KEYS})

    c = second_stage.choose({"in": m(50, 20), "a": m(60, 19.9), "b": m(51, 20.5), "c": m(49, 30)}, "in")
    assert c.chosen == "b"


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match="choices"):
        EliasPlusParams.from_dict({"choices": ["shortlist", "magic"]})


def _ensemble_run(tmp_path, members_valid, members_test, Y_valid, name):
    from xmc_steps import io
    from xmc_steps.stages import ensemble as ensemble_stage

    L = Y_valid.shape[1]
    io.write_table(tmp_path / "labels.parquet", {"label_id": [f"l{i}" for i in range(L)]})
    io.save_csr(tmp_path / "Y_valid.npz", Y_valid)
    paths = {}
    for split, members in (("valid", members_valid), ("test", members_test)):
        paths[split] = []
        for i, m in enumerate(members):
            p = tmp_path / f"{name}_{split}_{i}.parquet"
            io.write_predictions(p, m, 20)
            paths[split].append(str(p))
    out, choice = tmp_path / f"{name}.parquet", tmp_path / f"{name}.json"
    ensemble_stage.main(["--predictions", *paths["test"], "--names", "good", "other", "--valid-predictions",
                         *paths["valid"], "--valid-labels", str(tmp_path / "Y_valid.npz"), "--label-table",
                         str(tmp_path / "labels.parquet"), "--out", str(out), "--choice-out", str(choice),
                         "--no-tracking", "--params", '{"ensemble": "average", "topk": 20}'])
    return io.read_predictions(out, L), io.read_json(choice)


def _member(Y, signal, rng):
    return sp.csr_matrix((signal * Y.toarray() + rng.random(Y.shape)).astype(np.float32))


def test_an_ensemble_with_a_noise_member_is_switched_off_to_its_best_member(tmp_path):
    rng = np.random.default_rng(3)
    _, _, Yv, _ = _problem("noise", n=300, seed=3)
    _, _, Yt, _ = _problem("noise", n=300, seed=4)
    good_t = _member(Yt, 0.5, rng)
    P, choice = _ensemble_run(tmp_path, [_member(Yv, 0.5, rng), _member(Yv, 0.0, rng)],
                              [good_t, _member(Yt, 0.0, rng)], Yv, "noise")
    assert choice["chosen"] == "good" and choice["member"] == 0 and choice["weights"] is None
    # the answer is the good member's own ranking
    assert np.array_equal(metrics.document_hits(P, Yt, 5), metrics.document_hits(good_t, Yt, 5))


def test_an_ensemble_of_two_complementary_members_is_kept(tmp_path):
    rng = np.random.default_rng(5)
    _, _, Yv, _ = _problem("noise", n=300, seed=5)
    half = np.arange(Yv.shape[1]) < Yv.shape[1] // 2      # each member knows half of the labels

    def members(Y):
        d = Y.toarray()
        return [sp.csr_matrix((0.8 * d * half + rng.random(d.shape)).astype(np.float32)),
                sp.csr_matrix((0.8 * d * ~half + rng.random(d.shape)).astype(np.float32))]

    _, choice = _ensemble_run(tmp_path, members(Yv), members(Yv), Yv, "both")
    assert choice["member"] is None and choice["chosen"].startswith("combined")


def test_too_few_validation_documents_leave_the_fitted_combinations_out():
    """A half of the validation rows without a positive candidate cannot fit a tree: auto keeps what it can
    measure (the input among them); a forced tree says why it cannot be measured."""
    cand, h, Y, freq = _problem("signal", n=6, seed=2)
    Y = sp.csr_matrix(Y.shape, dtype=np.float32)
    Y[0, cand.indices[0]] = 1                      # one positive: one half has none
    c, choice = elias_plus.select(cand, h, Y, _params(), freq, "r", "s", LOG)
    assert not any(n.startswith("fusion") for n in choice.table) and "ranker" in choice.table
    with pytest.raises(StageError, match="cannot be measured out of fold on 6 validation documents"):
        elias_plus.select(cand, h, Y, _params(combine="fusion"), freq, "the ranker", "s", LOG)


@pytest.mark.slow
def test_the_bench_tabulates_every_ensemble_of_a_results_folder(neural_toy_run):
    """bench/second_stage_tables.py on the toy's neural run: each ensemble's members alone and combinations,
    valid (the stage's record) and test columns, the chosen row marked, from the ``ensemble.json`` it saved."""
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "bench" / "second_stage_tables.py"), "--results",
                        str(neural_toy_run / "results"), "--datasets", "toy", "--ensembles", "elias-ensemble",
                        "lightxml-ensemble", "dual-encoder-ensemble"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    for target, members in (("elias-ensemble", ("seed 0", "seed 1")), ("lightxml-ensemble", ("minilm-s0", "minilm-s1")),
                            ("dual-encoder-ensemble", ("dual-encoder", "xr-linear"))):
        block = r.stdout.split(f"### toy: {target} (chosen on validation: ", 1)[1].split("###", 1)[0]
        rows = [ln for ln in block.splitlines() if ln.startswith("| ") and not ln.startswith("| row")]
        assert len(rows) == 2 + 3 and sum("**chosen**" in ln for ln in rows) == 1, block   # 2 alone, 3 weights
        assert all(any(ln.startswith(f"| {m}") for ln in rows) for m in members), block
        assert all("-" not in ln.split("|")[2] for ln in rows), block        # every row measured on validation
    assert "### toy: dual-encoder-ranker" in r.stdout
