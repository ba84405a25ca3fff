"""The dual encoder's training driver on the shared :class:`~xmc_steps.trainer.Trainer`: NGAME's batches,
the label pool (the batch texts' positives plus the mined hard negatives), the label embeddings
re-encoded every ``label_refresh_every`` epochs for the mining, and the validation curve (docs/methods/dual-encoder.md)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from .. import distributed, metrics, neural
from ..baselines import most_frequent_top
from ..guard import Advice
from ..neural_stage import valid_subset
from ..search import topk_per_row
from ..trainer import Trainer, digest, param_groups
from .batching import balanced_clusters, cluster_order
from .loss import pool_loss
from .model import DualEncoder, build_label_index, encode, predict, search_labels
from .params import DualEncoderParams


class _TrainBox(nn.Module):
    """What a checkpoint holds besides the encoder: NGAME's clusters (``clusters``, from the texts' embeddings
    at the start of epoch ``cluster_epoch``; -1: none yet), the label embeddings the mining searches
    (``label_emb``, fp16, encoded after step ``label_step``; -1: none yet) and the pre-trained start's valid
    figures (``start_valid``: recall@w, P@1, P@5; -1: not measured)."""

    def __init__(self, model: DualEncoder, n_train: int, n_labels: int, clustered: bool, mining: bool):
        super().__init__()
        self.dual = model
        self.register_buffer("clusters", torch.full((n_train if clustered else 0,), -1, dtype=torch.int64))
        self.register_buffer("cluster_epoch", torch.full((), -1, dtype=torch.int64))
        self.register_buffer("label_emb", torch.zeros((n_labels if mining else 0, model.dim), dtype=torch.float16))
        self.register_buffer("label_step", torch.full((), -1, dtype=torch.int64))
        self.register_buffer("start_valid", torch.full((3,), -1.0, dtype=torch.float64))


class _Trainer(Trainer):
    """The shared trainer with an epoch's order given by ``order_fn(epoch)`` (NGAME's clusters) instead of a
    random permutation, when set."""

    order_fn: Callable[[int], np.ndarray] | None = None

    def _order(self, epoch: int, n: int) -> np.ndarray:
        if self.order_fn is None:
            return super()._order(epoch, n)
        order = self._order_cache.get((epoch, n))
        if order is None:
            order = np.asarray(self.order_fn(epoch), dtype=np.int64)
            if len(order) != n:
                raise ValueError(f"an epoch's order has {len(order)} texts, expected {n}")
            self._order_cache = {k: v for k, v in self._order_cache.items() if k[0] >= epoch - 1}
            self._order_cache[(epoch, n)] = order
        return order


def positive_pairs(Y: sp.csr_matrix, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch's positives as (row in the batch, label) pairs."""
    sub = Y[idx]
    return (np.repeat(np.arange(len(idx), dtype=np.int64), np.diff(sub.indptr)), sub.indices.astype(np.int64))


def mine_negatives(cand: np.ndarray, rows: np.ndarray, labels: np.ndarray, n_labels: int, depth: int, per_text: int,
                   rand: np.ndarray) -> np.ndarray:
    """The mined negatives of a batch (flat label ids): per text, ``per_text`` labels drawn uniformly (by the
    keys ``rand``, ``B x k`` in [0, 1)) from the first ``depth`` of its nearest labels ``cand`` (``B x k``,
    nearest first, ``-1`` padding) that are not among its positives (``rows, labels`` pairs)."""
    B, k = cand.shape
    if B == 0 or per_text <= 0:
        return np.zeros(0, dtype=np.int64)
    L = int(n_labels)
    pos_keys = np.sort(rows * L + labels)
    keys = np.arange(B, dtype=np.int64)[:, None] * L + np.maximum(cand, 0)
    j = np.searchsorted(pos_keys, keys).clip(max=max(len(pos_keys) - 1, 0))
    is_pos = (pos_keys[j] == keys) if len(pos_keys) else np.zeros_like(keys, dtype=bool)
    ok = (cand >= 0) & ~is_pos
    ok &= np.cumsum(ok, axis=1) <= int(depth)
    r = np.where(ok, rand, 2.0)
    pick = np.argsort(r, axis=1, kind="stable")[:, :per_text]
    chosen = np.take_along_axis(cand, pick, 1)
    return chosen[np.take_along_axis(r, pick, 1) < 2.0].astype(np.int64)


