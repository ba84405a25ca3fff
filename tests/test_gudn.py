import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from test_lightxml import _write_toy
from tiny_encoder import make_tiny_encoder, toy_tokens
from xmc_steps import gudn, io, layout, lightxml, neural
from xmc_steps.lightxml.train import train_lightxml
from xmc_steps.stage import cli_main
from xmc_steps.stages import gudn as gudn_stage
from xmc_steps.stages import lightxml as lightxml_stage
from xmc_steps.trainer import TrainParams


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("tiny_g") / "bert")


def test_feature_guide_is_eq2():
    e_t = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    e_l = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    # (1/2n) sum ||.||^2 = (1/4) (5 + 25)
    assert gudn.feature_guide(e_t, e_l, "paper").item() == pytest.approx(7.5)
    assert gudn.feature_guide(e_t, e_l, "mean").item() == pytest.approx(30 / 4)
    assert gudn.feature_guide(e_t, e_t, "paper").item() == 0


def test_relative_feature_guide_is_eq2_over_the_spread_and_gains_nothing_from_collapse():
    e_t = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    e_l = torch.tensor([[0.0, 0.0], [2.0, 2.0]])
    # centre (1, 0.5); squared distances 0 + 4; spread 1.25 + 1.25 + 1.25 + 3.25
    assert gudn.feature_guide(e_t, e_l, "relative").item() == pytest.approx(4 / 7)
    assert gudn.feature_guide(e_t, e_t, "relative").item() == 0
    torch.manual_seed(0)
    t, lab = torch.randn(16, 8), torch.randn(16, 8)
    assert 0.5 < gudn.feature_guide(t, lab, "relative").item() < 1.5       # unrelated: about 1
    # drawing every feature towards one point (the collapse GUDN's "mean" guide rewards) changes nothing
    c = torch.randn(8)
    for reduction, gains in (("mean", True), ("paper", True), ("relative", False)):
        alpha = torch.tensor(1.0, requires_grad=True)
        loss = gudn.feature_guide(c + alpha * (t - c), c + alpha * (lab - c), reduction)
        (grad,) = torch.autograd.grad(loss, alpha)
        assert (grad.item() > 1e-3) if gains else abs(grad.item()) < 1e-5, (reduction, grad.item())


def test_guide_loss_sums_the_switched_on_guides():
    torch.manual_seed(0)
    m = lightxml.LightXMLModel(None, 5, None, dim=3, dropout=0.0).eval()
    e_t, e_l = torch.randn(2, 3), torch.randn(2, 3)
    rows, labs = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 2])
    y = torch.zeros(2, 5)
    y[0, 4] = y[1, 0] = y[1, 2] = 1
    link = F.binary_cross_entropy_with_logits(m.generator(e_l), y)      # Eq. 3: labels from the label features
    feature = gudn.feature_guide(e_t, e_l, gudn.GUDNParams().feature_loss).item()
    both, logs = gudn.guide_loss(m, e_t, e_l, rows, labs, gudn.GUDNParams())
    assert both.item() == pytest.approx(feature + link.item(), rel=1e-6)
    assert set(logs) == {"loss_feature", "loss_link"}
    only_f, logs = gudn.guide_loss(m, e_t, e_l, rows, labs, gudn.GUDNParams(link_guide=False))
    assert set(logs) == {"loss_feature"} and only_f.item() == pytest.approx(feature)
    only_l, _ = gudn.guide_loss(m, e_t, e_l, rows, labs, gudn.GUDNParams(feature_guide=False))
    assert only_l.item() == pytest.approx(link.item(), rel=1e-6)


