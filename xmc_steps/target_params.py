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

from . import layout
from .params import flatten

__all__ = ["CONCEPTS", "NA", "concepts", "parent_params"]

#: the shared names, in the order the compare view lists them
CONCEPTS = ("encoder", "max_length", "epochs", "cluster_leaf_size", "beam", "negatives", "ensemble")

#: the value of a concept a method does not have
NA = "n/a"


def _encoder_names(settings: Mapping[str, Any], keys: list[str]) -> str:
    """Encoder keys as ``key=name`` (the name a key stands for in this config), joined by ``+``."""
    names = settings.get("encoders") or {}
    return "+".join(f"{k}={names[k]}" if k in names else str(k) for k in keys)


def _epochs(train: Mapping[str, Any]) -> str:
    """A training recipe's length: its epochs, or ``<n> steps`` where it fixes the step count."""
    if train.get("steps"):
        return f"{train['steps']} steps"
    return str(train.get("epochs", NA))


def concepts(method: str, settings: Mapping[str, Any], n_labels: int | None = None) -> dict[str, str]:
    """The shared concepts of ``method`` (a target name, variants included) under ``settings``.

    ``n_labels`` decides LightXML's and GUDN's mode (one label per cluster up to
    ``flat_max_labels``: ``cluster_leaf_size = 1``); without it the configured leaf size is given.
    """
    base, variant = layout.split_method(method)
    c = dict.fromkeys(CONCEPTS, NA)
    if base == "xr-linear":
        xr = settings["xr_linear"]
        c.update(encoder="tfidf", cluster_leaf_size=settings["cluster"]["leaf_size"], beam=xr["beam"],
                 negatives=xr["negatives"], ensemble=1)
    elif base == "parabel":
        pb = settings["parabel"]
        c.update(encoder="tfidf", cluster_leaf_size=pb["min_branch_size"], beam=pb["beam"],
                 negatives="parent-positives", ensemble=pb["n_trees"])
    elif base == "xtransformer":
        xt = settings["xtransformer"]
        spec = layout.xt_spec(settings, variant)
        c.update(encoder=_encoder_names(settings, list(spec["encoders"])), max_length=xt["matcher"]["max_length"],
                 epochs=_epochs(xt["matcher"]["train"]), cluster_leaf_size=xt["cluster"]["leaf_size"],
                 beam=xt["matcher"]["topb"], negatives=spec["negatives"],
                 ensemble=len(layout.xt_members(settings, variant)))
    elif base == "elias":
        el = settings["elias"]
        c.update(encoder=_encoder_names(settings, [el["encoder"]]), max_length=el["max_length"],
                 epochs="+".join(_epochs(el[s]["train"]) for s in ("stage1", "stage2") if variant != "stage1" or s == "stage1"),
                 cluster_leaf_size=el["cluster"]["leaf_size"], beam=el["index"]["b"],
                 negatives=f"shortlist-{el['index']['K']}", ensemble=len(layout.elias_seeds(settings, variant)))
    elif base in ("lightxml", "gudn"):
        net = settings["lightxml"] if base == "lightxml" else settings["gudn"]["backbone"]
        flat = n_labels is not None and n_labels <= net["flat_max_labels"]
        members = layout.lightxml_members(settings, variant) if base == "lightxml" else [None]
        encoders = sorted({m.enc for m in members}) if base == "lightxml" else [net["encoder"]]
        c.update(encoder=_encoder_names(settings, encoders), max_length=net["max_length"], epochs=_epochs(net["train"]),
                 cluster_leaf_size=1 if flat else net["cluster"]["leaf_size"], beam=net["topb"],
                 negatives="static" if variant == "static" else "dynamic", ensemble=len(members))
    return {k: str(v) for k, v in c.items()}


def parent_params(doc: Mapping[str, Any], n_labels: int | None = None) -> dict[str, Any]:
    """The parameters of a target's parent run from its effective config document
    (``{"dataset", "method", "config_hash", "settings"}``): the concepts first, then
    ``dataset``, ``method``, ``config_hash``, ``variant``, then every setting flattened."""
    settings = doc.get("settings") or {}
    out: dict[str, Any] = concepts(doc["method"], settings, n_labels)
    out.update(dataset=doc["dataset"], method=doc["method"], config_hash=doc.get("config_hash", ""))
    base, variant = layout.split_method(doc["method"])
    out["variant"] = variant or "none"
    if base == "xtransformer":  # a variant overrides these settings: the applied values
        for k, v in layout.xt_spec(settings, variant).items():
            out[f"xtransformer.applied.{k}"] = v
    for k, v in flatten(settings).items():
        out.setdefault(k, v)
    return out
