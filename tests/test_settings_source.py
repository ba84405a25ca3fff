"""One source for every setting: a setting's choices (a ``Literal[...]`` annotation) and numeric
bounds (:func:`xmc_steps.params.bounded`) are declared on its parameter class, and the
configuration schema (workflow/schemas/config.schema.json) states the same ones.

The test walks every section of the schema's settings that a parameter class reads
(:data:`SECTIONS`: a key of the section that is a field of the class is that field's setting; a
field holding a parameter object is a nested section) and asserts, setting by setting, that the
schema's ``enum`` is the field's ``Literal`` choices (in order) and that the schema's
``minimum``/``exclusiveMinimum``/``maximum``/``exclusiveMaximum`` are the field's bounds; and that
no ``Literal`` field lacks its enum in the schema (:data:`NOT_IN_SCHEMA` says why a field is not
a key of any section).  The wildcard constraints of workflow/rules/common.smk are built from the
same ``Literal`` types.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
import typing
from pathlib import Path

import pytest

from xmc_steps import config, negatives, params, registry
from xmc_steps.params import Params

ROOT = Path(__file__).resolve().parents[1]

#: the settings sections a parameter class reads, from each method's spec (``MethodSpec.params``): (dotted
#: section of the schema's settings, ``"module:Class"``, sub-sections whose keys are fields of the same
#: class); ``*`` is every key of a map
SECTIONS = [entry for spec in registry.METHODS.values() for entry in spec.params]
#: the settings sections no stage's parameter class reads (their stages take flags or read them as they are; the
#: shared ones are declared as trees in xmc_steps/sections.py, which the schema is generated from);
#: their subsections with a class are in SECTIONS
NO_CLASS = {"split", "ingest", "tfidf", "encoders", "tokenize", "cluster", "evaluate", "threads",
            "xtransformer", "resources", "suggestions", "seeds"}

#: Literal fields that are no key of any section, and why
NOT_IN_SCHEMA = {
    "LightXMLParams.negatives": "the rules' {sampling} wildcard: lightxml's dynamic negatives, lightxml-static's static",
    "EliasPlusParams.transform": "ELIAS++ re-ranks with the default transform: not a key of elias.plus",
    "DualEncoderRankerParams.transform": "the dual encoder's ranker (ELIAS++'s class) re-ranks with the default "
                                         "transform: not a key of dual_encoder.ranker",
}

#: settings whose schema bounds are meant to differ from the class's: (schema's, class's, why);
#: both are asserted, so either side drifting still fails
DIFFERENT = {
    "elias.stage1.lr_A": ({"exclusiveMinimum": 0}, {"minimum": 0},
                          "the class's stage-1 default is 0 (A is fixed in stage 1; the rate is in the checkpoint "
                          "fingerprint): a configured rate must be > 0"),
    "elias.stage2.lr_A": ({"exclusiveMinimum": 0}, {"minimum": 0},
                          "stage 2 trains A: EliasParams.resolved(2, ...) needs lr_A > 0, the schema says so first"),
}

#: checks that fail only because a class of a module being moved has not yet declared its choices and
#: bounds (the edits its owner makes: see the lead's notes); strict, so each one flips when its edit lands
PENDING: dict[str, str] = {}


@functools.cache
def _schema() -> dict:
    return json.loads(config.SCHEMA_PATH.read_text())


def _deref(node: dict) -> dict:
    while "$ref" in node:
        target: typing.Any = _schema()
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = target
    return node


def _node(dotted: str) -> dict:
    """The schema of a settings section (``*``: the schema of a map's values)."""
    node = _deref(_schema()["$defs"]["settings"])
    for part in dotted.split("."):
        node = _deref(node["additionalProperties"] if part == "*" else node["properties"][part])
    return node


@functools.cache
def _cls(ref: str) -> type:
    """The class of a ``"module:Class"`` reference."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


class Setting(typing.NamedTuple):
    where: str          # dotted key of the schema's settings
    cls: type
    field: str
    schema: dict        # the key's schema


def _walk(node: dict, cls: type, where: str, flat: tuple[str, ...] = ()) -> typing.Iterator[Setting]:
    fs = {f.name: f for f in dataclasses.fields(cls)}
    for key, prop in node.get("properties", {}).items():
        here, prop = f"{where}.{key}", _deref(prop)
        if key in fs:
            default = _default(fs[key])
            if isinstance(default, Params):
                yield from _walk(prop, type(default), here)
            else:
                yield Setting(here, cls, key, prop)
        elif key in flat:
            yield from _walk(prop, cls, here)


@functools.cache
def _settings() -> tuple[Setting, ...]:
    return tuple(s for where, name, flat in SECTIONS for s in _walk(_node(where), _cls(name), where, flat))


def _declared(cls: type, name: str) -> tuple[tuple | None, dict]:
    """The field's Literal choices and bounds."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return params.choices(typing.get_type_hints(cls)[name]), params.bounds(f)


def _constrained(s: Setting) -> bool:
    choices, bounds = _declared(s.cls, s.field)
    return bool(choices is not None or bounds or "enum" in s.schema or set(params.BOUNDS) & set(s.schema))


def _cases():
    # the ids are the schema's keys; a class that does not import yet still lists its settings (they fail)
    out = []
    for s in _settings():
        if not _constrained(s):
            continue
        marks = [pytest.mark.xfail(strict=True, reason=f"pending: {PENDING[s.where]}")] if s.where in PENDING else []
        out.append(pytest.param(s, id=s.where, marks=marks))
    return out


@pytest.mark.parametrize("s", _cases())
def test_the_schema_states_the_class_s_choices_and_bounds(s: Setting):
    choices, bounds = _declared(s.cls, s.field)
    what = f"{s.where} ({s.cls.__name__}.{s.field})"
    enum = s.schema.get("enum")
    assert (list(enum) if enum is not None else None) == (list(choices) if choices is not None else None), \
        f"{what}: the schema's enum {enum}, the class's Literal choices {choices}"
    schema_bounds = {k: s.schema[k] for k in params.BOUNDS if k in s.schema}
    if s.where in DIFFERENT:
        want_schema, want_class, _ = DIFFERENT[s.where]
        assert (schema_bounds, bounds) == (want_schema, want_class), f"{what}: DIFFERENT no longer holds"
    else:
        assert schema_bounds == bounds, f"{what}: the schema's bounds {schema_bounds}, the class's {bounds}"


def test_every_literal_field_has_its_enum_in_the_schema():
    """A field with choices is a key of a section (whose enum the test above compares) or is listed
    in NOT_IN_SCHEMA, with the reason."""
    seen = {(s.cls, s.field) for s in _settings()}
    classes = {s.cls for s in _settings()} | {_cls(name) for _, name, _ in SECTIONS}
    missing = []
    for cls in classes:
        for f in dataclasses.fields(cls):
            key = f"{cls.__name__}.{f.name}"
            if _declared(cls, f.name)[0] is not None and (cls, f.name) not in seen and key not in NOT_IN_SCHEMA:
                missing.append(key)
    assert not missing, f"Literal fields without a schema enum (add them to the schema or NOT_IN_SCHEMA): {missing}"
    names = {f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)}
    assert set(NOT_IN_SCHEMA) <= names, set(NOT_IN_SCHEMA) - names


