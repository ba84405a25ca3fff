"""The guide network's losses (GUDN §3.3): the feature guide (Eq. 2) and the link guide (Eq. 3)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp
import torch

from .. import neural
from ..lightxml.model import LightXMLModel
from ..lightxml.train import positive_pairs
from .params import GUDNParams


def feature_guide(e_text: torch.Tensor, e_label: torch.Tensor, reduction: str) -> torch.Tensor:
    """Eq. 2, ``1/(2n) sum_i ||E_t,i - E_l,i||^2`` (``reduction="paper"``); the mean of the squared
    differences over every coordinate (``"mean"``, the authors' ``MSELoss``); or (``"relative"``, an
    addition) Eq. 2's sum of squared distances over the batch's spread about its centre ``c`` (the
    mean of all ``2n`` features), ``sum_i ||E_t,i - E_l,i||^2 / sum_i (||E_t,i - c||^2 + ||E_l,i - c||^2)``:
    0 when every text sits on its label sequence, about 1 when texts and label sequences are
    unrelated, at most 2, and unchanged when every feature is shifted or scaled alike, so the guide
    cannot be met by drawing all features together (why: docs/methods/gudn.md)."""
    t, lab = e_text.float(), e_label.float()
    d = t - lab
    if reduction == "paper":
        return 0.5 * d.pow(2).sum(1).mean()
    if reduction == "relative":
        c = 0.5 * (t.mean(0) + lab.mean(0))
        spread = (t - c).pow(2).sum() + (lab - c).pow(2).sum()
        return d.pow(2).sum() / spread.clamp_min(torch.finfo(spread.dtype).tiny)
    return d.pow(2).mean()


def relative_global(e_text: torch.Tensor, e_label: torch.Tensor, real: float = 1.0) -> torch.Tensor:
    """:func:`feature_guide`'s ``relative`` over the *global* batch when several processes train (DDP): a ratio of
    two sums over the batch about the centre of all its features, which a rank's texts alone would measure
    about another centre and another spread (a per-rank ratio, averaged over the ranks, is not the one
    process's).  The centre and then the two sums are gathered across the ranks with their gradients
    (:func:`xmc_steps.distributed.gather_rows`), so every rank holds the one-process value; its gradient,
    DDP-averaged, is the one-process gradient (the gather's backward sums the ranks' pulls on a rank's rows).
    ``real`` 0: a rank without a real text this step (a stand-in, :func:`xmc_steps.distributed.shard`)
    contributes nothing.  One process: :func:`feature_guide`'s formula."""
    from .. import distributed

    t, lab = e_text.float(), e_label.float()
    if not distributed.active():
        return feature_guide(t, lab, "relative")
    D = t.shape[1]
    count = torch.full((1,), 2.0 * t.shape[0] * real, device=t.device)
    first = torch.cat([(t.sum(0) + lab.sum(0)) * real, count]).unsqueeze(0)
    tot = torch.cat(distributed.gather_rows(first), 0).sum(0)
    c = tot[:D] / tot[D].clamp_min(1.0)
    d = t - lab
    second = torch.stack([d.pow(2).sum(), (t - c).pow(2).sum() + (lab - c).pow(2).sum()]) * real
    num, spread = torch.cat(distributed.gather_rows(second.unsqueeze(0)), 0).sum(0)
    return num / spread.clamp_min(torch.finfo(spread.dtype).tiny)


def balanced_weight(feature_loss: torch.Tensor, class_loss: torch.Tensor, e_text: torch.Tensor) -> torch.Tensor:
    """``min(1, ||dL_class/dE_t|| / ||dL_feature/dE_t||)`` (``feature_weight: balanced``, ours): the largest
    weight up to Eq. 6's 1 at which the feature guide pulls the text features no harder than the
    classification loss does.  Both gradients are taken at the text features of this step (through the
    head only, not the encoder); the weight itself is a constant of the step (no gradient flows
    through it).  For Eq. 2's losses the pull on the label features has the same norm, so one weight
    bounds both.  Why: the classification loss is a mean over the L outputs (Eq. 1), so its gradient
    shrinks about as 1/L while the guide's does not; at 18,056 labels the guide alone decides where the
    encoder goes (measurements: docs/methods/gudn.md)."""
    if not (e_text.requires_grad and class_loss.requires_grad and feature_loss.requires_grad):
        return torch.ones((), device=e_text.device)
    g_class, = torch.autograd.grad(class_loss, e_text, retain_graph=True, allow_unused=True)
    g_feature, = torch.autograd.grad(feature_loss, e_text, retain_graph=True, allow_unused=True)
    from .. import distributed

    if distributed.active():
        # the global batch's norms (every rank's gradients carry the same factor, the world, which cancels);
        # a rank whose gradient is None sends zeros: every rank joins the all-reduce
        sq = torch.stack([g.float().pow(2).sum() if g is not None else torch.zeros((), device=e_text.device)
                          for g in (g_class, g_feature)])
        n_c, n_f = distributed.all_reduce_sum(sq).sqrt()
        ratio = n_c / n_f.clamp_min(torch.finfo(torch.float32).tiny)
        return torch.where(n_f > 0, ratio.clamp(max=1.0), torch.ones_like(ratio)).detach()
    if g_class is None or g_feature is None:
        return torch.ones((), device=e_text.device)
    n_f = g_feature.float().norm()
    ratio = g_class.float().norm() / n_f.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(n_f > 0, ratio.clamp(max=1.0), torch.ones_like(ratio)).detach()


def guide_loss(model: LightXMLModel, e_text: torch.Tensor, e_label: torch.Tensor, rows: torch.Tensor,
               labels: torch.Tensor, params: GUDNParams, class_loss: torch.Tensor | None = None,
               max_pos: int | None = None, ranks: Any = None) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """``L_guide`` of Eq. 4 with the guides ``params`` switches on: the feature guide on the
    representations before dropout, weighted by :func:`balanced_weight` against ``class_loss`` (the
    text's classification loss of the step) when ``params.feature_weight`` is ``balanced``; the link
    guide is the backbone's own classification loss with the label features in place of the text's
    (through dropout, as the text's).  The logs are 0-d tensors (read at the trainer's logging
    interval); ``max_pos``: see :meth:`~xmc_steps.lightxml.model.LightXMLModel.candidates`.  ``ranks``, with
    several processes (:meth:`~xmc_steps.lightxml.model.LightXMLModel.loss`): the rank's part of the global
    batch's guide, whose average over the ranks is the one process's: the feature losses ``mean`` and
    ``paper`` (a mean over the rank's texts) times its share, ``relative`` (a ratio of sums over the whole
    batch) the global value on every rank (:func:`relative_global`), the balanced weight from the global
    batch's gradient norms (:func:`balanced_weight`), the link guide as the backbone's."""
    total = torch.zeros((), device=e_text.device)
    logs: dict[str, torch.Tensor] = {}
    if params.feature_guide:
        if ranks is not None and params.feature_loss == "relative":
            lf = relative_global(e_text, e_label, float(ranks[0] > 0))   # every rank: the global value
        else:
            lf = feature_guide(e_text, e_label, params.feature_loss)
            if ranks is not None:
                lf = lf * ranks[0]
        logs["loss_feature"] = lf.detach()
        if params.feature_weight == "balanced":
            if class_loss is None:
                raise ValueError("feature_weight: balanced needs the step's classification loss")
            w = balanced_weight(lf, class_loss, e_text)
            lf = w * lf
            logs["feature_weight"] = w.detach()
        total = total + lf
    if params.link_guide:
        ll, _, _ = model.loss(model.dropout(e_label), rows, labels, max_pos=max_pos, ranks=ranks)
        total = total + ll
        logs["loss_link"] = ll.detach()
    return total, logs


def _grad_norm(loss: torch.Tensor, params: list[torch.Tensor], retain_graph: bool) -> float:
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))


