"""Training cases the data-parallel tests run twice: in one process, and as 2 processes under ``torchrun`` (gloo).

``python -m torch.distributed.run --nproc-per-node 2 tests/ddp_cases.py CASES ENCODER OUT`` trains each case of
``CASES`` (comma-separated) with the tiny test encoder (no dropout) and rank 0 writes its trained weights to
``OUT/<case>.npz``;
:func:`run` does the same in the calling process.  The cases use one global batch ``B`` whatever the number of
processes (each rank then trains on ``B / 2``).  A case ending in ``-wrong`` trains with a deliberately wrong
sharding (every rank takes the first part of the global batch), ``-nogather`` (the dual encoder) scores each
rank's texts against its own labels only: the tests must tell both apart from the right runs.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np

STEPS = 4


def _toy(n: int, length: int = 12, k: int = 3, seed: int = 0):
    from tiny_encoder import toy_tokens
    from xmc_steps import neural

    ids, lengths, cls = toy_tokens(n, length, k, seed)
    return neural.TokenData(ids, lengths), cls


def case_generic(encoder: str, ckpt: str | None):
    """A tiny encoder + linear head, BCE (a mean over the batch's examples), batch 8 x 2 accumulation over 21
    examples: the epochs' last micro-batch has 5 (3 + 2 on two ranks, weighted by their shares).  With
    ``DDP_CASES_SIGTERM_AT=k`` rank 1 sends itself SIGTERM after step ``k``; with ``DDP_CASES_KILL_AT=k`` it
    SIGKILLs itself there (after every step's checkpoint: ``DDP_CASES_CHECKPOINT_EVERY``, default none)."""
    import torch

    from xmc_steps import neural, trainer

    tokens, cls = _toy(21)
    neural.seed_everything(0)
    enc = neural.TextEncoder(encoder)
    model = torch.nn.ModuleDict({"enc": enc, "head": torch.nn.Linear(enc.dim, 3)})
    targets = torch.from_numpy(np.eye(3, dtype=np.float32)[cls])

    def batch_fn(idx):
        i, m = tokens.batch(idx)
        return i, m, targets[idx]

    def loss_fn(model, batch):
        i, m, t = batch
        out = model["head"](model["enc"](i, m))
        return torch.nn.functional.binary_cross_entropy_with_logits(out, t), {}

    params = trainer.TrainParams(steps=STEPS, batch_size=8, grad_accum=2, lr=1e-3, warmup_steps=1,
                                 checkpoint_every=int(os.environ.get("DDP_CASES_CHECKPOINT_EVERY", "0")),
                                 log_every=1, seed=0)
    groups = trainer.param_groups({"encoder": (model["enc"], 1e-3), "head": (model["head"], 1e-2)}, 0.01)
    tr = trainer.Trainer(model, groups, params, ckpt, device="cpu", amp="off")
    term_at = int(os.environ.get("DDP_CASES_SIGTERM_AT", "0"))
    kill_at = int(os.environ.get("DDP_CASES_KILL_AT", "0"))

    def step_end(step):                 # rank 1 alone gets SIGTERM: every rank must stop at one checkpoint
        if term_at and step == term_at and tr.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if kill_at and step == kill_at and tr.rank == 1:      # kill -9: no handler, no checkpoint of its own
            os.kill(os.getpid(), signal.SIGKILL)

    tr.fit(loss_fn, len(tokens), batch_fn, step_end=step_end)
    print(f"generic: rank {tr.rank} resumed from step {tr.resumed_from}", file=sys.stderr)
    return model


def case_matcher(encoder: str, ckpt: str | None):
    """X-Transformer's matcher (Eq. 3's squared hinge over K = 4 clusters, the least-squares head start),
    batch 6 over 20 documents, with validation points (rank 0's)."""
    import scipy.sparse as sp

    from xmc_steps.xtransformer.matcher import train_matcher

    tokens, cls = _toy(20)
    valid, vcls = _toy(8, seed=1)
    K = 4
    M = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), cls % K)), shape=(20, K))
    vM = sp.csr_matrix((np.ones(8, np.float32), (np.arange(8), vcls % K)), shape=(8, K))
    params = {"encoder": encoder, "device": "cpu", "amp": "off", "eval_every": 2, "head_init": "linear",
              "train": {"steps": STEPS, "batch_size": 6, "grad_accum": 1, "lr": 1e-3, "warmup_steps": 1,
                        "checkpoint_every": 0, "log_every": 1}}
    model, _ = train_matcher(tokens, M, params, ckpt, valid=(valid, vM))
    return model


