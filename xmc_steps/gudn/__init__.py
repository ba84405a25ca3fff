"""GUDN (Wang et al., "GUDN: A novel guide network for extreme multi-label text classification"):
the LightXML network (:mod:`xmc_steps.lightxml`) trained with a guide network that reads each
training text's gold label texts.

Readings and measured choices: docs/methods/gudn.md (backbone, feature extractor, feature guide and
link guide, the gate, the measured runs).

Files: :mod:`.params` (:class:`GUDNParams`), :mod:`.loss` (Eqs. 2-4, and :class:`GuideNetwork`: the guide
as :func:`xmc_steps.lightxml.train.train_lightxml` takes it), :mod:`.labels` (the label sequences).  The
stage is :mod:`xmc_steps.stages.gudn` (``python -m xmc_steps.stages.gudn train``): it builds the guide and
trains the backbone with it through LightXML's own training run (:func:`xmc_steps.lightxml.run.run_training`).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.gudn.spec`` costs no torch)
_EXPORTS = {
    "GUDNParams": ".params",
    "GuideNetwork": ".loss",
    "feature_guide": ".loss",
    "gate_ratio": ".loss",
    "guide_loss": ".loss",
    "label_sequences": ".labels",
    "label_tokens": ".labels",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
