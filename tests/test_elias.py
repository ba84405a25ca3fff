import json
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tiny_encoder import make_tiny_encoder, toy_tokens
from xmc_steps import elias, guard, io, layout, neural
from xmc_steps.baselines import most_frequent_top, recall_of_top
from xmc_steps.elias import train as elias_train
from xmc_steps.cluster_tree import ClusterTree
from xmc_steps.stage import cli_main
from xmc_steps.stages import elias as elias_stage
from xmc_steps.trainer import TrainParams


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("tiny_e") / "bert")


def _train(**kw) -> TrainParams:
    """An ELIAS training recipe (no default learning rate: each group has its own)."""
    return TrainParams(lr=None, **kw)


def _index_model(C, L, kappa, index, value=None, Wc=None, **kw):
    """An encoder-less model over D = 2 embeddings."""
    m = elias.EliasModel(None, C, L, kappa, dim=2, **kw)
    m.set_adjacency(torch.tensor(index), None if value is None else torch.tensor(value, dtype=torch.float32))
    if Wc is not None:
        with torch.no_grad():
            m.Wc.copy_(torch.tensor(Wc, dtype=torch.float32))
    return m


# --------------------------------------------------------------------------- Eqs. 1, 5, 6, 3


def test_eq1_and_eq5_clamps_against_hand_numbers():
    # C = 3 clusters, logits (2, 0, 0): softmax = (e^2, 1, 1) / (e^2 + 2)
    m = _index_model(3, 4, 2, [[0, 1], [2, -1], [3, 0]], [[math.log(3.0), 0.0], [5.0, 0.0], [0.0, 0.0]],
                     Wc=[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], alpha=2.0, beta=2.0)
    _, s = m.cluster_scores(torch.tensor([[2.0, 7.0]]))
    z = math.exp(2) + 2
    assert s[0].tolist() == pytest.approx([1.0, 2 / z, 2 / z])  # 2 * e^2 / z = 1.57 -> clamped to 1
    e = m.edge_scores(torch.tensor([0, 1, 2]))
    # row 0: softmax(log 3, 0) = (.75, .25), * beta 2 = (1.5 -> 1, .5); row 1: one real entry -> 1, pad -> 0
    # row 2: (.5, .5) * 2 = (1, 1)
    np.testing.assert_allclose(e.detach().numpy(), [[1.0, 0.5], [1.0, 0.0], [1.0, 1.0]], rtol=1e-6)
    # stage 1 (fixed edges): every real entry scores 1, pads 0, whatever A_value holds
    m1 = _index_model(3, 4, 2, [[0, 1], [2, -1], [3, 0]], [[9.0, -9.0], [0.0, 0.0], [0.0, 0.0]], fixed_edges=True)
    assert m1.edge_scores(torch.tensor([0, 1])).tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert not m1.A_value.requires_grad


def test_eq6_keeps_the_best_path_to_a_label():
    # label 3 is in rows 0 (edge .25*beta) and 1 (edge 1); clusters 0 and 1 are the top-2
    m = _index_model(3, 5, 2, [[0, 3], [3, 1], [4, 2]], [[math.log(3.0), 0.0], [0.0, -50.0], [0.0, 0.0]],
                     Wc=[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], alpha=1.0, beta=1.0, b=2, K=5)
    emb = torch.tensor([[1.0, 0.5]])
    _, s = m.cluster_scores(emb)
    s0, s1 = s[0, 0].item(), s[0, 1].item()
    labels, yhat, p = m.shortlist(emb)
    got = {int(l): float(y) for l, y in zip(labels[0], yhat[0].detach()) if l >= 0}
    e1 = 1 / (1 + math.exp(-50.0))
    assert set(got) == {0, 1, 3}  # cluster 2 (labels 4, 2) is not in the beam
    assert got[0] == pytest.approx(s0 * 0.75)
    assert got[1] == pytest.approx(s1 * (1 - e1))
    assert got[3] == pytest.approx(max(s0 * 0.25, s1 * e1))  # the path through cluster 1 wins
    assert s1 * e1 > s0 * 0.25
    assert (labels[0, 3:] == -1).all() and (yhat[0, 3:] == 0).all() and (p[0, 3:] == 0).all()
    # best first, and p = sigmoid(w_l . phi) * yhat
    assert yhat[0, 0] >= yhat[0, 1] >= yhat[0, 2]
    w = m.wl[labels[0, :3]]
    assert p[0, :3].tolist() == pytest.approx((torch.sigmoid(w @ emb[0]) * yhat[0, :3]).tolist())


def test_yhat_power_reweights_the_shortlist_score_and_keeps_padding_at_zero():
    """predict.yhat_power: p = sigmoid(w_l . phi) * yhat ** power (1: the paper's p; 0: the classifier
    alone on the shortlist), the shortlist itself unchanged, padding 0 whatever the power."""
    m = _index_model(3, 5, 2, [[0, 3], [3, 1], [4, 2]], [[math.log(3.0), 0.0], [0.0, -50.0], [0.0, 0.0]],
                     Wc=[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], alpha=1.0, beta=1.0, b=2, K=5)
    with torch.no_grad():
        m.wl.copy_(torch.tensor([[-2.0, 0.0], [3.0, 0.0], [0.0, 0.0], [0.5, 0.0], [0.0, 0.0]]))
    emb = torch.tensor([[1.0, 0.5]])
    labels, yhat, p1 = m.shortlist(emb)
    real = labels[0] >= 0
    sig = torch.sigmoid(m.wl[labels[0].clamp(min=0)] @ emb[0])
    for power in (0.0, 0.5, 2.0):
        lab_a, yhat_a, p = m.shortlist(emb, yhat_power=power)
        assert torch.equal(lab_a, labels) and torch.equal(yhat_a, yhat)
        assert p[0, real].tolist() == pytest.approx((sig[real] * yhat[0, real] ** power).tolist(), rel=1e-5)
        assert (p[0, ~real] == 0).all()
    assert torch.equal(m.shortlist(emb, yhat_power=1.0)[2], p1)
    # label 1's path has yhat ~ 1e-22: the classifier alone (w . phi = 3) ranks it first, the paper's p last
    by = {power: labels[0, int(torch.argmax(m.shortlist(emb, yhat_power=power)[2][0]))].item() for power in (0.0, 1.0)}
    assert by == {0.0: 1, 1.0: 3}


def test_training_parents_put_every_positive_in_the_shortlist():
    # 4 clusters, beam 1; label 5 sits in rows 1 (a = .1) and 2 (a = .9): its parent is 2
    index = [[0, 1, -1], [2, 3, 5], [4, 5, 6], [7, -1, -1]]
    value = [[0, 0, 0], [0, 0, 0.1], [0, 0.9, 0], [0, 0, 0]]
    m = _index_model(4, 8, 3, index, value, Wc=[[5, 0], [0, 0], [0, 0], [0, 0]], b=1, K=4)
    assert m.parents(torch.tensor([5, 7, 0, 2])).tolist() == [2, 3, 0, 1]
    emb = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    labels, _, _ = m.shortlist(emb)
    assert set(labels[0].tolist()) - {-1} == {0, 1}  # prediction: only the beam
    rows = torch.tensor([0, 0, 1])
    pos = torch.tensor([5, 7, 3])
    out = m._shortlist(emb, rows, pos)
    for r, l in zip(rows.tolist(), pos.tolist()):
        j = (out.labels[r] == l).nonzero()
        assert len(j) == 1 and out.target[r, j[0, 0]]
    assert int(out.target.sum()) == 3 and out.n_pos.tolist() == [2, 1]
    # K = 4 < the 6 candidates of example 0 (clusters 0, 2, 3): positives are kept first
    assert set(out.labels[0].tolist()) >= {5, 7}
    # a label that no row holds has no parent and is never shortlisted
    m2 = _index_model(2, 3, 1, [[0], [1]], b=1, K=3)
    assert m2.parents(torch.tensor([2])).tolist() == [-1] and m2.unreachable_labels() == 1