def test_balanced_feature_weight_bounds_the_guides_pull_by_the_classification_losss():
    torch.manual_seed(0)
    m = lightxml.LightXMLModel(None, 5, None, dim=3, dropout=0.0).eval()
    rows, labs = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 2])
    y = torch.zeros(2, 5)
    y[0, 4] = y[1, 0] = y[1, 2] = 1
    balanced = gudn.GUDNParams(feature_weight="balanced", link_guide=False)
    for far, capped in ((10.0, False), (1e-4, True)):
        e_t = torch.randn(2, 3, requires_grad=True)
        e_l = (e_t.detach() + far * torch.randn(2, 3)).requires_grad_()
        class_loss = F.binary_cross_entropy_with_logits(m.generator(e_t), y)
        g_c = torch.autograd.grad(class_loss, e_t, retain_graph=True)[0].norm()
        g_f = (2 * (e_t - e_l) / e_t.numel()).norm()            # d mean((E_t - E_l)^2) / dE_t
        want = min(1.0, (g_c / g_f).item())
        assert (want == 1.0) == capped
        loss, logs = gudn.guide_loss(m, e_t, e_l, rows, labs, balanced, class_loss=class_loss)
        logs = {k: float(v) for k, v in logs.items()}   # 0-d tensors (read at the trainer's logging interval)
        assert logs["feature_weight"] == pytest.approx(want, rel=1e-5)
        assert loss.item() == pytest.approx(want * logs["loss_feature"], rel=1e-5)
        # the weight is a constant of the step: the gradient is the weighted guide's, nothing through the weight
        (g,) = torch.autograd.grad(loss, e_t)
        assert g.norm().item() == pytest.approx(want * g_f.item(), rel=1e-4)
    fixed, _ = gudn.guide_loss(m, e_t, e_l, rows, labs, gudn.GUDNParams(link_guide=False))
    assert fixed.item() == pytest.approx(logs["loss_feature"])          # Eq. 6 as written: weight 1
    with pytest.raises(ValueError, match="classification loss"):
        gudn.guide_loss(m, e_t, e_l, rows, labs, balanced)
    with pytest.raises(ValueError, match="feature_weight"):
        gudn.GUDNParams(feature_weight="auto")


def _gate_toy(tiny, tmp_path):
    torch.set_num_threads(1)
    d = _write_toy(tmp_path, n_train=32, n_valid=8)
    tokens, Y = neural.TokenData.load(d / "tokens_train.npz"), io.load_csr(d / "Y_train.npz")
    ids, lengths, _ = toy_tokens(32, 10, 4, seed=1)
    params = lightxml.LightXMLParams(encoder=tiny, last_k=2, eval_every=0, device="cpu", amp="off", swa_start=1.0,
                                     head_init="linear", dropout=0.1,
                                     train=TrainParams(steps=4, batch_size=8, lr=1e-3, log_every=1)).resolved(32)
    return tokens, Y, neural.TokenData(ids, lengths), params


def test_gate_ratio_draws_no_random_numbers_and_opens_when_the_guide_has_nothing_to_pull(tiny, tmp_path):
    tokens, Y, label_tokens, params = _gate_toy(tiny, tmp_path)
    torch.manual_seed(0)
    model = lightxml.build_model(params, 8, None, None)
    lightxml.train.linear_start(model, tokens, Y, params, "cpu", neural._default_log)
    model.train()
    rng = torch.random.get_rng_state()
    r = gudn.gate_ratio(model, tokens, label_tokens, Y, "mean", "cpu", batches=2, batch_size=8)
    assert torch.equal(rng, torch.random.get_rng_state()) and model.training
    assert 0 < r < float("inf")
    # label sequences that read like the texts themselves: the guide pulls nowhere, the gate is open
    assert gudn.gate_ratio(model, tokens, tokens, Y, "mean", "cpu", batches=2, batch_size=8) == float("inf")


@pytest.mark.parametrize("ratio", [0.5, 2.0, float("inf")])
def test_gated_feature_guide_trains_as_eq6_when_open_and_as_no_feature_guide_when_shut(tiny, tmp_path, monkeypatch,
                                                                                      ratio):
    tokens, Y, label_tokens, params = _gate_toy(tiny, tmp_path)
    monkeypatch.setattr(gudn.loss, "gate_ratio", lambda *a, **k: ratio)
    seen = []

    def run(gp, ck):
        torch.manual_seed(0)
        model = lightxml.build_model(params, 8, None, None)
        logs = {}
        guide = gudn.GuideNetwork(gp, label_tokens)
        train_lightxml(model, tokens, Y, params, ck, guide=guide, on_step=lambda t, lg: logs.update({t: lg}))
        if guide.gate_ratio is not None:
            gate = guide.describe()["gudn"]["feature_gate"]
            seen.append((guide.gate_ratio, guide.feature_on()))
            assert gate == {"ratio": guide.gate_ratio, "feature_guide_on": guide.feature_on()}
        return model.state_dict(), logs

    gated, logs = run(gudn.GUDNParams(feature_weight="gated"), tmp_path / "gated")
    same = ratio >= 1
    ref, _ = run(gudn.GUDNParams(feature_weight="fixed", feature_guide=same), tmp_path / "ref")
    assert gated.keys() == ref.keys() and all(torch.equal(gated[k], ref[k]) for k in gated)
    assert ("loss_feature" in logs[1]) == same and seen == [(ratio, same)]
    # a resumed run keeps its start's decision (from the checkpoint): no second measurement
    monkeypatch.setattr(gudn.loss, "gate_ratio", lambda *a, **k: pytest.fail("the gate was measured again"))
    again, _ = run(gudn.GUDNParams(feature_weight="gated"), tmp_path / "gated")
    assert all(torch.equal(gated[k], again[k]) for k in gated) and seen[-1] == (ratio, same)


