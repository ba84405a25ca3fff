"""The dual encoder as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`): where its
artifacts live, the predictions and records of its targets, its shared concepts and its predictor.

Light on purpose (no torch): Snakemake imports it when it parses the workflow.

* ``DUAL_ENCODER`` ``dual-encoder/{enc}-{maxlen}/``: the model (one encoder for texts and label
  texts), the label embeddings and their search index, ``pred_{split}.parquet`` (the nearest labels)
  and ``emb_{split}.npz`` (the texts' embeddings);
* ``DUAL_ENCODER_RANKER`` ``.../ranker/``: NGAME's second module, per-label classifiers re-ranking the
  dual encoder's shortlist (the pipeline's sparse ranker on TF-IDF ⊕ the embedding, as ELIAS++'s);
* ``DUAL_ENCODER_ENSEMBLE``: the dual encoder's predictions averaged with xr-linear's;
* targets: ``dual-encoder`` (the dual encoder alone), ``dual-encoder-ranker``, ``dual-encoder-ensemble``.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..layout import INDEX, PREDICTIONS, RECORD, SPLITS, at, record, tokens_dir, tree_name, tree_path
from ..methods import TREE_SETTINGS, MethodSpec, encoder_names, train_length
from ..xr_linear.spec import XR_LINEAR
from ..xtransformer.spec import XT_LINEAR

DUAL_ENCODER = "{dataset}/dual-encoder/{enc}-{maxlen}"
DUAL_ENCODER_RANKER = DUAL_ENCODER + "/ranker"
DUAL_ENCODER_ENSEMBLE = "{dataset}/dual-encoder/ensemble-{variant}"

#: the targets beside ``dual-encoder``: with NGAME's classifiers, and averaged with xr-linear
VARIANTS = ("ranker", "ensemble")


def model_dir(res: str, dataset: str, settings: Mapping[str, Any], pattern: str = DUAL_ENCODER) -> str:
    de = settings["dual_encoder"]
    return at(res, pattern, dataset=dataset, enc=de["encoder"], maxlen=de["max_length"])


def _check(variant: str | None) -> None:
    if variant is not None and variant not in VARIANTS:
        raise KeyError(f"unknown dual-encoder variant '{variant}' (known: {', '.join(VARIANTS)})")


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    _check(variant)
    if variant == "ranker":
        return model_dir(res, dataset, settings, DUAL_ENCODER_RANKER) + "/" + PREDICTIONS
    if variant == "ensemble":
        return at(res, DUAL_ENCODER_ENSEMBLE, dataset=dataset, variant=variant) + "/" + PREDICTIONS
    return model_dir(res, dataset, settings) + "/pred_test.parquet"


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of a dual-encoder target (for its results file)."""
    _check(variant)
    de = settings["dual_encoder"]
    d = model_dir(res, dataset, settings)
    out = [f"{tokens_dir(res, dataset, de['encoder'], de['max_length'])}/{RECORD}", f"{d}/{RECORD}",
           f"{d}/{record('pred_test')}"]
    if variant == "ranker":
        r = model_dir(res, dataset, settings, DUAL_ENCODER_RANKER)
        out += [f"{d}/{record(f'pred_{s}')}" for s in SPLITS] + [f"{r}/{record(s)}" for s in ("train", "fusion", "predict")]
    if variant == "ensemble":
        xr = at(res, XR_LINEAR, dataset=dataset)
        out += [at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/" + record("label_emb"),
                record(tree_path(res, dataset, "pifa-tfidf", settings["cluster"])),
                f"{xr}/{record('train')}", f"{xr}/{record('predict')}",
                f"{d}/{record('pred_valid')}", f"{linear_tree(res, dataset, settings)}/{record('pred_valid')}",
                at(res, DUAL_ENCODER_ENSEMBLE, dataset=dataset, variant=variant) + "/" + RECORD]
    return list(dict.fromkeys(out))


def linear_tree(res: str, dataset: str, settings: Mapping[str, Any]) -> str:
    """The guard's linear tree (XR-Linear over the shared PIFA-TF-IDF tree, fit on train): its folder."""
    return at(res, XT_LINEAR, dataset=dataset, emb="pifa-tfidf", tree=tree_name(settings["cluster"]), fit="train")


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [("dual_encoder.encoder", (settings.get("dual_encoder") or {}).get("encoder"))]


def trees(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The shared PIFA-TF-IDF tree: the guard's linear baseline is XR-Linear over it, fit on train."""
    return [settings["cluster"]]


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    de = settings["dual_encoder"]
    return dict(encoder=encoder_names(settings, [de["encoder"]]), max_length=de["max_length"],
                epochs=train_length(de["train"]), negatives=f"{de['batching']}+{de['hard_negatives']}-mined",
                ensemble=2 if variant == "ensemble" else 1)


#: the model's settings (the ranker's and the ensemble's are theirs alone), what training and prediction read
_SECTION = ("dual_encoder", ("ranker", "ensemble"))
_MODEL = TREE_SETTINGS + ["encoders.{enc}", _SECTION]

SPEC = MethodSpec(
    paper='a dual encoder after NGAME (Dahiya et al., WSDM 2023) and DEXML (Gupta et al., ICLR 2024)',
    name="dual-encoder", section="dual_encoder",
    sections=("split", "ingest", "tfidf", "cluster", "xr_linear", "encoders", "dual_encoder", "evaluate"),
    variants=VARIANTS, predictions=predictions, records=records, encoder_refs=encoder_refs, trees=trees,
    concepts=concepts, predictor="xmc_steps.dual_encoder.serve:scores", rules="dual_encoder.smk",
    params=(("dual_encoder", "xmc_steps.dual_encoder.params:DualEncoderParams", ()),
            ("dual_encoder.ranker", "xmc_steps.dual_encoder.params:DualEncoderRankerParams", ())),
    tree="xmc_steps.dual_encoder.params:DualEncoderSection",
    passes={"dual_encoder_train": [_SECTION],
            # prediction: the model's settings but its own depths (evaluate.topk's; the shortlist's is saved with it)
            "dual_encoder_predict": [("dual_encoder", ("ranker", "ensemble", "topk", "shortlist_topk")), "evaluate.topk"],
            "dual_encoder_ranker": ["dual_encoder.ranker", "evaluate.topk"],
            "dual_encoder_ranker_fuse": ["dual_encoder.ranker", "evaluate.topk"],
            "dual_encoder_ranker_predict": ["dual_encoder.ranker", "evaluate.topk"],
            "linear_tree_valid_predict": ["xr_linear"],
            "dual_encoder_ensemble": ["dual_encoder.ensemble", "evaluate.topk"]},
    rule_settings={
        "dual_encoder_train": TREE_SETTINGS + ["encoders.{enc}"],
        "dual_encoder_predict": _MODEL,
        "dual_encoder_ranker": _MODEL,
        "dual_encoder_ranker_fuse": _MODEL,
        "dual_encoder_ranker_predict": _MODEL,
        "dual_encoder_ensemble": TREE_SETTINGS + ["xr_linear", "dual_encoder", "evaluate.topk"],
        "linear_tree_valid_predict": TREE_SETTINGS},
    patterns={"DUAL_ENCODER": DUAL_ENCODER, "DUAL_ENCODER_RANKER": DUAL_ENCODER_RANKER,
              "DUAL_ENCODER_ENSEMBLE": DUAL_ENCODER_ENSEMBLE})
