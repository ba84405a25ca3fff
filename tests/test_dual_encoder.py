"""The dual encoder (xmc_steps.dual_encoder): the losses by hand, NGAME's batches, learning on a synthetic
set, the guard, saving and loading, and the stage's CLI."""

import json
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tiny_encoder import make_tiny_encoder
from xmc_steps import encoders, io, layout, neural
from xmc_steps.dual_encoder import batching
from xmc_steps.dual_encoder.loss import decoupled_softmax, pool_loss, softmax, triplet
from xmc_steps.dual_encoder.model import (build_model, encode, label_tokens, load_dual_encoder, predict,
                                          save_dual_encoder)
from xmc_steps.dual_encoder.params import DualEncoderParams
from xmc_steps.dual_encoder.train import (GUARD_ADVICE, frequency_prior, mine_negatives, train_dual_encoder,
                                         valid_metrics)
from xmc_steps.guard import check, guard_width, message
from xmc_steps.stage import cli_main
from xmc_steps.stages import dual_encoder as de_stage

LOG = logging.getLogger("test.dual_encoder")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # one thread: the tiny network's kernels are too small to share, and a busy machine's cores are taken
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_tiny_encoder(tmp_path_factory.mktemp("tiny_de") / "bert")
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- a learnable synthetic set


def _words(tiny, n):
    """``n`` vocabulary words that are one token each (alphabetic, at least 5 letters)."""
    vocab = encoders.load_tokenizer(tiny).get_vocab()
    words = sorted((i, w) for w, i in vocab.items() if w.isalpha() and w.isascii() and len(w) >= 5)
    return [(w, i) for i, w in words[2000:2000 + n]]


def _synth(tiny, n_labels=200, splits=(("train", 640), ("valid", 200)), skew=0.5, noise=4, seed=0):
    """Each label's text is two words; a text holds one of the two words of each of its 1-3 labels (drawn with
    probability ~ rank^-skew) among ``noise`` common words.  Returns ``({split: (TokenData, Y)}, label texts)``."""
    words = _words(tiny, 2 * n_labels)
    texts = [f"{words[2 * j][0]} {words[2 * j + 1][0]}" for j in range(n_labels)]
    p = 1.0 / np.arange(1, n_labels + 1) ** skew
    p /= p.sum()
    perm = np.random.default_rng(99).permutation(n_labels)
    out = {}
    for s, (name, n) in enumerate(splits):
        rng = np.random.default_rng([seed, s])
        width = 2 + 3 + noise
        ids, lengths, rows = np.zeros((n, width), np.int32), np.zeros(n, np.int32), []
        for i in range(n):
            labs = np.unique(perm[rng.choice(n_labels, rng.integers(1, 4), p=p)])
            own = [words[2 * j + rng.integers(0, 2)][1] for j in labs]      # one word of each of its labels
            toks = np.concatenate([own, rng.integers(2000, 3000, noise)])
            rng.shuffle(toks)
            row = np.concatenate([[101], toks, [102]])
            ids[i, :len(row)], lengths[i] = row, len(row)
            rows.append(labs)
        Y = sp.csr_matrix((np.ones(sum(map(len, rows)), np.float32), np.concatenate(rows),
                           np.cumsum([0] + [len(r) for r in rows])), shape=(n, n_labels))
        out[name] = (neural.TokenData(ids, lengths), Y)
    return out, texts


def _params(tiny, **kw):
    base = {"encoder": tiny, "pooling": "mean", "device": "cpu", "amp": "off", "eval_every": 0, "label_max_length": 8,
            "topk": 10, "train": {"steps": 150, "batch_size": 32, "lr": 3e-3, "warmup": 0.1, "log_every": 50}}
    for k, v in kw.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return DualEncoderParams.from_dict(base)


# --------------------------------------------------------------------------- losses


