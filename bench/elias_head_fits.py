#!/usr/bin/env python3
"""Is ELIAS stage 1's index limited by its cluster head W_C or by its encoder?

Stage 1's shortlist is the labels of the top clusters by ``W_C phi(x)`` (``A`` fixed to the balanced
partition), so with the encoder frozen its valid shortlist recall depends on ``W_C`` alone.  This
script embeds the training and validation texts once with a given encoder (the pre-trained one, or a
trained stage 1's), fits ``W_C`` on the training embeddings in several ways, and prints the valid
shortlist recall at the guard's width for each, measured as the stage's guard measures it
(:meth:`xmc_steps.elias.model.EliasModel.shortlist`, ``recall_of_top``):

* ``least_squares``: the stage's own start and re-fit (:func:`xmc_steps.elias.model.linear_start`:
  ``+-head_init_scale`` targets, ridge ``head_init_l2``);
* ``cross_entropy``: the multi-positive softmax cross-entropy over the clusters (each document's
  target mass split evenly over its clusters), AdamW on the frozen embeddings, ``--epochs`` passes at
  ``--lr`` decaying linearly to 0, batch 1,024: the fit Eq. 1's softmax asks for, run to the end;
* ``trained`` (with ``--model``): the stage's own trained ``W_C``.

When every fit lands at the same recall, the head is not what holds stage 1 back; its encoder is.

    python bench/elias_head_fits.py --tokens-dir results/D/features/tokens/minilm-64 \\
        --labels-train results/D/ingest/Y_train.npz --labels-valid results/D/ingest/Y_valid.npz \\
        --tree results/D/index/pifa-tfidf/tree-b16-l100-c64-s0.npz [--model .../stage1] [--threads 1]

stdout: one JSON line per fit (``fit``, ``epochs``, ``lr``, ``valid_shortlist_recall``,
``train_shortlist_recall`` on at most 5,000 training documents, ``seconds``); logs on stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import io, neural  # noqa: E402
from xmc_steps.baselines import recall_of_top  # noqa: E402
from xmc_steps.cluster_tree import ClusterTree  # noqa: E402
from xmc_steps.guard import guard_width  # noqa: E402
from xmc_steps.elias.model import (EliasModel, adjacency_from_assignment, linear_start, load_elias,  # noqa: E402
                                   partition_targets)
from xmc_steps.elias.params import EliasParams  # noqa: E402
from xmc_steps.neural_stage import load_tokens  # noqa: E402
from xmc_steps.search import padded_to_csr  # noqa: E402

log = logging.getLogger("elias_head_fits")


@torch.no_grad()
def shortlist_recall(model: EliasModel, emb: np.ndarray, Y: sp.spmatrix, width: int, batch: int = 512) -> float:
    """Recall of the top-``width`` shortlisted labels by ``yhat`` (the guard's measure) on embeddings."""
    n = len(emb)
    lab = np.full((n, width), -1, dtype=np.int64)
    val = np.zeros((n, width), dtype=np.float32)
    for a in range(0, n, batch):
        labels, yhat, _ = model.shortlist(torch.from_numpy(emb[a:a + batch]))
        v, i = torch.topk(yhat.float().masked_fill(labels < 0, -1.0), width, dim=1)
        lab[a:a + len(v)], val[a:a + len(v)] = labels.gather(1, i).numpy(), v.numpy()
    return recall_of_top(padded_to_csr(lab, val, model.n_labels), sp.csr_matrix(Y))


def cross_entropy_head(emb: np.ndarray, M: sp.spmatrix, epochs: int, lr: float, seed: int = 0,
                       batch: int = 1024) -> np.ndarray:
    """``W_C`` (C x D, no bias, as Eq. 1) minimising the mean over documents of
    ``-sum_c t_c log softmax(W_C e)_c`` with ``t`` the document's clusters, mass split evenly."""
    T = torch.from_numpy(sp.csr_matrix(M, dtype=np.float32).toarray())
    keep = T.sum(1) > 0
    T = T[keep] / T[keep].sum(1, keepdim=True)
    E = torch.from_numpy(np.asarray(emb, dtype=np.float32))[keep]
    W = torch.zeros(T.shape[1], E.shape[1], requires_grad=True)
    opt = torch.optim.AdamW([W], lr=lr, weight_decay=0.0)
    n = len(E)
    total = epochs * -(-n // batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / total))
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad():               # a caller inside no_grad still gets a fit
        for _ in range(epochs):
            perm = torch.randperm(n, generator=gen)
            for a in range(0, n, batch):
                i = perm[a:a + batch]
                loss = -(T[i] * torch.log_softmax(E[i] @ W.T, dim=1)).sum(1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return W.detach().numpy()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens-dir", required=True)
    ap.add_argument("--labels-train", required=True)
    ap.add_argument("--labels-valid", required=True)
    ap.add_argument("--tree", required=True, help="the stage-1 cluster tree (its finest level is the partition)")
    ap.add_argument("--model", help="a trained stage-1 folder: its encoder and W_C (default: the pre-trained encoder)")
    ap.add_argument("--encoder", default=EliasParams().encoder,
                    help="without --model: the pre-trained encoder (a packaged name or a folder)")
    ap.add_argument("--K", type=int, help="shortlist size (default: the model's, or the rule from the data)")
    ap.add_argument("--epochs", type=int, nargs="+", default=[10, 30])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-2, 3e-3])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    torch.set_num_threads(a.threads)
    tree = ClusterTree.load(a.tree)
    L, C = tree.n_labels, tree.n_clusters
    Y_train, Y_valid = io.load_csr(a.labels_train), io.load_csr(a.labels_valid)
    tokens = load_tokens(a.tokens_dir, ("train", "valid"))
    index, value = adjacency_from_assignment(tree.assignment(-1), C)
    if a.model:
        model = load_elias(a.model)
        if (model.n_labels, model.n_clusters) != (L, C):
            raise SystemExit(f"--model has L {model.n_labels}, C {model.n_clusters}; --tree has {L}, {C}")
        trained_wc = model.Wc.detach().clone()
    else:
        p = EliasParams(encoder=a.encoder).resolved(1, len(tokens["train"]), L, C)
        enc = neural.TextEncoder(p.encoder, pooling=p.pooling, last_k=p.last_k, pretrained=True)
        model = EliasModel(enc, C, L, index.shape[1], alpha=p.alpha, beta=p.beta, b=p.b, K=p.K, fixed_edges=True)
        model.set_adjacency(index, value)
        trained_wc = None
    if a.K:
        model.K = int(a.K)
    model.eval()
    width = guard_width(model.K, L)
    t0 = time.perf_counter()
    emb = {s: neural.embed(model.encoder, tokens[s], 256, "cpu", "auto", progress=log.info) for s in ("train", "valid")}
    log.info("embedded %d + %d texts in %.0f s; C %d, L %d, b %d, K %d, width %d", len(emb["train"]),
             len(emb["valid"]), time.perf_counter() - t0, C, L, model.b, model.K, width)
    sub = slice(0, min(5000, len(emb["train"])))

    def report(fit: str, seconds: float, **extra) -> None:
        row = {"fit": fit, **extra,
               "valid_shortlist_recall": round(shortlist_recall(model, emb["valid"], Y_valid, width), 4),
               "train_shortlist_recall": round(shortlist_recall(model, emb["train"][sub], Y_train[sub], width), 4),
               "seconds": round(seconds, 1)}
        print(json.dumps(row), flush=True)

    if trained_wc is not None:
        report("trained", 0.0)
    t = time.perf_counter()
    defaults = EliasParams()
    linear_start(model, emb["train"], Y_train, defaults.head_init_l2, defaults.head_init_scale)
    report("least_squares", time.perf_counter() - t)
    M = partition_targets(Y_train, model.A_index.numpy(), C)
    for ep in a.epochs:
        for lr in a.lr:
            t = time.perf_counter()
            W = cross_entropy_head(emb["train"], M, ep, lr)
            with torch.no_grad():
                model.Wc.copy_(torch.from_numpy(W))
            report("cross_entropy", time.perf_counter() - t, epochs=ep, lr=lr)


if __name__ == "__main__":
    main()
