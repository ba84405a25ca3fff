"""The hyper-parameters of a target, under names shared across methods.

A target's parent run in MLflow (one per dataset and method, :mod:`xmc_steps.tracking`)
carries what the MLflow compare view needs to say *what differed* between two methods
or two variants of one:

* **concepts** that several methods share, each under one name whatever the method
  calls it in ``config.yaml`` (:data:`CONCEPTS`): ``encoder`` (``tfidf`` for the sparse
  linear methods), ``max_length``, ``epochs``, ``cluster_leaf_size``, ``beam``,
  ``negatives`` and ``ensemble`` (the number of models averaged).  A concept a method
  does not have is ``n/a``, so the compare view lines the columns up instead of leaving
  holes;
* ``dataset``, ``method``, ``variant`` and ``config_hash`` (that of the target's effective
  config); for X-Transformer also the variant's applied settings (``xtransformer.applied.*``);
* every effective setting the target depends on, flattened with dotted keys under its
  config section (``lightxml.train.lr``, ``xr_linear.solver.C``), variants applied.

:func:`parent_params` builds them from the effective config document the
``effective_config`` rule writes (``results/{dataset}/config/{method}.json``).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import registry
from .params import flatten

__all__ = ["CONCEPTS", "NA", "concepts", "parent_params"]

#: the shared names, in the order the compare view lists them
CONCEPTS = ("encoder", "max_length", "epochs", "cluster_leaf_size", "beam", "negatives", "ensemble")

#: the value of a concept a method does not have
NA = "n/a"


def concepts(method: str, settings: Mapping[str, Any], n_labels: int | None = None) -> dict[str, str]:
    """The shared concepts of ``method`` (a target name, variants included) under ``settings``: what
    its spec says (:attr:`xmc_steps.methods.MethodSpec.concepts`), :data:`NA` for the others.

    ``n_labels`` decides LightXML's and GUDN's mode (one label per cluster up to
    ``flat_max_labels``: ``cluster_leaf_size = 1``); without it the configured leaf size is given.
    """
    base, variant = registry.split_method(method)
    c = dict.fromkeys(CONCEPTS, NA)
    if base in registry.METHODS:
        got = registry.METHODS[base].concepts(settings, variant, n_labels)
        unknown = set(got) - set(CONCEPTS)
        if unknown:
            raise KeyError(f"method '{base}' states concepts that are not shared ones: {sorted(unknown)} "
                           f"(target_params.CONCEPTS: {', '.join(CONCEPTS)})")
        c.update(got)
    return {k: str(v) for k, v in c.items()}


def parent_params(doc: Mapping[str, Any], n_labels: int | None = None) -> dict[str, Any]:
    """The parameters of a target's parent run from its effective config document
    (``{"dataset", "method", "config_hash", "settings"}``): the concepts first, then
    ``dataset``, ``method``, ``config_hash``, ``variant``, then the settings a variant applies
    (:attr:`~xmc_steps.methods.MethodSpec.applied`), then every setting flattened."""
    settings = doc.get("settings") or {}
    out: dict[str, Any] = concepts(doc["method"], settings, n_labels)
    out.update(dataset=doc["dataset"], method=doc["method"], config_hash=doc.get("config_hash", ""))
    base, variant = registry.split_method(doc["method"])
    out["variant"] = variant or "none"
    if base in registry.METHODS:
        out.update(registry.METHODS[base].applied(settings, variant))
    for k, v in flatten(settings).items():
        out.setdefault(k, v)
    return out
