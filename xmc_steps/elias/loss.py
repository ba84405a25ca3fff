"""The ELIAS loss (§3.3, Eqs. 7-8; see docs/methods/elias.md, "Loss")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .model import Shortlist


def elias_loss(out: Shortlist, lambda_: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, L_c, L_s)`` of §3.3 (batch means of per-example sums; see the module docstring)."""
    if out.target is None or out.n_pos is None:
        raise ValueError("the loss needs a training-mode shortlist (positives given)")
    valid = out.labels >= 0
    t = out.target & valid
    yh = out.yhat.float()
    logp = F.logsigmoid(out.logits.float()) + torch.log(yh.clamp(min=eps))
    log1mp = torch.log1p(-out.p.float().clamp(max=1.0 - eps))
    lc = -(torch.where(t, logp, log1mp) * valid).sum(1)
    missing = (out.n_pos - t.sum(1)).clamp(min=0).float()
    ls = -(torch.log(yh.clamp(min=eps)) * t).sum(1) + missing * (-math.log(eps))
    lc, ls = lc.mean(), ls.mean()
    return lc + float(lambda_) * ls, lc.detach(), ls.detach()
