"""The methods of the pipeline: one line each.

A method is a :class:`~xmc_steps.methods.MethodSpec` declared in its package's ``spec`` module.
The rules (``common.smk``: the method names, the ``method`` wildcard and the rule files the
Snakefile includes; ``evaluate.smk``: predictions and stage records), :mod:`xmc_steps.config`
(settings sections, encoder references), :mod:`xmc_steps.target_params` (shared concepts) and
:mod:`xmc_steps.serving` (predictors) read this table and list no method themselves.

To add a method: its package (model, its parameter tree, ``spec.py`` with ``SPEC``), its stage, its rule
file, its config section (``config.yaml``, the paper's values in ``config.paper.yaml``) and one line below;
the schema's section is generated from the tree (docs/architecture.md, "Adding a method").
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Mapping

from .methods import MethodSpec

#: the methods: one line each, the module that declares its ``SPEC``, in the order their rule files
#: are included (a rule file may use rules of one above it)
SPEC_MODULES = (
    "xmc_steps.xr_linear.spec",
    "xmc_steps.parabel.spec",
    "xmc_steps.xtransformer.spec",
    "xmc_steps.elias.spec",
    "xmc_steps.lightxml.spec",
    "xmc_steps.gudn.spec",
    "xmc_steps.dual_encoder.spec",
)

#: every method, by target name
METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec``; its name must be new and a valid target name."""
    if spec.name in METHODS and METHODS[spec.name] is not spec:
        raise ValueError(f"method '{spec.name}' is registered twice")
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", spec.name):
        raise ValueError(f"method name '{spec.name}': lower-case letters, digits and hyphens")
    METHODS[spec.name] = spec
    return spec


for _module in SPEC_MODULES:
    register(importlib.import_module(_module).SPEC)


def split_method(method: str) -> tuple[str, str | None]:
    """``xtransformer-foo`` -> (``xtransformer``, ``foo``); ``xr-linear`` -> (``xr-linear``, None).
    The longest registered name that ``method`` is, or starts with followed by ``-``, wins."""
    for name in sorted(METHODS, key=len, reverse=True):
        if method == name:
            return name, None
        if method.startswith(name + "-") and METHODS[name].has_variants:
            return name, method[len(name) + 1:]
    return method, None


def get(method: str) -> MethodSpec:
    """The spec of a target name (variants included); an unknown method is a KeyError naming the known."""
    base, _ = split_method(method)
    if base not in METHODS:
        raise KeyError(f"unknown method '{method}' (known: {', '.join(METHODS)})")
    return METHODS[base]


def method_re() -> str:
    """The ``method`` wildcard: a registered name, with ``-<variant>`` where the method has variants."""
    plain = [n for n, s in METHODS.items() if not s.has_variants]     # names are [a-z0-9-]: no escaping
    varied = [n for n, s in METHODS.items() if s.has_variants]
    return "|".join(plain + ([f"({'|'.join(varied)})(-[A-Za-z0-9_.-]+)?"] if varied else []))


def rule_files() -> list[str]:
    """The methods' rule files (``workflow/rules/<file>``), each once, in registration order."""
    return list(dict.fromkeys(s.rules for s in METHODS.values()))


def patterns() -> dict[str, str]:
    """Every artifact path pattern: the shared ones (:data:`xmc_steps.layout.PATTERNS`) and the methods'."""
    from . import layout

    out = dict(layout.PATTERNS)
    for s in METHODS.values():
        out.update(s.patterns)
    return out


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(dotted key, encoder key)`` of every place a settings block names an encoder: the shared
    ``tokenize`` stage's and each method's."""
    refs = [("tokenize.encoder", (settings.get("tokenize") or {}).get("encoder"))]
    for s in METHODS.values():
        refs += s.encoder_refs(settings)
    return [(where, k) for where, k in refs if k is not None]


def tree_settings(settings: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The settings of the cluster tree called ``name`` (``tree-b16-l100-s0``): the one among the trees
    the registered methods read under ``settings`` (:attr:`~xmc_steps.methods.MethodSpec.trees`) whose
    name it is, with ``min_leaves`` (the floor on the cluster count, 1 without one) and the shared
    ``cluster.max_iter``.  A name no method asks for is a KeyError naming the configured trees."""
    from .layout import tree_name

    found: dict[str, dict[str, Any]] = {}
    for spec in METHODS.values():
        for c in spec.trees(settings):
            found.setdefault(tree_name(c), c)
    if name not in found:
        raise KeyError(f"no configured method reads the cluster tree '{name}' (configured: {', '.join(sorted(found))})")
    c = found[name]
    return {"branching": int(c["branching"]), "leaf_size": int(c["leaf_size"]), "seed": int(c["seed"]),
            "min_leaves": max(1, int(c.get("min_clusters") or 1)), "max_iter": int(settings["cluster"]["max_iter"])}
