"""The LightXML network (text representation, generator, discriminator), its dynamic candidates,
the losses of Eqs. 1, 5 and 6, inference, and saving and loading (see docs/methods/lightxml.md)."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import neural
from ..neural_stage import load_trained
from ..search import padded_to_csr
from .params import LightXMLParams

FORMAT = "xmc-lightxml-v1"


def cluster_table(cluster_of: np.ndarray, n_clusters: int) -> np.ndarray:
    """The labels of each cluster, ``K x s_max`` (``-1`` pads clusters with fewer labels), from each
    label's cluster id (``g_c`` of Eq. 2)."""
    cluster_of = np.asarray(cluster_of, dtype=np.int64)
    if cluster_of.size and (cluster_of.min() < 0 or cluster_of.max() >= n_clusters):
        raise ValueError(f"cluster ids must lie in [0, {n_clusters})")
    counts = np.bincount(cluster_of, minlength=n_clusters)
    table = np.full((n_clusters, max(1, int(counts.max(initial=0)))), -1, dtype=np.int64)
    order = np.argsort(cluster_of, kind="stable")
    starts = np.cumsum(counts) - counts
    slot = np.arange(len(order)) - starts[cluster_of[order]]
    table[cluster_of[order], slot] = order
    return table


class Candidates(NamedTuple):
    labels: torch.Tensor         # B x S long, -1 = padding
    cluster_score: torch.Tensor  # B x S: sigmoid(G(e)) of the label's cluster (0 for padding and added positives)
    target: torch.Tensor | None  # B x S bool: the label is a positive (training only)


