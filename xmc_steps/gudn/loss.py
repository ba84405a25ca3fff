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


def guide_loss(model: LightXMLModel, e_text: torch.Tensor, e_label: torch.Tensor, rows: torch.Tensor,
               labels: torch.Tensor, params: GUDNParams) -> tuple[torch.Tensor, Mapping[str, float]]:
    """``L_guide`` of Eq. 4 with the guides ``params`` switches on: the feature guide on the
    representations before dropout; the link guide is the backbone's own classification loss with
    the label features in place of the text's (through dropout, as the text's)."""
    total = torch.zeros((), device=e_text.device)
    logs: dict[str, float] = {}
    if params.feature_guide:
        lf = feature_guide(e_text, e_label, params.feature_loss)
        total = total + lf
        logs["loss_feature"] = float(lf.detach())
    if params.link_guide:
        ll, _, _ = model.loss(model.dropout(e_label), rows, labels)
        total = total + ll
        logs["loss_link"] = float(ll.detach())
    return total, logs