def case_dual(encoder: str, ckpt: str | None):
    """The dual encoder: DEXML's decoupled softmax over the batch's label pool (the ranks' pools gathered with
    their gradients), NGAME's clustered batches (rank 0's clusters), batch 8 over 24 texts and 12 labels."""
    import scipy.sparse as sp

    from xmc_steps import neural
    from xmc_steps.dual_encoder.model import build_model
    from xmc_steps.dual_encoder.params import DualEncoderParams
    from xmc_steps.dual_encoder.train import train_dual_encoder

    tokens, cls = _toy(24, k=6)
    rng = np.random.default_rng(3)
    rows, cols = [], []
    for i in range(24):                      # each text: its class's label and 0-2 others
        labs = np.unique(np.concatenate([[cls[i]], rng.integers(6, 12, rng.integers(0, 3))]))
        rows += [i] * len(labs)
        cols += list(labs)
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(24, 12))
    lab_ids, lab_len, _ = __import__("tiny_encoder").toy_tokens(12, 6, 12, seed=5)
    labels = neural.TokenData(lab_ids, lab_len)
    params = DualEncoderParams.from_dict({
        "encoder": encoder, "pooling": "mean", "device": "cpu", "amp": "off", "eval_every": 0,
        "label_max_length": 6, "hard_negatives": 0, "batching": "ngame", "cluster_size": 2,
        "train": {"steps": STEPS, "batch_size": 8, "lr": 1e-3, "warmup_steps": 1, "checkpoint_every": 0,
                  "log_every": 1}}).resolved(24, 12)
    model = build_model(params)
    train_dual_encoder(model, tokens, Y, labels, params, ckpt, width=5)
    return model


