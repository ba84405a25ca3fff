"""Issue 51: a rule's settings hash covers everything it passes its stage.

Every rule passes its stage a JSON of settings (``params.settings``) and tags and reruns it by a hash
(``params.hash``, ``H(rule)``: the settings :data:`xmc_steps.config.RULE_SETTINGS` lists for it).  The two are
written separately, so they can drift: a setting the stage reads but the hash leaves out changes the stage's
result without rerunning it.  This test loads the workflow (Snakemake's API, the shipped config), and for
every rule and every setting of ``defaults``, changes that one setting: wherever the JSON a rule passes
changes, its hash must change too."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest

from conftest import ROOT

#: a value for every wildcard of the rules (the settings functions read only some)
WILDCARDS = {"dataset": "debtags", "enc": "minilm", "maxlen": "64", "emb": "pifa-tfidf", "stage": "2",
             "split": "test", "cal": "calibrated", "variant": "main", "sampling": "dynamic", "rin": "tfidf+neural",
             "neg": "tfn+man", "cand": "matcher", "comb": "product", "method": "xr-linear", "fit": "train",
             "guide": "full", "archive": "eurlex-4k", "guides": "full", "tree": None}


class _W:
    """Wildcards as a rule's functions see them: attributes and ``items()``."""

    def __init__(self, values):
        self.__dict__.update(values)
        self._values = values

    def items(self):
        return self._values.items()

    def keys(self):
        return self._values.keys()


def _leaves(d, pre=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, pre + (k,))
        else:
            yield pre + (k,), v


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 2 + 1
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return v + v[-1:] if v else [1]
    if v is None:
        return 1
    return None


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, ResourceSettings

    import os

    work, cwd, env = tmp_path_factory.mktemp("rule-hashes"), os.getcwd(), dict(os.environ)
    api = SnakemakeApi()
    api.__enter__()
    try:
        wf = api.workflow(resource_settings=ResourceSettings(cores=1),
                          config_settings=ConfigSettings(configfiles=[ROOT / "config.yaml"]),
                          snakefile=ROOT / "Snakefile", workdir=Path(work))._workflow
        yield wf
    finally:
        api.__exit__(None, None, None)
        os.chdir(cwd)                      # Snakemake moved into its work folder and set the stages' variables
        os.environ.clear()
        os.environ.update(env)


def _both(rule, config, tree):
    w = _W({k: (tree if k == "tree" else v) for k, v in WILDCARDS.items()})
    out = []
    for name in ("settings", "hash"):
        fn = getattr(rule.params, name)
        out.append(fn(w) if len(inspect.signature(fn).parameters) == 1 else None)
    return out


def test_every_setting_a_rule_passes_is_in_its_hash(workflow):
    from xmc_steps import config as xcfg, layout as lay

    config = workflow.config
    eff = xcfg.dataset_settings(config, "debtags")
    tree = lay.tree_name(eff["cluster"])
    from xmc_steps.lightxml.spec import lightxml_tree

    # the LightXML and GUDN rules' own trees (their member's seed comes from it)
    trees = {"lightxml_train": lightxml_tree(eff), "lightxml_predict": lightxml_tree(eff),
             "gudn_train": lightxml_tree(eff, section=eff["gudn"]["backbone"]),
             "gudn_predict": lightxml_tree(eff, section=eff["gudn"]["backbone"])}
    rules = [r for r in workflow.rules if {"settings", "hash"} <= set(r.params.keys())]
    base = {}
    for r in rules:
        try:
            s, h = _both(r, config, trees.get(r.name, tree))
        except Exception:   # noqa: BLE001 - a function needing more than wildcards: not checked here
            continue
        if s is not None and h is not None and r.name not in ("leaderboard",):
            base[r.name] = (s, h)
    assert len(base) >= 30, sorted(base)
    # every rule that passes its sections (PASS) is checked: its settings function builds from the wildcards
    passing = {r.name for r in rules} & set(xcfg.RULE_PASSES)
    assert passing and passing <= set(base), sorted(passing - set(base))
    drift = {}
    original = copy.deepcopy(config["defaults"])
    for path, value in _leaves(original):
        new = _changed(value)
        if new is None or path[0] in ("resources", "threads"):
            continue
        node = config["defaults"]
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = new
        try:
            for r in rules:
                if r.name not in base:
                    continue
                try:
                    s, h = _both(r, config, trees.get(r.name, tree))
                except Exception:   # noqa: BLE001 - the changed value breaks the function: nothing passed
                    continue
                if s != base[r.name][0] and h == base[r.name][1]:
                    drift.setdefault(r.name, []).append(".".join(path))
        finally:
            node[path[-1]] = value
    assert not drift, json.dumps(drift, indent=1)