def test_loss_on_a_hand_worked_example():
    # shortlist (0, 1, pad); yhat (.5, .25); sigmoid(z) = (.5, .75) -> p = (.25, .1875)
    # positives: label 0 (shortlisted) and one that no path reaches
    out = elias.Shortlist(labels=torch.tensor([[0, 1, -1]]), yhat=torch.tensor([[0.5, 0.25, 0.0]]),
                          p=torch.tensor([[0.25, 0.1875, 0.0]]), logits=torch.tensor([[0.0, math.log(3.0), 0.0]]),
                          target=torch.tensor([[True, False, False]]), n_pos=torch.tensor([2]))
    eps = 1e-6
    lc = -math.log(0.25) - math.log(1 - 0.1875)          # standard BCE (not Eq. 7's 1 - log p typo)
    ls = -math.log(0.5) - math.log(eps)                  # the unreached positive counts as yhat = eps
    loss, got_lc, got_ls = elias.elias_loss(out, lambda_=0.05, eps=eps)
    assert got_lc.item() == pytest.approx(lc, rel=1e-5)
    assert got_ls.item() == pytest.approx(ls, rel=1e-5)
    assert loss.item() == pytest.approx(lc + 0.05 * ls, rel=1e-5)
    # batch reduction: the mean of per-example sums
    two = elias.Shortlist(*(torch.cat([x, x]) for x in out))
    assert elias.elias_loss(two, 0.05, eps)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_loss_gradients_reach_encoder_side_index_and_A():
    torch.manual_seed(0)
    m = _index_model(3, 6, 2, [[0, 1], [2, 3], [4, 5]], [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], b=1, K=4,
                     alpha=1.0, beta=1.0)  # no clamp active (a clamped score passes no gradient)
    emb = torch.randn(2, 2, requires_grad=True)
    out = m._shortlist(emb, torch.tensor([0, 1]), torch.tensor([3, 4]))
    loss, _, _ = elias.elias_loss(out, 0.05)
    loss.backward()
    for t in (emb, m.Wc, m.wl, m.A_value):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


# --------------------------------------------------------------------------- init_adjacency (Eqs. 9-10)


def test_init_adjacency_hand_worked():
    # N = 3 documents, C = 2 clusters (top-b scores), L = 4 labels
    M = sp.csr_matrix(np.array([[0.9, 0.1], [0.0, 1.0], [0.5, 0.0]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 1, 0]], np.float32))
    # A' = M^T Y: row 0 = (.9, .9, .5, 0); row 1 = (.1, 1.1, 0, 1.0)
    index, value = elias.init_adjacency(M, Y, kappa=2, seed=3)
    assert index.tolist() == [[0, 1], [1, 3]]  # row 0: tie .9/.9 -> both, label order; row 1: 1.1, 1.0
    assert value.shape == (2, 2) and value.dtype == np.float32 and ((value > 0) & (value < 1)).all()
    np.testing.assert_array_equal(value, np.random.default_rng(3).random((2, 2)).astype(np.float32))
    index3, _ = elias.init_adjacency(M, Y, kappa=3, seed=3)
    assert index3.tolist() == [[0, 1, 2], [1, 3, 0]]
    index5, _ = elias.init_adjacency(M, Y, kappa=5, seed=3)  # fewer candidates than kappa: -1 pads
    assert index5.tolist() == [[0, 1, 2, -1, -1], [1, 3, 0, -1, -1]]
    # blockwise computation (one row per block) gives the same
    assert elias.init_adjacency(M, Y, kappa=3, seed=3, max_products=1)[0].tolist() == index3.tolist()


def test_partition_start_keeps_stage1s_clusters_at_the_given_mass():
    """a_init partition: each row holds stage 1's labels first (even those Eq. 9's counts would
    drop), then Eq. 10's best other candidates; beta softmax gives stage 1's labels `mass` of the row."""
    eq10 = np.array([[2, 0, 3, 1], [1, 3, 0, -1]])              # Eq. 10's top-4 per row, best first
    stage1 = np.array([[0, 1, -1], [2, 3, -1]])                 # stage 1's partition {0, 1}, {2, 3}
    index, value = elias.partition_start(eq10, stage1, mass=0.9)
    assert index.tolist() == [[0, 1, 2, 3], [2, 3, 1, 0]]       # row 1: label 2 was not among Eq. 10's
    m = elias.EliasModel(None, 2, 4, 4, dim=2, beta=2.0)
    m.set_adjacency(index, value)
    e = m.edge_scores(torch.arange(2))
    torch.testing.assert_close(e[:, :2].sum(1) / 2.0, torch.tensor([0.9, 0.9]))     # beta softmax over the row
    torch.testing.assert_close(e[:, 0], torch.tensor([0.9, 0.9]))                   # own labels' edges: ~mass
    assert (e[:, 2:] < 0.11).all()
    # kappa smaller than stage 1's cluster: its own labels only, value 0
    index1, value1 = elias.partition_start(eq10[:, :1], stage1, mass=0.9)
    assert index1.tolist() == [[0], [2]] and (value1 == 0).all()
    with pytest.raises(ValueError, match="mass"):
        elias.partition_start(eq10, stage1, mass=1.0)
    # mass None (the default): the same rows, every candidate at the same start
    index0, value0 = elias.partition_start(eq10, stage1)
    assert index0.tolist() == index.tolist() and (value0 == 0).all()
    assert elias.EliasParams().a_init == "partition" and elias.EliasParams().a_init_mass is None


def test_adjacency_from_assignment_is_the_partition():
    index, value = elias.adjacency_from_assignment(np.array([1, 0, 1, 2, 1]), 3)
    assert index.tolist() == [[1, -1, -1], [0, 2, 4], [3, -1, -1]]
    assert (value == 0).all()


# --------------------------------------------------------------------------- scale: nothing dense over L


