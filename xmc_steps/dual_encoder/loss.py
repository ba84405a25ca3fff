"""The training losses over a batch's label pool (docs/methods/dual-encoder.md, "The losses").

Every loss takes the cosines ``cos`` (``B x P``: the batch's texts against the pool's labels, both
embeddings unit-norm) and ``pos`` (``B x P`` bool: the label is a positive of the text).  Each positive
``(i, p)`` has a term; a text's terms are averaged over its positives in the pool and the texts with at
least one are averaged, so that every loss has the same scale whatever the label cardinality, and the
three losses coincide in their normalisation (``softmax`` and ``decoupled-softmax`` are then equal when
every text has a single positive).

* ``decoupled-softmax`` (DEXML, Gupta et al. ICLR 2024, §4): the softmax of the positive against the
  pool's *negatives* of the text only: ``-log(exp(s_ip) / (exp(s_ip) + sum_{j not in P_i} exp(s_ij)))``
  with ``s = cos / temperature``.  The text's other positives are left out of the denominator, so
  raising one positive does not push the others down.
* ``softmax`` (InfoNCE): ``-log(exp(s_ip) / sum_j exp(s_ij))`` over the whole pool, the text's other
  positives included.
* ``triplet`` (NGAME, Dahiya et al. WSDM 2023): ``max(0, cos_in - cos_ip + margin)`` averaged over the
  ``k`` hardest (highest-cosine) negatives ``n`` of the text in the pool.
"""

from __future__ import annotations

import torch

LOSSES = ("decoupled-softmax", "softmax", "triplet")
#: what masks an entry out of a max or a log-sum-exp: finite (no NaN in the backward pass of a row that is all
#: masked), and far below any logit (|cos / temperature| <= 1 / temperature)
_OUT = -1e4


def _average(per: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``per`` (``B x P``) at the positives, averaged per text over its positives, then over the texts that
    have one (0 when none has)."""
    per = torch.where(pos, per, torch.zeros_like(per))
    n_pos = pos.sum(1)
    has = n_pos > 0
    per_text = per.sum(1) / n_pos.clamp(min=1)
    return (per_text * has).sum() / has.sum().clamp(min=1)


def decoupled_softmax(logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """DEXML's decoupled softmax on ``logits = cos / temperature`` (module docstring)."""
    neg = logits.masked_fill(pos, _OUT)
    lse_neg = torch.logsumexp(neg, dim=1, keepdim=True)          # about _OUT for a text without negatives
    per = torch.logaddexp(lse_neg.expand_as(logits), logits) - logits
    return _average(per, pos)


def softmax(logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """InfoNCE over the whole pool, every positive a target (module docstring)."""
    per = torch.logsumexp(logits, dim=1, keepdim=True) - logits
    return _average(per, pos)


def triplet(cos: torch.Tensor, pos: torch.Tensor, margin: float, k: int) -> torch.Tensor:
    """NGAME's margin loss against each text's ``k`` hardest pool negatives (module docstring)."""
    B, P = cos.shape
    k = max(1, min(int(k), P))
    neg = cos.masked_fill(pos, _OUT)
    hard, _ = torch.topk(neg, k, dim=1)                            # B x k, _OUT where the pool has fewer
    valid = hard > _OUT / 2
    hinge = torch.relu(hard.unsqueeze(1) - cos.unsqueeze(2) + float(margin))   # B x P x k
    hinge = torch.where(valid.unsqueeze(1), hinge, torch.zeros_like(hinge))
    per = hinge.sum(2) / valid.sum(1, keepdim=True).clamp(min=1)
    return _average(per, pos)


def pool_loss(cos: torch.Tensor, pos: torch.Tensor, kind: str, temperature: float, margin: float = 0.3,
              triplet_negatives: int = 10) -> torch.Tensor:
    """The loss ``kind`` (:data:`LOSSES`) of a batch's cosines against its label pool (float32)."""
    cos = cos.float()
    if kind == "decoupled-softmax":
        return decoupled_softmax(cos / float(temperature), pos)
    if kind == "softmax":
        return softmax(cos / float(temperature), pos)
    if kind == "triplet":
        return triplet(cos, pos, margin, triplet_negatives)
    raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {kind!r}")