def test_decoupled_softmax_is_the_hand_computation_and_differs_from_softmax_only_with_several_positives():
    cos = torch.tensor([[0.9, 0.5, 0.1, -0.2],
                        [0.3, 0.8, 0.4, 0.0]])
    pos = torch.tensor([[True, True, False, False],       # text 0: two positives
                        [False, True, False, False]])     # text 1: one
    t = 0.5
    s = (cos / t).tolist()

    def dsm(i, p, negs):      # -log(e^s_ip / (e^s_ip + sum_n e^s_in))
        return -(s[i][p] - math.log(math.exp(s[i][p]) + sum(math.exp(s[i][j]) for j in negs)))

    # text 0: each positive against the negatives 2, 3 only (the other positive left out); text 1: against 0, 2, 3
    want = ((dsm(0, 0, [2, 3]) + dsm(0, 1, [2, 3])) / 2 + dsm(1, 1, [0, 2, 3])) / 2
    assert pool_loss(cos, pos, "decoupled-softmax", t).item() == pytest.approx(want, rel=1e-6)
    assert decoupled_softmax(cos / t, pos).item() == pytest.approx(want, rel=1e-6)
    # InfoNCE keeps the other positive in the denominator: a larger loss for text 0, the same for text 1
    lse = [math.log(sum(math.exp(v) for v in row)) for row in s]
    want_sm = ((lse[0] - s[0][0] + lse[0] - s[0][1]) / 2 + lse[1] - s[1][1]) / 2
    assert softmax(cos / t, pos).item() == pytest.approx(want_sm, rel=1e-6)
    assert want_sm > want
    one = pos.clone()
    one[0, 1] = False                                     # every text has one positive: the two losses agree
    assert decoupled_softmax(cos / t, one).item() == pytest.approx(softmax(cos / t, one).item(), rel=1e-6)
    # gradients stay finite for a text without negatives in the pool
    all_pos = torch.ones(1, 3, dtype=torch.bool)
    x = torch.tensor([[0.2, 0.4, 0.6]], requires_grad=True)
    pool_loss(x, all_pos, "decoupled-softmax", 0.05).backward()
    assert torch.isfinite(x.grad).all()


def test_triplet_is_the_margin_over_the_hardest_negatives():
    cos = torch.tensor([[0.6, 0.7, 0.5, -0.1]])
    pos = torch.tensor([[True, False, False, False]])
    # hardest 2 negatives 0.7, 0.5: max(0, 0.7 - 0.6 + 0.3) = 0.4, max(0, 0.5 - 0.6 + 0.3) = 0.2
    assert triplet(cos, pos, 0.3, 2).item() == pytest.approx(0.3, rel=1e-6)
    assert pool_loss(cos, pos, "triplet", 0.05, margin=0.3, triplet_negatives=2).item() == pytest.approx(0.3, rel=1e-6)


def test_mined_negatives_skip_the_positives_and_stay_within_the_depth():
    cand = np.array([[3, 5, 7, 9, 11], [5, 2, -1, -1, -1]])
    rows, labels = np.array([0, 1]), np.array([5, 2])
    rng = np.random.default_rng(0)
    for _ in range(20):
        m = mine_negatives(cand, rows, labels, 20, depth=3, per_text=2, rand=rng.random(cand.shape))
        assert len(m) == 3 and set(m[:2]) <= {3, 7, 9} and m[2] == 5     # text 1 has one candidate left


# --------------------------------------------------------------------------- NGAME's batches


def test_balanced_clusters_find_the_groups_and_the_epoch_order_keeps_clusters_together():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(8, 16))
    emb = np.repeat(centres, 8, axis=0) + 0.05 * rng.normal(size=(64, 16))
    shuffle = rng.permutation(64)
    emb, group = emb[shuffle], np.repeat(np.arange(8), 8)[shuffle]
    cl = batching.balanced_clusters(emb, 8, seed=1)
    assert np.bincount(cl).tolist() == [8] * 8
    assert all(len(set(group[cl == c])) == 1 for c in range(8))            # each cluster is one group
    assert np.array_equal(cl, batching.balanced_clusters(emb, 8, seed=1))  # deterministic
    order = batching.cluster_order(cl, seed=3, epoch=0)
    assert sorted(order.tolist()) == list(range(64))                         # every text once
    for b in batching.batches_of(order, 16):                                 # a batch is two whole groups
        assert len(set(group[b])) == 2 and np.bincount(group[b]).max() == 8
    assert np.array_equal(order, batching.cluster_order(cl, 3, 0))
    assert not np.array_equal(order, batching.cluster_order(cl, 3, 1))     # a new order every epoch
    sizes = np.bincount(batching.balanced_clusters(rng.normal(size=(100, 8)), 8, seed=0))
    assert sizes.max() <= 8 and sizes.min() >= 4


class _Recorder(neural.TokenData):
    """Token data that records the rows of every batch drawn from it."""

    def __init__(self, t):
        super().__init__(t.input_ids, t.lengths)
        self.drawn = []

    def batch(self, indices):
        self.drawn.append(np.asarray(indices).copy())
        return super().batch(indices)


