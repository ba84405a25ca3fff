"""XR-Linear: the model (:mod:`.model`, whose docstring holds the method and its readings), the
method's spec for the registry (:mod:`.spec`) and its predictor (:mod:`.serve`).  The stage is
:mod:`xmc_steps.stages.xr_linear`."""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.xr_linear.spec`` is light)
_EXPORTS = {
    "FORMAT": ".model",
    "XRLinearParams": ".model",
    "PredictParams": ".model",
    "with_bias": ".model",
    "XRLinearModel": ".model",
    "max_children": ".model",
    "train_bytes": ".model",
    "predict_bytes": ".model",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