def test_forward_is_never_dense_over_labels():
    L, C, kappa, D, B = 200_000, 2000, 1000, 8, 2
    g = torch.Generator().manual_seed(0)
    m = elias.EliasModel(None, C, L, kappa, dim=D, b=8, K=500)
    with torch.no_grad():
        m.A_index.copy_(torch.randint(0, L, (C, kappa), generator=g))
        m.A_value.copy_(torch.rand(C, kappa, generator=g))
    m.rebuild_label_index()
    emb = torch.randn(B, D, generator=g)
    rows, pos = torch.tensor([0, 0, 1]), torch.tensor([5, 77_000, 199_999])
    m._shortlist(emb, rows, pos)  # warm-up
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = m._shortlist(emb, rows, pos)
        loss, _, _ = elias.elias_loss(out, 0.05)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    # an L-vector of floats is 800 kB, a C x L matrix 1.6 GB; the largest single allocation stays far below
    assert biggest < 4 * L, biggest      # speed: bench/bench_neural.py (ELIAS index + classifier per document)
    assert out.labels.shape == (B, 500) and bool(out.target.sum() >= 1)


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize("select", ["joint", "per_head"])
@pytest.mark.parametrize("wc_refit_wins", [True, False])
def test_refit_heads_keeps_wc_by_recall_and_per_head_wl_by_p_at_1(select, wc_refit_wins):
    # the evaluation tells the heads apart by their values: recall is W_C's (the re-fit's or the trained
    # one's), P@1 is set per (W_C, W_L) pair so that the mix ranks best in both directions
    rng = np.random.default_rng(0)
    n, L, C = 40, 6, 3
    model = _index_model(C, L, 2, [[0, 1], [2, 3], [4, 5]])
    trained = {k: v.detach().clone() for k, v in model.named_parameters() if k in ("Wc", "wl")}
    emb = rng.normal(size=(n, 2)).astype(np.float32)
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), rng.integers(0, L, n))), shape=(n, L))
    recall = {"trained": 0.5, "re-fit": 0.6 if wc_refit_wins else 0.4}
    p_at_1 = {("trained", "trained"): 0.30, ("re-fit", "re-fit"): 0.20, ("re-fit", "trained"): 0.35,
              ("trained", "re-fit"): 0.40}
    calls = []

    def which(name):
        return "trained" if torch.equal(getattr(model, name), trained[name]) else "re-fit"

    def evaluate():
        wc, wl = which("Wc"), which("wl")
        calls.append((wc, wl))
        return {}, {"shortlist_recall": recall[wc], "p_at_1": p_at_1[wc, wl]}

    as_trained = evaluate()
    calls.clear()
    (_, m), kept, evals = elias.refit_heads(model, emb, Y, 1e-3, 4.0, evaluate, as_trained, select)
    wc = "re-fit" if wc_refit_wins else "trained"
    wl = wc if select == "joint" else {"re-fit": "trained", "trained": "re-fit"}[wc]
    assert kept == {"Wc": wc, "wl": wl} and (which("Wc"), which("wl")) == (wc, wl)
    assert m == {"shortlist_recall": recall[wc], "p_at_1": p_at_1[wc, wl]}
    # the re-fit pair is evaluated once; per_head adds the one mix of the kept W_C
    assert calls == [("re-fit", "re-fit")] + ([(wc, wl)] if select == "per_head" else [])
    assert set(evals) == {("trained", "trained"), ("re-fit", "re-fit")} | ({(wc, wl)} if select == "per_head" else set())
    # the re-fit heads are the least-squares fits, not the trained ones
    if "re-fit" in (wc, wl):
        assert not torch.equal(getattr(model, "Wc" if wc == "re-fit" else "wl"),
                               trained["Wc" if wc == "re-fit" else "wl"])
    with pytest.raises(ValueError, match="head_refit_select"):
        elias.refit_heads(model, emb, Y, 1e-3, 4.0, evaluate, as_trained, "both")


def test_refit_heads_per_head_keeps_the_pair_when_the_mix_ranks_no_better():
    model = _index_model(2, 4, 2, [[0, 1], [2, 3]])
    trained_wc = model.Wc.detach().clone()
    emb = np.random.default_rng(1).normal(size=(20, 2)).astype(np.float32)
    Y = sp.csr_matrix((np.ones(20), (np.arange(20), np.arange(20) % 4)), shape=(20, 4))

    def evaluate():
        refit = not torch.equal(model.Wc, trained_wc)
        return {}, {"shortlist_recall": 0.9 if refit else 0.8, "p_at_1": 0.5}    # the mix ties the pair

    _, kept, _ = elias.refit_heads(model, emb, Y, 1e-3, 4.0, evaluate, evaluate(), "per_head")
    assert kept == {"Wc": "re-fit", "wl": "re-fit"}


def test_params_defaults_and_unknown_keys():
    with pytest.raises(ValueError, match="unknown"):
        elias.EliasParams.from_dict({"lambda": 0.1})
    with pytest.raises(ValueError, match="batch_size is now train.batch_size"):
        elias.EliasParams.from_dict({"batch_size": 10})
    with pytest.raises(ValueError, match="lr_encoder, lr_clf, lr_A"):
        elias.EliasParams.from_dict({"train": {"lr": 0.1}})
    p1 = elias.EliasParams.from_dict({"train": {"batch_size": 10}}).resolved(1, n_train=100, n_labels=1000, n_clusters=10)
    # K = clip(L / 10, 200, 2000); b: the fewest of the C clusters (L / C = 100 labels each) covering 2 K labels
    assert (p1.alpha, p1.beta, p1.b, p1.K, p1.kappa, p1.lambda_) == (10.0, 100.0, 4, 200, 1000, 0.0)
    assert p1.train.steps == 20 and p1.lr_clf == 1e-3 and p1.lr_encoder == 1e-4   # 2 epochs of 100 at batch 10
    assert p1.train.warmup_steps == 2 and p1.train.checkpoint_every == 500         # warm-up: a tenth of the steps
    assert p1.eval_every == 2                                                      # ten validation points
    p2 = elias.EliasParams(train=TrainParams(steps=7, lr=None), lr_A=0.1).resolved(2, 100, 100_000, 1000)
    assert (p2.kappa, p2.lambda_, p2.lr_A, p2.lr_clf, p2.train.steps, p2.b, p2.K) == (1000, 0.05, 0.1, 3e-4, 7, 40, 2000)
    # the paper's sizes (b 20, K 2000 at 100 labels per cluster) are coverage 1
    p3 = elias.EliasParams(coverage=1.0, train=TrainParams(steps=7, lr=None)).resolved(1, 100, 500_000, 5000)
    assert (p3.b, p3.K, p3.kappa, p3.beta) == (20, 2000, 1000, 100.0)
    # a small label space: K at least 200 (at most L), the beam at most every cluster
    p4 = elias.EliasParams(train=TrainParams(steps=7, lr=None)).resolved(1, 100, 150, 64)
    assert (p4.b, p4.K) == (64, 150)
    q = elias.EliasParams.from_dict(json.loads(json.dumps(p2.to_dict())))
    assert q == p2


def test_wl_delay_and_swa(tiny, tmp_path):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    ids, lengths, cls = toy_tokens(16, 12, 2)
    Y = sp.csr_matrix(np.eye(4, dtype=np.float32)[cls * 2])
    tokens = neural.TokenData(ids, lengths)
    p = elias.EliasParams(encoder=tiny, train=_train(steps=3, batch_size=8, warmup_steps=0, checkpoint_every=0),
                          wl_delay_steps=2, swa_epochs=0.5, eval_every=0, device="cpu").resolved(1, 16, 4, 2)
    index, value = elias.adjacency_from_assignment(np.array([0, 0, 1, 1]), 2)
    m = elias.build_model(p, 2, 4, index.shape[1], fixed_edges=True)
    m.set_adjacency(index, value)
    wl0, wc0 = m.wl.detach().clone(), m.Wc.detach().clone()
    seen = {}

    def on_step(step, logs):
        seen[step] = logs
        if step == 2:
            assert torch.equal(m.wl, wl0)  # frozen for the first 2 steps
            assert not torch.equal(m.Wc, wc0)

    p = elias.EliasParams.from_dict({**p.to_dict(), "train": {**p.train.to_dict(), "log_every": 1}})
    tr = elias.train_elias(m, tokens, Y, p, tmp_path / "ck", on_step=on_step)
    assert tr.step == 3 and set(seen) == {1, 2, 3}
    assert {"loss", "loss_c", "loss_s"} <= set(seen[1])
    assert not torch.equal(m.wl, wl0) and m.wl.requires_grad
    # SWA over the last 0.5 epoch = 1 step: the average is the last weights; resuming reproduces it
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    m2 = elias.build_model(p, 2, 4, index.shape[1], fixed_edges=True)
    m2.set_adjacency(index, value)
    tr2 = elias.train_elias(m2, tokens, Y, p, tmp_path / "ck")
    assert tr2.resumed_from == 3
    for k, v in m2.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # a checkpoint written under another classifier rate is not resumed
    m3 = elias.build_model(p, 2, 4, index.shape[1], fixed_edges=True)
    m3.set_adjacency(index, value)
    p3 = elias.EliasParams.from_dict({**p.to_dict(), "lr_clf": p.lr_clf / 2})
    assert elias.train_elias(m3, tokens, Y, p3, tmp_path / "ck").resumed_from is None


