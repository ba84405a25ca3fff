"""Dual encoder (NGAME: Dahiya et al., WSDM 2023; DEXML: Gupta et al., ICLR 2024): one transformer embeds
the texts and the label texts in one space, trained so that a text's labels are its nearest; prediction
is a nearest-neighbour search over the label embeddings (:mod:`xmc_steps.ann`), so no parameter grows with
the label count and a label without training texts is scored by its text alone.

Readings and measured choices: docs/methods/dual-encoder.md (the model, the losses, NGAME's batches,
mined negatives, training, the guard, the settings and their defaults, choosing the defaults, measured).

Files: :mod:`.params`, :mod:`.model` (the network, label tokens, search, prediction, saving and loading),
:mod:`.loss`, :mod:`.batching`, :mod:`.train` (the driver; the guard's advice, the guard being the shared
:mod:`xmc_steps.guard`), :mod:`.run` (the training run its stage calls), :mod:`.spec`, :mod:`.serve`.
The stage is :mod:`xmc_steps.stages.dual_encoder` (``python -m xmc_steps.stages.dual_encoder``).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.dual_encoder.spec`` costs no torch)
_EXPORTS = {
    "DualEncoder": ".model",
    "DualEncoderParams": ".params",
    "FORMAT": ".model",
    "TRAIN_DEFAULTS": ".params",
    "balanced_clusters": ".batching",
    "build_label_index": ".model",
    "build_model": ".model",
    "cluster_order": ".batching",
    "encode": ".model",
    "label_tokens": ".model",
    "load_dual_encoder": ".model",
    "load_label_index": ".model",
    "pool_loss": ".loss",
    "predict": ".model",
    "train_dual_encoder": ".train",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