def test_the_trainer_draws_ngame_batches_of_whole_clusters_covering_every_text_once(tiny):
    data, texts = _synth(tiny, n_labels=40, splits=(("train", 96),))
    tokens, Y = data["train"]
    p = _params(tiny, cluster_size=8, hard_negatives=0,
                train={"steps": 6, "batch_size": 16, "warmup": 0.0}).resolved(96, 40)
    model = build_model(p)
    lt = label_tokens(texts, tiny, p.label_max_length)
    want = batching.balanced_clusters(encode(model, tokens, device="cpu", amp="off"), 8, seed=[p.train.seed, 0])
    rec = _Recorder(tokens)
    train_dual_encoder(model, rec, Y, lt, p, None, 10, LOG)
    drawn = [d for d in rec.drawn if len(d) <= 16]      # the training batches (the clustering pass reads all 96)
    assert len(drawn) == 6
    seq = np.concatenate(drawn)
    assert sorted(seq.tolist()) == list(range(96))
    runs = [c for j, c in enumerate(want[seq]) if j == 0 or c != want[seq][j - 1]]
    assert len(runs) == len(set(runs)) == int(want.max()) + 1     # each cluster's texts are consecutive


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tiny, tmp_path):
    """The clusters and the mined labels' embeddings are in the checkpoints: a run stopped at step 11 and resumed
    from its checkpoint at step 10 (an epoch is 6 steps, so mid-epoch after the re-clustering at step 6, and
    between the label refreshes at steps 9 and 12) ends bit for bit as one that was not stopped."""
    data, texts = _synth(tiny, n_labels=40, splits=(("train", 96),))
    tokens, Y = data["train"]
    p = _params(tiny, cluster_size=8, hard_negatives=2, label_refresh_every=0.5,
                train={"steps": 14, "batch_size": 16, "checkpoint_every": 5, "log_every": 1}).resolved(96, 40)
    lt = label_tokens(texts, tiny, p.label_max_length)

    def run(ckpt, stop=None):
        model = build_model(p)

        def on_step(step, logs):
            if stop is not None and step == stop:
                raise KeyboardInterrupt
        try:
            train_dual_encoder(model, tokens, Y, lt, p, ckpt, 10, LOG, on_step=on_step)
        except KeyboardInterrupt:
            return None
        return {k: v.clone() for k, v in model.state_dict().items()}

    want = run(tmp_path / "a")
    assert run(tmp_path / "b", stop=11) is None
    got = run(tmp_path / "b")
    assert all(torch.equal(want[k], got[k]) for k in want)


# --------------------------------------------------------------------------- learning, the guard, saving


@pytest.fixture(scope="module")
def trained(tiny):
    data, texts = _synth(tiny)
    (tr, Ytr), (va, Yva) = data["train"], data["valid"]
    p = _params(tiny, eval_every=75).resolved(len(tr), Ytr.shape[1])
    model = build_model(p)
    lt = label_tokens(texts, tiny, p.label_max_length)
    curve = {}
    trainer = train_dual_encoder(model, tr, Ytr, lt, p, None, 10, LOG, on_step=lambda s, logs: curve.update(
        {s: logs["valid_recall"]} if "valid_recall" in logs else {}), valid=(va, Yva))
    label_emb = encode(model, lt, device="cpu", amp="off")
    m, top = valid_metrics(model, va, Yva, label_emb, p, 10, "cpu")
    return SimpleNamespace(p=p, model=model, lt=lt, data=data, texts=texts, curve=curve, trainer=trainer,
                           label_emb=label_emb, m=m, top=top)


def test_a_few_steps_raise_valid_recall_well_above_the_frequency_prior(trained):
    (_, Ytr), (_, Yva) = trained.data["train"], trained.data["valid"]
    prior = frequency_prior(Ytr, Yva, 10)
    assert trained.trainer.step == 150 and sorted(trained.curve) == [0, 75, 150]
    assert trained.trainer.start_valid["recall"] == pytest.approx(trained.curve[0])
    # measured: the prior 0.19, the pre-trained (random) start 0.25, after 150 steps 0.72
    assert trained.m["recall"] >= max(0.45, 2 * prior["recall"]), (trained.m, prior)
    assert trained.m["recall"] > trained.curve[0] + 0.2
    report, _ = check(trained.top, Yva, Ytr, 10, p_at_1=trained.m["p_at_1"], advice=GUARD_ADVICE)
    assert report.passed and message(report) is None


