"""The layout module: every artifact path pattern stated once, filled the same way by the
rules and by the code."""

import io
import re
import tokenize
from pathlib import Path

import pytest

from xmc_steps import config, layout, registry
from xmc_steps.elias import spec as elias_spec
from xmc_steps.gudn import spec as gudn_spec
from xmc_steps.lightxml import spec as lightxml_spec
from xmc_steps.xtransformer import spec as xt_spec

ROOT = Path(__file__).resolve().parents[1]
#: every pattern: the shared ones and each method's (its spec's)
PATTERNS = registry.patterns()


def _constraint_blocks() -> str:
    """Every ``wildcard_constraints:`` block of the rule files (common.smk's shared ones, each method's own)."""
    out = []
    for f in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        text = f.read_text()
        start = 0
        while (i := text.find("\nwildcard_constraints:", start)) >= 0:
            end = text.find("\n\n", i + 1)
            out.append(text[i:end if end >= 0 else len(text)])
            start = i + 1
    return "\n".join(out)


def _constraints() -> set[str]:
    """The wildcard names the rule files constrain."""
    return set(re.findall(r"^\s+(\w+)=", _constraint_blocks(), flags=re.M))


def test_every_pattern_is_under_a_dataset_and_uses_constrained_wildcards():
    known = _constraints()
    assert {"TOKENS", "XT_MATCHER", "ELIAS_STAGE", "METHOD"} <= set(PATTERNS)
    for name, pattern in PATTERNS.items():
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
        assert PATTERNS[child].startswith(PATTERNS[parent] + "/"), child


def test_helpers_are_the_patterns_filled():
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    (m,) = xt_spec.xt_members(s, None)
    values = dict(dataset="d", emb=m.emb, tree=m.tree, enc="minilm", rin=m.ranker_input, neg=m.negatives,
                  cand=m.candidates, comb=m.combiner)
    assert m.matcher_dir("r", "d") == layout.at("r", xt_spec.XT_MATCHER, **values)
    assert m.predict_dir("r", "d") == layout.at("r", xt_spec.XT_PREDICT, **values)
    assert m.linear_dir("r", "d", "train") == layout.at("r", xt_spec.XT_LINEAR, fit="train", **values)
    assert layout.tokens_dir("r", "d", "minilm", 64) == "r/d/features/tokens/minilm-64"
    assert layout.tree_path("r", "d", "pifa-tfidf", s["cluster"]) == "r/d/index/pifa-tfidf/tree-b16-l100-s0.npz"
    el = elias_spec.elias_dir("r", "d", s, 0)
    assert el == "r/d/elias/tree-b16-l100-c64-s0/minilm-64"
    assert elias_spec.predictions("r", "d", s, "stage2") == el + "/stage2/pred_test.parquet"
    assert elias_spec.predictions("r", "d", s, "ranker") == el + "/plus/predictions_test_uncalibrated.parquet"
    assert elias_spec.predictions("r", "d", s, None) == el + "/plus/predictions_test_calibrated.parquet"
    assert elias_spec.predictions("r", "d", s, "ensemble") == "r/d/elias/ensemble-ensemble/predictions_test.parquet"
    records = elias_spec.records("r", "d", s, "stage1")
    assert records[0] == "r/d/features/tokens/minilm-64/record.json" and el + "/stage1/pred_test.record.json" in records
    with pytest.raises(KeyError, match="unknown elias variant"):
        elias_spec.elias_seeds(s, "nope")