def test_length_bucket_reaches_the_elias_trainer(tiny, tmp_path):
    """``train.length_bucket`` orders ELIAS's batches by length (it was accepted and ignored: the trainer
    had no lengths): each batch of the epoch's order spans a narrow range of lengths."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    ids, lengths, cls = toy_tokens(64, 24, 2)
    Y = sp.csr_matrix(np.eye(4, dtype=np.float32)[cls * 2])
    tokens = neural.TokenData(ids, lengths)
    index, value = elias.adjacency_from_assignment(np.array([0, 0, 1, 1]), 2)
    spreads = {}
    for bucket in (0, 8):
        p = elias.EliasParams(encoder=tiny, train=_train(steps=1, batch_size=8, warmup_steps=0, checkpoint_every=0,
                                                         length_bucket=bucket),
                              eval_every=0, device="cpu").resolved(1, 64, 4, 2)
        m = elias.build_model(p, 2, 4, index.shape[1], fixed_edges=True)
        m.set_adjacency(index, value)
        tr = elias.train_elias(m, tokens, Y, p, None)
        order = tr._order(0, 64)
        assert sorted(order.tolist()) == list(range(64))
        spreads[bucket] = np.mean([np.ptp(lengths[order[a:a + 8]]) for a in range(0, 64, 8)])
    assert spreads[8] == 0 or spreads[8] < 0.5 * spreads[0], spreads


@pytest.mark.parametrize("mode", ["touched", "all"])
def test_wl_decay_shrinks_only_the_rows_a_step_touched(tiny, tmp_path, monkeypatch, mode):
    """wl_decay touched: a W_L row outside every shortlist of the run is never decayed (nor moved);
    wl_decay all: AdamW shrinks it at every step, as the dense parameter it is."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    ids, lengths, cls = toy_tokens(16, 12, 2)
    L = 16
    Y = sp.csr_matrix(np.eye(L, dtype=np.float32)[cls * 2])            # labels 0 and 2 only (cluster 0)
    p = elias.EliasParams(encoder=tiny, train=_train(steps=3, batch_size=8, warmup_steps=0, checkpoint_every=0,
                                                     weight_decay=0.1),
                          eval_every=0, device="cpu", lr_clf=0.5, b=1, K=4, wl_decay=mode).resolved(1, 16, L, 4)
    index, value = elias.adjacency_from_assignment(np.arange(L) // 4, 4)
    m = elias.build_model(p, 4, L, index.shape[1], fixed_edges=True)
    m.set_adjacency(index, value)
    wl0 = m.wl.detach().clone()
    touched = set()
    real = elias.decay_touched_rows

    def spy(wl, rows, trainer, wd):       # rows: a mask over W_L's rows (a device tensor, read here by the test)
        touched.update(torch.nonzero(rows).flatten().tolist())
        return real(wl, rows, trainer, wd)

    monkeypatch.setattr(elias_train, "decay_touched_rows", spy)
    elias.train_elias(m, neural.TokenData(ids, lengths), Y, p, tmp_path / "ck")
    moved = {i for i in range(L) if not torch.equal(m.wl[i], wl0[i])}
    if mode == "touched":
        assert {0, 2} <= touched and len(touched) < L
        assert moved <= touched                          # an untouched row neither moves nor decays
        assert moved                                     # and the touched ones learn
    else:
        assert not touched and moved == set(range(L))   # every row decays at every step


def test_wl_accumulator_applies_the_mean_of_k_steps_gradients():
    """wl_update_every k: no W_L gradient reaches the optimiser between updates; at the k-th step
    (and the stage's last) the mean of the steps' gradients does, and the sums start again."""
    class M:
        wl = torch.nn.Parameter(torch.zeros(3, 2))
        wl_bias = None

    acc = elias_train.WlAccumulator(M, every=3, total_steps=5)
    g = [torch.randn(3, 2) for _ in range(5)]
    for step in (1, 2):
        M.wl.grad = g[step - 1].clone()
        acc(step)
        assert M.wl.grad is None
    M.wl.grad = g[2].clone()
    acc(3)
    torch.testing.assert_close(M.wl.grad, (g[0] + g[1] + g[2]) / 3)
    M.wl.grad = g[3].clone()
    acc(4)
    assert M.wl.grad is None
    M.wl.grad = g[4].clone()
    acc(5)                                              # the last step applies what is left
    torch.testing.assert_close(M.wl.grad, (g[3] + g[4]) / 2)
    M.wl.grad = None
    acc(6)                                              # a frozen W_L (wl_delay_steps): nothing to do
    assert int(acc.count) == 0


def test_wl_update_every_moves_wl_only_at_updates_and_resumes_exactly(tiny, tmp_path):
    """W_L moves at steps 2, 4 and 5 of 5 with k = 2 (W_C at every step); a run stopped at step 3,
    between two updates, resumes to the same weights as one that was never stopped."""
    import os
    import signal
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    ids, lengths, cls = toy_tokens(16, 12, 2)
    Y = sp.csr_matrix(np.eye(4, dtype=np.float32)[cls * 2])
    tokens = neural.TokenData(ids, lengths)
    p = elias.EliasParams(encoder=tiny, train=_train(steps=5, batch_size=8, warmup_steps=0, checkpoint_every=0,
                                                     log_every=1),
                          wl_update_every=2, eval_every=0, device="cpu").resolved(1, 16, 4, 2)
    index, value = elias.adjacency_from_assignment(np.array([0, 0, 1, 1]), 2)

    def model():
        m = elias.build_model(p, 2, 4, index.shape[1], fixed_edges=True)
        m.set_adjacency(index, value)
        return m

    m = model()
    wl = {0: m.wl.detach().clone()}
    wc = {0: m.Wc.detach().clone()}

    def on_step(step, logs):
        wl[step], wc[step] = m.wl.detach().clone(), m.Wc.detach().clone()

    elias.train_elias(m, tokens, Y, p, tmp_path / "a", on_step=on_step)
    moved = [s for s in range(1, 6) if not torch.equal(wl[s], wl[s - 1])]
    assert moved == [2, 4, 5]
    assert all(not torch.equal(wc[s], wc[s - 1]) for s in range(1, 6))

    m2 = model()

    def stop_at_3(step, logs):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)        # the trainer checkpoints step 3 and stops

    with pytest.raises(SystemExit):
        elias.train_elias(m2, tokens, Y, p, tmp_path / "b", on_step=stop_at_3)
    m3 = model()
    tr = elias.train_elias(m3, tokens, Y, p, tmp_path / "b")
    assert tr.resumed_from == 3
    for k, v in m3.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k


