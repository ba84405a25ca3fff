"""The ELIAS training driver: one stage of §3.4 on the shared :class:`~xmc_steps.trainer.Trainer`
(SWA, ``wl_decay``, ``wl_delay_steps``, ``wl_update_every``, periodic shortlist evaluation)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable, Mapping

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from .. import distributed, neural
from ..neural_stage import valid_subset
from ..trainer import Trainer, WeightAverage, digest, param_groups
from .loss import elias_loss
from ..guard import guard_width
from .model import EliasModel, predict, shortlist_metrics
from .params import EliasParams

# --------------------------------------------------------------------------- training


class _TrainBox(nn.Module):
    def __init__(self, model: EliasModel, swa: WeightAverage | None, wl_accumulator: "WlAccumulator | None" = None):
        super().__init__()
        self.elias = model
        self.swa = swa
        self.wl_accumulator = wl_accumulator


class WlAccumulator(nn.Module):
    """``wl_update_every: k`` (the paper's §4: "optimization update is performed at every k training
    steps, where k = 10" for ``W_L``): between updates, the gradients of ``wl`` (and ``wl_bias``) are
    summed here and removed from the parameters, so the optimiser skips them (no moment update, no
    weight decay); at every k-th step the parameters get the mean of the k steps' gradients and take
    one optimiser step at that step's learning rate.

    Readings: the mean, not the sum, as gradient accumulation over micro-batches averages them (Adam
    hardly sees the scale, but gradient clipping over all parameters would); the clipping norm counts
    ``W_L`` only at its update steps.  The sums are buffers, so a checkpoint between updates resumes
    exactly."""

    def __init__(self, model: EliasModel, every: int, total_steps: int):
        super().__init__()
        self.every, self.total_steps = int(every), int(total_steps)
        self.params = [model.wl] + ([model.wl_bias] if model.wl_bias is not None else [])
        for i, p in enumerate(self.params):
            self.register_buffer(f"sum{i}", torch.zeros_like(p, dtype=torch.float32))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def is_update_step(self, step: int) -> bool:
        """Every ``every``-th step, and the stage's last (no gradient is left unapplied)."""
        return step % self.every == 0 or step >= self.total_steps

    def __call__(self, step: int) -> None:  # Trainer.fit's grads_ready
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):       # W_L frozen (wl_delay_steps)
            return
        bufs = [getattr(self, f"sum{i}") for i in range(len(self.params))]
        if not self.is_update_step(step):
            for p, g, buf in zip(self.params, grads, bufs):
                if g is not None:
                    buf += g.float()
                    p.grad = None
            self.count += 1
            return
        n = self.count.to(torch.float32) + 1.0
        for p, g, buf in zip(self.params, grads, bufs):
            if g is not None:
                p.grad = ((buf + g.float()) / n).to(g.dtype)
            buf.zero_()
        self.count.zero_()



def decay_touched_rows(wl: torch.Tensor, rows: torch.Tensor, trainer: Trainer, weight_decay: float) -> None:
    """AdamW's decoupled decay ``w <- w (1 - lr wd)`` on the given rows of ``wl`` only, at the
    current learning rate of the optimiser's ``wl`` group (``wl_decay: touched``).  ``rows``: a
    boolean mask over the rows (what training keeps, :func:`mark_touched`) or row ids (repeats
    allowed).  One multiply of ``wl`` by a per-row factor (1 off the rows): no size is read from the
    device."""
    lr = next(g["lr"] for g in trainer.optimizer.param_groups if g.get("group") == "wl")
    with torch.no_grad():
        rows = rows.to(wl.device)
        if rows.dtype != torch.bool:
            rows = torch.zeros(wl.shape[0], dtype=torch.bool, device=wl.device).index_fill_(0, rows, True)
        factor = torch.where(rows[: wl.shape[0]], 1.0 - lr * weight_decay, 1.0).to(wl.dtype)
        wl.mul_(factor.unsqueeze(1))


