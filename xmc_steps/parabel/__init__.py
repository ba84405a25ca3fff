"""Parabel (omikuji): the model (:mod:`.model`, whose docstring holds the method and its readings), the
method's spec for the registry (:mod:`.spec`) and its predictor (:mod:`.serve`).  The stage is
:mod:`xmc_steps.stages.parabel`."""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.parabel.spec`` is light)
_EXPORTS = {
    "HYPER_KEYS": ".model",
    "ParabelParams": ".model",
    "PredictParams": ".model",
    "META": ".model",
    "save_meta": ".model",
    "write_xmc_file": ".model",
    "train": ".model",
    "predict": ".model",
    "load": ".model",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