# --------------------------------------------------------------------------- CLI, stage 1 -> 2 -> predict


def _write_toy(tmp_path, n_train=96, n_valid=32, width=12):
    """4 topics; topic t has labels {t, t+4}; the tree's 4 clusters split them ({0,1}, {2,3}, {4,5}, {6,7})."""
    ids, lengths, cls = toy_tokens(n_train + n_valid, width, 4, seed=2)
    L = 8
    rows = [[t, t + 4] for t in cls]
    Y = sp.csr_matrix((np.ones(2 * len(rows), np.float32), np.concatenate(rows), np.arange(len(rows) + 1) * 2),
                      shape=(len(rows), L))
    d = tmp_path / "in"
    for s, sl in (("train", slice(0, n_train)), ("valid", slice(n_train, None))):
        io.save_arrays(d / f"tokens_{s}.npz", input_ids=ids[sl], lengths=lengths[sl])
        io.save_csr(d / f"Y_{s}.npz", Y[sl])
    io.save_arrays(d / "tokens_test.npz", input_ids=ids[n_train:], lengths=lengths[n_train:])
    io.save_csr(d / "Y_test.npz", Y[n_train:])
    ClusterTree.from_assignments([np.arange(L) // 2]).save(d / "tree.npz")
    return d


def test_cli_stage1_stage2_predict(tiny, tmp_path):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    d = _write_toy(tmp_path)
    common = {"encoder": tiny, "b": 1, "K": 4, "alpha": 2.0, "eval_every": 40, "device": "cpu", "threads": 1}
    recipe = {"batch_size": 16, "warmup_steps": 5, "log_every": 10, "checkpoint_every": 30, "seed": 0, "steps": 80}

    def train(stage, out, params, extra):
        argv = ["train", "--stage", str(stage), "--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"),
                "--labels-valid", str(d / "Y_valid.npz"), "--out", str(out), "--params", json.dumps(params),
                "--no-tracking", "--record", str(out / layout.RECORD)] + extra
        assert cli_main(elias_stage.main, argv) == 0
        return io.read_json(out / layout.RECORD)

    o1, o2 = tmp_path / "s1", tmp_path / "s2"
    # stage 1's beam of 1 cluster reaches half the positives at most, as many as the most frequent labels
    # (allow_weak in case a run lands below them); stage 2 must pass the guard by itself
    r1 = train(1, o1, {**common, "train": recipe, "lr_encoder": 2e-3, "lr_clf": 3e-2, "allow_weak": True,
                       "head_refit_select": "per_head"},
               ["--tree", str(d / "tree.npz")])
    r2 = train(2, o2, {**common, "train": recipe, "lr_encoder": 1e-3, "lr_clf": 1e-2, "lr_A": 0.1, "kappa": 4},
               ["--init", str(o1)])
    for o in (o1, o2):
        assert (o / layout.WEIGHTS).is_file() and (o / "elias.json").is_file() and not (o / "checkpoints").exists()
    M = io.load_csr(o1 / "clusters_train.npz")
    assert M.shape == (96, 4) and (np.diff(M.indptr) == 1).all() and (M.data > 0).all() and (M.data <= 1).all()
    m1, m2 = io.read_json(o1 / "elias.json"), io.read_json(o2 / "elias.json")
    assert (m1["stage"], m1["kappa"], m1["fixed_edges"], m1["C"], m1["L"]) == (1, 2, True, 4, 8)
    assert (m2["stage"], m2["kappa"], m2["fixed_edges"], m2["beta"], m2["alpha"]) == (2, 4, False, 2.0, 2.0)
    assert r2["params"]["lambda_"] == 0.05 and r1["params"]["lambda_"] == 0.0
    assert r1["metrics"]["train_steps"] == 80 and r2["metrics"]["train_steps"] == 80
    # the re-fit's three evaluations: both heads as trained, both re-fit, the kept W_C with the other W_L
    mt = r1["metrics"]
    mixes = {"refit_wc_trained_wl", "trained_wc_refit_wl"} & {k[len("valid_p_at_1_"):] for k in mt}
    assert {"valid_p_at_1_trained_head", "valid_p_at_1_refit_head"} <= set(mt) and len(mixes) == 1
    kept_wc = "refit" if mt["valid_shortlist_recall_refit_head"] > mt["valid_shortlist_recall_trained_head"] else "trained"
    assert mixes == {f"{kept_wc}_wc_{'trained' if kept_wc == 'refit' else 'refit'}_wl"}
    assert mt[f"valid_shortlist_recall_{mixes.pop()}"] == mt[f"valid_shortlist_recall_{kept_wc}_head"]
    # stage 1 (beam 1, each cluster holds one label of a topic) reaches at most half of the positives
    rec1, rec2 = r1["metrics"]["valid_shortlist_recall"], r2["metrics"]["valid_shortlist_recall"]
    assert rec1 <= 0.5 + 1e-6
    assert rec2 >= rec1, (rec1, rec2)
    g1, g2 = io.read_json(o1 / "guard.json"), io.read_json(o2 / "guard.json")
    # stage 1 ties the most frequent labels (0.5 each): not below them, so it passes (allow_weak is not needed)
    assert g1["passed"] is True and g1["allow_weak"] is True and g1["baselines"]["most_frequent"] == pytest.approx(0.5)
    assert g2["passed"] is True and g2["stage1_shortlist_recall"] == pytest.approx(g1["shortlist_recall"])
    assert g2["shortlist_recall"] > g2["baselines"]["most_frequent"]
    assert "0" in g1["curve"] and (o1 / "curve.png").stat().st_size > 0 and (o2 / "curve.png").stat().st_size > 0

    pred, emb, sl = tmp_path / "pred.parquet", tmp_path / "emb.npz", tmp_path / "sl.parquet"
    argv = ["predict", "--model", str(o2), "--tokens", str(d / "tokens_test.npz"), "--out", str(pred),
            "--emb-out", str(emb), "--shortlist-out", str(sl), "--params", json.dumps({"topk": 2, "device": "cpu"}),
            "--no-tracking", "--record", str(tmp_path / "pred.json")]
    assert cli_main(elias_stage.main, argv) == 0
    P, S = io.read_predictions(pred, 8), io.read_predictions(sl, 8)
    assert P.shape == (32, 8) and (np.diff(P.indptr) <= 2).all() and (np.diff(S.indptr) <= 2).all()
    assert io.load_arrays(emb)["emb"].shape == (32, 32)
    rec = io.read_json(tmp_path / "pred.json")
    assert rec["metrics"]["predict_latency_ms_per_doc"] > 0
    # the saved model reloads and predicts the same scores
    model = elias.load_elias(o2)
    r = elias.predict(model, neural.TokenData.load(d / "tokens_test.npz"), topk=2, device="cpu", progress=None)
    np.testing.assert_allclose(r["scores"].toarray(), P.toarray(), atol=1e-5)


def test_cli_rejects_bad_inputs(tiny, tmp_path, capsys):
    d = _write_toy(tmp_path, n_train=8, n_valid=4)
    argv = ["train", "--stage", "2", "--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"),
            "--labels-valid", str(d / "Y_valid.npz"), "--out", str(tmp_path / "o"), "--params",
            json.dumps({"encoder": tiny, "train": {"steps": 1}}), "--no-tracking"]
    assert cli_main(elias_stage.main, argv) == 2
    assert "--init" in capsys.readouterr().err
    argv[2] = "1"
    argv[-2] = json.dumps({"encoder": tiny, "stepz": 1})
    assert cli_main(elias_stage.main, argv + ["--tree", str(d / "tree.npz")]) == 2
    assert "unknown ELIAS parameter" in capsys.readouterr().err