def test_the_guard_fires_on_an_untrained_model(tiny):
    # skewed labels: the most frequent ones are a strong answer that a random encoder does not reach
    data, texts = _synth(tiny, n_labels=200, skew=1.0, noise=8)
    (_, Ytr), (va, Yva) = data["train"], data["valid"]
    p = _params(tiny).resolved(640, 200)
    model = build_model(p)
    _, top = valid_metrics(model, va, Yva, encode(model, label_tokens(texts, tiny, 8), device="cpu", amp="off"), p,
                           guard_width(p.topk, 200), "cpu")
    report, _ = check(top, Yva, Ytr, p.topk, advice=GUARD_ADVICE)
    msg = message(report)
    assert not report.passed and msg is not None
    assert f"{report.shortlist:.4f}" in msg and f"{report.baselines['most_frequent']:.4f}" in msg
    assert "dual_encoder.train.epochs" in msg and "dual_encoder.allow_weak" in msg


def test_save_load_round_trip_predicts_the_same(trained, tmp_path):
    outputs, metrics_ = {}, {}
    st = SimpleNamespace(output=lambda k, v: outputs.__setitem__(k, str(v)),
                         metric=lambda k, v: metrics_.__setitem__(k, v), extra={})
    save_dual_encoder(st, tmp_path, trained.model, trained.label_emb,
                      {"encoder": trained.p.encoder, "max_length": 9, "params": trained.p.to_dict()})
    assert set(outputs) == {"model", "dual_encoder_json", "label_emb"} and metrics_["model_bytes"] > 0
    model, label_emb = load_dual_encoder(tmp_path)
    np.testing.assert_array_equal(label_emb, trained.label_emb)
    va = trained.data["valid"][0]
    a = predict(trained.model, va, trained.label_emb, 5, device="cpu", amp="off", progress=None)["scores"]
    b = predict(model, va, label_emb, 5, device="cpu", amp="off", progress=None)["scores"]
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_allclose(a.data, b.data, atol=1e-6)
    assert (a.data >= 0).all() and (a.data <= 1).all()


def test_params_sizes_from_the_data_and_bad_values_are_rejected():
    p = DualEncoderParams().resolved(10_000, 572)
    assert p.cluster_size == 64 // 8 and p.mine_depth == 58 and p.train.steps == math.ceil(2 * 10_000 / 64)
    assert p.train.warmup_steps == round(0.1 * p.train.steps) and p.eval_every == p.train.steps // 10
    assert DualEncoderParams().resolved(10_000, 500_000).mine_depth == 100
    assert DualEncoderParams(hard_negatives=5).resolved(100, 20).mine_depth == 5
    assert DualEncoderParams().label_refresh_steps(6400) == 100
    for bad in ({"loss": "bce"}, {"batching": "cluster"}, {"temperature": 0}, {"pooling": "cls-concat-last-k"},
                {"hard_negatives": -1}, {"train": {"lr": None}}):
        with pytest.raises(ValueError):
            DualEncoderParams.from_dict(bad)


# --------------------------------------------------------------------------- the stage


def _write(tiny, tmp_path):
    data, texts = _synth(tiny, n_labels=40, splits=(("train", 160), ("valid", 48), ("test", 32)))
    d = tmp_path / "in"
    for s, (t, Y) in data.items():
        io.save_arrays(d / f"tokens_{s}.npz", input_ids=t.input_ids, lengths=t.lengths)
        io.save_csr(d / f"Y_{s}.npz", Y)
    io.write_table(d / "labels.parquet", {"label_id": [f"L{j}" for j in range(40)], "label_text": texts,
                                          "train_freq": np.asarray(data["train"][1].sum(0)).ravel().astype(np.int64)})
    return d


