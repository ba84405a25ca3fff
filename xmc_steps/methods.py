"""What a method declares so that the DAG, evaluation, the settings and ``predict`` can find it.

A method (xr-linear, parabel, xtransformer, elias, lightxml, gudn, or yours) is one
:class:`MethodSpec`, declared in its package's light ``spec`` module (no torch, no scikit-learn:
Snakemake imports every spec when it parses the workflow) and listed once in
:mod:`xmc_steps.registry`.  Everything that used to switch on the method's name reads the spec:

* ``workflow/rules/common.smk``: the method names and the ``method`` wildcard (:func:`method_re`);
* ``workflow/rules/evaluate.smk``: the predictions a target is evaluated on and its stage records;
* :mod:`xmc_steps.config`: the settings sections a target depends on, the encoder references;
* :mod:`xmc_steps.target_params`: the concepts shared across methods (MLflow's compare view);
* :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): the predictor.

Adding a method is its package (model, its parameter tree, ``spec``), its rule file (``workflow/rules/<name>.smk``,
included by the Snakefile from the registry), its config section and one line in the registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports", "MethodSpec", "Only", "BASE_SETTINGS", "TREE_SETTINGS", "no_encoders", "flat_concepts",
           "encoder_names", "train_length"]

#: the settings every stage reads (the split and the ingested data), and those of a stage that also reads the
#: shared PIFA-TF-IDF cluster tree: the start of most rules' entries in ``rule_settings``
BASE_SETTINGS = ["split", "ingest"]
TREE_SETTINGS = BASE_SETTINGS + ["tfidf", "cluster"]



@dataclass(frozen=True)
class Only:
    """A ``passes`` entry: the section ``key`` with only its keys ``names``, in its own shape (``Only("elias",
    ("index", "stage1"))`` passes ``{"index": {...}, "stage1": {...}}``).  Its hash entries are the dotted keys
    ``key.name`` (:func:`xmc_steps.config.expand`)."""

    key: str
    names: tuple[str, ...]

    @property
    def keys(self) -> list[str]:
        return [f"{self.key}.{n}" for n in self.names]


#: ``f(res, dataset, settings, variant) -> path`` of the test predictions a target is evaluated on
Predictions = Callable[[str, str, Mapping[str, Any], "str | None"], str]
#: ``f(res, dataset, settings, variant) -> [path]``: the stage records of a target's own stages
Records = Callable[[str, str, Mapping[str, Any], "str | None"], list]
#: ``f(settings) -> [(dotted key, encoder key)]``: every place the method's settings name an encoder
EncoderRefs = Callable[[Mapping[str, Any]], list]
#: ``f(settings, variant, n_labels) -> {concept: value}`` (:data:`xmc_steps.target_params.CONCEPTS`)
Concepts = Callable[[Mapping[str, Any], "str | None", "int | None"], dict]


def no_encoders(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The encoder references of a method that reads no neural encoder."""
    return []


def encoder_names(settings: Mapping[str, Any], keys: list[str]) -> str:
    """Encoder keys as ``key=name`` (the name a key stands for in this config), joined by ``+``."""
    names = settings.get("encoders") or {}
    return "+".join(f"{k}={names[k]}" if k in names else str(k) for k in keys)


def train_length(train: Mapping[str, Any]) -> str:
    """A training recipe's length: its epochs, or ``<n> steps`` where it fixes the step count."""
    if train.get("steps"):
        return f"{train['steps']} steps"
    return str(train.get("epochs", "n/a"))


def flat_concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    """No shared concept (every one ``n/a``)."""
    return {}


@dataclass(frozen=True)
class MethodSpec:
    """One method, as the rest of the pipeline sees it.

    ``name`` is the target name (``results/<dataset>/<name>[-<variant>].json``); ``section`` its own
    config section (``xr_linear``); ``sections`` every settings section its targets depend on (their
    hash names the target's MLflow run; a change elsewhere does not rerun it); ``variants`` the
    variant names it accepts after ``<name>-`` (``None``: no variants; ``("*",)``: variants named in
    the settings, checked by ``predictions``); ``rules`` the rule file's name under
    ``workflow/rules/``; ``predictor`` a ``"module:function"`` reference, imported only when asked (or the function itself)
    (``f(target, variant, features, topk, device) -> CSR scores``, :mod:`xmc_steps.serving`);
    ``encoder_refs`` and ``concepts`` see a dataset's effective settings."""

    name: str
    section: str
    sections: tuple[str, ...]
    predictions: Predictions
    records: Records
    predictor: str | Callable[..., Any]
    rules: str
    variants: tuple[str, ...] | None = None
    encoder_refs: EncoderRefs = no_encoders
    concepts: Concepts = flat_concepts
    #: ``f(settings, variant) -> {key: value}``: settings a variant overrides, logged beside the concepts
    applied: Callable[[Mapping[str, Any], "str | None"], dict] = lambda settings, variant: {}
    #: ``f(settings) -> [cluster settings]``: every cluster tree its targets read (``branching``, ``leaf_size``,
    #: ``min_clusters``, ``seed``), so the cluster rule takes a tree's values from the settings, not its name
    trees: Callable[[Mapping[str, Any]], list] = lambda settings: []
    #: the parameter class of each of its config sections: ``(dotted section, "module:Class", subsections
    #: whose keys are fields of that class)``, ``*`` every key of a map; ``tests/test_settings_source.py``
    #: holds the schema's enums and bounds of these sections equal to the classes'
    params: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    #: ``"module:Class"``: the parameter tree of its whole config section (``section``), shaped like it; the
    #: schema's section is generated from it (:mod:`xmc_steps.schema`), its defaults are config.yaml's
    tree: str = ""
    #: the settings each of its rules passes its stage (``params.settings``, :func:`xmc_steps.config.rule_payload`):
    #: rule name -> dotted keys, each a section passed unchanged; they are part of the rule's hash
    #: (:data:`xmc_steps.config.RULE_SETTINGS` adds them to ``rule_settings``), so the two cannot disagree
    passes: Mapping[str, list] = field(default_factory=dict)
    #: its rules' settings (:data:`xmc_steps.config.RULE_SETTINGS`'s entries): rule name -> dotted keys
    rule_settings: Mapping[str, list] = field(default_factory=dict)
    #: the method's artifact path patterns by name (``{dataset}/...``, as :mod:`xmc_steps.layout`'s)
    patterns: Mapping[str, str] = field(default_factory=dict)
    #: the paper (or library) the method follows, one line: the MLflow runs' descriptions name it
    paper: str = ""

    @property
    def has_variants(self) -> bool:
        return self.variants is not None

    def load_predictor(self) -> Callable[..., Any]:
        if callable(self.predictor):
            return self.predictor
        module, _, attr = self.predictor.partition(":")
        return getattr(importlib.import_module(module), attr)


def lazy_exports(package: str, exports: Mapping[str, str], modules: tuple[str, ...] = ()) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562) that imports each re-exported name from its
    submodule (``exports``: name -> ``.submodule``) on first use: ``import xmc_steps.elias.spec``
    (what Snakemake does for every method) then costs no torch, while ``from xmc_steps.elias import
    train_elias`` still works.  ``modules``: submodules reachable as attributes without an import."""

    def __getattr__(name: str) -> Any:
        if name in modules:                      # a submodule as an attribute (``xtransformer.matcher``)
            return importlib.import_module(f".{name}", package)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
