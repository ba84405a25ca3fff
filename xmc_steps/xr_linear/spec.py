"""XR-Linear as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`).

Light on purpose (no scikit-learn): Snakemake imports it when it parses the workflow.
``XR_LINEAR``: the model (``model/``), ``predictions_test.parquet`` and the stage records; its tree is
the shared PIFA-TF-IDF tree ``index/pifa-tfidf/tree-b{branching}-l{leaf_size}-s{seed}`` (``cluster``).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..layout import INDEX, LABEL_EMB, PREDICTIONS, at, record, tree_path
from ..methods import TREE_SETTINGS, MethodSpec

XR_LINEAR = "{dataset}/xr-linear"


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    return at(res, XR_LINEAR, dataset=dataset) + "/" + PREDICTIONS


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    tree = tree_path(res, dataset, "pifa-tfidf", settings["cluster"])
    folder = at(res, XR_LINEAR, dataset=dataset)
    return [at(res, INDEX, dataset=dataset, emb="pifa-tfidf") + "/" + record(LABEL_EMB),
            record(tree), f"{folder}/{record('train')}", f"{folder}/{record('predict')}"]


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    xr = settings["xr_linear"]
    return dict(encoder="tfidf", cluster_leaf_size=settings["cluster"]["leaf_size"], beam=xr["beam"],
                negatives=xr["negatives"], ensemble=1)


def trees(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [settings["cluster"]]


SPEC = MethodSpec(
    paper='PECOS XR-Linear (Yu et al., "PECOS: Prediction for Enormous and Correlated Output Spaces", JMLR 2022)',
    name="xr-linear", section="xr_linear",
    sections=("split", "ingest", "tfidf", "cluster", "xr_linear", "evaluate"),
    predictions=predictions, records=records, concepts=concepts,
    predictor="xmc_steps.xr_linear.serve:scores", rules="linear.smk",
    patterns={"XR_LINEAR": XR_LINEAR},
    trees=trees,
    params=(("xr_linear", "xmc_steps.xr_linear.model:XRLinearParams", ()),),
    tree="xmc_steps.xr_linear.model:XRLinearParams",
    rule_settings={"xr_linear_train": TREE_SETTINGS, "xr_linear_predict": TREE_SETTINGS},
    passes={"xr_linear_train": ["xr_linear"], "xr_linear_predict": ["xr_linear"]})