def test_cli_train_predict(tiny, tmp_path, capsys):
    d = _write(tiny, tmp_path)
    out = tmp_path / "m"
    params = {"encoder": tiny, "pooling": "mean", "device": "cpu", "threads": 1, "label_max_length": 8, "topk": 5,
              "eval_every": 20, "cluster_size": 4, "train": {"steps": 60, "batch_size": 16, "lr": 3e-3,
                                                             "checkpoint_every": 25}}
    train = ["train", "--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"), "--labels-valid",
             str(d / "Y_valid.npz"), "--label-table", str(d / "labels.parquet"), "--out", str(out), "--no-tracking",
             "--record", str(out / layout.RECORD)]
    assert cli_main(de_stage.main, train + ["--params", json.dumps(params)]) == 0
    rec = io.read_json(out / layout.RECORD)
    for f in (layout.WEIGHTS, "dual_encoder.json", layout.LABEL_EMB, "label_index.faiss", layout.GUARD, layout.CURVE):
        assert (out / f).is_file(), f
    assert (out / layout.CURVE).read_bytes()[:4] == b"\x89PNG" and not (out / "checkpoints").exists()
    m = rec["metrics"]
    assert m["train_steps"] == 60 and m["valid_recall"] > m["valid_prior_recall"] + 0.2, m
    assert io.read_json(out / layout.GUARD)["passed"] and rec["params"]["max_length"] == 9
    meta = io.read_json(out / "dual_encoder.json")
    assert meta["L"] == 40 and meta["pooling"] == "mean" and meta["max_length"] == 9
    pred, short, emb = tmp_path / "pred.parquet", tmp_path / "short.parquet", tmp_path / "emb.npz"
    argv = ["predict", "--model", str(out), "--tokens", str(d / "tokens_test.npz"), "--out", str(pred),
            "--shortlist-out", str(short), "--emb-out", str(emb), "--no-tracking", "--record", str(tmp_path / "p.json"),
            "--params", json.dumps({"topk": 3, "shortlist_topk": 7, "device": "cpu"})]
    assert cli_main(de_stage.main, argv) == 0
    P, S = io.read_predictions(pred, 40), io.read_predictions(short, 40)
    assert P.shape == (32, 40) and (np.diff(P.indptr) == 3).all() and (np.diff(S.indptr) == 7).all()
    assert io.load_arrays(emb)["emb"].shape[0] == 32
    assert io.read_json(tmp_path / "p.json")["metrics"]["predict_latency_ms_per_doc"] > 0
    model, label_emb = load_dual_encoder(out)
    r = predict(model, neural.TokenData.load(d / "tokens_test.npz"), label_emb, 3, device="cpu", progress=None)
    np.testing.assert_allclose(r["scores"].toarray(), P.toarray(), atol=1e-5)
    # a run that learns nothing fails with the guard's numbers, and allow_weak keeps it
    weak = {**params, "eval_every": 0, "train": {"steps": 1, "batch_size": 16, "lr": 1e-9}}
    skewed = tmp_path / "skew"
    data, texts = _synth(tiny, n_labels=40, splits=(("train", 160), ("valid", 48)), skew=1.5, noise=8)
    for s, (t, Y) in data.items():
        io.save_arrays(skewed / f"tokens_{s}.npz", input_ids=t.input_ids, lengths=t.lengths)
        io.save_csr(skewed / f"Y_{s}.npz", Y)
    io.write_table(skewed / "labels.parquet", {"label_id": [f"L{j}" for j in range(40)], "label_text": texts})
    argv = ["train", "--tokens-dir", str(skewed), "--labels-train", str(skewed / "Y_train.npz"), "--labels-valid",
            str(skewed / "Y_valid.npz"), "--label-table", str(skewed / "labels.parquet"), "--out",
            str(tmp_path / "w"), "--no-tracking", "--params", json.dumps(weak)]
    capsys.readouterr()
    assert cli_main(de_stage.main, argv) != 0
    err = capsys.readouterr().err
    assert "no better than a trivial index" in err and "dual_encoder.allow_weak" in err
    assert not (tmp_path / "w" / layout.WEIGHTS).exists()
    argv[argv.index("--params") + 1] = json.dumps({**weak, "allow_weak": True})
    assert cli_main(de_stage.main, argv) == 0 and (tmp_path / "w" / layout.WEIGHTS).exists()


def test_choices_table_reads_the_records(tmp_path):
    """bench/dual_encoder_choices.py: one row per run, valid figures only, the changed settings named."""
    from conftest import load_bench
    bench = load_bench("dual_encoder_choices")
    metrics = {"valid_p_at_1": 0.5, "valid_p_at_5": 0.2, "valid_recall": 0.9, "valid_start_recall": 0.7,
               "valid_recall_most_frequent": 0.8, "valid_recall_linear_tree": 0.85, "train_time_s": 12.0,
               "train_seq_per_s": 40.0}
    for name, loss, p1 in (("d", "decoupled-softmax", 0.5), ("d-softmax", "softmax", 0.25)):
        folder = tmp_path / name / "dual-encoder" / "minilm-64"
        folder.mkdir(parents=True)
        params = {"loss": loss, "threads": 2, "train": {"epochs": 2.0}}
        (folder / "record.json").write_text(json.dumps({"metrics": {**metrics, "valid_p_at_1": p1}, "params": params}))
    rows = bench.table(tmp_path, ["d", "d-softmax", "d-gone"], "minilm-64").splitlines()
    assert rows[2].startswith("| d | 50.00 | 20.00 | 90.00 | 70.00 | 80.00 | 85.00 | 12 | 40.0 | (defaults) |")
    assert rows[3].startswith("| d-softmax | 25.00 |") and rows[3].endswith("| loss=softmax |")
    assert rows[4].startswith("| d-gone | missing")
