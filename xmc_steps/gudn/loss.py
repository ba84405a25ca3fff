"""The guide network's losses (GUDN §3.3): the feature guide (Eq. 2) and the link guide (Eq. 3)."""

from __future__ import annotations

from typing import Mapping

import torch

from ..lightxml.model import LightXMLModel
from .params import GUDNParams


def feature_guide(e_text: torch.Tensor, e_label: torch.Tensor, reduction: str) -> torch.Tensor:
    """Eq. 2, ``1/(2n) sum_i ||E_t,i - E_l,i||^2`` (``reduction="paper"``); the mean of the squared
    differences over every coordinate (``"mean"``, the authors' ``MSELoss``); or (``"relative"``, an
    addition) Eq. 2's sum of squared distances over the batch's spread about its centre ``c`` (the
    mean of all ``2n`` features), ``sum_i ||E_t,i - E_l,i||^2 / sum_i (||E_t,i - c||^2 + ||E_l,i - c||^2)``:
    0 when every text sits on its label sequence, about 1 when texts and label sequences are
    unrelated, at most 2, and unchanged when every feature is shifted or scaled alike, so the guide
    cannot be met by drawing all features together (why: the package docstring)."""
    t, lab = e_text.float(), e_label.float()
    d = t - lab
    if reduction == "paper":
        return 0.5 * d.pow(2).sum(1).mean()
    if reduction == "relative":
        c = 0.5 * (t.mean(0) + lab.mean(0))
        spread = (t - c).pow(2).sum() + (lab - c).pow(2).sum()
        return d.pow(2).sum() / spread.clamp_min(torch.finfo(spread.dtype).tiny)
    return d.pow(2).mean()


def balanced_weight(feature_loss: torch.Tensor, class_loss: torch.Tensor, e_text: torch.Tensor) -> torch.Tensor:
    """``min(1, ||dL_class/dE_t|| / ||dL_feature/dE_t||)`` (``feature_weight: balanced``, ours): the largest
    weight up to Eq. 6's 1 at which the feature guide pulls the text features no harder than the
    classification loss does.  Both gradients are taken at the text features of this step (through the
    head only, not the encoder); the weight itself is a constant of the step (no gradient flows
    through it).  For Eq. 2's losses the pull on the label features has the same norm, so one weight
    bounds both.  Why: the classification loss is a mean over the L outputs (Eq. 1), so its gradient
    shrinks about as 1/L while the guide's does not; at 18,056 labels the guide alone decides where the
    encoder goes (measurements: the package docstring)."""
    if not (e_text.requires_grad and class_loss.requires_grad and feature_loss.requires_grad):
        return torch.ones((), device=e_text.device)
    g_class, = torch.autograd.grad(class_loss, e_text, retain_graph=True, allow_unused=True)
    g_feature, = torch.autograd.grad(feature_loss, e_text, retain_graph=True, allow_unused=True)
    if g_class is None or g_feature is None:
        return torch.ones((), device=e_text.device)
    n_f = g_feature.float().norm()
    ratio = g_class.float().norm() / n_f.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(n_f > 0, ratio.clamp(max=1.0), torch.ones_like(ratio)).detach()


def guide_loss(model: LightXMLModel, e_text: torch.Tensor, e_label: torch.Tensor, rows: torch.Tensor,
               labels: torch.Tensor, params: GUDNParams, class_loss: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, Mapping[str, float]]:
    """``L_guide`` of Eq. 4 with the guides ``params`` switches on: the feature guide on the
    representations before dropout, weighted by :func:`balanced_weight` against ``class_loss`` (the
    text's classification loss of the step) when ``params.feature_weight`` is ``balanced``; the link
    guide is the backbone's own classification loss with the label features in place of the text's
    (through dropout, as the text's)."""
    total = torch.zeros((), device=e_text.device)
    logs: dict[str, float] = {}
    if params.feature_guide:
        lf = feature_guide(e_text, e_label, params.feature_loss)
        logs["loss_feature"] = float(lf.detach())
        if params.feature_weight == "balanced":
            if class_loss is None:
                raise ValueError("feature_weight: balanced needs the step's classification loss")
            w = balanced_weight(lf, class_loss, e_text)
            lf = w * lf
            logs["feature_weight"] = float(w)
        total = total + lf
    if params.link_guide:
        ll, _, _ = model.loss(model.dropout(e_label), rows, labels)
        total = total + ll
        logs["loss_link"] = float(ll.detach())
    return total, logs
