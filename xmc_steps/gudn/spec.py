"""GUDN as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`): where its artifacts live,
the predictions and records of its targets, its shared concepts and its predictor.

Light on purpose (no torch): Snakemake imports it when it parses the workflow.

* ``GUDN`` ``gudn/{tree}/{enc}-{maxlen}/{guides}/``: a GUDN model (a LightXML network; ``lightxml.json``
  with its ``gudn`` settings), ``predictions_test.parquet``; ``guides``: ``full``, ``no-feature-guide``,
  ``no-link-guide``;
* targets: ``gudn`` and Table 3's ablations ``gudn-no-feature-guide``, ``gudn-no-link-guide``.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..layout import INDEX, LABEL_EMB, PREDICTIONS, RECORD, TREE, at, record, tokens_dir
from ..lightxml.spec import lightxml_tree, network_concepts
from ..methods import TREE_SETTINGS, MethodSpec

GUDN = "{dataset}/gudn/{tree}/{enc}-{maxlen}/{guides}"

#: the guide settings of each model folder (``{guides}``): the full method, and Table 3's ablations
#: ``gudn-no-feature-guide``, ``gudn-no-link-guide`` (the folder is a key; the values are these)
GUIDES: dict[str, dict[str, bool]] = {"full": {}, "no-feature-guide": {"feature_guide": False},
                                      "no-link-guide": {"link_guide": False}}
VARIANTS = tuple(k for k in GUIDES if k != "full")


def gudn_dir(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    """The GUDN model of a target: the backbone's clusters, encoder and length; the guides it trains with."""
    if variant is not None and variant not in VARIANTS:
        raise KeyError(f"unknown gudn variant '{variant}' (known: {', '.join(VARIANTS)})")
    b = settings["gudn"]["backbone"]
    return at(res, GUDN, dataset=dataset, tree=lightxml_tree(settings, section=b), enc=b["encoder"],
              maxlen=b["max_length"], guides=variant or "full")


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    return gudn_dir(res, dataset, settings, variant) + "/" + PREDICTIONS


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    b = settings["gudn"]["backbone"]
    d = gudn_dir(res, dataset, settings, variant)
    return [f"{tokens_dir(res, dataset, b['encoder'], b['max_length'])}/{RECORD}",
            at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/" + record(LABEL_EMB),
            record(at(res, TREE, dataset=dataset, emb="pifa-tfidf", tree=lightxml_tree(settings, section=b))),
            f"{d}/{RECORD}", f"{d}/{record('predict')}"]


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [("gudn.backbone.encoder", ((settings.get("gudn") or {}).get("backbone") or {}).get("encoder"))]


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    net = settings["gudn"]["backbone"]
    return network_concepts(net, settings, [net["encoder"]], n_labels, "dynamic", 1)


def trees(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    c = settings["gudn"]["backbone"]["cluster"]
    return [{"branching": 2, "leaf_size": c["leaf_size"], "seed": c["seed"]}]


SPEC = MethodSpec(
    paper='GUDN (Wang et al., "GUDN: A novel guide network for extreme multi-label text classification")',
    name="gudn", section="gudn",
    sections=("split", "ingest", "tfidf", "cluster", "encoders", "gudn", "evaluate"),
    variants=VARIANTS, predictions=predictions, records=records, encoder_refs=encoder_refs,
    concepts=concepts, predictor="xmc_steps.gudn.serve:scores", rules="gudn.smk",
    trees=trees,
    params=(("gudn", "xmc_steps.gudn.params:GUDNParams", ()),),   # gudn.backbone: LightXMLParams
    tree="xmc_steps.gudn.params:GUDNSection",
    # the backbone's clusters come in as the tree file, and GUDN trains one model (no ensemble)
    passes={"gudn_train": [("gudn", ("backbone.cluster", "backbone.ensemble"))],
            "gudn_predict": [("gudn.backbone", ("cluster", "ensemble")), "evaluate.topk"]},
    rule_settings={"gudn_train": TREE_SETTINGS + ["encoders.{enc}", "gudn"],
                   "gudn_predict": TREE_SETTINGS + ["encoders.{enc}", "gudn", "evaluate.topk"]},
    patterns={"GUDN": GUDN})