def test_label_sequences_join_each_rows_label_texts():
    Y = sp.csr_matrix(np.array([[0, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=np.float32))
    assert gudn.label_sequences(Y, ["a", "b c", "d"], "; ") == ["b c; d", "a", ""]


def _with_label_texts(d, has: bool):
    io.write_table(d / "labels.parquet", {"label_id": [str(i) for i in range(8)],
                                          "label_text": [f"topic {i % 4} word {i}" for i in range(8)],
                                          "train_freq": [1] * 8})
    io.write_json(d / "ingest.json", {"extra": {"report": {"has_label_texts": has}}})


def test_cli_trains_with_both_guides_and_predicts_with_lightxml(tiny, tmp_path):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    d = _write_toy(tmp_path)
    _with_label_texts(d, True)
    out = tmp_path / "m"
    params = {"backbone": {"encoder": tiny, "dropout": 0.1, "device": "cpu", "threads": 1, "eval_every": 0,
                           "swa_start": 1.0, "train": {"steps": 100, "batch_size": 16, "lr": 2e-3}},
              "label_max_length": 12, "feature_weight": "balanced"}
    argv = ["train", "--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"), "--labels-valid",
            str(d / "Y_valid.npz"), "--label-table", str(d / "labels.parquet"), "--ingest-record", str(d / "ingest.json"),
            "--tree", str(d / "tree.npz"), "--out", str(out), "--params", json.dumps(params), "--no-tracking",
            "--record", str(out / layout.RECORD)]
    assert cli_main(gudn_stage.main, argv) == 0
    rec = io.read_json(out / layout.RECORD)
    meta = io.read_json(out / "lightxml.json")
    assert meta["last_k"] == 2                     # the paper's 10 layers, capped at the tiny encoder's 2
    assert meta["gudn"]["feature_guide"] and meta["gudn"]["link_guide"] and meta["gudn"]["feature_loss"] == "mean"
    assert meta["gudn"]["feature_weight"] == "balanced"
    assert rec["params"]["backbone"]["last_k"] == 2 and rec["params"]["label_max_length"] == 12
    assert rec["metrics"]["valid_p_at_1"] >= 0.9, rec["metrics"]
    pred = tmp_path / "pred.parquet"
    argv = ["predict", "--model", str(out), "--tokens", str(d / "tokens_test.npz"), "--out", str(pred),
            "--params", json.dumps({"topk": 3, "device": "cpu"}), "--no-tracking"]
    assert cli_main(lightxml_stage.main, argv) == 0
    assert io.read_predictions(pred, 8).shape == (32, 8)


def test_cli_names_the_missing_label_text_file(tiny, tmp_path, capsys):
    d = _write_toy(tmp_path, n_train=16, n_valid=8)
    _with_label_texts(d, False)
    argv = ["train", "--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"), "--labels-valid",
            str(d / "Y_valid.npz"), "--label-table", str(d / "labels.parquet"), "--ingest-record", str(d / "ingest.json"),
            "--label-texts-file", "data/mine/label_texts.txt", "--out", str(tmp_path / "m"),
            "--params", json.dumps({"backbone": {"encoder": tiny, "device": "cpu", "train": {"steps": 1}}}),
            "--no-tracking"]
    assert cli_main(gudn_stage.main, argv) != 0
    err = capsys.readouterr().err
    assert "data/mine/label_texts.txt is missing" in err
    assert not (tmp_path / "m" / layout.WEIGHTS).exists()
