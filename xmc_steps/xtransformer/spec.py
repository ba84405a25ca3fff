"""X-Transformer as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`): where its
artifacts live, the predictions and records of its targets, its shared concepts and its predictor.

Light on purpose (no torch): Snakemake imports it when it parses the workflow.

* an X-Transformer member (one indexing x one encoder): ``XT_MATCHER``, ``XT_RANKER``
  (``ranker-{rin}-{neg}-{cand}/model/``), ``XT_PREDICT`` (``.../{comb}/predictions_test.parquet``);
  the linear tree over the member's clusters (guard baseline, candidate source) ``XT_LINEAR``
  (``linear-{fit}``, ``fit`` = ``train`` or ``train+valid``); ``XT_ENSEMBLE``; ``XT_SELECTION``;
* targets: ``xtransformer`` and ``xtransformer-<variant>`` for every variant named in
  ``xtransformer.variants``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..layout import INDEX, LABEL_EMB, PREDICTIONS, PRETRAINED, RECORD, at, emb_name, record, tokens_dir, tree_name
from ..methods import TREE_SETTINGS, MethodSpec, Only, encoder_names, train_length
from ..xr_linear.spec import XR_LINEAR

XT_TREE = "{dataset}/xtransformer/{emb}/{tree}"
XT_LINEAR = XT_TREE + "/linear-{fit}"
XT = XT_TREE + "/{enc}"
XT_MATCHER = XT + "/matcher"
XT_RANKER = XT + "/ranker-{rin}-{neg}-{cand}"
XT_PREDICT = XT_RANKER + "/{comb}"
#: the member's rankers fit on the train split alone, where ``xtransformer.fit_on`` adds valid: what its
#: validation predictions (``XT_PREDICT/pred_valid.parquet``, an ensemble's choice) are scored with
XT_RANKER_VALID = XT_RANKER + "/valid"
XT_ENSEMBLE = "{dataset}/xtransformer/ensemble-{variant}"
XT_SELECTION = "{dataset}/xtransformer-selection"


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

    def valid_ranker_dir(self, res: str, dataset: str, settings: Mapping[str, Any]) -> str:
        """The folder of the rankers that score the validation split: fit on train alone (the member's own
        where ``xtransformer.fit_on`` is ``[train]``)."""
        if list(settings["xtransformer"]["fit_on"]) == ["train"]:
            return self.ranker_dir(res, dataset)
        return self._at(res, dataset, XT_RANKER_VALID)

    @property
    def name(self) -> str:
        """The member's name in an ensemble's record: ``{emb}/{enc}``."""
        return f"{self.emb}/{self.enc}"

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


def fit_splits(settings: Mapping[str, Any], fit: str) -> list[str]:
    """The splits a member's linear tree (``linear-{fit}``) is fit on: ``train`` (the guard's baseline, the
    candidate source on the matcher's training data) or ``xtransformer.fit_on`` (the candidate source at
    test time).  The folder's name is the key; the splits come from the settings."""
    names = {"train": ["train"], "+".join(settings["xtransformer"]["fit_on"]): list(settings["xtransformer"]["fit_on"])}
    if fit not in names:
        raise KeyError(f"no configured X-Transformer linear tree is fit on '{fit}' (configured: {', '.join(names)})")
    return names[fit]


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


def index_encoder(settings: Mapping[str, Any], enc: str) -> str:
    """The encoder key of a member's pifa-neural and text-emb indexing: ``xtransformer.embed.encoder``
    (one pre-trained encoder for every member: §3.2's XLNet), or the member's own matcher encoder ``enc``."""
    return (settings["xtransformer"].get("embed") or {}).get("encoder") or enc


