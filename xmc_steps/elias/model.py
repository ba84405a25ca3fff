"""The ELIAS network (§3.1-3.2), its index initialisation (Eqs. 9-10), inference, and saving and
loading (see docs/methods/elias.md)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from .. import neural
from ..baselines import recall_of_top
from ..linear_start import least_squares_head
from ..negatives import binarize
from ..neural_stage import load_trained
from ..search import padded_to_csr
from ..errors import StageError
from ..layout import WEIGHTS
from .params import EliasParams

FORMAT = "xmc-elias-v1"


# --------------------------------------------------------------------------- model


class Shortlist(NamedTuple):
    labels: torch.Tensor   # B x K long, -1 = padding
    yhat: torch.Tensor     # B x K shortlist scores (Eq. 6), 0 for padding
    p: torch.Tensor        # B x K final scores sigmoid(w_l^T phi) * yhat, 0 for padding
    logits: torch.Tensor   # B x K classifier logits w_l^T phi (+ bias)
    target: torch.Tensor | None  # B x K bool: the label is a positive (training only)
    n_pos: torch.Tensor | None   # B: positives per example (training only)


class EliasModel(nn.Module):
    """Encoder, cluster classifiers ``Wc``, label classifiers ``wl`` and the sparse ``A`` (see the module doc).

    ``encoder`` may be ``None`` (then give ``dim``) for index-only use on precomputed
    embeddings.  ``fixed_edges=True`` is stage 1: every real edge scores 1 and
    ``A_value`` is frozen.
    """

    def __init__(self, encoder: nn.Module | None, n_clusters: int, n_labels: int, kappa: int, alpha: float = 10.0,
                 beta: float | None = None, b: int = 20, K: int = 2000, wl_bias: bool = False,
                 fixed_edges: bool = False, dim: int | None = None, init_std: float = 0.02):
        super().__init__()
        self.encoder = encoder
        D = int(encoder.dim) if encoder is not None else int(dim)
        C, L, kappa = int(n_clusters), int(n_labels), int(kappa)
        self.dim, self.n_clusters, self.n_labels, self.kappa = D, C, L, kappa
        self.alpha = float(alpha)
        self.beta = float(beta) if beta is not None else L / C
        self.b, self.K = min(int(b), C), min(int(K), L)
        self.fixed_edges = bool(fixed_edges)
        self.Wc = nn.Parameter(torch.randn(C, D) * init_std)
        self.wl = nn.Parameter(torch.randn(L, D) * init_std)
        self.wl_bias = nn.Parameter(torch.zeros(L)) if wl_bias else None
        self.register_buffer("A_index", torch.full((C, kappa), -1, dtype=torch.long))
        self.A_value = nn.Parameter(torch.zeros(C, kappa), requires_grad=not self.fixed_edges)
        # label -> entries of A (flat c * kappa + slot), CSR over labels; rebuilt from A_index
        self.register_buffer("lab_ptr", torch.zeros(L + 1, dtype=torch.long), persistent=False)
        self.register_buffer("lab_ent", torch.zeros(0, dtype=torch.long), persistent=False)
        self.max_rows_per_label = 0   # the most rows of A holding one label (rebuild_label_index)
        self.register_load_state_dict_post_hook(lambda module, keys: module.rebuild_label_index())

    # -- adjacency
    def set_adjacency(self, index: torch.Tensor | np.ndarray, value: torch.Tensor | np.ndarray | None = None) -> None:
        index = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index, dtype=torch.long)
        if tuple(index.shape) != (self.n_clusters, self.kappa):
            raise ValueError(f"A_index has shape {tuple(index.shape)}, expected {(self.n_clusters, self.kappa)}")
        if index.numel() and (int(index.max()) >= self.n_labels or int(index.min()) < -1):
            raise ValueError("A_index holds label ids outside [-1, L)")
        with torch.no_grad():
            self.A_index.copy_(index.to(self.A_index.device))
            if value is not None:
                v = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value,
                                    dtype=torch.float32)
                self.A_value.copy_(v.to(self.A_value.device))
        self.rebuild_label_index()

    @torch.no_grad()
    def rebuild_label_index(self) -> None:
        """The label -> entries inverse index of ``A_index`` and the most rows holding one label
        (``max_rows_per_label``, read once here: the training step's parent lookup is that wide)."""
        idx = self.A_index.reshape(-1)
        ent = torch.nonzero(idx >= 0).squeeze(1)
        labs = idx[ent]
        order = torch.argsort(labs, stable=True)
        counts = torch.bincount(labs, minlength=self.n_labels)
        ptr = torch.zeros(self.n_labels + 1, dtype=torch.long, device=idx.device)
        ptr[1:] = torch.cumsum(counts, 0)
        self.lab_ptr = ptr
        self.lab_ent = ent[order]
        self.max_rows_per_label = int(counts.max()) if counts.numel() else 0

    def unreachable_labels(self) -> int:
        """Labels that no row of ``A`` holds (they can never be shortlisted)."""
        return int((torch.diff(self.lab_ptr) == 0).sum())

    # -- pieces
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.encoder is None:
            raise ValueError("this EliasModel has no encoder")
        return self.encoder(input_ids, attention_mask)

    def cluster_scores(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, s)``: ``Wc phi`` and Eq. 1's ``min(1, alpha * softmax(Wc phi))`` (fp32), B x C."""
        logits = F.linear(emb, self.Wc.to(emb.dtype)).float()
        return logits, torch.clamp(self.alpha * torch.softmax(logits, dim=-1), max=1.0)

    def edge_scores(self, rows: torch.Tensor) -> torch.Tensor:
        """Eq. 5 for the rows ``rows`` (any shape ``S``): ``S x kappa`` (0 at pad entries)."""
        valid = self.A_index[rows] >= 0
        if self.fixed_edges:
            return valid.float()
        a = self.A_value[rows].float().masked_fill(~valid, torch.finfo(torch.float32).min)
        e = torch.clamp(self.beta * torch.softmax(a, dim=-1), max=1.0)
        return e * valid

    def parents(self, labels: torch.Tensor) -> torch.Tensor:
        """Eq. 3: per label, the row ``c`` with the largest ``a_{c,l}`` among the rows holding it (-1: none;
        ties: the lowest ``c * kappa + slot``).  Fixed shapes (``n x max_rows_per_label``, a padded
        gather of the inverse index): no size is read from the device."""
        n, dev, R = labels.numel(), labels.device, self.max_rows_per_label
        if n == 0 or R == 0:
            return torch.full((n,), -1, dtype=torch.long, device=dev)
        start = self.lab_ptr[labels]
        cnt = self.lab_ptr[labels + 1] - start
        j = torch.arange(R, device=dev)
        held = j < cnt.unsqueeze(1)                                        # n x R: the label's real entries
        ent = self.lab_ent[(start.unsqueeze(1) + j).clamp(max=self.lab_ent.numel() - 1)]
        val = self.A_value.detach().reshape(-1)[ent].float().masked_fill(~held, -math.inf)
        first = val.argmax(1, keepdim=True)                                # the first maximum (lowest entry)
        return torch.where(cnt > 0, ent.gather(1, first).squeeze(1) // self.kappa, torch.full_like(cnt, -1))

    # -- the index and the classifier
    def _shortlist(self, emb: torch.Tensor, pos_rows: torch.Tensor | None = None,
                   pos_labels: torch.Tensor | None = None, b: int | None = None, K: int | None = None,
                   max_pos: int | None = None) -> Shortlist:
        """Eqs. 1-6 and the classifier on the shortlist, in fixed shapes (every size from ``B``, ``b``,
        ``kappa``, ``K`` and ``max_pos``; no value is read from the device, so a CUDA step does not wait
        here).  ``max_pos``: the most positives of an example in the batch (training; the batch builder
        knows it; ``None`` reads it from the device).  The paths' labels are deduplicated per example by
        a sort (Eq. 6's scatter-max over each run of equal labels); the top-``K`` cut is a stable sort
        of the scores: ties go to the lower label id."""
        B, dev, L = emb.shape[0], emb.device, self.n_labels
        b = min(int(b or self.b), self.n_clusters)
        K = min(int(K or self.K), L)
        logits_c, s = self.cluster_scores(emb)
        top = torch.topk(logits_c, b, dim=1).indices                      # Eq. 2, B x b
        clusters, cvalid = top, torch.ones_like(top, dtype=torch.bool)
        training = pos_rows is not None
        n_pos = None
        if training:
            pos_rows, pos_labels = pos_rows.long(), pos_labels.long()
            # a scatter, not bincount (on CUDA, bincount reads the input's range back)
            n_pos = torch.zeros(B, dtype=torch.long, device=dev).index_add_(0, pos_rows, torch.ones_like(pos_rows))
            if pos_labels.numel():
                par = self.parents(pos_labels)                            # Eq. 3
                if max_pos is None:
                    max_pos = int(n_pos.max())
                starts = torch.cumsum(n_pos, 0) - n_pos
                col = torch.arange(pos_rows.numel(), device=dev) - starts[pos_rows]
                extra = torch.full((B, max(int(max_pos), 1)), -1, dtype=torch.long, device=dev)
                extra[pos_rows, col] = par
                clusters = torch.cat([top, extra.clamp(min=0)], 1)        # Eq. 4 (repeats are harmless)
                cvalid = torch.cat([cvalid, extra >= 0], 1)
        # paths: B x b' x kappa, flattened to B x M
        rows = clusters
        lab = self.A_index[rows]
        path = s.gather(1, rows).unsqueeze(-1) * self.edge_scores(rows)  # Eq. 5 and the path score
        keep = (lab >= 0) & cvalid.unsqueeze(-1)
        M = lab.shape[1] * lab.shape[2]
        key, perm = torch.sort(torch.where(keep, lab, L).reshape(B, M), dim=1, stable=True)
        real = key < L                                                    # the paths, by label; then L: none
        first = real & torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev), key[:, 1:] != key[:, :-1]], 1)
        seg = torch.cumsum(first, 1) - 1                                  # the path's (example, label) column
        spare = torch.full_like(seg, M)                                   # a spare column for what is not a path
        yh_u = torch.zeros(B, M + 1, dtype=path.dtype, device=dev).scatter_reduce(
            1, torch.where(real, seg, spare), path.reshape(B, M).gather(1, perm), "amax",
            include_self=False)[:, :M]                                    # Eq. 6
        lab_u = torch.full((B, M + 1), -1, dtype=torch.long, device=dev).scatter(
            1, torch.where(first, seg, spare), key)[:, :M]                # -1: no label in that column
        has = lab_u >= 0
        sel = yh_u.detach()
        is_pos_u = None
        if training:
            pkeys = torch.sort(pos_rows * L + pos_labels).values
            if pkeys.numel():
                ukeys = torch.arange(B, device=dev).unsqueeze(1) * L + lab_u
                j = torch.searchsorted(pkeys, ukeys).clamp(max=pkeys.numel() - 1)
                is_pos_u = (pkeys[j] == ukeys) & has
            else:
                is_pos_u = torch.zeros_like(has)
            sel = sel + 2.0 * is_pos_u                                     # positives first (see doc)
        grid = torch.where(has, sel.float(), -math.inf)
        if M < K:
            grid = F.pad(grid, (0, K - M), value=-math.inf)
        order = torch.sort(grid, dim=1, descending=True, stable=True).indices[:, :K]   # top-K
        valid = torch.isfinite(grid.gather(1, order))
        c0 = torch.where(valid, order, 0)
        labels = torch.where(valid, lab_u.gather(1, c0), -1)
        yhat = yh_u.gather(1, c0) * valid
        target = is_pos_u.gather(1, c0) & valid if training else None
        # classifier on the shortlist: B x K x D gather
        lab0 = labels.clamp(min=0)
        w = self.wl[lab0].to(emb.dtype)
        z = torch.bmm(w, emb.unsqueeze(-1)).squeeze(-1).float()
        if self.wl_bias is not None:
            z = z + self.wl_bias[lab0].float()
        p = torch.sigmoid(z) * yhat
        return Shortlist(labels, yhat, p, z, target, n_pos)

    def shortlist(self, emb: torch.Tensor, b: int | None = None, K: int | None = None, yhat_power: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prediction on precomputed embeddings: ``(labels, yhat, p)``, each B x K (labels -1 = padding).
        ``yhat_power``: ``p = sigmoid(w_l^T phi) * yhat ** yhat_power`` (1: §3.2, the paper; see the package
        docstring, ``predict.yhat_power``); padding keeps ``p = 0``."""
        out = self._shortlist(emb, b=b, K=K)
        return out.labels, out.yhat, rescore(out, yhat_power)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos_rows: torch.Tensor | None = None,
                pos_labels: torch.Tensor | None = None, b: int | None = None, K: int | None = None,
                max_pos: int | None = None) -> Shortlist:
        """Encode and shortlist; pass the batch's positives (``pos_rows``, ``pos_labels``) in training
        (``max_pos``: see :meth:`_shortlist`)."""
        return self._shortlist(self.encode(input_ids, attention_mask), pos_rows, pos_labels, b, K, max_pos)

    def describe(self) -> dict[str, Any]:
        return {"C": self.n_clusters, "L": self.n_labels, "kappa": self.kappa, "alpha": self.alpha,
                "beta": self.beta, "b": self.b, "K": self.K, "dim": self.dim, "wl_bias": self.wl_bias is not None,
                "fixed_edges": self.fixed_edges}


def rescore(out: Shortlist, yhat_power: float) -> torch.Tensor:
    """The shortlist's final scores with the shortlist score raised to ``yhat_power``:
    ``sigmoid(logits) * yhat ** yhat_power`` (``out.p`` itself at 1, §3.2); 0 on padding."""
    if float(yhat_power) == 1.0:
        return out.p
    p = torch.sigmoid(out.logits.float()) * out.yhat.float().clamp(min=0).pow(float(yhat_power))
    return torch.where(out.labels >= 0, p, torch.zeros_like(p)).to(out.p.dtype)


# --------------------------------------------------------------------------- adjacency


def adjacency_from_assignment(assign: np.ndarray, n_clusters: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1's ``A``: row ``c`` = the labels of cluster ``c`` (ascending), ``kappa1`` = largest cluster; values 0."""
    assign = np.asarray(assign, dtype=np.int64)
    L = len(assign)
    counts = np.bincount(assign, minlength=n_clusters)
    kappa = max(int(counts.max()) if L else 1, 1)
    order = np.argsort(assign, kind="stable")
    starts = np.cumsum(counts) - counts
    slot = np.arange(L) - starts[assign[order]]
    index = np.full((n_clusters, kappa), -1, dtype=np.int64)
    index[assign[order], slot] = order
    return index, np.zeros((n_clusters, kappa), dtype=np.float32)


def _top_kappa_row(idx: np.ndarray, val: np.ndarray, kappa: int) -> np.ndarray:
    """Label ids of the ``kappa`` largest values (ties: lower id first), best first; ``idx`` ascending."""
    if len(val) > kappa:
        thr = -np.partition(-val, kappa - 1)[kappa - 1]
        above = val > thr
        ties = np.flatnonzero(val == thr)[: kappa - int(above.sum())]
        keep = np.concatenate([np.flatnonzero(above), ties])
        idx, val = idx[keep], val[keep]
    order = np.lexsort((idx, -val))
    return idx[order]


def init_adjacency(M: sp.spmatrix, Y: sp.spmatrix, kappa: int, seed: int = 0,
                   max_products: int = 20_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. 9-10: ``(A_index, A_value)`` (C x kappa) from ``A' = M^T Y`` (top-kappa per row, random(0,1) values).

    ``M`` is N x C (top-b cluster scores per training document, Eq. 9), ``Y`` N x L
    (any nonzero is a positive).  Rows of ``A'`` are computed in blocks whose number of
    scalar products (``sum over the block's (document, cluster) pairs of |y_i|``) stays
    under ``max_products``, so the peak memory is bounded whatever ``C`` and ``L``.  Entries
    of ``A'`` that are 0 are never candidates; rows with fewer than ``kappa`` candidates
    are padded with label ``-1``.  ``A_value`` is ``default_rng(seed).random((C, kappa))``.
    """
    M = sp.csr_matrix(M, dtype=np.float32)
    Y = sp.csr_matrix(Y, dtype=np.float32)
    Y.data[:] = 1.0
    if M.shape[0] != Y.shape[0]:
        raise ValueError(f"M has {M.shape[0]} rows but Y has {Y.shape[0]}")
    C, kappa = M.shape[1], int(kappa)
    if kappa < 1:
        raise ValueError("kappa must be >= 1")
    MT = M.T.tocsr()
    MT.eliminate_zeros()
    y_len = np.diff(Y.indptr).astype(np.int64)
    cs = np.zeros(MT.nnz + 1, dtype=np.int64)
    np.cumsum(y_len[MT.indices], out=cs[1:])
    work = cs[MT.indptr[1:]] - cs[MT.indptr[:-1]]  # scalar products per cluster row
    index = np.full((C, kappa), -1, dtype=np.int64)
    a = 0
    while a < C:
        e, acc = a, 0
        while e < C and (e == a or acc + work[e] <= max_products):
            acc += int(work[e])
            e += 1
        P = (MT[a:e] @ Y).tocsr()
        P.sum_duplicates()
        P.sort_indices()
        for r in range(e - a):
            s0, s1 = P.indptr[r], P.indptr[r + 1]
            if s1 == s0:
                continue
            idx, val = P.indices[s0:s1], P.data[s0:s1]
            nz = val != 0
            top = _top_kappa_row(idx[nz].astype(np.int64), val[nz], kappa)
            index[a + r, : len(top)] = top
        a = e
    value = np.random.default_rng(seed).random((C, kappa)).astype(np.float32)
    return index, value


def partition_start(index: np.ndarray, stage1_index: np.ndarray, mass: float | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``a_init: partition`` (ours, the default): stage 2's ``A`` on Eq. 9's candidates, every label
    in its stage-1 cluster's row.

    Row ``c`` holds stage 1's labels of cluster ``c`` first, then Eq. 10's top-``kappa`` candidates
    of ``A' = M^T Y`` (``index``, best first) that are not among them, up to ``kappa``.  ``mass``
    None: every value 0 (a uniform row: each edge starts at ``beta / kappa``, about 0.1).  A
    number: 0 for stage 1's labels and ``-t`` for the others, with ``t`` such that stage 1's
    labels hold the share ``mass`` of the row's softmax (their edges near ``mass``, the others near
    ``(1 - mass) beta / (kappa - m)``).  Eq. 10's own rows can leave a label in no row at all (the
    frequent labels fill every row's top-``kappa``), and such a label is never predicted; here none
    is.  The measurements behind the default are docs/methods/elias.md's "Choosing the defaults"."""
    index = np.asarray(index, dtype=np.int64)
    own = np.asarray(stage1_index, dtype=np.int64)
    C, kappa = index.shape
    if own.shape[0] != C:
        raise ValueError(f"stage 1's A has {own.shape[0]} rows, stage 2's {C}")
    if mass is not None and not 0.0 < mass < 1.0:
        raise ValueError(f"mass must be in (0, 1), got {mass}")
    value = np.zeros((C, kappa), dtype=np.float32)
    out = np.full((C, kappa), -1, dtype=np.int64)
    for c in range(C):
        mine = own[c][own[c] >= 0][:kappa]
        rest = index[c][index[c] >= 0]
        rest = rest[~np.isin(rest, mine)][: kappa - len(mine)]
        m, r = len(mine), len(rest)
        out[c, :m], out[c, m:m + r] = mine, rest
        if mass is not None and m and r:
            value[c, m:m + r] = math.log(m * (1.0 - mass) / (mass * r))
    return out, value


# --------------------------------------------------------------------------- the linear start


def partition_targets(Y: sp.spmatrix, A_index: np.ndarray, n_clusters: int) -> sp.csr_matrix:
    """``M = Y C`` binarised (document -> clusters of its labels) for stage 1's partition ``A_index``."""
    index = np.asarray(A_index)
    rows, slots = np.nonzero(index >= 0)
    labels = index[rows, slots]
    L = sp.csr_matrix(Y).shape[1]
    C = sp.csr_matrix((np.ones(len(labels), dtype=np.float32), (labels, rows)), shape=(L, int(n_clusters)))
    M = (binarize(Y) @ C).tocsr()
    M.data[:] = 1.0
    return M


@torch.no_grad()
def linear_start(model: EliasModel, emb: np.ndarray, Y: sp.spmatrix, l2: float = 0.001, scale: float = 4.0) -> None:
    """``head_init: linear``: ``W_C`` and ``W_L`` (and ``wl_bias``) as the least-squares fits
    (:func:`xmc_steps.linear_start.least_squares_head`) of ``+-scale`` targets on ``emb``, the
    *pre-trained* encoder's embeddings of the training texts: ``W_C`` of each document's clusters
    under the model's current ``A`` (stage 1's partition), ``W_L`` of its labels (in label chunks)."""
    M = partition_targets(Y, model.A_index.cpu().numpy(), model.n_clusters)
    Wc, _ = least_squares_head(emb, M, l2, scale)
    Wl, bl = least_squares_head(emb, Y, l2, scale, bias=model.wl_bias is not None, chunk=65536)
    model.Wc.copy_(torch.from_numpy(Wc).to(model.Wc.device))
    model.wl.copy_(torch.from_numpy(Wl).to(model.wl.device))
    if model.wl_bias is not None:
        model.wl_bias.copy_(torch.from_numpy(bl).to(model.wl_bias.device))


#: the classifiers stage 1 re-fits after training (``head_refit``); ``W_L``'s part of them
HEADS, WL_HEADS = ("Wc", "wl", "wl_bias"), ("wl", "wl_bias")

#: the evaluation :func:`refit_heads` calls: (predictions, metrics with ``shortlist_recall`` and ``p_at_1``)
Evaluation = tuple[dict[str, Any], dict[str, float]]


def refit_heads(model: EliasModel, emb: np.ndarray, Y: sp.spmatrix, l2: float, scale: float,
                evaluate: Callable[[], Evaluation], as_trained: Evaluation,
                select: str = "joint") -> tuple[Evaluation, dict[str, str], dict[str, Evaluation]]:
    """``head_refit``: ``W_C`` and ``W_L`` re-fit by :func:`linear_start` on ``emb`` (the fine-tuned
    encoder's embeddings of the training texts), then the heads kept by ``evaluate`` on the valid split
    (``as_trained``: its result for the trained heads, already computed).

    ``select: joint``: both re-fit heads when the valid shortlist recall is higher, else both trained.
    ``per_head``: ``W_C`` so (the shortlist is ``W_C``'s and ``A``'s alone), then ``W_L`` by the valid P@1
    it gives on that shortlist: the trained ``W_L`` with a re-fit ``W_C``, or the other way round, when
    the mix ranks better than the pair.  Returns the kept heads' evaluation, which of each head was kept
    (``{"Wc": "trained" | "re-fit", "wl": ...}``) and every evaluation by ``(W_C, W_L)``; the model holds
    the kept heads."""
    if select not in ("joint", "per_head"):
        raise ValueError(f"head_refit_select must be joint or per_head, not {select!r}")
    params = dict(model.named_parameters())
    keys = [k for k in HEADS if k in params]
    heads = {"trained": {k: params[k].detach().clone() for k in keys}}
    linear_start(model, emb, Y, l2, scale)
    heads["re-fit"] = {k: params[k].detach().clone() for k in keys}
    evals = {("trained", "trained"): as_trained, ("re-fit", "re-fit"): evaluate()}

    def load(wc: str, wl: str) -> None:
        with torch.no_grad():
            for k in keys:
                params[k].copy_(heads[wl if k in WL_HEADS else wc][k])

    wc = "re-fit" if evals["re-fit", "re-fit"][1]["shortlist_recall"] > as_trained[1]["shortlist_recall"] \
        else "trained"
    wl = wc
    if select == "per_head":
        other = "trained" if wc == "re-fit" else "re-fit"
        load(wc, other)
        evals[wc, other] = evaluate()
        if evals[wc, other][1]["p_at_1"] > evals[wc, wc][1]["p_at_1"]:
            wl = other
    load(wc, wl)
    return evals[wc, wl], {"Wc": wc, "wl": wl}, evals


# --------------------------------------------------------------------------- inference


@torch.no_grad()
def predict(model: EliasModel, tokens: neural.TokenData, topk: int = 100, b: int | None = None, K: int | None = None,
            batch_size: int = 128, device: torch.device | str = "auto", amp: str = "auto",
            shortlist_topk: int | None = None, with_emb: bool = True,
            progress: Callable[..., Any] | None = neural._default_log.info,
            yhat_power: float = EliasParams.yhat_power) -> dict[str, Any]:
    """Top-``topk`` labels by ``p`` (CSR N x L; ``yhat_power``: :meth:`EliasModel.shortlist`; its default is
    :class:`EliasParams`'s, the one the prediction parameters saved with a model take:
    :class:`xmc_steps.elias.serve.PredictParams`), the shortlist's top-``shortlist_topk`` by ``yhat``, phi(x),
    seconds.  A trained model's folder is predicted by :func:`xmc_steps.elias.serve.predict`."""
    device = neural.resolve_device(device)
    model.to(device)
    n, L = len(tokens), model.n_labels
    K_eff = min(int(K or model.K), L)
    k1, k2 = min(int(topk), K_eff), min(int(shortlist_topk or topk), K_eff)
    lab_p = np.full((n, k1), -1, dtype=np.int64)
    val_p = np.zeros((n, k1), dtype=np.float32)
    lab_s = np.full((n, k2), -1, dtype=np.int64)
    val_s = np.zeros((n, k2), dtype=np.float32)
    emb_all = np.zeros((n, model.dim), dtype=np.float32) if with_emb else None

    def fn(ids, mask):
        e = model.encode(ids, mask)
        labels, yhat, p = model.shortlist(e, b=b, K=K, yhat_power=yhat_power)
        pv, pi = torch.topk(p.float().masked_fill(labels < 0, -1.0), k1, dim=1)
        sv, si = torch.topk(yhat.float().masked_fill(labels < 0, -1.0), k2, dim=1)
        return e, labels.gather(1, pi), pv, labels.gather(1, si), sv

    t0 = time.perf_counter()
    for idx, (e, lp, pv, ls, sv) in neural.run_inference(fn, model, tokens, batch_size, device, amp, progress,
                                                         what="elias predict"):
        lab_p[idx], val_p[idx] = lp.cpu().numpy(), pv.float().cpu().numpy()
        lab_s[idx], val_s[idx] = ls.cpu().numpy(), sv.float().cpu().numpy()
        if with_emb:
            emb_all[idx] = e.float().cpu().numpy()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return {"scores": padded_to_csr(lab_p, val_p, L), "shortlist": padded_to_csr(lab_s, val_s, L), "emb": emb_all,
            "seconds": seconds}




@torch.no_grad()
def cluster_topb(model: EliasModel, emb: np.ndarray, b: int | None = None, batch_size: int = 4096) -> sp.csr_matrix:
    """Eq. 9's ``M`` from the documents' embeddings ``phi(x)`` (N x D, on the model's device in
    batches): CSR N x C with each document's top-``b`` cluster scores ``s_c`` (Eq. 1)."""
    n, C = len(emb), model.n_clusters
    b = min(int(b or model.b), C)
    vals = np.zeros((n, b), dtype=np.float32)
    inds = np.zeros((n, b), dtype=np.int32)
    for a in range(0, n, batch_size):
        e = torch.from_numpy(np.asarray(emb[a:a + batch_size], dtype=np.float32)).to(model.Wc.device)
        logits, s = model.cluster_scores(e)
        i = torch.topk(logits, b, dim=1).indices
        vals[a:a + len(e)], inds[a:a + len(e)] = s.gather(1, i).cpu().numpy(), i.cpu().numpy().astype(np.int32)
    M = sp.csr_matrix((vals.ravel(), inds.ravel(), np.arange(n + 1, dtype=np.int64) * b), shape=(n, C))
    M.sort_indices()
    return M


def shortlist_metrics(labels_csr: sp.csr_matrix, scores_csr: sp.csr_matrix | None, Y: sp.spmatrix) -> dict[str, float]:
    """``shortlist_recall`` (share of positives in the shortlist, averaged over documents with a positive)
    and ``p_at_1`` of ``scores_csr`` (its best label is a positive)."""
    Y = sp.csr_matrix(Y)
    out = {"shortlist_recall": recall_of_top(labels_csr, Y)}
    if scores_csr is not None:
        sc = sp.csr_matrix(scores_csr)
        n = sc.shape[0]
        lens = np.diff(sc.indptr)
        has_pred = lens > 0
        best = np.zeros(n, dtype=np.int64)
        if sc.nnz:
            rows = np.repeat(np.arange(n), lens)
            order = np.lexsort((-sc.data, rows))  # per row, best score first
            first = sc.indptr[:-1][has_pred]
            best[has_pred] = sc.indices[order[first]]
        T = sp.csr_matrix((has_pred.astype(np.float32), best, np.arange(n + 1)), shape=sc.shape)
        out["p_at_1"] = float(np.asarray(T.multiply(Y).sum(1)).ravel().astype(bool).mean()) if n else 0.0
    return out


# --------------------------------------------------------------------------- building / loading


def build_model(params: EliasParams, n_clusters: int, n_labels: int, kappa: int, fixed_edges: bool,
                pretrained: bool = True) -> EliasModel:
    neural.seed_everything(params.train.seed)
    enc = neural.TextEncoder(params.encoder, pooling=params.pooling, last_k=params.last_k, pretrained=pretrained)
    return EliasModel(enc, n_clusters, n_labels, kappa, alpha=params.alpha, beta=params.beta, b=params.b,
                      K=params.K, wl_bias=params.wl_bias, fixed_edges=fixed_edges)


def load_elias(folder: str | os.PathLike, device: str | torch.device = "cpu") -> EliasModel:
    """Load a model written by ``train`` (``elias.json`` + ``model.safetensors``)."""
    def build(enc: neural.TextEncoder, meta: dict[str, Any]) -> EliasModel:
        return EliasModel(enc, meta["C"], meta["L"], meta["kappa"], alpha=meta["alpha"], beta=meta["beta"],
                          b=meta["b"], K=meta["K"], wl_bias=meta["wl_bias"], fixed_edges=meta["fixed_edges"])

    return load_trained(folder, "elias.json", FORMAT, build, device)


def copy_stage1_weights(model: EliasModel, folder: Path) -> np.ndarray:
    """Stage 1's encoder, ``W_C`` and ``W_L`` into ``model``; returns stage 1's ``A_index`` (its
    clusters' labels, for ``a_init: partition``)."""
    from safetensors.torch import load_file

    sd = load_file(str(folder / WEIGHTS))
    own = model.state_dict()
    take = {k: v for k, v in sd.items() if k.startswith("encoder.") or k in ("Wc", "wl", "wl_bias")}
    for k, v in take.items():
        if k not in own:
            continue
        if tuple(own[k].shape) != tuple(v.shape):
            raise StageError(f"stage-1 weight {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    missing = [k for k in own if k.startswith("encoder.") and k not in take]
    if missing:
        raise StageError(f"stage-1 model lacks encoder weights, e.g. {missing[0]}")
    model.load_state_dict({k: v for k, v in take.items() if k in own}, strict=False)
    if "A_index" not in sd:
        raise StageError(f"{folder}/{WEIGHTS} has no A_index")
    return sd["A_index"].numpy()
