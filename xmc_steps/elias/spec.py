"""ELIAS as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`): where its artifacts
live, the predictions and records of its targets, its shared concepts and its predictor.

Light on purpose (no torch): Snakemake imports it when it parses the workflow.

* ``ELIAS`` ``elias/{tree}/{enc}-{maxlen}/``: one model (a clustering seed, an encoder, a maximum
  length) with ``stage1/``, ``stage2/`` (models and ``pred_{split}.parquet``) and ``plus/`` (ELIAS++);
* ``ELIAS_ENSEMBLE``: the ensemble over ``elias.seeds`` (or ``ensemble_seeds``);
* targets: ``elias`` (ELIAS++, calibrated) and Table 3's build-up rows ``elias-<row>``
  (:data:`VARIANTS`).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..layout import INDEX, LABEL_EMB, PREDICTIONS, RECORD, SPLITS, TREE, at, record, tokens_dir, tree_name
from ..methods import TREE_SETTINGS, MethodSpec, Only, encoder_names, train_length

ELIAS = "{dataset}/elias/{tree}/{enc}-{maxlen}"
ELIAS_STAGE = ELIAS + "/stage{stage}"
ELIAS_PLUS = ELIAS + "/plus"
ELIAS_ENSEMBLE = "{dataset}/elias/ensemble-{variant}"

#: Table 3 build-up rows, each a variant target ``elias-<row>``.
VARIANTS = ("stage1", "stage2", "ranker", "calibrated", "ensemble")


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
    if variant not in VARIANTS:
        raise KeyError(f"unknown elias variant '{variant}' (known: {', '.join(VARIANTS)})")
    return [el["seeds"][0]]


def depth(topk: int, n_candidates: int | None = None) -> int:
    """How many labels ELIAS's prediction keeps per document: ``topk`` (``evaluate.topk``), or ELIAS++'s deeper
    ``n_candidates`` (``elias.plus.n_candidates``, what its re-rank reads), whichever is more."""
    return max(int(topk), int(n_candidates or 0))


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    seeds = elias_seeds(settings, variant)
    if variant in (None, "ensemble"):
        if len(seeds) == 1:
            return elias_dir(res, dataset, settings, seeds[0], ELIAS_PLUS) + "/predictions_test_calibrated.parquet"
        return at(res, ELIAS_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/" + PREDICTIONS
    if variant in ("stage1", "stage2"):
        return elias_dir(res, dataset, settings, seeds[0], ELIAS_STAGE, stage=variant[-1]) + "/pred_test.parquet"
    return elias_dir(res, dataset, settings, seeds[0], ELIAS_PLUS) + f"/predictions_test_{variant.replace('ranker', 'uncalibrated')}.parquet"


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    """Every stage record of an ELIAS target (for its results file)."""
    el = settings["elias"]
    seeds = elias_seeds(settings, variant)
    out = [f"{tokens_dir(res, dataset, el['encoder'], el['max_length'])}/{RECORD}",
           at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/" + record(LABEL_EMB)]
    stage_only = variant in ("stage1", "stage2")
    for seed in seeds:
        s1, s2 = (elias_dir(res, dataset, settings, seed, ELIAS_STAGE, stage=k) for k in (1, 2))
        plus = elias_dir(res, dataset, settings, seed, ELIAS_PLUS)
        out.append(record(at(res, TREE, dataset=dataset, emb="pifa-tfidf", tree=tree_name(el["cluster"], seed))))
        out.append(f"{s1}/{RECORD}")
        if variant == "stage1":
            out.append(f"{s1}/{record('pred_test')}")
            continue
        out.append(f"{s2}/{RECORD}")
        if stage_only:
            out.append(f"{s2}/{record('pred_test')}")
            continue
        out += [f"{s2}/{record(f'pred_{s}')}" for s in SPLITS]
        out.append(f"{plus}/{record('ranker')}")
        if variant == "ranker":
            out.append(f"{plus}/{record('predict_uncalibrated')}")
        else:
            out += [f"{plus}/{record('calibration')}", f"{plus}/{record('predict_calibrated')}"]
    if variant in (None, "ensemble") and len(seeds) > 1:
        out.append(at(res, ELIAS_ENSEMBLE, dataset=dataset, variant=variant or "main") + "/" + RECORD)
    return list(dict.fromkeys(out))


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [("elias.encoder", (settings.get("elias") or {}).get("encoder"))]


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    el = settings["elias"]
    stages = ("stage1",) if variant == "stage1" else ("stage1", "stage2")
    return dict(encoder=encoder_names(settings, [el["encoder"]]), max_length=el["max_length"],
                epochs="+".join(train_length(el[s]["train"]) for s in stages),
                cluster_leaf_size=el["cluster"]["leaf_size"], beam=el["index"]["b"],
                negatives=f"shortlist-{el['index']['K']}", ensemble=len(elias_seeds(settings, variant)))


#: what both training stages read of the section (xmc_steps.elias.params.STAGE_KEYS, kept equal by
#: tests/test_params.py) beside its stage's own subsection; their rules pass them unchanged (Only)
_READ = ("max_length", "pooling", "index", "train", "eval_every", "amp", "device", "allow_cpu_fallback", "head_init",
         "head_init_l2", "head_init_scale", "head_refit", "head_refit_select", "allow_weak")
#: what the stages' hashes cover: both stages' (and prediction's) reads, and stage 1's subsection
_STAGES = TREE_SETTINGS + ["encoders.{enc}", *(f"elias.{k}" for k in _READ), "elias.stage1"]


def trees(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One tree per clustering seed of the full method and of the ensemble row."""
    el = settings["elias"]
    return [{**el["cluster"], "seed": seed} for seed in dict.fromkeys([*el["seeds"], *el["ensemble_seeds"]])]


