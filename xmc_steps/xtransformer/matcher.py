"""X-Transformer's neural matcher (§3.3): :class:`MatcherModel` (encoder + bias-free head over ``K``
clusters), Eq. 3's loss, the least-squares heads (start and re-fit), training (:func:`train_matcher`),
the cluster scores (``head`` and ``head+linear``), :func:`finish_matcher` (re-fit, scorers, guard)
and :func:`load_matcher`.  The matcher's prediction (:class:`PredictParams`, saved in ``matcher.json``'s
``predict``): :func:`embed_texts` and :func:`top_clusters`, what the end-of-training pass and serving
(:func:`predict_matcher`) both call.  The readings and the measurements: docs/methods/xtransformer.md;
the stage: :mod:`xmc_steps.stages.matcher`."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from .. import io, neural, resources
from ..errors import StageError
from ..layout import GUARD
from ..linear_start import least_squares_bytes, least_squares_head
from ..negatives import binarize
from ..neural import Amp
from ..neural_stage import load_trained, sharded_embed
from ..params import bounded
from ..prediction import SavedPredictParams
from ..search import SCORE_FLOOR, matcher_scores, topk_per_row, transform
from ..trainer import Trainer, digest, list_checkpoints, param_groups
from .guard import GuardReport, check_matcher, cluster_recall, guard_width, top1_precision
from .params import MatcherParams

FORMAT = "xmc-matcher-v1"


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



@dataclass
class PredictParams(SavedPredictParams):
    """The matcher's prediction (defaults :class:`MatcherParams`'s): the encoder pass's batch and autocast, the
    clusters kept.  Saved in ``matcher.json``'s ``predict`` by the training run; a matcher saved before falls
    back to its training ``params`` (the same keys)."""

    topb: int = bounded(MatcherParams.topb, ge=1)
    eval_batch_size: int = bounded(MatcherParams.eval_batch_size, ge=1)
    amp: Amp = MatcherParams.amp

    _what = "matcher prediction parameter"


def embed_texts(model: MatcherModel, tokens: neural.TokenData, p: PredictParams, device: torch.device | str,
                progress: Callable[..., Any] | None = None) -> tuple[np.ndarray | None, float]:
    """``(phi(x), seconds)``: the matcher's encoder pass over ``tokens`` (``p.eval_batch_size``, ``p.amp``), split
    over the ranks under torchrun (:func:`~xmc_steps.neural_stage.sharded_embed`; rank 0 gets every row, the
    others ``None``).  The end-of-training pass's and serving's."""
    return sharded_embed(model.encoder, tokens, p.eval_batch_size, device, p.amp, progress=progress)


def top_clusters(emb: np.ndarray, W: np.ndarray, topb: int, scorer: str, linear_top: sp.spmatrix | None,
                 device: torch.device | str = "cpu") -> sp.csr_matrix:
    """The top-``topb`` clusters of the embeddings by the head ``W`` and the ``scorer`` the guard chose
    (``head``: :func:`topb_from_emb`; ``head+linear``: :func:`head_linear_topb` with the linear tree's
    ``linear_top``).  The end-of-training pass's (``clusters_*.npz``) and serving's."""
    with torch.no_grad():
        if scorer == "head+linear":
            return head_linear_topb(emb, W, linear_top, topb, device)
        return topb_from_emb(emb, W, topb, device)


def predict_matcher(model_dir: str | os.PathLike, tokens: neural.TokenData,
                    params: Mapping[str, Any] | PredictParams | None = None, device: torch.device | str = "auto",
                    model: MatcherModel | None = None, linear_top: sp.spmatrix | None = None) -> dict[str, Any]:
    """A trained matcher's prediction for new texts, as its stage's end-of-training pass writes the test split's:
    ``emb`` (:func:`embed_texts`), ``clusters`` (:func:`top_clusters` by the scorer in ``guard.json``; a
    ``head+linear`` matcher needs the linear tree's ``linear_top``), the head ``W`` and the ``params`` used (the
    saved ones overridden by ``params``).  ``model``: the folder's :func:`load_matcher` when the caller has it."""
    folder = Path(model_dir)
    p = PredictParams.effective(io.read_json(folder / "matcher.json"), params)
    dev = neural.resolve_device(device)
    if model is None:
        model = load_matcher(folder, dev)
    emb, _ = embed_texts(model, tokens, p, dev)
    W = model.head.weight.detach().float().cpu().numpy()
    scorer = io.read_json(folder / GUARD).get("scorer", "head")
    return {"emb": emb, "clusters": top_clusters(emb, W, p.topb, scorer, linear_top, dev), "head": W, "params": p,
            "scorer": scorer}


def evaluate_clusters(model: MatcherModel, tokens: neural.TokenData, M: sp.spmatrix, b: int, batch_size: int = 128,
                      device: torch.device | str = "auto", amp: str = "auto") -> dict[str, float]:
    """``cluster_p_at_1`` and ``cluster_recall_at_b`` of the model's ranking of the clusters."""
    top, _ = predict_clusters(model, tokens, b, batch_size, device, amp, progress=None)
    return {"cluster_p_at_1": top1_precision(top, M), "cluster_recall_at_b": cluster_recall(top, M)}



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
            # with several processes rank 0 alone evaluates, on the whole subset (the others wait at the next step)
            if (step % eval_every and step != tp.steps) or not trainer.is_main:
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
    if eval_fn is not None and trainer.step == 0 and on_step is not None and trainer.is_main:
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


def load_cluster_assignment(path: str | os.PathLike) -> sp.csr_matrix:
    """``C`` (L x K, 0/1) from a CSR ``.npz`` or from a cluster tree of :mod:`xmc_steps.cluster_tree`
    (whose finest cluster level is then the flat assignment)."""
    from ..cluster_tree import FORMAT as TREE_FORMAT
    from ..cluster_tree import ClusterTree

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
