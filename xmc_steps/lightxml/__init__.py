"""LightXML (Jiang et al., AAAI 2021): one transformer trained end to end with a generator that
recalls label clusters and a discriminator that ranks their labels, the negatives re-drawn from
the current generator at every step ("dynamic negative sampling").

Readings and measured choices: docs/methods/lightxml.md (the model, static negatives, ensembles,
training, the start and the rates, the clustered start, the guard).

Files: :mod:`.params` (:class:`LightXMLParams`), :mod:`.model` (the network, candidates, losses,
inference, loading), :mod:`.train` (the training driver, and the :class:`~.train.Guide` another loss plugs
in as), :mod:`.run` (a training run as the stages run it: inputs, model, training, guard, outputs).  The
stage is :mod:`xmc_steps.stages.lightxml` (``python -m xmc_steps.stages.lightxml``).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.lightxml.spec`` costs no torch)
_EXPORTS = {
    "FORMAT": ".model",
    "TRAIN_DEFAULTS": ".params",
    "Candidates": ".model",
    "Guide": ".train",
    "LightXMLModel": ".model",
    "LightXMLParams": ".params",
    "build_model": ".model",
    "cluster_table": ".model",
    "frequency_prior": "..guard",
    "load_lightxml": ".model",
    "predict": ".model",
    "train_lightxml": ".train",
    "valid_metrics": ".train",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