SPEC = MethodSpec(
    paper='ELIAS (Gupta et al., "ELIAS: End-to-End Learning to Index and Search in Large Output Spaces", NeurIPS 2022)',
    name="elias", section="elias",
    sections=("split", "ingest", "tfidf", "cluster", "encoders", "elias", "evaluate"),
    variants=VARIANTS, predictions=predictions, records=records, encoder_refs=encoder_refs,
    concepts=concepts, predictor="xmc_steps.elias.serve:scores", rules="elias.smk",
    trees=trees,
    params=(("elias", "xmc_steps.elias.params:EliasParams", ("index", "predict", "stage1", "stage2")),
            ("elias.plus", "xmc_steps.elias_plus:EliasPlusParams", ())),
    tree="xmc_steps.elias.params:EliasSection",
    passes={"elias_stage1": [Only("elias", _READ + ("stage1",))],
            "elias_stage2": [Only("elias", _READ + ("stage2",))],
            # the prediction parameters over the model's saved ones (elias.predict's keys, where it runs) and the
            # depths its stage keeps (spec.depth: evaluate.topk, or ELIAS++'s deeper n_candidates)
            "elias_predict": ["elias.predict", "elias.device", "elias.allow_cpu_fallback", "elias.plus.n_candidates",
                              "evaluate.topk"],
            **{rule: ["elias.plus", "evaluate.topk"] for rule in ("elias_plus_ranker", "elias_plus_calibrate",
                                                                  "elias_plus_predict")},
            "elias_ensemble": ["elias.ensemble", "evaluate.topk"]},
    rule_settings={
        "elias_stage1": _STAGES,
        "elias_stage2": _STAGES + ["elias.stage2"],
        "elias_predict": _STAGES + ["elias.stage2", "elias.predict", "elias.plus.n_candidates", "evaluate.topk"],
        "elias_plus_ranker": TREE_SETTINGS + ["encoders.{enc}", "elias", "evaluate.topk"],
        "elias_plus_calibrate": TREE_SETTINGS + ["encoders.{enc}", "elias", "evaluate.topk"],
        "elias_plus_predict": TREE_SETTINGS + ["encoders.{enc}", "elias", "evaluate.topk"],
        "elias_ensemble": TREE_SETTINGS + ["encoders", "elias", "evaluate.topk"]},
    patterns={"ELIAS": ELIAS, "ELIAS_STAGE": ELIAS_STAGE, "ELIAS_PLUS": ELIAS_PLUS, "ELIAS_ENSEMBLE": ELIAS_ENSEMBLE})
