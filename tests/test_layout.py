"""The layout module: every artifact path pattern stated once, filled the same way by the
rules and by the code."""

import re
from pathlib import Path

import pytest

from xmc_steps import config, layout

ROOT = Path(__file__).resolve().parents[1]


def _constraints() -> set[str]:
    """The wildcard names common.smk constrains."""
    text = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    block = text[text.index("wildcard_constraints:"):text.index("def R(")]
    return set(re.findall(r"^\s+(\w+)=", block, flags=re.M))


def test_every_pattern_is_under_a_dataset_and_uses_constrained_wildcards():
    known = _constraints()
    assert {"TOKENS", "XT_MATCHER", "ELIAS_STAGE", "METHOD"} <= set(layout.PATTERNS)
    for name, pattern in layout.PATTERNS.items():
        assert pattern.startswith("{dataset}/"), name
        names = set(re.findall(r"\{(\w+)\}", pattern))
        assert names <= known | {"stage"}, (name, names - known)


def test_at_fills_what_it_is_given_and_keeps_the_other_wildcards():
    assert layout.at("res", layout.TOKENS, dataset="d", enc="minilm", maxlen=64) == "res/d/features/tokens/minilm-64"
    assert layout.at("res", layout.TOKENS, enc="minilm") == "res/{dataset}/features/tokens/minilm-{maxlen}"
    assert layout.at("", layout.INGEST, dataset="d") == "d/ingest"
    # a filled value is not read again as a pattern (an embedding name that names a wildcard)
    assert layout.at("r", layout.INDEX, emb="pifa-neural__{enc}") == "r/{dataset}/index/pifa-neural__{enc}"
    # nested patterns share their prefix
    for child, parent in [("XT_MATCHER", "XT"), ("XT_RANKER", "XT"), ("XT_PREDICT", "XT_RANKER"),
                          ("XT_LINEAR", "XT_TREE"), ("ELIAS_STAGE", "ELIAS"), ("ELIAS_PLUS", "ELIAS"), ("TREE", "INDEX")]:
        assert layout.PATTERNS[child].startswith(layout.PATTERNS[parent] + "/"), child


def test_helpers_are_the_patterns_filled():
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    (m,) = layout.xt_members(s, None)
    values = dict(dataset="d", emb=m.emb, tree=m.tree, enc="minilm", rin=m.ranker_input, neg=m.negatives,
                  cand=m.candidates, comb=m.combiner)
    assert m.matcher_dir("r", "d") == layout.at("r", layout.XT_MATCHER, **values)
    assert m.predict_dir("r", "d") == layout.at("r", layout.XT_PREDICT, **values)
    assert m.linear_dir("r", "d", "train") == layout.at("r", layout.XT_LINEAR, fit="train", **values)
    assert layout.tokens_dir("r", "d", "minilm", 64) == "r/d/features/tokens/minilm-64"
    assert layout.tree_path("r", "d", "pifa-tfidf", s["cluster"]) == "r/d/index/pifa-tfidf/tree-b16-l100-s0.npz"
    el = layout.elias_dir("r", "d", s, 0)
    assert el == "r/d/elias/tree-b16-l100-c64-s0/minilm-64"
    assert layout.elias_predictions("r", "d", s, "stage2") == el + "/stage2/pred_test.parquet"
    assert layout.elias_predictions("r", "d", s, "ranker") == el + "/plus/predictions_test_uncalibrated.parquet"
    assert layout.elias_predictions("r", "d", s, None) == el + "/plus/predictions_test_calibrated.parquet"
    assert layout.elias_predictions("r", "d", s, "ensemble") == "r/d/elias/ensemble-ensemble/predictions_test.parquet"
    records = layout.elias_records("r", "d", s, "stage1")
    assert records[0] == "r/d/features/tokens/minilm-64/record.json" and el + "/stage1/pred_test.record.json" in records
    with pytest.raises(KeyError, match="unknown elias variant"):
        layout.elias_seeds(s, "nope")


def test_lightxml_members_variants_and_records():
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    (m,) = layout.lightxml_members(s, None)
    d = "r/d/lightxml/tree-b2-l64-s0/minilm-64/dynamic"
    assert m.dir("r", "d") == d == layout.at("r", layout.LIGHTXML, dataset="d", tree=m.tree, enc="minilm", maxlen=64,
                                             sampling="dynamic")
    assert layout.lightxml_predictions("r", "d", s, None) == d + "/predictions_test.parquet"
    assert layout.lightxml_predictions("r", "d", s, "static") == d.replace("dynamic", "static") + "/predictions_test.parquet"
    ens = layout.lightxml_members(s, "ensemble")
    assert [x.tree for x in ens] == [f"tree-b2-l64-s{i}" for i in range(3)] and ens[0] == m   # member 0 is the main model
    assert layout.lightxml_predictions("r", "d", s, "ensemble") == "r/d/lightxml/ensemble-ensemble/predictions_test.parquet"
    rec = layout.lightxml_records("r", "d", s, "ensemble")
    assert sum(r.endswith("/dynamic/record.json") for r in rec) == 3 and rec[-1].endswith("ensemble-ensemble/record.json")
    assert "r/d/features/tokens/minilm-64/record.json" in rec and len(rec) == len(set(rec))
    with pytest.raises(KeyError, match="unknown lightxml variant"):
        layout.lightxml_predictions("r", "d", s, "nope")


def test_rules_spell_no_results_path_themselves():
    """The rule files build every results path from a layout pattern (R(lay.X)), none by hand."""
    offenders = []
    for f in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r'RES \+ "|\{RES\}/|"results/', line):
                offenders.append(f"{f.name}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_gudn_backbone_is_lightxml_with_its_changes_and_variants_are_folders():
    cfg = config.load(ROOT / "config.yaml")
    cfg["datasets"]["d"] = {"lightxml": {"hidden": 64}, "gudn": {"backbone": {"dropout": 0.2}}}
    s = config.dataset_settings(cfg, "d")
    b = s["gudn"]["backbone"]
    assert b["last_k"] == 10 and b["dropout"] == 0.2 and b["hidden"] == 64 and b["cluster"] == s["lightxml"]["cluster"]
    full = layout.gudn_dir("r", "d", s, None)
    assert full == "r/d/gudn/tree-b2-l64-s0/minilm-64/full"
    assert layout.gudn_predictions("r", "d", s, "no-link-guide") == full.replace("full", "no-link-guide") + "/predictions_test.parquet"
    assert layout.gudn_records("r", "d", s, None)[-2:] == [full + "/record.json", full + "/predict.record.json"]
    with pytest.raises(KeyError, match="unknown gudn variant"):
        layout.gudn_dir("r", "d", s, "nope")
