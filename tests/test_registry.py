"""The method registry: one line per method, and a new method added the documented way runs.

docs/architecture.md ("Adding a method") lists what a method touches: its package, its stage, its rule
file, its config section (config.yaml, config.paper.yaml) and one registry line.  The slow
test holds the project to the wiring: it copies the project, lays the toy method of ``tests/toy_method``
over it (package, stage, rule file), adds its config section and its line in ``xmc_steps/registry.py``, and
runs it through the DAG, evaluate and predict.  The schema is not edited: the toy's section is generated from
its parameter tree (tests/test_schema.py; the toy has no paper, so config.paper.yaml stays as it is).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from xmc_steps import config, io, layout, methods, registry


def test_every_method_is_registered_once_with_its_rule_file_and_predictor():
    assert list(registry.METHODS) == ["xr-linear", "parabel", "xtransformer", "elias", "lightxml", "gudn", "dual-encoder"]
    for name, spec in registry.METHODS.items():
        assert spec.name == name
        assert (ROOT / "workflow" / "rules" / spec.rules).is_file(), spec.rules
        module, _, attr = spec.predictor.partition(":")
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").is_file(), spec.predictor
        assert set(spec.rule_settings) <= set(config.RULE_SETTINGS)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(methods.MethodSpec(name="elias", section="x", sections=(), predictions=lambda *a: "",
                                             records=lambda *a: [], predictor="m:f", rules="x.smk"))


def test_split_method_and_the_method_wildcard_follow_the_registry():
    import re

    assert registry.split_method("xr-linear") == ("xr-linear", None)
    assert registry.split_method("elias-stage2") == ("elias", "stage2")
    assert registry.split_method("lightxml-static") == ("lightxml", "static")
    assert registry.split_method("parabel-x") == ("parabel-x", None)        # parabel has no variants
    pattern = re.compile(rf"^({registry.method_re()})$")
    assert pattern.match("xtransformer-tfidf-tfn") and pattern.match("gudn") and not pattern.match("parabel-x")
    with pytest.raises(KeyError, match="unknown method 'nope'"):
        registry.get("nope")


def test_the_specs_give_what_the_layout_and_config_gave():
    """The registry's answers for debtags: each target's settings sections and encoder references."""
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    assert config.method_settings(config.load(ROOT / "config.yaml"), "debtags", "parabel").keys() == \
        {"split", "ingest", "tfidf", "parabel", "evaluate", "threads"}
    refs = dict(registry.encoder_refs(s))
    assert refs["tokenize.encoder"] == refs["elias.encoder"] == refs["gudn.backbone.encoder"] == "minilm"
    assert "xtransformer.encoders[0]" in refs and "lightxml.ensemble.encoders[0]" in refs
    assert registry.METHODS["xr-linear"].predictions("r", "d", s, None) == "r/d/xr-linear/predictions_test.parquet"


def _add_toy_method(proj: Path) -> None:
    """The toy method of tests/toy_method added to the project copy ``proj`` as docs/architecture.md says."""
    import yaml

    shutil.copytree(ROOT / "tests" / "toy_method" / "xmc_steps", proj / "xmc_steps", dirs_exist_ok=True)
    shutil.copytree(ROOT / "tests" / "toy_method" / "workflow", proj / "workflow", dirs_exist_ok=True)
    # the config section (its schema is generated from the toy's tree: no schema edit)
    cfg = yaml.safe_load((proj / "config.yaml").read_text())
    cfg["defaults"]["toymethod"] = {"topk": 10}
    (proj / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    # the registry line
    reg = proj / "xmc_steps" / "registry.py"
    text = reg.read_text()
    anchor = '    "xmc_steps.gudn.spec",\n'
    assert anchor in text
    reg.write_text(text.replace(anchor, anchor + '    "xmc_steps.toymethod.spec",\n'))


@pytest.mark.slow
def test_a_method_added_through_the_registry_runs_through_the_dag_evaluate_and_predict(toy_linear_run, tmp_path):
    from test_workflow import RUN_TIMEOUT, _command

    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("Snakefile", "config.yaml", "workflow", "xmc_steps", "envs"):
        src = ROOT / name
        (shutil.copytree(src, proj / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, proj / name))
    _add_toy_method(proj)
    work = tmp_path / "work"
    shutil.copytree(toy_linear_run, work, symlinks=True, ignore=shutil.ignore_patterns("mlflow*", "mlartifacts"))
    cmd, env = _command(work, "results/toy/toymethod.json")
    env["XMC_TRACKING"] = "0"
    cmd = [proj / "Snakefile" if c == str(ROOT / "Snakefile") else c for c in cmd]
    cmd = [str(proj / "config.yaml") if c == str(ROOT / "config.yaml") else str(c) for c in cmd]
    env["PYTHONPATH"] = str(proj)
    r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stderr[-5000:]

    # the DAG: its rule ran, its target was evaluated against the test split
    res = json.loads((work / "results" / "toy" / "toymethod.json").read_text())
    assert res["method"] == "toymethod" and list((work / "logs" / "toymethod_train").glob("*.log"))
    Y_train = io.load_csr(work / "results" / "toy" / "ingest" / "Y_train.npz")
    Y_test = io.load_csr(work / "results" / "toy" / "ingest" / "Y_test.npz")
    top = int(np.argmax(np.asarray(Y_train.sum(axis=0)).ravel()))
    assert res["metrics"]["p_at_1"] == pytest.approx(100.0 * Y_test[:, top].sum() / Y_test.shape[0], abs=1e-6)
    assert "toymethod_train" in {st["rule"] for st in res["stages"]}

    # predict: the registry's predictor answers new text (the most frequent labels, best first)
    model = layout.at(str(work / "results"), layout.METHOD, dataset="toy", method="toymethod")
    r = subprocess.run([sys.executable, "-m", "xmc_steps.stages.predict", "--model", model, "--top-k", "2"],
                       input="anything at all\n", capture_output=True, text=True, cwd=proj,
                       env=dict(os.environ, PYTHONPATH=str(proj)))
    assert r.returncode == 0, r.stderr
    labels = io.read_table(work / "results" / "toy" / "ingest" / "labels.parquet", ["label_id"]).column("label_id").to_pylist()
    answer = json.loads(r.stdout.splitlines()[0])
    assert answer["labels"][0]["label"] == str(labels[top]) and len(answer["labels"]) == 2


def test_values_come_from_the_settings_and_paths_carry_keys():
    """The cluster rule's branching, leaf size, floor and seed, LightXML's training seed and GUDN's guides
    come from the settings (the specs), the path's wildcard only picks which."""
    import re

    from xmc_steps.gudn import spec as gudn_spec
    from xmc_steps.lightxml import spec as lightxml_spec

    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    assert registry.tree_settings(s, "tree-b16-l100-c64-s0") == {
        "branching": 16, "leaf_size": 100, "seed": 0, "min_leaves": 64, "max_iter": s["cluster"]["max_iter"]}
    assert registry.tree_settings(s, "tree-b2-l64-s2")["seed"] == 2            # a lightxml-ensemble member's tree
    with pytest.raises(KeyError, match="no configured method reads the cluster tree 'tree-b3-l7-s0'"):
        registry.tree_settings(s, "tree-b3-l7-s0")
    m = lightxml_spec.member_of(s, "tree-b2-l64-s1", "minilm", 64, "dynamic")
    assert m.seed == 1 and m in lightxml_spec.lightxml_members(s, "ensemble")
    assert gudn_spec.GUIDES["no-link-guide"] == {"link_guide": False}
    # no rule parses a value out of a wildcard
    for f in (ROOT / "workflow" / "rules").glob("*.smk"):
        text = f.read_text()
        assert not re.search(r"\bw(ildcards)?\.\w+\.(r?split|replace|partition)\(", text), f.name
        assert not re.search(r"\{wildcards\.(branching|leaf|seed|floor)\}", text), f.name
