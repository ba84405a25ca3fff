"""The LightXML training driver: Eq. 6 end to end on the shared :class:`~xmc_steps.trainer.Trainer`,
with the paper's weight averaging and periodic validation."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from .. import metrics, neural
from ..trainer import Trainer, WeightAverage, digest, param_groups
from .model import LightXMLModel, predict
from .params import LightXMLParams


class _TrainBox(nn.Module):
    def __init__(self, model: LightXMLModel, swa: WeightAverage):
        super().__init__()
        self.lightxml = model
        self.swa = swa


def valid_metrics(model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix, params: LightXMLParams,
                  device: torch.device | str, progress: Callable[..., Any] | None = None) -> dict[str, float]:
    """P@1, P@5 and R@``topk`` of the model's predictions on ``tokens`` (fractions)."""
    r = predict(model, tokens, topk=params.topk, batch_size=params.eval_batch_size, device=device, amp=params.amp,
                progress=progress)
    p = metrics.precision(r["scores"], Y, 5)
    rec = metrics.recall(r["scores"], Y, params.topk)
    return {"p_at_1": float(p[0]), "p_at_5": float(p[4]), f"recall_at_{params.topk}": float(rec[-1])}


def frequency_prior(Y_train: sp.spmatrix, Y: sp.spmatrix, k: int = 100) -> dict[str, float]:
    """The same metrics for the trivial predictor that ranks every text's labels by training
    frequency: what a model that learned nothing from the text reaches."""
    freq = np.asarray(sp.csr_matrix(Y_train).sum(0)).ravel()
    top = np.argsort(-freq, kind="stable")[:k]
    n = Y.shape[0]
    vals = np.tile(np.linspace(1.0, 0.5, len(top), dtype=np.float32), n)
    scores = sp.csr_matrix((vals, np.tile(top, n), np.arange(n + 1) * len(top)), shape=Y.shape)
    p = metrics.precision(scores, Y, 5)
    return {"p_at_1": float(p[0]), "p_at_5": float(p[4]), f"recall_at_{k}": float(metrics.recall(scores, Y, k)[-1])}


def train_lightxml(model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix, params: LightXMLParams,
                   ckpt_dir: str | os.PathLike | None, log: logging.Logger | None = None,
                   on_step: Callable[[int, dict[str, float]], Any] | None = None,
                   valid: tuple[neural.TokenData, sp.spmatrix] | None = None,
                   fingerprint: Mapping[str, Any] | None = None) -> Trainer:
    """Train ``model`` with Eq. 6 (one learning rate for every part, AdamW's decay except on biases
    and LayerNorm).  ``params`` must be resolved (:meth:`LightXMLParams.resolved`).  Resumes from
    ``ckpt_dir``.  The model ends on the training device with the weight average copied in (when
    the run took any)."""
    log = log or neural._default_log
    tp = params.train
    if not tp.is_resolved or params.eval_every is None:
        raise ValueError("resolve the parameters first (LightXMLParams.resolved)")
    Y = sp.csr_matrix(Y, dtype=np.float32)
    Y.sort_indices()
    n = len(tokens)
    if Y.shape != (n, model.n_labels):
        raise ValueError(f"Y has shape {Y.shape}, expected ({n}, {model.n_labels})")
    heads = [(f"generator.{k}", v) for k, v in model.generator.named_parameters()]
    if not model.flat:
        heads += [(f"bottleneck.{k}", v) for k, v in model.bottleneck.named_parameters()]
        heads += [("label_emb.weight", model.label_emb.weight)]
    groups = param_groups({"encoder": (model.encoder, tp.lr), "heads": (heads, tp.lr)}, tp.weight_decay)
    swa = WeightAverage(model)
    swa_first, swa_every = params.swa_schedule(n)
    box = _TrainBox(model, swa)
    fp = {"model": model.describe(), "encoder": params.encoder, "last_k": params.last_k, "swa": [swa_first, swa_every],
          "data": digest(tokens.input_ids, tokens.lengths, Y.indptr, Y.indices)}
    if not model.flat:
        fp["clusters"] = digest(model.cluster_of.cpu().numpy())
    fp.update(dict(fingerprint or {}))
    trainer = Trainer(box, groups, tp, ckpt_dir, log=log, on_step=on_step, fingerprint=fp, device=params.device,
                      amp=params.amp)

    vt = vY = None
    if valid is not None and params.eval_every > 0:
        vt, vY = valid
        vY = sp.csr_matrix(vY)
        if len(vt) > params.eval_max_docs:
            sub = np.sort(np.random.default_rng(tp.seed).choice(len(vt), params.eval_max_docs, replace=False))
            vt, vY = neural.TokenData(vt.input_ids[sub], vt.lengths[sub]), vY[sub]

    def step_end(step: int) -> dict[str, float] | None:
        if step >= swa_first and (step - swa_first) % swa_every == 0:
            swa.update(model)
        if vt is None or (step % params.eval_every and step != tp.steps):
            return None
        m = valid_metrics(model, vt, vY, params, trainer.device)
        log.info("step %d: valid P@1 %.4f, P@5 %.4f (%d documents)", step, m["p_at_1"], m["p_at_5"], len(vt))
        return {"valid_p_at_1": m["p_at_1"], "valid_p_at_5": m["p_at_5"]}

    def batch_fn(idx: np.ndarray):
        ids, mask = tokens.batch(idx)
        sub = Y[idx]
        rows = np.repeat(np.arange(len(idx), dtype=np.int64), np.diff(sub.indptr))
        return ids, mask, torch.from_numpy(rows), torch.from_numpy(sub.indices.astype(np.int64))

    def loss_fn(m: _TrainBox, batch):
        ids, mask, rows, labels = batch
        loss, lg, ld = m.lightxml(ids, mask, rows, labels)
        return loss, {"loss_g": float(lg), "loss_d": float(ld)}

    trainer.fit(loss_fn, n, batch_fn, step_end=step_end)
    if int(swa.n) > 0:
        log.info("weight average of %d snapshots (from step %d, every %d steps) replaces the last weights",
                 int(swa.n), swa_first, swa_every)
        swa.copy_to(model)
    return trainer
