"""GUDN parameters: the LightXML backbone's (:class:`~xmc_steps.lightxml.LightXMLParams`, composed as
``backbone``) and the guide network's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..lightxml.params import LightXMLParams, LightXMLSection
from ..params import Params, bounded

#: Eq. 2's distance between the text and the label features (see ``feature_loss`` below)
FeatureLoss = Literal["paper", "mean", "relative"]
#: the guide's weight in Eq. 6 (see ``feature_weight`` below)
FeatureWeight = Literal["fixed", "balanced", "gated"]


@dataclass
class GUDNParams(Params):
    """The defaults are config.yaml's ``gudn`` section (tests/test_params.py keeps them equal)."""

    backbone: LightXMLParams = field(default_factory=lambda: LightXMLParams(last_k=10))
    feature_guide: bool = True        # Eq. 2: text features towards their label sequence's features
    link_guide: bool = True           # Eq. 3: the labels predicted from the label features
    feature_loss: FeatureLoss = "mean"  # mean: the mean over every coordinate (the authors' MSELoss) |
                                      # paper: Eq. 2 as written (squared distance / 2, mean over texts) |
                                      # relative: Eq. 2's squared distances over the batch's spread (ours);
                                      # see docs/methods/gudn.md for what each does
    feature_weight: FeatureWeight = "gated"  # fixed: Eq. 6 as written (weight 1, config.paper.yaml) |
                                      # gated (ours, config.yaml): 1 or 0, decided on the start's model
                                      # (xmc_steps.gudn.loss.gate_ratio) | balanced (ours): at each step at most
                                      # the weight that makes the guide's gradient on the text features as
                                      # large as the classification loss's (xmc_steps.gudn.loss.balanced_weight)
    label_max_length: int = bounded(32, ge=2)  # tokens of a text's label sequence
    label_separator: str = "; "       # between the label texts of one sequence

    _what = "GUDN parameter"


@dataclass
class GUDNSection(GUDNParams):
    """GUDN (xmc_steps.gudn): the ``gudn`` section; its backbone: changes to the lightxml section."""

    backbone: LightXMLSection = field(default_factory=lambda: LightXMLSection(last_k=10))  # GUDN's network:
                                      # changes to the lightxml section