def mark_touched(mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Set ``mask`` (``L + 1`` booleans, on the labels' device) at the shortlists' labels (``-1``, the
    padding, marks the spare last entry); returns it."""
    flat = labels.reshape(-1)
    return mask.index_fill_(0, torch.where(flat >= 0, flat, mask.numel() - 1), True)


def _set_wl_trainable(model: EliasModel, on: bool) -> None:
    model.wl.requires_grad_(on)
    if model.wl_bias is not None:
        model.wl_bias.requires_grad_(on)


def train_elias(model: EliasModel, tokens: neural.TokenData, Y: sp.spmatrix, params: EliasParams,
                ckpt_dir: str | os.PathLike | None, log: logging.Logger | None = None,
                on_step: Callable[[int, dict[str, float]], Any] | None = None,
                valid: tuple[neural.TokenData, sp.spmatrix] | None = None,
                fingerprint: Mapping[str, Any] | None = None) -> Trainer:
    """Train ``model`` (either stage: ``A_value`` is trained iff it requires grad) with §3.3's loss.

    ``params`` must be resolved (:meth:`EliasParams.resolved`).  Resumes from ``ckpt_dir``.
    Returns the :class:`Trainer`; the model ends on the training device, with
    the SWA average copied in when ``swa_epochs > 0``.
    """
    log = log or neural._default_log
    if not params.is_resolved:
        raise ValueError("resolve the parameters first (EliasParams.resolved)")
    # the classifier's rate as the loop's default rate: it is then part of the checkpoints' trajectory
    # (lr_encoder and lr_A are in the fingerprint), as it was before the recipe was composed
    tp = replace(params.train, lr=params.lr_clf)
    Y = sp.csr_matrix(Y, dtype=np.float32)
    Y.sort_indices()
    n = len(tokens)
    if Y.shape != (n, model.n_labels):
        raise ValueError(f"Y has shape {Y.shape}, expected ({n}, {model.n_labels})")
    decay_touched = params.wl_decay == "touched" and tp.weight_decay > 0
    named_clf = [("Wc", model.Wc)] + ([] if decay_touched else [("wl", model.wl)])
    if model.wl_bias is not None:
        named_clf.append(("wl_bias", model.wl_bias))
    groups = []
    if model.encoder is not None:
        groups += param_groups({"encoder": (model.encoder, params.lr_encoder)}, tp.weight_decay)
    groups += param_groups({"clf": (named_clf, params.lr_clf)}, tp.weight_decay)
    if decay_touched:       # no AdamW decay on W_L: step_end decays the rows each step touched
        groups += param_groups({"wl": ([("wl", model.wl)], params.lr_clf)}, 0.0)
    touched: dict[str, torch.Tensor] = {}   # "mask": the rows of W_L the steps since the last decay touched
    if model.A_value.requires_grad:
        groups += param_groups({"A": ([("A_value", model.A_value)], params.lr_A)}, params.weight_decay_A)
    swa, swa_start = None, tp.steps
    if params.swa_epochs > 0:
        swa_steps = max(1, round(params.swa_epochs * params.steps_per_epoch(n)))
        swa_start = max(0, tp.steps - swa_steps)
        swa = WeightAverage(model)
    wl_acc = WlAccumulator(model, params.wl_update_every, tp.steps) if params.wl_update_every > 1 else None
    box = _TrainBox(model, swa, wl_acc)
    fp = {"stage_model": model.describe(), "lr_encoder": params.lr_encoder, "lr_A": params.lr_A,
          "weight_decay_A": params.weight_decay_A, "lambda_": params.lambda_, "eps": params.eps,
          "wl_delay_steps": params.wl_delay_steps, "wl_decay": params.wl_decay,
          **({"wl_update_every": params.wl_update_every} if params.wl_update_every > 1 else {}), "swa_epochs": params.swa_epochs, "encoder": params.encoder,
          "pooling": params.pooling, "data": digest(tokens.input_ids, tokens.lengths, Y.indptr, Y.indices),
          "A": digest(model.A_index.cpu().numpy())}
    fp.update(dict(fingerprint or {}))
    # with several processes W_L's gradient goes through the rows the shortlists touched (distributed.RowExchange)
    head = [model.wl] + ([model.wl_bias] if model.wl_bias is not None else [])
    trainer = Trainer(box, groups, tp, ckpt_dir, log=log, on_step=on_step, fingerprint=fp,
                      lengths=tokens.lengths, device=params.device, amp=params.amp, row_sparse=head)
    _set_wl_trainable(model, trainer.step >= params.wl_delay_steps)

    vt, vY = valid_subset(valid if params.eval_every > 0 else None, params.eval_max_docs, tp.seed)
    width = guard_width(model.K, model.n_labels)

    def evaluate(step: int) -> dict[str, float]:
        r = predict(model, vt, topk=1, batch_size=params.eval_batch_size, device=trainer.device, amp=params.amp,
                    shortlist_topk=width, with_emb=False, progress=None,
                    yhat_power=1.0)   # the trained p (§3.2), as the loss; predict.yhat_power is prediction's
        m = shortlist_metrics(r["shortlist"], r["scores"], vY)
        log.info("step %d: valid shortlist recall@%d %.4f, P@1 %.4f (%d documents)", step, width,
                 m["shortlist_recall"], m["p_at_1"], len(vt))
        return {"valid_shortlist_recall": m["shortlist_recall"], "valid_p_at_1": m["p_at_1"]}

    def step_end(step: int) -> dict[str, float] | None:
        if touched and (wl_acc is None or wl_acc.is_update_step(step)):
            # the rows the global batch touched: every rank's shortlists (one all-reduce of L + 1 bytes)
            rows = distributed.all_reduce_any(touched.pop("mask")) if trainer.dist else touched.pop("mask")
            decay_touched_rows(model.wl, rows[: model.n_labels], trainer, tp.weight_decay)
        if step == params.wl_delay_steps:
            _set_wl_trainable(model, True)
        if swa is not None and step > swa_start:
            swa.update(model)
        # with several processes rank 0 alone evaluates, on the whole subset (the others wait at the next step)
        if vt is None or not trainer.is_main or (step % params.eval_every and step != tp.steps):
            return None
        return evaluate(step)

    def batch_fn(idx: np.ndarray):
        ids, mask = tokens.batch(idx)
        sub = Y[idx]
        n_pos = np.diff(sub.indptr)
        rows = np.repeat(np.arange(len(idx), dtype=np.int64), n_pos)
        # the most positives of a text, known here: the shortlist's sizes need no read from the device
        return (ids, mask, torch.from_numpy(rows), torch.from_numpy(sub.indices.astype(np.int64)),
                int(n_pos.max()) if len(n_pos) else 0)

    def loss_fn(m: _TrainBox, batch):
        ids, mask, rows, labels, max_pos = batch
        out = m.elias(ids, mask, rows, labels, max_pos=max_pos)
        loss, lc, ls = elias_loss(out, params.lambda_, params.eps)
        if trainer.dist:      # W_L's rows this step reaches: the shortlists' (the exchange sends those)
            for q in head:
                trainer.row_exchange.touch(q, out.labels)
        if decay_touched and model.wl.requires_grad:     # a device mask, no read back
            if "mask" not in touched:
                touched["mask"] = torch.zeros(model.n_labels + 1, dtype=torch.bool, device=out.labels.device)
            mark_touched(touched["mask"], out.labels.detach())
        return loss, {"loss_c": lc, "loss_s": ls}   # tensors: read at the logging interval, no sync per step

    if vt is not None and trainer.step == 0 and on_step is not None and trainer.is_main:   # the start, on a fresh run
        on_step(0, evaluate(0))
    trainer.fit(loss_fn, n, batch_fn, step_end=step_end, grads_ready=wl_acc)
    _set_wl_trainable(model, True)
    if swa is not None:
        swa.copy_to(model)
    return trainer