def _method_sections() -> list[tuple[str, ...]]:
    """The settings sections each method's config hash reads (the method registry's, or config's table)."""
    if hasattr(config, "METHOD_SECTIONS"):
        return list(config.METHOD_SECTIONS.values())
    from xmc_steps import registry

    return [tuple(spec.sections) for spec in registry.METHODS.values()]


def test_every_settings_section_is_classified():
    """Each section of the schema's settings (and each a method's config hash reads) is read by a
    parameter class (SECTIONS) or by none (NO_CLASS), so a new section is not silently unchecked."""
    top = set(_deref(_schema()["$defs"]["settings"])["properties"])
    with_class = {where.split(".")[0] for where, _, _ in SECTIONS}
    used = {s for sections in _method_sections() for s in sections}
    assert (top | used) <= with_class | NO_CLASS, (top | used) - with_class - NO_CLASS
    assert not (with_class & NO_CLASS - {"xtransformer"})
    for where, _, _ in SECTIONS:          # the sections exist
        _node(where)


def test_the_pending_and_different_entries_name_settings():
    wheres = {s.where for s in _settings()}
    assert set(PENDING) <= wheres, set(PENDING) - wheres
    assert set(DIFFERENT) <= wheres, set(DIFFERENT) - wheres


@pytest.mark.parametrize("where, constant", [
    ("xtransformer.indexing", "xmc_steps.label_embedding:KINDS"),
    ("xtransformer.variants.*.indexing", "xmc_steps.label_embedding:KINDS"),
    ("xtransformer.ensemble", "xmc_steps.ensemble:METHODS"),
    ("xtransformer.variants.*.ensemble", "xmc_steps.ensemble:METHODS"),
    ("elias.ensemble", "xmc_steps.ensemble:METHODS"),
    ("lightxml.ensemble.method", "xmc_steps.ensemble:METHODS"),
])
def test_settings_without_a_class_state_their_module_s_choices(where, constant):
    node = _node(where)
    enum = node.get("enum") or _deref(node.get("items", {})).get("enum")
    module, name = constant.split(":")
    assert list(enum) == list(getattr(importlib.import_module(module), name)), where


