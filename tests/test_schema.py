"""Issue 51: the configuration schema is generated from the parameter trees (xmc_steps.schema).

The committed workflow/schemas/config.schema.json is what the generator writes; a method's section is its
tree's fields (type, choices, bounds, doc); a new method (the toy of tests/toy_method) needs no schema edit,
and a new setting is one field.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from xmc_steps import config, registry, schema


def test_the_committed_schema_is_the_generated_one():
    """Run `python -m xmc_steps.schema --write` after changing a parameter class or config.base.json."""
    assert config.SCHEMA_PATH.read_text() == schema.render(schema.build()), \
        "workflow/schemas/config.schema.json is stale: run python -m xmc_steps.schema --write"


def test_config_yaml_s_comments_are_the_generated_ones():
    """config.yaml's comments in `defaults:` are the trees' one-line docs (xmc_steps.config_comments); its keys,
    values and layout are its own (yaml loads the same data).  Run `python -m xmc_steps.schema --write` after
    changing a doc."""
    import yaml

    from xmc_steps import config_comments

    text = (ROOT / "config.yaml").read_text()
    new = config_comments.rewrite(text)
    assert yaml.safe_load(new) == yaml.safe_load(text)
    assert new == text, "config.yaml's comments are stale: run python -m xmc_steps.schema --write"
    assert config_comments.rewrite(new) == new


def test_config_comments_keep_values_and_entries_and_name_a_missing_doc():
    from xmc_steps import config_comments

    text = (ROOT / "config.yaml").read_text()
    assert "paper-candidates: {candidates: matcher}   # Eq. 2 over the matcher's top-b" in text   # an entry: kept
    line = next(x for x in text.splitlines() if x.startswith("    beam: 10 ") and "MAN" in x)
    stale = text.replace(line, "    beam: 10  # a stale note\n              # and its continuation", 1)
    assert stale != text and config_comments.rewrite(stale) == text
    assert config_comments.rewrite(text.replace("  xr_linear:\n", "  xr_linear:\n    # a stale paragraph\n", 1)) == text
    with pytest.raises(KeyError, match="defaults.xr_linear.nope is no setting"):
        config_comments.rewrite(text.replace("  xr_linear:\n", "  xr_linear:\n    nope: 1\n", 1))


def test_the_settings_that_are_no_section_are_declared_once():
    """encoders, seeds, resources, threads: fields of xmc_steps.sections.TopLevelSettings, their schema generated
    (config.base.json holds the top level only), their defaults config.yaml's."""
    import dataclasses

    from xmc_steps import sections

    base = json.loads(schema.BASE_PATH.read_text())["$defs"]["settings"]["properties"]
    built = schema.build()["$defs"]["settings"]["properties"]
    d = config.load(ROOT / "config.yaml")["defaults"]
    for f in dataclasses.fields(sections.TopLevelSettings):
        assert f.name not in base and "description" in built[f.name], f.name
        assert getattr(sections.TopLevelSettings(), f.name) == d[f.name], f.name
    assert built["encoders"]["propertyNames"]["pattern"] == sections.ENCODER_KEY_PATTERN == config.ENCODER_KEY
    assert built["resources"]["additionalProperties"]["properties"]["mem_mb"] == {
        "description": "memory in MB", "type": "integer", "minimum": 1}
    with pytest.raises(config.ConfigError):
        c = config.load(ROOT / "config.yaml")
        c["defaults"]["resources"] = {"tfidf": {"mem_mb": None}}
        config.validate(c)


def test_each_tree_s_section_is_generated_from_its_fields_and_base_states_none():
    base = json.loads(schema.BASE_PATH.read_text())["$defs"]["settings"]["properties"]
    full = schema.build()
    built = full["$defs"]["settings"]["properties"]
    trees = schema.generated_sections()
    assert {"xr_linear", "parabel", "dual_encoder", "lightxml", "gudn"} <= set(trees)
    for section, ref in trees.items():
        assert section not in base, section
        cls = schema.load_class(ref)
        node = built[section]
        if "$ref" in node:                      # a class of more than one place (schema.SHARED)
            assert node == {"$ref": f"#/$defs/{schema.SHARED[ref]}"}
            node = full["$defs"][schema.SHARED[ref]]
        assert node["additionalProperties"] is False
        settings = [f.name for f in cls.__dataclass_fields__.values() if f.metadata.get("setting", True)]
        assert list(node["properties"]) == settings, section
    xr = built["xr_linear"]["properties"]
    assert xr["beam"] == {"description": "beam width of the tree search: the predictions and the MAN negatives",
                          "type": "integer", "minimum": 1}
    assert xr["fit_on"]["items"] == {"enum": ["train", "valid"]} and xr["fit_on"]["minItems"] == 1
    assert xr["solver"] == {"$ref": "#/$defs/solver"} and "threads" not in xr


def test_the_resources_keys_are_the_rules_that_declare_resources():
    enum = schema.build()["$defs"]["settings"]["properties"]["resources"]["propertyNames"]["enum"]
    assert "xr_linear_train" in enum and "dual_encoder_ranker" in enum and enum == sorted(set(enum))