def _elias(encoder: str, ckpt: str | None, stage: int):
    """ELIAS over 8 labels in 4 clusters, batch 8 over 20 documents: stage 1 (A fixed by the clusters, W_L's
    decay on the rows the global batch's shortlists touched, its first step frozen) or stage 2 (A learnt)."""
    import scipy.sparse as sp

    from xmc_steps import elias
    from xmc_steps.trainer import TrainParams

    tokens, cls = _toy(20, k=4)
    rng = np.random.default_rng(4)
    L = 8
    rows, cols = [], []
    for i in range(20):
        labs = np.unique([2 * cls[i], rng.integers(0, L)])
        rows += [i] * len(labs)
        cols += list(labs)
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(20, L))
    train = TrainParams(steps=STEPS, batch_size=8, warmup_steps=1, checkpoint_every=0, log_every=1, lr=None)
    p = elias.EliasParams(encoder=encoder, train=train, wl_delay_steps=1 if stage == 1 else 0, eval_every=2,
                          device="cpu", amp="off", swa_epochs=0.5).resolved(stage, 20, L, 4)
    index, value = elias.adjacency_from_assignment(np.repeat(np.arange(4), 2), 4)
    m = elias.build_model(p, 4, L, index.shape[1] if stage == 1 else L, fixed_edges=stage == 1)
    if stage == 1:
        m.set_adjacency(index, value)
    else:
        full = np.tile(np.arange(L), (4, 1))
        m.set_adjacency(full, np.where(full // 2 == np.arange(4)[:, None], 1.0, 0.1).astype(np.float32))
    valid = (_toy(6, k=4, seed=2)[0], Y[:6])
    elias.train_elias(m, tokens, Y, p, ckpt, valid=valid)
    return m


def case_elias1(encoder: str, ckpt: str | None):
    return _elias(encoder, ckpt, 1)


def case_elias2(encoder: str, ckpt: str | None):
    return _elias(encoder, ckpt, 2)


def _lightxml(encoder: str, ckpt: str | None, guided: bool, feature_loss: str = "mean", feature_weight: str = "fixed"):
    """LightXML over 8 labels in 4 clusters (dynamic negatives: L_d over each text's candidates, a mean over the
    global batch's real candidates), the least-squares start, batch 8 over 20 texts with validation points;
    ``guided``: GUDN's guide (``feature_loss``, ``feature_weight``, link guide) on label sequences."""
    import scipy.sparse as sp

    from xmc_steps import lightxml
    from xmc_steps.lightxml.train import train_lightxml
    from xmc_steps.trainer import TrainParams

    tokens, cls = _toy(20, k=4)
    rng = np.random.default_rng(6)
    rows, cols = [], []
    for i in range(20):
        labs = np.unique([2 * cls[i], rng.integers(0, 8), rng.integers(0, 8)])
        rows += [i] * len(labs)
        cols += list(labs)
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(20, 8))
    params = lightxml.LightXMLParams(encoder=encoder, last_k=2, topb=2, hidden=8, eval_every=2, device="cpu",
                                     amp="off", dropout=0.0, swa_start=0.5, head_init="linear",
                                     train=TrainParams(steps=STEPS, batch_size=8, lr=1e-3, warmup_steps=1,
                                                       checkpoint_every=0, log_every=1)).resolved(20)
    model = lightxml.build_model(params, 8, np.arange(8) // 2, 4)
    guide = None
    if guided:
        from xmc_steps import gudn

        seq, seq_len, _ = __import__("tiny_encoder").toy_tokens(20, 8, 4, seed=7)
        guide = gudn.GuideNetwork(gudn.GUDNParams(feature_loss=feature_loss, feature_weight=feature_weight),
                                  __import__("xmc_steps.neural", fromlist=["TokenData"]).TokenData(seq, seq_len))
    valid = (_toy(6, k=4, seed=2)[0], Y[:6])
    train_lightxml(model, tokens, Y, params, ckpt, valid=valid, guide=guide)
    return model


def case_lightxml(encoder: str, ckpt: str | None):
    return _lightxml(encoder, ckpt, False)


def case_gudn(encoder: str, ckpt: str | None):
    return _lightxml(encoder, ckpt, True)


def case_gudnrel(encoder: str, ckpt: str | None):
    """GUDN with the feature loss ``relative`` (a ratio of sums over the global batch about its centre: gathered
    across the ranks) weighted ``balanced`` (by the global batch's gradient norms)."""
    return _lightxml(encoder, ckpt, True, "relative", "balanced")


def case_rows(encoder: str, ckpt: str | None):
    """distributed.RowExchange on a 1000 x 16 head: rank r's gradient has 30 touched rows (a few shared with the
    other rank), then 900: the result is the mean of the ranks' dense gradients, through the touched rows
    (a payload below a dense all-reduce's) and then, the rows being too many, densely.  One process: that mean."""
    import torch

    from xmc_steps import distributed

    def grad(r: int, n: int) -> torch.Tensor:
        g = torch.zeros(1000, 16)
        rows = torch.from_numpy(np.random.default_rng([r, n]).choice(1000, n, replace=False))
        rows[:3] = torch.tensor([5, 6, 7])                  # rows both ranks touch
        g[rows] = torch.from_numpy(np.random.default_rng([r, n, 1]).normal(size=(n, 16)).astype(np.float32))
        return g

    out = torch.nn.Module()
    for name, n in (("sparse", 30), ("dense", 900)):
        if distributed.world_size() > 1:
            p = torch.nn.Parameter(torch.zeros(1000, 16))
            p.grad = grad(distributed.rank(), n)
            ex = distributed.RowExchange()
            ex.mode = "auto"                        # by the bytes, whatever the launch forces
            ex(p)
            dense_bytes = 1000 * 16 * 4             # a ring all-reduce's per-rank bytes at world 2
            assert ex.stats["dense"] == (name == "dense"), ex.stats
            assert ex.stats["rows"] == n
            if name == "sparse":
                assert ex.stats["bytes"] < dense_bytes / 5, ex.stats
            result = p.grad
        else:
            result = (grad(0, n) + grad(1, n)) / 2
        out.register_buffer(name, result)
    return out


CASES = {"generic": case_generic, "rows": case_rows, "matcher": case_matcher, "dual": case_dual, "elias1": case_elias1,
         "elias2": case_elias2, "lightxml": case_lightxml, "gudn": case_gudn, "gudnrel": case_gudnrel}


def run(case: str, encoder: str, out: str | None = None, ckpt: str | None = None) -> dict[str, np.ndarray]:
    """Train ``case`` in this process (or as this rank); its weights (rank 0 writes them to ``out``)."""
    import torch

    from xmc_steps import distributed

    torch.set_num_threads(1)
    name, _, fault = case.partition("-")
    saved = distributed.shard, distributed.gather_union
    if fault == "wrong":
        def wrong(idx, r=None, world=None):        # every rank trains on rank 0's part: half the batch, twice
            return saved[0](idx, 0, world)
        distributed.shard = wrong
    elif fault == "local":
        from xmc_steps.gudn import loss as gudn_loss

        saved_rel = gudn_loss.relative_global

        def per_rank(t, lab, real=1.0):            # each rank's own centre and spread, times its share
            return gudn_loss.feature_guide(t, lab, "relative") * real
        gudn_loss.relative_global = per_rank
    elif fault == "nogather":
        def local(ids, emb):                       # each rank's texts against its own labels only
            order = torch.argsort(ids)
            return ids[order], emb[order]
        distributed.gather_union = local
    elif fault:
        raise ValueError(f"unknown fault {fault!r}")
    try:
        model = CASES[name](encoder, ckpt)
    finally:
        distributed.shard, distributed.gather_union = saved
        if fault == "local":
            gudn_loss.relative_global = saved_rel
    weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if out is not None and distributed.is_main():
        np.savez(out, **weights)
    return weights


if __name__ == "__main__":
    # CASES (comma-separated) ENCODER OUT_FOLDER: each case's weights to OUT_FOLDER/<case>.npz
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ckpt = sys.argv[4] if len(sys.argv) > 4 else None     # generic's checkpoint folder (the SIGTERM test's)
    for c in sys.argv[1].split(","):
        run(c, sys.argv[2], str(Path(sys.argv[3]) / f"{c}.npz"), ckpt)