def pool_of(pos_labels: np.ndarray, mined: np.ndarray | None = None) -> np.ndarray:
    """The batch's label pool: its texts' positives and the mined negatives, each once (sorted)."""
    parts = [pos_labels] if mined is None else [pos_labels, mined]
    return np.unique(np.concatenate(parts).astype(np.int64))


def positive_mask(pool: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``B x P`` bool: the pool's label is a positive of the text (every positive of a batch text is in the pool)."""
    pos = torch.zeros((n_rows, pool.numel()), dtype=torch.bool, device=pool.device)
    if labels.numel():
        pos[rows, torch.searchsorted(pool, labels)] = True
    return pos


def width_metrics(scores: sp.csr_matrix, Y: sp.spmatrix, width: int) -> dict[str, float]:
    """``recall`` (R@``width``), ``p_at_1``, ``p_at_5`` of a score matrix (fractions)."""
    p = metrics.precision(scores, Y, 5)
    return {"recall": float(metrics.recall(scores, Y, width)[-1]), "p_at_1": float(p[0]), "p_at_5": float(p[4])}


def frequency_prior(Y_train: sp.spmatrix, Y: sp.spmatrix, width: int) -> dict[str, float]:
    """:func:`width_metrics` of the most frequent training labels, the same for every text (ranked by count)."""
    top = most_frequent_top(Y_train, Y.shape[0], width)
    return width_metrics(top, Y, width)


#: what a failed guard (:mod:`xmc_steps.guard`: recall@w against the most frequent labels and the linear
#: tree's index at the same budget) tells the user
GUARD_ADVICE = Advice("the dual encoder",
                      "Train longer or faster (dual_encoder.train.epochs, dual_encoder.train.lr), give it harder "
                      "negatives (dual_encoder.hard_negatives, dual_encoder.batching: ngame, dual_encoder.cluster_size), "
                      "check the label texts, the encoder and max_length", "dual_encoder",
                      failed="retrieves no better than a trivial index")


def valid_metrics(model: DualEncoder, tokens: neural.TokenData, Y: sp.spmatrix, label_emb: np.ndarray | None,
                  params: DualEncoderParams, width: int, device: torch.device | str,
                  progress: Callable[..., Any] | None = None, index: Any = None
                  ) -> tuple[dict[str, float], sp.csr_matrix]:
    """The model's :func:`width_metrics` on ``tokens`` against the labels (``index``, or one built over
    ``label_emb``), and its top-``width`` predictions."""
    r = predict(model, tokens, label_emb, max(width, 5), params.eval_batch_size, device, params.amp, params.search,
                params.exact_max_labels, progress, index=index)
    top = topk_per_row(r["scores"], width)
    return width_metrics(r["scores"], Y, width), top


def train_dual_encoder(model: DualEncoder, tokens: neural.TokenData, Y: sp.spmatrix, label_tokens: neural.TokenData,
                       params: DualEncoderParams, ckpt_dir: str | os.PathLike | None, width: int,
                       log: logging.Logger | None = None,
                       on_step: Callable[[int, dict[str, float]], Any] | None = None,
                       valid: tuple[neural.TokenData, sp.spmatrix] | None = None,
                       fingerprint: Mapping[str, Any] | None = None) -> Trainer:
    """Train ``model`` (resumes from ``ckpt_dir``); ``params`` resolved (:meth:`DualEncoderParams.resolved`),
    ``width`` the validation recall's cut-off.  Validation points (``valid_recall``, ``valid_p_at_1``,
    ``valid_p_at_5`` to ``on_step``) every ``eval_every`` steps on a fixed subset of ``valid`` (and, on a fresh
    run, at step 0: the pre-trained start, kept as ``trainer.start_valid``)."""
    log = log or neural._default_log
    tp = params.train
    if not tp.is_resolved or params.eval_every is None or params.mine_depth is None or params.cluster_size is None:
        raise ValueError("resolve the parameters first (DualEncoderParams.resolved)")
    Y = sp.csr_matrix(Y, dtype=np.float32)
    Y.sort_indices()
    n, L = len(tokens), len(label_tokens)
    if Y.shape != (n, L):
        raise ValueError(f"Y has shape {Y.shape}, expected ({n}, {L}) (training texts x label texts)")
    clustered = params.batching == "ngame" and 1 < params.cluster_size < n
    mining = params.hard_negatives > 0
    box = _TrainBox(model, n, L, clustered, mining)
    groups = param_groups({"encoder": (model.encoder, tp.lr)}, tp.weight_decay)
    fp = {"encoder": params.encoder, "pooling": params.pooling, "loss": params.loss, "temperature": params.temperature,
          "margin": params.margin, "triplet_negatives": params.triplet_negatives, "batching": params.batching,
          "cluster_size": params.cluster_size, "refresh_every": params.refresh_every,
          "hard_negatives": params.hard_negatives, "mine_depth": params.mine_depth,
          "label_refresh_every": params.label_refresh_every,
          "data": digest(tokens.input_ids, tokens.lengths, Y.indptr, Y.indices),
          "label_tokens": digest(label_tokens.input_ids, label_tokens.lengths)}
    fp.update(dict(fingerprint or {}))
    trainer = _Trainer(box, groups, tp, ckpt_dir, log=log, on_step=on_step, fingerprint=fp, lengths=tokens.lengths,
                       device=params.device, amp=params.amp)
    device = trainer.device
    vt, vY = valid_subset(valid if params.eval_every > 0 else None, params.eval_max_docs, tp.seed)
    refresh_steps = params.label_refresh_steps(n)

    cache: dict[str, Any] = {"step": None, "emb": None}

    def labels_at(step: int) -> np.ndarray:
        """Every label's embedding by the current weights (once per step, shared by the mining and validation)."""
        if cache["step"] != step:
            t0 = time.perf_counter()
            cache["emb"] = encode(model, label_tokens, params.eval_batch_size, device, params.amp)
            cache["step"] = step
            log.debug("label embeddings after step %d in %.1f s", step, time.perf_counter() - t0)
        return cache["emb"]

    def refresh_labels(step: int) -> None:
        box.label_emb.copy_(torch.from_numpy(labels_at(step)).to(box.label_emb.device, torch.float16))
        box.label_step.fill_(step)

    index: dict[str, Any] = {"step": None, "index": None}

    def mining_index() -> Any:
        """The search index over the kept label embeddings (rebuilt when they were refreshed or resumed)."""
        s = int(box.label_step)
        if index["step"] != s:
            emb = box.label_emb.float().cpu().numpy()
            index.update(step=s, index=build_label_index(emb, params.search, params.exact_max_labels, tp.seed))
        return index["index"]

    def evaluate(step: int) -> dict[str, float]:
        # exact search: the curve's points are the model's own, and a few thousand texts search L labels faster
        # than an HNSW graph over them is built
        exact = build_label_index(labels_at(step), "exact")
        m, _ = valid_metrics(model, vt, vY, None, params, width, device, index=exact)
        log.info("step %d: valid recall@%d %.4f, P@1 %.4f, P@5 %.4f (%d documents)", step, width, m["recall"],
                 m["p_at_1"], m["p_at_5"], len(vt))
        return {"valid_recall": m["recall"], "valid_p_at_1": m["p_at_1"], "valid_p_at_5": m["p_at_5"]}

    fresh = trainer.step == 0 and trainer.resumed_from is None
    if fresh and vt is not None and trainer.is_main:        # the curve: rank 0's, on the whole validation subset
        m0 = evaluate(0)
        box.start_valid.copy_(torch.tensor([m0["valid_recall"], m0["valid_p_at_1"], m0["valid_p_at_5"]],
                                           dtype=torch.float64))
        if on_step is not None:
            on_step(0, m0)
    if mining and int(box.label_step) < 0:
        refresh_labels(trainer.step)

    if clustered:
        def order_fn(epoch: int) -> np.ndarray:
            r = epoch - epoch % params.refresh_every              # the epoch whose start the clusters are of
            if int(box.cluster_epoch) != r:
                t0 = time.perf_counter()
                cl = None
                if trainer.is_main:      # with several processes rank 0 clusters and every rank takes its clusters
                    emb = encode(model, tokens, params.eval_batch_size, device, params.amp)
                    cl = balanced_clusters(emb, params.cluster_size, seed=[tp.seed, r])
                cl = distributed.broadcast_object(cl)
                box.clusters.copy_(torch.from_numpy(cl).to(box.clusters.device))
                box.cluster_epoch.fill_(r)
                log.info("ngame: epoch %d's batches from %d clusters of <= %d texts (the training texts re-encoded "
                         "and clustered in %.1f s)", epoch, int(cl.max()) + 1, params.cluster_size,
                         time.perf_counter() - t0)
            return cluster_order(box.clusters.cpu().numpy(), tp.seed, epoch)

        trainer.order_fn = order_fn

    n_pos = np.diff(Y.indptr)

    def batch_fn(idx: np.ndarray) -> dict[str, Any]:
        # built ahead of its step (Trainer.fit's prefetch): nothing here may read the training state
        ids, mask = tokens.batch(idx)
        rows, labels = positive_pairs(Y, idx)
        b = {"ids": ids, "mask": mask, "rows": torch.from_numpy(rows), "labels": torch.from_numpy(labels),
             "rows_np": rows, "labels_np": labels, "max_pos": int(n_pos[idx].max()) if len(idx) else 0}
        if not mining:
            pool = pool_of(labels)
            b["pool"] = torch.from_numpy(pool)
            b["pool_ids"], b["pool_mask"] = label_tokens.batch(pool)
        return b

    def loss_fn(m: _TrainBox, b: Mapping[str, Any]):
        net = m.dual
        e = net(b["ids"], b["mask"])
        if mining:
            k = params.mine_depth + b["max_pos"]
            _, cand = search_labels(mining_index(), L, e.detach().cpu().numpy(), k)
            rand = torch.rand(cand.shape, dtype=torch.float64).numpy()      # the trainer's checkpointed generator
            mined = mine_negatives(cand, b["rows_np"], b["labels_np"], L, params.mine_depth, params.hard_negatives,
                                   rand)
            pool_np = pool_of(b["labels_np"], mined)
            pool = torch.from_numpy(pool_np).to(e.device)
            pids, pmask = label_tokens.batch(pool_np)
            pids, pmask = pids.to(e.device), pmask.to(e.device)
        else:
            pool, pids, pmask = b["pool"], b["pool_ids"], b["pool_mask"]
        le = net(pids, pmask)
        if trainer.dist:
            # every text against every label of the global batch: the ranks' pools gathered with their gradients
            pool, le = distributed.gather_union(pool, le)
        pos = positive_mask(pool, b["rows"], b["labels"], e.shape[0])
        with torch.autocast(e.device.type, enabled=False):      # the cosines in fp32 (logits = cos / temperature)
            cos = e.float() @ le.float().T
        loss = pool_loss(cos, pos, params.loss, params.temperature, params.margin, params.triplet_negatives)
        if trainer.dist:
            # the mean over the global batch's texts with a positive: this rank's sum over the global count
            # (times the world: DDP averages the ranks' gradients); a stand-in rank counts none
            has = (pos.any(1).sum() if trainer.rank_examples else pos.new_zeros(())).to(torch.float32)
            total = distributed.all_reduce_sum(has)
            loss = loss * has * trainer.world / total.clamp(min=1)
        return loss, {"pool": float(pool.numel())}

    def step_end(step: int) -> dict[str, float] | None:
        if mining and step % refresh_steps == 0 and step < tp.steps:
            refresh_labels(step)
        if vt is None or not trainer.is_main or (step % params.eval_every and step != tp.steps):
            return None
        return evaluate(step)

    trainer.fit(loss_fn, n, batch_fn, step_end=step_end, loss_scope="global")
    start = box.start_valid.tolist()
    trainer.start_valid = ({"recall": start[0], "p_at_1": start[1], "p_at_5": start[2]} if start[0] >= 0 else None)
    return trainer