def test_a_rule_passes_its_section_unchanged_and_hashes_it():
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    for rule, keys in config.RULE_PASSES.items():     # what a rule passes lies within what it hashes
        assert all(config.covered(k, config.RULE_SETTINGS[rule]) for k in keys), rule
    assert config.rule_payload(s, "xr_linear_train") == s["xr_linear"]
    assert config.rule_payload(s, "parabel_predict") == s["parabel"]
    w = {"enc": "minilm"}
    for rule, keys in config.RULE_PASSES.items():     # each payload builds (no key passed twice); tokenize's is
        assert config.rule_payload(s, rule, w) or not keys, rule   # its wildcards' alone (PASS's given keys)
    de = config.rule_payload(s, "dual_encoder_predict", w)
    assert de["topk"] == s["evaluate"]["topk"] and not {"ranker", "ensemble", "shortlist_topk"} & set(de)
    assert de == {**{k: v for k, v in s["dual_encoder"].items() if k not in ("ranker", "ensemble", "shortlist_topk")},
                  "topk": s["evaluate"]["topk"]}
    lx = config.rule_payload(s, "lightxml_train", w)
    assert lx == {k: v for k, v in s["lightxml"].items() if k not in ("cluster", "ensemble")}
    g = config.rule_payload(s, "gudn_train", w)
    assert g["backbone"] == {k: v for k, v in s["gudn"]["backbone"].items() if k not in ("cluster", "ensemble")}
    assert {k: v for k, v in g.items() if k != "backbone"} == {k: v for k, v in s["gudn"].items() if k != "backbone"}
    with pytest.raises(KeyError, match="passes no settings"):
        config.rule_payload(s, "tfidf")


def _copy_project(dest: Path) -> None:
    for name in ("config.yaml", "workflow", "xmc_steps"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)


def _changed(a: Path, b: Path, rel: Path = Path()) -> set[str]:
    """Files of ``b`` that are new or differ from ``a``'s (``__pycache__`` aside)."""
    cmp = filecmp.dircmp(a / rel, b / rel, ignore=["__pycache__"])
    out = {str(rel / n) for n in cmp.right_only if (b / rel / n).is_file()}
    out |= {str(p.relative_to(b)) for n in cmp.right_only if (b / rel / n).is_dir() for p in (b / rel / n).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    out |= {str(rel / n) for n in cmp.diff_files}
    for sub in cmp.common_dirs:
        out |= _changed(a, b, rel / sub)
    return out


def _run(proj: Path, code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=proj, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_new_method_and_a_new_setting_touch_no_schema(tmp_path):
    """The toy method is its package, its stage, its rule file, its config section and one registry line: the
    configuration validates against its generated section with no schema file edited; a setting added to its
    tree is one line, checked at once (a wrong value stops the configuration naming the key)."""
    from test_registry import _add_toy_method

    orig, proj = tmp_path / "orig", tmp_path / "proj"
    orig.mkdir()
    proj.mkdir()
    _copy_project(orig)
    _copy_project(proj)
    _add_toy_method(proj)
    assert _changed(orig, proj) == {
        "config.yaml", "xmc_steps/registry.py", "workflow/rules/toymethod.smk", "xmc_steps/stages/toymethod.py",
        "xmc_steps/toymethod/__init__.py", "xmc_steps/toymethod/params.py", "xmc_steps/toymethod/serve.py",
        "xmc_steps/toymethod/spec.py"}
    # the new setting: one line in the toy's tree
    params = proj / "xmc_steps" / "toymethod" / "params.py"
    text = params.read_text()
    anchor = "    _what = "
    params.write_text(text.replace(anchor, "    power: float = bounded(1.0, gt=0)  # frequencies to this power\n\n"
                                           + anchor))
    out = _run(proj, """
import json
from xmc_steps import config, schema
c = config.load("config.yaml")
section = schema.build()["$defs"]["settings"]["properties"]["toymethod"]
print(json.dumps(section))
print(json.dumps(config.rule_payload(config.dataset_settings(c, "debtags"), "toymethod_train")))
for bad in ({"power": 0}, {"nope": 1}):
    c["defaults"]["toymethod"] = {"topk": 10, **bad}
    try:
        config.validate(c)
        print("accepted")
    except config.ConfigError as e:
        print(str(e).splitlines()[-1].strip())
""").splitlines()
    section = json.loads(out[0])
    assert section["properties"]["power"] == {"description": "frequencies to this power", "type": "number",
                                              "exclusiveMinimum": 0}
    assert section["properties"]["topk"]["minimum"] == 1
    assert json.loads(out[1]) == {"topk": 10}
    assert out[2] == "key 'defaults.toymethod.power': 0 is less than or equal to the minimum of 0"
    assert out[3].startswith("unknown key 'defaults.toymethod.nope' (allowed here: power, smoothing, topk)")
    assert registry.METHODS.keys().isdisjoint({"toymethod"})


def test_every_setting_of_every_tree_has_its_one_line_doc():
    """A setting's documentation is declared once, as the comment beside its field (the schema's description,
    `xmc params <method>`'s commented YAML): every setting of every method's tree has one, inherited fields
    included.  config.yaml's comments in `defaults:` are generated from them (xmc_steps.config_comments), its values
    are the trees' defaults (tests/test_params.py); measurements and the papers' values: docs/methods/*.md."""
    import dataclasses

    from xmc_steps.params import Params
    from xmc_steps.skeleton import field_docs

    missing = []

    def walk(cls, where):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("setting", True):
                continue
            d = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if isinstance(d, Params):
                walk(type(d), f"{where}.{f.name}")
            elif not docs.get(f.name):
                missing.append(f"{where}.{f.name} ({cls.__name__})")

    for section, ref in schema.generated_sections().items():
        walk(schema.load_class(ref), section)
    assert not missing, missing
    lx = schema.build()["$defs"]["lightxml"]["properties"]
    assert lx["dropout"]["description"].startswith("on that representation")      # inherited from LightXMLParams
