"""ELIAS (Gupta et al., NeurIPS 2022): a learnable cluster-to-label index trained end to end.

Readings and measured choices: docs/methods/elias.md (the model and its equations, staged training,
the sizes from the data, the linear start, choosing the defaults, the guard; the test-split tables).

Files: :mod:`.params` (:class:`EliasSection`, the ``elias`` section; :class:`EliasParams`, a stage's),
:mod:`.model` (the network, the index initialisation of Eqs. 9-10, inference, saving and loading), :mod:`.loss` (:func:`elias_loss`),
:mod:`.train` (the training driver: SWA, ``wl_decay``, evaluation), :mod:`.run` (a training run as its
stage runs it: inputs, model, training, guard, outputs), :mod:`.serve` (the one prediction path of a
trained folder, the predict stage's and serving's: :class:`~.serve.PredictParams`, :func:`~.serve.predict`);
the guard is the shared :mod:`xmc_steps.guard`; the stage is :mod:`xmc_steps.stages.elias`
(``python -m xmc_steps.stages.elias``).
"""

from ..methods import lazy_exports

#: the public names, each imported from its submodule on first use (``import xmc_steps.elias.spec`` costs no torch)
_EXPORTS = {
    "FORMAT": ".model",
    "STAGE_DEFAULTS": ".params",
    "EliasModel": ".model",
    "EliasParams": ".params",
    "EliasSection": ".params",
    "GuardReport": "..guard",
    "Shortlist": ".model",
    "adjacency_from_assignment": ".model",
    "build_model": ".model",
    "check_stage": "..guard",
    "cluster_topb": ".model",
    "decay_touched_rows": ".train",
    "default_K": ".params",
    "default_b": ".params",
    "elias_loss": ".loss",
    "guard_width": "..guard",
    "init_adjacency": ".model",
    "linear_start": ".model",
    "load_elias": ".model",
    "partition_start": ".model",
    "partition_targets": ".model",
    "predict": ".model",
    "refit_heads": ".model",
    "shortlist_metrics": ".model",
    "train_elias": ".train",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