def test_lightxml_members_variants_and_records():
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), "debtags")
    (m,) = lightxml_spec.lightxml_members(s, None)
    d = "r/d/lightxml/tree-b2-l64-s0/minilm-64/dynamic"
    assert m.dir("r", "d") == d == layout.at("r", lightxml_spec.LIGHTXML, dataset="d", tree=m.tree, enc="minilm", maxlen=64,
                                             sampling="dynamic")
    assert lightxml_spec.predictions("r", "d", s, None) == d + "/predictions_test.parquet"
    assert lightxml_spec.predictions("r", "d", s, "static") == d.replace("dynamic", "static") + "/predictions_test.parquet"
    ens = lightxml_spec.lightxml_members(s, "ensemble")
    assert [x.tree for x in ens] == [f"tree-b2-l64-s{i}" for i in range(3)] and ens[0] == m   # member 0 is the main model
    assert lightxml_spec.predictions("r", "d", s, "ensemble") == "r/d/lightxml/ensemble-ensemble/predictions_test.parquet"
    rec = lightxml_spec.records("r", "d", s, "ensemble")
    assert sum(r.endswith("/dynamic/record.json") for r in rec) == 3 and rec[-1].endswith("ensemble-ensemble/record.json")
    assert "r/d/features/tokens/minilm-64/record.json" in rec and len(rec) == len(set(rec))
    with pytest.raises(KeyError, match="unknown lightxml variant"):
        lightxml_spec.predictions("r", "d", s, "nope")


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
    full = gudn_spec.gudn_dir("r", "d", s, None)
    assert full == "r/d/gudn/tree-b2-l64-s0/minilm-64/full"
    assert gudn_spec.predictions("r", "d", s, "no-link-guide") == full.replace("full", "no-link-guide") + "/predictions_test.parquet"
    assert gudn_spec.records("r", "d", s, None)[-2:] == [full + "/record.json", full + "/predict.record.json"]
    with pytest.raises(KeyError, match="unknown gudn variant"):
        gudn_spec.gudn_dir("r", "d", s, "nope")


def test_file_names_inside_the_folders_keep_their_values():
    """The names are part of every produced path (the plans of ``snakemake -n`` must not move): they are
    pinned here, once; the rules, the specs, the code and the other tests use the constants."""
    assert (layout.RECORD, layout.WEIGHTS, layout.PREDICTIONS) == ("record.json", "model.safetensors",
                                                                   "predictions_test.parquet")
    assert (layout.GUARD, layout.CURVE, layout.LABEL_EMB, layout.LABELS) == ("guard.json", "curve.png", "label_emb.npz",
                                                                             "labels.parquet")
    assert layout.record("train") == "train.record.json" and layout.record("pred_{split}") == "pred_{split}.record.json"
    assert layout.record(layout.LABEL_EMB) == "label_emb.record.json"
    assert layout.record(layout.tree_path("r", "d", "pifa-tfidf", {"branching": 2, "leaf_size": 8})) == \
        "r/d/index/pifa-tfidf/tree-b2-l8-s0.record.json"


#: file names only layout.py spells (its constants RECORD, WEIGHTS); ``record.json`` covers ``*.record.json``
ONCE = ("record.json", "model.safetensors")
_FSTRING_MIDDLE = getattr(tokenize, "FSTRING_MIDDLE", None)   # Python >= 3.12 splits f-strings


def _literals(text: str):
    """``(line, text)`` of every string literal of Python or Snakemake source, docstrings (a string that
    is a statement of its own) and comments left out."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in (tokenize.NL, tokenize.COMMENT)]
    alone = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for i, t in enumerate(toks):
        if t.type == tokenize.STRING:
            before = toks[i - 1].type if i else tokenize.NEWLINE
            after = toks[i + 1].type if i + 1 < len(toks) else tokenize.ENDMARKER
            if before in alone and after in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue
            yield t.start[0], t.string
        elif t.type == _FSTRING_MIDDLE:
            yield t.start[0], t.string


def test_file_names_are_spelled_only_in_layout():
    """A rule file or a module under xmc_steps/ names ``record.json`` (``train.record.json``...) and
    ``model.safetensors`` through layout's constants (``lay.RECORD``, ``lay.record("train")``,
    ``layout.WEIGHTS``), never literally; docstrings and comments may mention them."""
    probe = 'x = f"{d}/train.record.json"  # record.json\ndef f():\n    """model.safetensors"""\n    return "model.safetensors"\n'
    assert [n for n, _ in _literals(probe)] == [1, 4]   # the scan itself: literals found, docstring and comment not
    files = sorted((ROOT / "workflow" / "rules").glob("*.smk")) + sorted((ROOT / "xmc_steps").rglob("*.py"))
    files = [f for f in files if f != ROOT / "xmc_steps" / "layout.py"]
    assert len(files) > 50
    offenders = [f"{f.relative_to(ROOT)}:{n}: {s}" for f in files for n, s in _literals(f.read_text())
                 if any(name in s for name in ONCE)]
    assert not offenders, "spell these through xmc_steps.layout (RECORD, record(), WEIGHTS):\n" + "\n".join(offenders)