def gate_ratio(model: LightXMLModel, tokens: neural.TokenData, label_tokens: neural.TokenData, Y: sp.spmatrix,
               reduction: str, device: torch.device | str, batches: int = 16, batch_size: int = 16) -> float:
    """How much harder the classification loss pulls the encoder than the feature guide does, at the
    model as it is (the linear start): ``mean_b ||dL_class,b/dtheta|| / mean_b ||dL_feature,b/dtheta||``
    over the encoder's parameters ``theta``, for ``batches`` batches of ``batch_size`` texts spread
    evenly over the training set; the feature guide's gradient reaches the encoder through the text
    and the label sequence alike.  Eval mode: no dropout and no random numbers drawn, so a run whose
    gate opens trains exactly as ``feature_weight: fixed``.  ``inf`` when the guide pulls nowhere."""
    Y = sp.csr_matrix(Y)
    n = len(tokens)
    m = min(n, batches * batch_size)
    order = np.linspace(0, n - 1, m).round().astype(np.int64) if m else np.zeros(0, np.int64)
    theta = [p for p in model.encoder.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()
    pull_class, pull_feature = [], []
    try:
        for start in range(0, m, batch_size):
            idx = order[start:start + batch_size]
            ids, mask = (t.to(device) for t in tokens.batch(idx))
            lids, lmask = (t.to(device) for t in label_tokens.batch(idx))
            rows, labels = (t.to(device) for t in positive_pairs(Y, idx))
            e_text = model.encoder(ids, mask)
            e_label = model.encoder(lids, lmask)
            class_loss, _, _ = model.loss(model.dropout(e_text), rows, labels)
            pull_class.append(_grad_norm(class_loss, theta, retain_graph=True))
            pull_feature.append(_grad_norm(feature_guide(e_text, e_label, reduction), theta, retain_graph=False))
    finally:
        model.train(was_training)
    f = float(np.mean(pull_feature)) if pull_feature else 0.0
    return float(np.mean(pull_class)) / f if f > 0 else float("inf")


class GuideNetwork:
    """GUDN's guide network as the LightXML trainer takes it (:class:`xmc_steps.lightxml.train.Guide`):
    :func:`guide_loss` with ``params`` on the texts and their label sequences (``tokens``, one row per
    training text: :func:`xmc_steps.gudn.labels.label_tokens`).  With ``feature_weight: gated`` the
    trainer calls :meth:`start` once on the linear start and keeps its answer in the checkpoint, so a
    resumed run keeps the decision its start made: the feature guide is on (weight 1, Eq. 6) when
    :func:`gate_ratio` is at least 1, else off for the whole run (``gate_ratio`` and :meth:`describe`
    say which, once started)."""

    def __init__(self, params: GUDNParams, tokens: neural.TokenData):
        self.params = params
        self.tokens = tokens
        self.gate_ratio: float | None = None   # the start's gate_ratio (feature_weight: gated), once started
        self._on: bool | None = None
        self._off = dataclasses.replace(params, feature_guide=False)

    @property
    def needs_start(self) -> bool:
        return self.params.feature_guide and self.params.feature_weight == "gated"

    def start(self, model: LightXMLModel, tokens: neural.TokenData, Y: sp.spmatrix, device: torch.device | str,
              log: logging.Logger, kept: float | None = None) -> float:
        """The gate of this run: ``kept`` (a resumed run's, from its checkpoint), or :func:`gate_ratio`
        measured on ``model`` (a fresh run); the feature guide is on when it is at least 1."""
        if kept is None:
            kept = gate_ratio(model, tokens, self.tokens, Y, self.params.feature_loss, device)
            verdict = ("on (weight 1, Eq. 6)" if kept >= 1 else "off for this run: it would outpull the classification "
                       "loss and draw the features together (xmc_steps.gudn); gudn.feature_weight: fixed keeps it")
            (log.info if kept >= 1 else log.warning)(
                "gudn feature guide gate: at the linear start the classification loss pulls the encoder %.3g times as "
                "hard as the feature guide (gradient norms over its parameters, 16 batches): the feature guide is %s",
                kept, verdict)
        self.gate_ratio = float(kept)
        self._on = self.gate_ratio >= 1
        return self.gate_ratio

    def feature_on(self) -> bool:
        if not self.params.feature_guide:
            return False
        if self.needs_start:
            if self._on is None:
                raise RuntimeError("feature_weight: gated needs the start's gate (GuideNetwork.start)")
            return self._on
        return True

    def loss(self, model: LightXMLModel, e_text: torch.Tensor, e_tokens: torch.Tensor, rows: torch.Tensor,
             labels: torch.Tensor, class_loss: torch.Tensor, max_pos: int | None = None, ranks: Any = None
             ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
        """:func:`guide_loss` of a batch (``e_tokens``: its label sequences' features; ``ranks``: see there)."""
        p = self.params if self.feature_on() or not self.params.feature_guide else self._off
        return guide_loss(model, e_text, e_tokens, rows, labels, p, class_loss=class_loss, max_pos=max_pos,
                          ranks=ranks)

    def describe(self) -> dict[str, Any]:
        """``{"gudn": the guide's parameters (the backbone's are the model's own), and, once started with
        a gate, "feature_gate": {"ratio", "feature_guide_on"}}``: GUDN's entry of ``lightxml.json``."""
        d: dict[str, Any] = {k: v for k, v in self.params.to_dict().items() if k != "backbone"}
        if self.gate_ratio is not None:
            d["feature_gate"] = {"ratio": self.gate_ratio, "feature_guide_on": self._on}
        return {"gudn": d}