def test_the_wildcards_of_settings_are_built_from_their_choices():
    """The rule files' constraints of the path segments that name a setting's choice are the Literal
    types' (no choice spelled again), and each matches exactly its choices."""
    from test_layout import _constraint_blocks

    block = _constraint_blocks()
    for wildcard, name in [("rin", "RankerInput"), ("neg", "NegativeKind"), ("cand", "Candidates"),
                           ("comb", "Combiner"), ("sampling", "Sampling")]:
        assert re.search(rf"^\s+{wildcard}=xparams\.regex\(xparams\.{name}\),$", block, flags=re.M), wildcard
        typ = getattr(params, name)
        pattern = params.regex(typ)
        for choice in params.choices(typ):
            assert re.fullmatch(pattern, choice), (wildcard, choice)
        for other in ("tfn+", "tfidf+", "union+linear", "x"):
            assert not re.fullmatch(pattern, other), (wildcard, other)
    assert negatives.KINDS == params.choices(params.NegativeKind)
    assert "tfn\\+man" not in block and "tfidf\\+neural" not in block


def test_the_declared_choices_and_bounds_are_checked_with_the_key_named():
    """From a mapping (the configuration, ``--params``) and from the constructor alike."""
    from xmc_steps.gudn import GUDNParams
    from xmc_steps.lightxml import LightXMLParams
    from xmc_steps.ranker import RankerParams
    from xmc_steps.trainer import TrainParams

    with pytest.raises(ValueError, match=r"GUDN parameter feature_weight must be one of fixed, balanced, gated, "
                                         r"got 'weighted'"):
        GUDNParams.from_dict({"feature_weight": "weighted"})
    with pytest.raises(ValueError, match=r"LightXML parameter dropout must be in \[0, 1\), got 1.0"):
        LightXMLParams(dropout=1.0)
    with pytest.raises(ValueError, match=r"LightXML parameter head_init must be one of random, linear"):
        GUDNParams.from_dict({"backbone": {"head_init": "zeros"}})
    with pytest.raises(ValueError, match=r"ranker solver parameter C must be > 0, got 0"):
        RankerParams.from_dict({"C": 0})
    with pytest.raises(ValueError, match=r"training parameter warmup must be in \[0, 1\), got 1.0"):
        TrainParams(warmup=1.0)
    with pytest.raises(ValueError, match=r"training parameter schedule must be one of linear, constant"):
        TrainParams.from_dict({"schedule": "cosine"})
    assert TrainParams.from_dict({"steps": None, "warmup": None}).steps is None     # None is not bounded