def xt_members(settings: Mapping[str, Any], variant: str | None) -> list[XTMember]:
    spec = xt_spec(settings, variant)
    tree = tree_name(settings["xtransformer"]["cluster"], settings["cluster"]["seed"])
    return [XTMember(emb_name(ix, index_encoder(settings, enc)), tree, enc, spec["ranker_input"], spec["negatives"],
                     spec["candidates"], spec["combiner"])
            for ix in spec["indexing"] for enc in spec["encoders"]]


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    members = xt_members(settings, variant)
    if len(members) == 1:
        return f"{members[0].predict_dir(res, dataset)}/{PREDICTIONS}"
    return at(res, XT_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/" + PREDICTIONS


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of an X-Transformer target (for its results file): the token ids of its
    encoders first, then each member's stages."""
    xt = settings["xtransformer"]
    members = xt_members(settings, variant)
    out = [f"{tokens_dir(res, dataset, e, xt['matcher']['max_length'])}/{RECORD}"
           for e in sorted({m.enc for m in members})]
    for m in members:
        idx = at(res, INDEX, dataset=dataset, emb=m.emb)
        if m.emb.startswith("pifa-neural"):
            out.append(at(res, PRETRAINED, dataset=dataset, enc=index_encoder(settings, m.enc),
                          maxlen=xt["embed"]["max_length"]) + "/" + RECORD)
        fit = "+".join(xt["fit_on"])
        out += [f"{idx}/{record(LABEL_EMB)}", f"{idx}/{record(m.tree)}"]
        for f in dict.fromkeys(("train", fit)):
            model = linear_model_dir(res, dataset, settings, m.emb, m.tree, f)
            out += [f"{model.rsplit('/', 1)[0]}/{record('train')}", f"{m.linear_dir(res, dataset, f)}/{record('clusters')}"]
        out += [f"{m.matcher_dir(res, dataset)}/{RECORD}", f"{m.ranker_dir(res, dataset)}/{record('train')}",
                f"{m.predict_dir(res, dataset)}/{record('predict')}"]
    if len(members) > 1:
        for m in members:
            out += [f"{m.valid_ranker_dir(res, dataset, settings)}/{record('train')}",
                    f"{m.predict_dir(res, dataset)}/{record('pred_valid')}"]
        out.append(at(res, XT_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/" + RECORD)
    return list(dict.fromkeys(out))


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    xt = settings.get("xtransformer") or {}
    embed = (xt.get("embed") or {}).get("encoder")
    return [(f"xtransformer.encoders[{i}]", k) for i, k in enumerate(xt.get("encoders") or [])] + (
        [("xtransformer.embed.encoder", embed)] if embed else [])


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    xt = settings["xtransformer"]
    spec = xt_spec(settings, variant)
    return dict(encoder=encoder_names(settings, list(spec["encoders"])), max_length=xt["matcher"]["max_length"],
                epochs=train_length(xt["matcher"]["train"]), cluster_leaf_size=xt["cluster"]["leaf_size"],
                beam=xt["matcher"]["topb"], negatives=spec["negatives"], ensemble=len(xt_members(settings, variant)))


def applied(settings: Mapping[str, Any], variant: str | None) -> dict[str, Any]:
    """A variant overrides these settings: the applied values (``xtransformer.applied.*`` in MLflow)."""
    return {f"xtransformer.applied.{k}": v for k, v in xt_spec(settings, variant).items()}


#: the keys of ``xtransformer.ranker`` that only prediction reads (Eq. 2's combiner and its
#: transform): the rankers' training leaves them out, so a new combiner reruns prediction alone
PREDICT_ONLY = ("combiner", "transform")
#: the ranker settings training alone reads (prediction takes the trained rankers' own)
TRAIN_ONLY = ("ranker_input", "negatives", "neural_weight", "solver")
_XT = TREE_SETTINGS + ["xr_linear", "encoders.{enc}", "xtransformer.matcher", "xtransformer.fit_on"]


def trees(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Its members' tree: ``xtransformer.cluster``'s shape with the shared clustering seed (for every indexing)."""
    return [{**settings["xtransformer"]["cluster"], "seed": settings["cluster"]["seed"]}]


SPEC = MethodSpec(
    paper='X-Transformer (Chang et al., "Taming Pretrained Transformers for Extreme Multi-label Text Classification", KDD 2020)',
    name="xtransformer", section="xtransformer",
    sections=("split", "ingest", "tfidf", "cluster", "xr_linear", "encoders", "xtransformer", "evaluate"),
    variants=("*",), predictions=predictions, records=records, encoder_refs=encoder_refs,
    concepts=concepts, applied=applied, predictor="xmc_steps.xtransformer.serve:scores", rules="xtransformer.smk",
    trees=trees,
    params=(("xtransformer.matcher", "xmc_steps.xtransformer.params:MatcherParams", ()),
            ("xtransformer.ranker", "xmc_steps.xtransformer.ranker:XTransformerRankerParams", ()),
            ("xtransformer.variants.*", "xmc_steps.xtransformer.ranker:XTransformerRankerParams", ())),
    tree="xmc_steps.xtransformer.params:XTransformerSection",
    rule_settings={
        "xtransformer_linear_train": TREE_SETTINGS,
        "xtransformer_linear_clusters": TREE_SETTINGS + ["xr_linear"],     # and what it passes
        "matcher": TREE_SETTINGS + ["encoders.{enc}", "xtransformer.matcher"],
        "xtransformer_ranker": _XT + [("xtransformer.ranker", PREDICT_ONLY)],
        "xtransformer_predict": _XT + ["xtransformer.ranker", "evaluate.topk"],
        "xtransformer_valid_ranker": _XT + [("xtransformer.ranker", PREDICT_ONLY)],
        "xtransformer_valid_predict": _XT + ["xtransformer.ranker", "evaluate.topk"],
        "xtransformer_select": TREE_SETTINGS + ["xr_linear", "encoders", "xtransformer", "evaluate.topk"],
        "xtransformer_ensemble": TREE_SETTINGS + ["encoders", "xtransformer", "evaluate.topk"]},
    passes={"xtransformer_linear_train": ["xr_linear"],
            # the matcher's beam and scorer, the rankers' splits (the stage derives its beam, kept clusters and
            # online test split from them and the tree's {fit}, which the rule gives)
            "xtransformer_linear_clusters": [Only("xtransformer.matcher", ("topb", "scorer")), "xtransformer.fit_on"],
            "matcher": ["xtransformer.matcher"],
            # the member's ranker input, negatives and candidates are its path's (given by the rule)
            "xtransformer_ranker": [("xtransformer.ranker", PREDICT_ONLY), "xtransformer.matcher.topb"],
            "xtransformer_predict": [("xtransformer.ranker", TRAIN_ONLY), "xtransformer.matcher.topb", "evaluate.topk"],
            "xtransformer_valid_ranker": [("xtransformer.ranker", PREDICT_ONLY), "xtransformer.matcher.topb"],
            "xtransformer_valid_predict": [("xtransformer.ranker", TRAIN_ONLY), "xtransformer.matcher.topb",
                                           "evaluate.topk"],
            "xtransformer_select": [("xtransformer.ranker", PREDICT_ONLY), "xtransformer.matcher.topb",
                                    "evaluate.topk"],
            # the method is the variant's (the rule gives it, from its {variant})
            "xtransformer_ensemble": ["evaluate.topk"]},
    patterns={"XT_TREE": XT_TREE, "XT_LINEAR": XT_LINEAR, "XT": XT, "XT_MATCHER": XT_MATCHER, "XT_RANKER": XT_RANKER,
              "XT_PREDICT": XT_PREDICT, "XT_RANKER_VALID": XT_RANKER_VALID, "XT_ENSEMBLE": XT_ENSEMBLE, "XT_SELECTION": XT_SELECTION})