# --------------------------------------------------------------------------- learning at C >= 1,000


class _BagEncoder(torch.nn.Module):
    """A text encoder small enough to train many steps in a unit test: the mean of learnable token vectors."""

    def __init__(self, vocab: int, dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, dim)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(vocab, dim, generator=g))
        self.dim = dim

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).float()
        return (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1.0)


def _topic_data(n_docs: int, n_labels: int, width: int = 8, seed: int = 0):
    """Each document has one label; its text is the label's own word (id 1000 + label) three times
    among background words (ids 1..999): learnable structure, nothing else."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_labels, n_docs)
    ids = rng.integers(1, 1000, size=(n_docs, width))
    for j in range(3):
        ids[np.arange(n_docs), rng.integers(0, width, n_docs)] = 1000 + labels
    Y = sp.csr_matrix((np.ones(n_docs, np.float32), labels, np.arange(n_docs + 1)), shape=(n_docs, n_labels))
    return neural.TokenData(ids.astype(np.int32), np.full(n_docs, width, np.int32)), Y


@pytest.mark.parametrize("head_init", ["linear", "random"])
def test_stage1_learns_at_a_thousand_clusters(head_init, tmp_path):
    """C = 1,024 clusters of 2 labels (L = 2,048): a few hundred steps lift the valid shortlist recall far
    above the most frequent labels', from either start; the least-squares start is above them at step 0."""
    torch.manual_seed(0)
    C, L = 1024, 2048
    tokens, Y = _topic_data(12_288, L)
    vt, vY = _topic_data(1024, L, seed=1)
    p = elias.EliasParams(train=_train(steps=300, batch_size=64, warmup_steps=10, checkpoint_every=0),
                          lr_encoder=1e-2, eval_every=300, device="cpu", amp="off").resolved(1, len(tokens), L, C)
    assert (p.K, p.b) == (205, 205)                     # K = clip(L / 10, 200, 2000), b L / C >= 2 K
    index, value = elias.adjacency_from_assignment(np.arange(L) // 2, C)
    model = elias.EliasModel(_BagEncoder(1000 + L, 64), C, L, index.shape[1], b=p.b, K=p.K, fixed_edges=True)
    model.set_adjacency(index, value)
    if head_init == "linear":
        emb = neural.embed(model.encoder, tokens, 512, "cpu", "off", progress=None)
        elias.linear_start(model, emb, Y, p.head_init_l2, p.head_init_scale)
    seen = {}
    elias_train.train_elias(model, tokens, Y, p, None, on_step=lambda s, logs: seen.update({s: logs}),
                            valid=(vt, vY))
    w = elias.guard_width(p.K, L)
    prior = recall_of_top(most_frequent_top(Y, len(vt), w), vY)
    start, end = seen[0]["valid_shortlist_recall"], seen[300]["valid_shortlist_recall"]
    assert prior < 0.15
    assert end > 0.8 and end > 5 * prior, (prior, start, end)
    if head_init == "linear":
        assert start > 2 * prior, (prior, start)


def test_headline_overlay_has_the_papers_wiki500k_index_sizes():
    """bench/headline.yaml runs the headline on synthetic data with config.paper.yaml's Wiki-500K index."""
    import yaml

    from conftest import ROOT

    paper = yaml.safe_load((ROOT / "config.paper.yaml").read_text())["datasets"]["wiki500k"]["elias"]
    head = yaml.safe_load((ROOT / "bench" / "headline.yaml").read_text())["datasets"]["wiki500k"]["elias"]
    assert head["cluster"] == paper["cluster"] and head["index"] == paper["index"]
    assert (paper["index"]["b"], paper["index"]["K"]) == (20, 2000)            # ELIAS §4
    p = elias.EliasParams.from_dict({k: v for k, v in paper["index"].items()}).resolved(1, 100, 501_070, 4096)
    assert (p.b, p.K, p.kappa, round(p.beta)) == (20, 2000, 1224, 122)       # kappa 10 L / C, beta L / C (§3.4, §3.2)


def test_guard_against_hand_numbers():
    """The guard's baselines and verdicts on a hand-made case: 4 labels in 2 clusters ({0, 1}, {2, 3})."""
    Y_train = sp.csr_matrix(np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], np.float32))
    Y_valid = sp.csr_matrix(np.array([[0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32))
    # the linear tree's beam: cluster 1 first for rows 0, 1; cluster 0 for row 2 (width 2: one whole cluster)
    beam = sp.csr_matrix(np.array([[0.2, 0.9], [0.1, 0.8], [0.7, 0.3], [0.5, 0.5]], np.float32))
    idx = guard.index_candidates(beam, np.array([0, 0, 1, 1]), 2)
    assert [sorted(idx[i].indices.tolist()) for i in range(3)] == [[2, 3], [2, 3], [0, 1]]
    shortlist = sp.csr_matrix(np.array([[0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]], np.float32))
    rep, rows = elias.check_stage(1, shortlist, Y_valid, Y_train, K=2, linear_valid=idx)
    assert rep.width == 2 and np.isnan(rows[3]) and rows[:3].tolist() == [1.0, 0.0, 1.0]
    # most frequent: labels 0 and 1 (2 and 1 training documents) -> recall 1/3 over the 3 rows with a positive
    assert rep.baselines == {"most_frequent": pytest.approx(1 / 3), "linear_tree": pytest.approx(1.0)}
    # 2/3 against the tree's 1.0: the paired difference (0, -1, 0) has two standard errors of 0.667, so the
    # stage is within the noise of the tree on three documents, and far below it on thirty of the same kind
    assert rep.shortlist == pytest.approx(2 / 3) and rep.margins["linear_tree"] == pytest.approx(2 / 3)
    assert rep.passed
    many = sp.vstack([Y_valid[:3]] * 10).tocsr()
    rep10, _ = elias.check_stage(1, sp.vstack([shortlist[:3]] * 10).tocsr(), many, Y_train, K=2,
                                 linear_valid=sp.vstack([idx[:3]] * 10).tocsr())
    assert not rep10.passed and "linear_tree 1.0000" in rep10.message() and "noise" in rep10.message()
    # one document of three lost against stage 1 is within the noise: the paired difference (0, -1, 0) has
    # two standard errors of 2 * 0.577 / sqrt(3) = 0.667, more than the mean's 1/3
    rep2, _ = elias.check_stage(2, shortlist, Y_valid, Y_train, K=2, previous_rows=np.array([1.0, 1.0, 1.0, np.nan]))
    assert rep2.previous == pytest.approx(1.0) and rep2.noise == pytest.approx(2 * np.sqrt(1 / 3) / np.sqrt(3))
    assert rep2.keeps_stage1 and rep2.beats_baselines and rep2.passed
    # every document 0.5 below stage 1: no noise in the difference, a clear fall
    rep3, _ = elias.check_stage(2, shortlist, Y_valid, Y_train, K=2, previous_rows=np.array([1.5, 0.5, 1.5, np.nan]))
    assert not rep3.keeps_stage1 and "fell below stage 1" in rep3.message()


def test_stage1_refuses_before_allocating_what_cannot_fit(tiny, tmp_path, monkeypatch, capsys):
    """The memory guard (xmc_steps.resources): W_L, W_C and their optimiser state are estimated first."""
    from xmc_steps import resources

    d = _write_toy(tmp_path)
    monkeypatch.setattr(resources, "available_memory", lambda: (1024, "test"))
    argv = ["train", "--stage", "1", "--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"),
            "--labels-valid", str(d / "Y_valid.npz"), "--tree", str(d / "tree.npz"), "--out", str(tmp_path / "o"),
            "--params", json.dumps({"encoder": tiny, "train": {"steps": 1}, "device": "cpu"}), "--no-tracking"]
    assert cli_main(elias_stage.main, argv) == 2
    err = capsys.readouterr().err
    assert "W_L (8 x 32)" in err and "elias.cluster.leaf_size" in err and not (tmp_path / "o" / layout.WEIGHTS).exists()


# --------------------------------------------------------------------------- no read-back per step (issue 36)


def _old_parents(m, labels):
    """The value-dependent Eq. 3 lookup the fixed-shape one replaced (kept as the reference)."""
    n, dev = labels.numel(), labels.device
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    start = m.lab_ptr[labels]
    cnt = m.lab_ptr[labels + 1] - start
    total = int(cnt.sum())
    if total == 0:
        return torch.full((n,), -1, dtype=torch.long, device=dev)
    seg = torch.repeat_interleave(torch.arange(n, device=dev), cnt)
    offs = torch.arange(total, device=dev) - (torch.cumsum(cnt, 0) - cnt)[seg]
    ent = m.lab_ent[start[seg] + offs]
    val = m.A_value.detach().reshape(-1)[ent].float()
    best = torch.full((n,), -math.inf, device=dev).scatter_reduce(0, seg, val, "amax", include_self=True)
    pos = torch.where(val == best[seg], torch.arange(total, device=dev), torch.full_like(seg, total))
    first = torch.full((n,), total, dtype=torch.long, device=dev).scatter_reduce(0, seg, pos, "amin")
    return torch.where(first < total, ent[first.clamp(max=total - 1)] // m.kappa, torch.full_like(first, -1))


def _old_shortlist(m, emb, pos_rows=None, pos_labels=None, b=None, K=None, max_pos=None, stable_ties=False):
    """The shortlist before it had fixed shapes (unique over the paths' keys, a grid as wide as the
    most candidates, top-k), kept as the reference.  ``stable_ties``: the top-K cut by a stable sort
    (ties: lower label id), the new rule; the old top-k left ties to its implementation."""
    B, dev, L = emb.shape[0], emb.device, m.n_labels
    b = min(int(b or m.b), m.n_clusters)
    K = min(int(K or m.K), L)
    logits_c, s = m.cluster_scores(emb)
    top = torch.topk(logits_c, b, dim=1).indices
    clusters, cvalid = top, torch.ones_like(top, dtype=torch.bool)
    training = pos_rows is not None
    if training:
        pos_rows, pos_labels = pos_rows.long(), pos_labels.long()
        n_pos = torch.bincount(pos_rows, minlength=B)
        if pos_labels.numel():
            par = _old_parents(m, pos_labels)
            starts = torch.cumsum(n_pos, 0) - n_pos
            col = torch.arange(pos_rows.numel(), device=dev) - starts[pos_rows]
            extra = torch.full((B, int(n_pos.max())), -1, dtype=torch.long, device=dev)
            extra[pos_rows, col] = par
            clusters = torch.cat([top, extra.clamp(min=0)], 1)
            cvalid = torch.cat([cvalid, extra >= 0], 1)
    lab = m.A_index[clusters]
    path = s.gather(1, clusters).unsqueeze(-1) * m.edge_scores(clusters)
    keep = (lab >= 0) & cvalid.unsqueeze(-1)
    ex = torch.arange(B, device=dev).view(B, 1, 1).expand_as(lab)
    keys, vals = (ex * L + lab)[keep], path[keep]
    uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
    yh_u = torch.zeros(uniq.numel(), dtype=vals.dtype, device=dev).scatter_reduce(0, inv, vals, "amax",
                                                                                   include_self=False)
    ex_u, lab_u = uniq // L, uniq % L
    sel, is_pos_u = yh_u.detach(), None
    if training:
        pkeys = torch.sort(pos_rows * L + pos_labels).values
        if pkeys.numel():
            j = torch.searchsorted(pkeys, uniq).clamp(max=pkeys.numel() - 1)
            is_pos_u = pkeys[j] == uniq
        else:
            is_pos_u = torch.zeros_like(uniq, dtype=torch.bool)
        sel = sel + 2.0 * is_pos_u
    counts = torch.bincount(ex_u, minlength=B)
    W = max(int(counts.max()) if counts.numel() else 0, 1)
    col = torch.arange(uniq.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[ex_u]
    grid = torch.full((B, W), -math.inf, device=dev)
    grid[ex_u, col] = sel.float()
    flat = torch.full((B, W), -1, dtype=torch.long, device=dev)
    flat[ex_u, col] = torch.arange(uniq.numel(), device=dev)
    k = min(K, W)
    if stable_ties:
        order = torch.sort(grid, dim=1, descending=True, stable=True).indices[:, :k]
    else:
        order = torch.topk(grid, k, dim=1).indices
    chosen = flat.gather(1, order)
    valid = chosen >= 0
    c0 = chosen.clamp(min=0)
    if uniq.numel() == 0:
        labels, yhat = torch.full((B, k), -1, dtype=torch.long, device=dev), torch.zeros(B, k, device=dev)
    else:
        labels, yhat = torch.where(valid, lab_u[c0], torch.full_like(c0, -1)), yh_u[c0] * valid
    if k < K:
        labels = torch.nn.functional.pad(labels, (0, K - k), value=-1)
        yhat = torch.nn.functional.pad(yhat, (0, K - k), value=0.0)
    target = None
    if training:
        t = is_pos_u[c0] & (chosen >= 0) if uniq.numel() else torch.zeros_like(chosen, dtype=torch.bool)
        target = torch.nn.functional.pad(t, (0, K - k), value=False) if k < K else t
    lab0 = labels.clamp(min=0)
    z = torch.bmm(m.wl[lab0].to(emb.dtype), emb.unsqueeze(-1)).squeeze(-1).float()
    if m.wl_bias is not None:
        z = z + m.wl_bias[lab0].float()
    return elias.Shortlist(labels, yhat, torch.sigmoid(z) * yhat, z, target, n_pos if training else None)


def _random_index_model(stage, C=6, L=30, kappa=7, D=5, seed=0, **kw):
    g = np.random.default_rng(seed)
    if stage == 1:
        index, value = elias.adjacency_from_assignment(g.integers(0, C, L), C)
        kappa = index.shape[1]
    else:
        index = np.stack([g.choice(L, kappa, replace=False) for _ in range(C)])
        index[0, -2:] = -1                                              # a short row
        value = g.normal(size=(C, kappa)).astype(np.float32)
        value[1, 0] = value[2, 0] = 9.0                                  # a tie between rows (Eq. 3: lower c wins)
        index[2, 0] = index[1, 0]
    m = elias.EliasModel(None, C, L, kappa, dim=D, fixed_edges=stage == 1, wl_bias=True, **kw)
    m.set_adjacency(index, value)
    torch.manual_seed(seed)
    with torch.no_grad():
        m.Wc.normal_()
        m.wl.normal_()
    return m


@pytest.mark.parametrize("stage", [1, 2])
def test_fixed_shape_shortlist_matches_the_value_dependent_one(stage):
    """The fixed-shape shortlist (sorts, scatters and a padded parent lookup; nothing read from the
    device) gives the old one's labels, scores, targets and gradients, bit for bit, once the top-K cut
    breaks ties the same way (lower label id); without ties (stage 2's learned edges) it is the old
    top-k's cut too.  Stage 1's fixed edges tie every label of a cluster: there the old top-k chose
    among them by its implementation."""
    from test_neural import HostReads

    m = _random_index_model(stage, alpha=1.0, beta=1.0, b=2, K=6)    # no clamp at 1: no ties in stage 2
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(4, 5, generator=g)
    rows, labels = torch.tensor([0, 0, 0, 2, 3, 3]), torch.tensor([1, 7, 20, 4, 29, 5])
    assert m.parents(labels).tolist() == _old_parents(m, labels).tolist()
    assert m.parents(torch.arange(m.n_labels)).tolist() == _old_parents(m, torch.arange(m.n_labels)).tolist()
    refs = [(True, {})] + ([(False, {})] if stage == 2 else []) + [(True, {"K": 30}), (True, {"b": 6, "K": 30})]
    for stable, kw in refs:
        for training in (True, False):
            args = (rows, labels) if training else ()
            grads = []
            for fn in (lambda: m._shortlist(emb, *args, max_pos=3 if training else None, **kw),
                       lambda: _old_shortlist(m, emb, *args, stable_ties=stable, **kw)):
                m.zero_grad()
                with HostReads() as reads:
                    out = fn()
                (out.p.sum() + out.yhat.sum() * (out.target is not None)).backward()
                grads.append((out, reads.ops, [None if q.grad is None else q.grad.clone() for q in m.parameters()]))
            (new, new_reads, g_new), (old, _, g_old) = grads
            assert new_reads == [], new_reads                  # no size or value read from the device
            for a, b_ in zip(new, old):
                assert (a is None) == (b_ is None) and (a is None or torch.equal(a, b_)), (stable, kw, training)
            for a, b_ in zip(g_new, g_old):
                assert (a is None) == (b_ is None) and (a is None or torch.equal(a, b_))
    # max_pos left out: read from the device (callers outside the trainer), the same result
    torch.testing.assert_close(m._shortlist(emb, rows, labels).p, m._shortlist(emb, rows, labels, max_pos=3).p,
                               rtol=0, atol=0)


def test_decay_touched_rows_by_mask_or_ids_is_the_old_row_decay():
    class Tr:
        optimizer = type("O", (), {"param_groups": [{"group": "wl", "lr": 0.3}]})()

    wl = torch.randn(6, 3)
    ref = wl.clone()
    r = torch.tensor([4, 1, 4, 0])
    ref[torch.unique(r)] *= 1.0 - 0.3 * 0.1                    # the old decay
    by_ids, by_mask = wl.clone(), wl.clone()
    elias.decay_touched_rows(by_ids, r, Tr, 0.1)
    mask = elias_train.mark_touched(torch.zeros(7, dtype=torch.bool), torch.tensor([[4, 1, -1], [4, 0, -1]]))
    assert mask.tolist() == [True, True, False, False, True, False, True]     # -1 marks the spare entry
    elias.decay_touched_rows(by_mask, mask[:6], Tr, 0.1)
    assert torch.equal(by_ids, ref) and torch.equal(by_mask, ref)


class _NoHostCopies:
    """Counts ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` and ``bool()`` on tensors outside the
    trainer's log-interval reduction (``Trainer._reduce_logs``): on CUDA each is a wait for the device."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch):
        import sys

        self.calls: list[str] = []
        self.on = False
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def wrapped(t, *a, _real=real, _name=name, **k):
                if self.on:
                    f, inside = sys._getframe(1), False
                    while f is not None:
                        inside = inside or f.f_code.co_name == "_reduce_logs"
                        f = f.f_back
                    if not inside:
                        self.calls.append(_name)
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.mark.parametrize("stage", [1, 2])
def test_training_steps_read_nothing_back_and_match_the_old_path(tiny, tmp_path, monkeypatch, stage):
    """ELIAS's steps (shortlist, Eq. 3's parents, the loss, W_L's touched-row decay, the k-step W_L
    accumulator) make the host wait for the device only at the log lines: nothing in between here.
    The weights after the steps equal, bit for bit, those of the old value-dependent shortlist (kept
    in this file) with the same tie rule."""
    from test_neural import HostReads
    from xmc_steps import trainer as trainer_mod

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    ids, lengths, _ = toy_tokens(24, 12, 3)
    L, C = 20, 4
    g = np.random.default_rng(stage)
    Y = sp.csr_matrix((g.random((24, L)) < 0.12).astype(np.float32))
    p = elias.EliasParams(encoder=tiny, train=_train(steps=6, batch_size=8, warmup_steps=1, checkpoint_every=0,
                                                     log_every=3, weight_decay=0.1),
                          eval_every=0, device="cpu", b=2, K=6, lr_clf=0.05, lr_A=0.05,
                          wl_update_every=2).resolved(stage, 24, L, C)
    if stage == 1:
        index, value = elias.adjacency_from_assignment(np.arange(L) % C, C)
    else:
        index = np.stack([g.choice(L, p.kappa, replace=False) for _ in range(C)])
        value = g.random((C, p.kappa)).astype(np.float32)

    def run(shortlist=None):
        m = elias.build_model(p, C, L, index.shape[1], fixed_edges=stage == 1)
        m.set_adjacency(index, value)
        if shortlist is not None:
            m._shortlist = shortlist.__get__(m)
        seen = []
        elias.train_elias(m, neural.TokenData(ids, lengths), Y, p, None, on_step=lambda s, logs: seen.append(s))
        return m, seen

    reads, copies = HostReads(), _NoHostCopies(monkeypatch)
    real_fit, real_encode = trainer_mod.Trainer.fit, elias.EliasModel.encode

    def paused(fn):
        def inner(*a, **k):
            reads.paused, copies.on = True, False
            try:
                return fn(*a, **k)
            finally:
                reads.paused, copies.on = False, True
        return inner

    def fit(tr, *a, **k):
        # AdamW's CPU loop reads its step counts (the fused CUDA one does not; as in test_neural), and the
        # encoder's transformers mask builder checks for padding on the host: neither is ELIAS's
        tr.optimizer.step = paused(tr.optimizer.step)
        tr.optimizer.step._wrapped_by_lr_sched = True
        copies.on = True
        try:
            with reads:
                return real_fit(tr, *a, **k)
        finally:
            copies.on = False

    monkeypatch.setattr(trainer_mod.Trainer, "fit", fit)
    monkeypatch.setattr(elias.EliasModel, "encode", paused(real_encode))
    new, seen = run()
    assert seen == [3, 6]
    assert reads.ops == [] and copies.calls == [], (reads.ops, copies.calls)
    monkeypatch.setattr(trainer_mod.Trainer, "fit", real_fit)
    old, _ = run(lambda self, *a, **k: _old_shortlist(self, *a, **{**k, "stable_ties": True}))
    for k, v in new.state_dict().items():
        assert torch.equal(v, old.state_dict()[k]), k
