"""The toy method's settings: the ``toymethod`` config section, declared once (the schema's section is generated
from it: xmc_steps.schema)."""

from __future__ import annotations

from dataclasses import dataclass

from ..params import Params, bounded


@dataclass
class ToyParams(Params):
    """The label-frequency prior."""

    topk: int = bounded(10, ge=1)  # labels written per test document
    smoothing: float = bounded(0.0, ge=0)  # added to every label's count before the frequencies are taken

    _what = "toy method parameter"