class LightXMLModel(nn.Module):
    """Encoder with dropout, generator ``G`` over ``K`` clusters and, unless every cluster holds
    one label (``cluster_of=None``: the paper's small-label mode), the discriminator of Eq. 4
    (bottleneck ``W_h, b_h`` and label embeddings ``E``).

    ``encoder`` may be ``None`` (then give ``dim``) for use on precomputed representations.
    """

    def __init__(self, encoder: nn.Module | None, n_labels: int, cluster_of: np.ndarray | None = None,
                 n_clusters: int | None = None, hidden: int = 300, topb: int = 10, dropout: float = 0.5,
                 bottleneck: str = "sigmoid", train_candidates: str = "positives", dim: int | None = None):
        super().__init__()
        self.encoder = encoder
        D = int(encoder.dim) if encoder is not None else int(dim)
        L = int(n_labels)
        self.dim, self.n_labels, self.hidden = D, L, int(hidden)
        self.flat = cluster_of is None
        self.n_clusters = L if self.flat else int(n_clusters if n_clusters is not None else int(np.max(cluster_of)) + 1)
        self.topb = min(int(topb), self.n_clusters)
        self.bottleneck_kind, self.train_candidates = bottleneck, train_candidates
        self.dropout = nn.Dropout(float(dropout))
        self.generator = nn.Linear(D, self.n_clusters)                      # G(e) = sigma(W_g e + b_g)
        if not self.flat:
            cluster_of = np.asarray(cluster_of, dtype=np.int64)
            if cluster_of.shape != (L,):
                raise ValueError(f"cluster_of has shape {cluster_of.shape}, expected ({L},)")
            self.register_buffer("cluster_of", torch.from_numpy(cluster_of))
            self.register_buffer("cluster_labels", torch.from_numpy(cluster_table(cluster_of, self.n_clusters)))
            self.bottleneck = nn.Linear(D, self.hidden)                      # W_h, b_h of Eq. 4
            self.label_emb = nn.Embedding(L, self.hidden)                    # E of Eq. 3
            nn.init.xavier_uniform_(self.label_emb.weight)

    def describe(self) -> dict[str, Any]:
        return {"L": self.n_labels, "K": self.n_clusters, "flat": self.flat, "dim": self.dim, "hidden": self.hidden,
                "topb": self.topb, "bottleneck": self.bottleneck_kind, "train_candidates": self.train_candidates,
                "dropout": self.dropout.p,
                "cluster_size": None if self.flat else int(self.cluster_labels.shape[1])}

    # -- pieces
    def represent(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``e``: the encoder's representation (the last layers' [CLS], concatenated) after dropout."""
        if self.encoder is None:
            raise ValueError("this LightXMLModel has no encoder")
        return self.dropout(self.encoder(input_ids, attention_mask))

    def label_logits(self, e: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Eq. 4 before its outer sigmoid: ``E_l . act(W_h e + b_h)`` for each row's labels (``B x S``;
        padding ``-1`` reads label 0, to be masked by the caller)."""
        h = self.bottleneck(e)
        if self.bottleneck_kind == "sigmoid":
            h = torch.sigmoid(h)
        M = self.label_emb(labels.clamp(min=0))                               # B x S x b (Eq. 3)
        return torch.bmm(M, h.unsqueeze(-1)).squeeze(-1).float()

    def top_clusters(self, g: torch.Tensor) -> torch.Tensor:
        """The top-``topb`` clusters by the generator's logits ``g`` (``B x b``)."""
        return torch.topk(g.detach().float(), self.topb, dim=1).indices

    def candidates(self, g: torch.Tensor, pos_rows: torch.Tensor | None = None,
                   pos_labels: torch.Tensor | None = None, top: torch.Tensor | None = None,
                   max_pos: int | None = None) -> Candidates:
        """Eq. 2: the labels of the top-``topb`` clusters by ``G(e)`` (from ``g``, the generator's
        logits, re-read at every call: the negatives are dynamic), or of the given clusters ``top``
        (``B x b``: the static negatives drawn once); in training (positives given) the positives are
        added (see docs/methods/lightxml.md for ``train_candidates``); ``max_pos``, the most positives
        of a text in the batch, if the caller knows it (the batch's builder does), spares reading it
        from the device (a host-device sync per step)."""
        B, dev, L = g.shape[0], g.device, self.n_labels
        prob = torch.sigmoid(g.detach().float())
        training = pos_rows is not None
        if top is None:
            order = prob
            if training and self.train_candidates == "positive-clusters":
                gold = torch.zeros_like(prob)
                gold[pos_rows, self.cluster_of[pos_labels]] = 1.0
                order = prob + gold                                           # gold clusters first
            top = torch.topk(order, self.topb, dim=1).indices                 # B x b
        s = self.cluster_labels.shape[1]
        labels = self.cluster_labels[top].reshape(B, -1)                      # B x (b s)
        cscore = prob.gather(1, top).unsqueeze(-1).expand(B, self.topb, s).reshape(B, -1)
        cscore = cscore.masked_fill(labels < 0, 0.0)
        if not training:
            return Candidates(labels, cscore, None)
        # a scatter, not bincount (on CUDA, bincount reads the input's range back: a sync)
        n_pos = torch.zeros(B, dtype=torch.long, device=dev).index_add_(0, pos_rows, torch.ones_like(pos_rows))
        if max_pos is None:
            max_pos = int(n_pos.max()) if n_pos.numel() else 0
        P = max(int(max_pos), 1)
        starts = torch.cumsum(n_pos, 0) - n_pos
        col = torch.arange(pos_rows.numel(), device=dev) - starts[pos_rows]
        extra = torch.full((B, P), -1, dtype=torch.long, device=dev)
        extra[pos_rows, col] = pos_labels
        ext_cluster = self.cluster_of[extra.clamp(min=0)]
        covered = (ext_cluster.unsqueeze(2) == top.unsqueeze(1)).any(2)       # B x P x b: already a candidate
        extra = extra.masked_fill(covered, -1)
        labels = torch.cat([labels, extra], 1)
        cscore = torch.cat([cscore, torch.zeros_like(extra, dtype=cscore.dtype)], 1)
        keys = torch.arange(B, device=dev).unsqueeze(1) * L + labels
        pkeys = torch.sort(pos_rows * L + pos_labels).values
        if pkeys.numel():
            j = torch.searchsorted(pkeys, keys).clamp(max=pkeys.numel() - 1)
            target = (pkeys[j] == keys) & (labels >= 0)
        else:
            target = torch.zeros_like(labels, dtype=torch.bool)
        return Candidates(labels, cscore, target)

    # -- training
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos_rows: torch.Tensor,
                pos_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 6's loss ``L_g + L_d`` for a batch and its positives (``pos_rows``, ``pos_labels``:
        one entry per (text, positive label)); returns ``(loss, L_g, L_d)`` (``L_d = 0`` when flat)."""
        e = self.represent(input_ids, attention_mask)
        return self.loss(e, pos_rows, pos_labels)

    def loss(self, e: torch.Tensor, pos_rows: torch.Tensor, pos_labels: torch.Tensor, top: torch.Tensor | None = None,
             generator_only: bool = False, max_pos: int | None = None,
             ranks: tuple[float, Callable[[torch.Tensor], torch.Tensor]] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(L_g + L_d, L_g, L_d)``; ``top``: given candidate clusters (static negatives);
        ``generator_only``: ``L_g`` alone (the first phase of static negatives); ``max_pos``: see
        :meth:`candidates`.  ``ranks``, with several processes: ``(share, candidates)``, this rank's share of
        the global batch (:func:`xmc_steps.distributed.loss_weight`) and the global batch's real candidates per
        rank given this rank's count; the losses are then this rank's part of the global batch's (``L_g``, a
        mean over texts, times the share; ``L_d``, a mean over every real candidate of the global batch, the
        rank's sum over that mean count), whose average over the ranks is the one process's loss."""
        g = self.generator(e).float()
        y_g = torch.zeros_like(g)
        y_g[pos_rows, pos_labels if self.flat else self.cluster_of[pos_labels]] = 1.0
        loss_g = F.binary_cross_entropy_with_logits(g, y_g)                   # Eq. 1 (mean over B x K)
        if ranks is not None:
            loss_g = loss_g * ranks[0]
        if self.flat or generator_only:
            return loss_g, loss_g.detach(), torch.zeros((), device=g.device)
        c = self.candidates(g, pos_rows, pos_labels, top, max_pos)
        d = self.label_logits(e, c.labels)
        valid = (c.labels >= 0).float()
        # Eq. 5, the mean over the real candidates (masked, not selected: no sync for the selection's size)
        per = F.binary_cross_entropy_with_logits(d, c.target.float(), reduction="none")
        n_valid = valid.sum() if ranks is None else ranks[1](valid.sum())
        loss_d = (per * valid).sum() / n_valid
        return loss_g + loss_d, loss_g.detach(), loss_d.detach()

    # -- prediction
    def scores(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(labels, p)`` per text: every label by ``G(e)`` when flat; else the candidates of the
        top-``topb`` clusters, ``p`` = the cluster's ``G`` score x the discriminator's score."""
        g = self.generator(e).float()
        if self.flat:
            p = torch.sigmoid(g)
            return torch.arange(self.n_labels, device=g.device).expand_as(p), p
        c = self.candidates(g)
        p = c.cluster_score * torch.sigmoid(self.label_logits(e, c.labels))
        return c.labels, p.masked_fill(c.labels < 0, -1.0)


def build_model(params: LightXMLParams, n_labels: int, cluster_of: np.ndarray | None, n_clusters: int | None,
                pretrained: bool = True) -> LightXMLModel:
    """The network of ``params``; its random parts (generator, bottleneck, label embeddings) drawn
    from ``params.train.seed``, so a run is repeatable (as the matcher's and ELIAS's)."""
    neural.seed_everything(params.train.seed)
    enc = neural.TextEncoder(params.encoder, pooling="cls-concat-last-k", last_k=params.last_k, pretrained=pretrained)
    return LightXMLModel(enc, n_labels, cluster_of, n_clusters, hidden=params.hidden, topb=params.topb,
                         dropout=params.dropout, bottleneck=params.bottleneck, train_candidates=params.train_candidates)


def load_lightxml(folder, device: str | torch.device = "cpu") -> LightXMLModel:
    """A model :func:`xmc_steps.neural_stage.save_trained` wrote (``model.safetensors``, ``lightxml.json``)."""

    def build(enc: neural.TextEncoder, meta: dict[str, Any]) -> LightXMLModel:
        flat = meta["flat"]
        # a placeholder assignment (every cluster non-empty, a small table): the real one is in the weights
        cluster_of = None if flat else np.arange(meta["L"], dtype=np.int64) % meta["K"]
        m = LightXMLModel(enc, meta["L"], cluster_of, meta["K"], hidden=meta["hidden"], topb=meta["topb"],
                          dropout=meta["dropout"], bottleneck=meta["bottleneck"],
                          train_candidates=meta["train_candidates"])
        if not flat:   # the table's width is the trained one's
            m.cluster_labels = torch.full((meta["K"], meta["cluster_size"]), -1, dtype=torch.long)
        return m

    return load_trained(folder, "lightxml.json", FORMAT, build, device)


@torch.no_grad()
def predict(model: LightXMLModel, tokens: neural.TokenData, topk: int = 100, batch_size: int = 128,
            device: torch.device | str = "auto", amp: str = "auto",
            progress: Callable[..., Any] | None = neural._default_log.info) -> dict[str, Any]:
    """Top-``topk`` labels by ``p`` (CSR N x L) and the seconds the pass took."""
    device = neural.resolve_device(device)
    model.to(device)
    n, L = len(tokens), model.n_labels
    k = min(int(topk), L)
    lab = np.full((n, k), -1, dtype=np.int64)
    val = np.zeros((n, k), dtype=np.float32)

    def fn(ids, mask):
        labels, p = model.scores(model.represent(ids, mask))
        kk = min(k, p.shape[1])
        v, i = torch.topk(p.float(), kk, dim=1)
        return labels.gather(1, i), v

    t0 = time.perf_counter()
    for idx, (lb, v) in neural.run_inference(fn, model, tokens, batch_size, device, amp, progress,
                                             what="lightxml predict"):
        kk = lb.shape[1]
        lb, v = lb.cpu().numpy(), v.float().cpu().numpy()
        lb[v < 0] = -1
        lab[idx, :kk], val[idx, :kk] = lb, np.maximum(v, 0.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"scores": padded_to_csr(lab, val, L), "seconds": time.perf_counter() - t0}
