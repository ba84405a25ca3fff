"""GUDN parameters: the LightXML backbone's (:class:`~xmc_steps.lightxml.LightXMLParams`, composed as
``backbone``) and the guide network's own."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..lightxml.params import LightXMLParams
from ..params import Params

FEATURE_LOSSES = ("paper", "mean", "relative")
FEATURE_WEIGHTS = ("fixed", "balanced", "gated")


@dataclass
class GUDNParams(Params):
    """The defaults are config.yaml's ``gudn`` section (tests/test_params.py keeps them equal)."""

    backbone: LightXMLParams = field(default_factory=lambda: LightXMLParams(last_k=10))
    feature_guide: bool = True        # Eq. 2: text features towards their label sequence's features
    link_guide: bool = True           # Eq. 3: the labels predicted from the label features
    feature_loss: str = "mean"        # mean: the mean over every coordinate (the authors' MSELoss) |
                                      # paper: Eq. 2 as written (squared distance / 2, mean over texts) |
                                      # relative: Eq. 2's squared distances over the batch's spread (ours);
                                      # see the package docstring for what each does
    feature_weight: str = "gated"     # fixed: Eq. 6 as written (weight 1, config.paper.yaml) | gated (ours, config.yaml):
                                      # 1 or 0, decided on the start's model (xmc_steps.gudn.loss.gate_ratio) |
                                      # balanced (ours): at each step at most the weight that makes the guide's gradient
                                      # on the text features as large as the classification loss's
                                      # (xmc_steps.gudn.loss.balanced_weight)
    label_max_length: int = 32        # tokens of a text's label sequence
    label_separator: str = "; "       # between the label texts of one sequence

    def __post_init__(self) -> None:
        if self.feature_loss not in FEATURE_LOSSES:
            raise ValueError(f"feature_loss must be one of {', '.join(FEATURE_LOSSES)}, got {self.feature_loss!r}")
        if self.feature_weight not in FEATURE_WEIGHTS:
            raise ValueError(f"feature_weight must be one of {', '.join(FEATURE_WEIGHTS)}, got {self.feature_weight!r}")
        if self.label_max_length < 2:
            raise ValueError(f"label_max_length must be >= 2, got {self.label_max_length}")

    _what = "GUDN parameter"
