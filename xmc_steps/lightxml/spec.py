"""LightXML as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`): where its artifacts
live, the predictions and records of its targets, its shared concepts and its predictor.

Light on purpose (no torch): Snakemake imports it when it parses the workflow.

* ``LIGHTXML`` ``lightxml/{tree}/{enc}-{maxlen}/{sampling}/``: one model (``sampling``: ``dynamic``
  or ``static`` negatives; ``lightxml.json``, ``curve.png``, ``predictions_test.parquet``); its clusters
  are ``index/pifa-tfidf/tree-b2-l{leaf_size}-s{seed}``;
* ``LIGHTXML_ENSEMBLE``: the ensemble's predictions;
* targets: ``lightxml`` (one model), ``lightxml-ensemble`` (one model per encoder x seed of
  ``lightxml.ensemble``) and ``lightxml-static`` (Table 5's "S": negatives from a generator trained
  first, then frozen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..layout import INDEX, LABEL_EMB, PREDICTIONS, RECORD, TREE, at, record, tokens_dir, tree_name
from ..methods import TREE_SETTINGS, MethodSpec, encoder_names, train_length

LIGHTXML = "{dataset}/lightxml/{tree}/{enc}-{maxlen}/{sampling}"
LIGHTXML_ENSEMBLE = "{dataset}/lightxml/ensemble-{variant}"

VARIANTS = ("ensemble", "static")


@dataclass(frozen=True)
class LightXMLMember:
    """One LightXML model: its clusters (a tree), an encoder key, the negative sampling (``dynamic`` |
    ``static``) and its seed (the tree's clustering seed is also the training seed)."""

    tree: str
    enc: str
    maxlen: int
    sampling: str = "dynamic"
    seed: int = 0

    def dir(self, res: str, dataset: str) -> str:
        return at(res, LIGHTXML, dataset=dataset, tree=self.tree, enc=self.enc, maxlen=self.maxlen,
                  sampling=self.sampling)

    @property
    def name(self) -> str:
        """The member's name in an ensemble's record: ``{enc}-s{seed}``."""
        return f"{self.enc}-s{self.seed}"


def lightxml_tree(settings: Mapping[str, Any], seed: int | None = None, section: Mapping[str, Any] | None = None) -> str:
    """The tree whose finest level gives LightXML's clusters (or those of another network on its settings,
    ``section``: GUDN's backbone): balanced 2-means down to ``leaf_size``."""
    c = (section if section is not None else settings["lightxml"])["cluster"]
    return tree_name({"branching": 2, "leaf_size": c["leaf_size"]}, c["seed"] if seed is None else seed)


def lightxml_members(settings: Mapping[str, Any], variant: str | None) -> list[LightXMLMember]:
    lx = settings["lightxml"]
    if variant is not None and variant not in VARIANTS:
        raise KeyError(f"unknown lightxml variant '{variant}' (known: {', '.join(VARIANTS)})")
    if variant == "ensemble":
        ens = lx["ensemble"]
        return [LightXMLMember(lightxml_tree(settings, seed), enc, lx["max_length"], seed=seed)
                for enc in ens["encoders"] for seed in ens["seeds"]]
    return [LightXMLMember(lightxml_tree(settings), lx["encoder"], lx["max_length"],
                           "static" if variant == "static" else "dynamic", lx["cluster"]["seed"])]


def member_of(settings: Mapping[str, Any], tree: str, enc: str, maxlen: int, sampling: str) -> LightXMLMember:
    """The member of a LightXML target whose folder these are (the rule's wildcards): its seed comes
    from the settings, not from the tree's name.  None configured: a KeyError naming the folder."""
    for variant in (None, *VARIANTS):
        for m in lightxml_members(settings, variant):
            if (m.tree, m.enc, int(m.maxlen), m.sampling) == (tree, enc, int(maxlen), sampling):
                return m
    raise KeyError(f"no configured LightXML model is {tree}/{enc}-{maxlen}/{sampling}")


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    members = lightxml_members(settings, variant)
    if len(members) == 1:
        return members[0].dir(res, dataset) + "/" + PREDICTIONS
    return at(res, LIGHTXML_ENSEMBLE, dataset=dataset, variant=variant) + "/" + PREDICTIONS


def valid_predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """The members' validation predictions an ensemble chooses its combination on; none where the members
    train on the validation split too (``lightxml.train.fit_valid``: they have seen its labels)."""
    if settings["lightxml"]["train"].get("fit_valid"):
        return []
    return [f"{m.dir(res, dataset)}/pred_valid.parquet" for m in lightxml_members(settings, variant)]


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of a LightXML target (for its results file)."""
    members = lightxml_members(settings, variant)
    out = [at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/" + record(LABEL_EMB)]
    for m in members:
        out += [f"{tokens_dir(res, dataset, m.enc, m.maxlen)}/{RECORD}",
                record(at(res, TREE, dataset=dataset, emb="pifa-tfidf", tree=m.tree)),
                f"{m.dir(res, dataset)}/{RECORD}", f"{m.dir(res, dataset)}/{record('predict')}"]
    if len(members) > 1:
        if valid_predictions(res, dataset, settings, variant):
            out += [f"{m.dir(res, dataset)}/{record('pred_valid')}" for m in members]
        out.append(at(res, LIGHTXML_ENSEMBLE, dataset=dataset, variant=variant) + "/" + RECORD)
    return list(dict.fromkeys(out))


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    lx = settings.get("lightxml") or {}
    return [("lightxml.encoder", lx.get("encoder"))] + [
        (f"lightxml.ensemble.encoders[{i}]", k) for i, k in enumerate((lx.get("ensemble") or {}).get("encoders") or [])]


def network_concepts(net: Mapping[str, Any], settings: Mapping[str, Any], encoders: list[str], n_labels: int | None,
                     negatives: str, ensemble: int) -> dict[str, Any]:
    """The concepts of a LightXML network (LightXML's own or GUDN's backbone): ``n_labels`` decides the
    mode (one label per cluster up to ``flat_max_labels``: ``cluster_leaf_size = 1``); without it the
    configured leaf size is given."""
    flat = n_labels is not None and n_labels <= net["flat_max_labels"]
    return dict(encoder=encoder_names(settings, encoders), max_length=net["max_length"], epochs=train_length(net["train"]),
                cluster_leaf_size=1 if flat else net["cluster"]["leaf_size"], beam=net["topb"],
                negatives=negatives, ensemble=ensemble)


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    members = lightxml_members(settings, variant)
    return network_concepts(settings["lightxml"], settings, sorted({m.enc for m in members}), n_labels,
                            "static" if variant == "static" else "dynamic", len(members))


def trees(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The trees of every member of every LightXML target (balanced 2-means, a seed each)."""
    seeds = {m.seed for v in (None, *VARIANTS) for m in lightxml_members(settings, v)}
    return [{"branching": 2, "leaf_size": settings["lightxml"]["cluster"]["leaf_size"], "seed": s} for s in sorted(seeds)]


#: a model's settings: the section but its clusters (the rule's tree file) and its ensemble (the members are jobs)
_MODEL = ("lightxml", ("cluster", "ensemble"))

SPEC = MethodSpec(
    paper='LightXML (Jiang et al., "LightXML: Transformer with Dynamic Negative Sampling for High-Performance Extreme Multi-label Text Classification", AAAI 2021)',
    name="lightxml", section="lightxml",
    sections=("split", "ingest", "tfidf", "cluster", "encoders", "lightxml", "evaluate"),
    variants=VARIANTS, predictions=predictions, records=records, encoder_refs=encoder_refs,
    concepts=concepts, predictor="xmc_steps.lightxml.serve:scores", rules="lightxml.smk",
    trees=trees,
    params=(("lightxml", "xmc_steps.lightxml.params:LightXMLParams", ()),),
    tree="xmc_steps.lightxml.params:LightXMLSection",
    passes={"lightxml_train": [_MODEL], "lightxml_predict": [_MODEL, "evaluate.topk"],
            "lightxml_valid_predict": [_MODEL, "evaluate.topk"],
            # the ensemble stage's method is its key `ensemble` (as elias.ensemble): the rule gives it
            # lightxml.ensemble.method, which the hash covers (`lightxml`)
            "lightxml_ensemble": ["evaluate.topk"]},
    rule_settings={"lightxml_train": TREE_SETTINGS + ["encoders.{enc}", "lightxml"],
                   "lightxml_predict": TREE_SETTINGS + ["encoders.{enc}", "lightxml", "evaluate.topk"],
                   "lightxml_valid_predict": TREE_SETTINGS + ["encoders.{enc}", "lightxml", "evaluate.topk"],
                   "lightxml_ensemble": TREE_SETTINGS + ["encoders", "lightxml", "evaluate.topk"]},
    patterns={"LIGHTXML": LIGHTXML, "LIGHTXML_ENSEMBLE": LIGHTXML_ENSEMBLE})
