"""Parabel (omikuji) as the pipeline sees it (:class:`xmc_steps.methods.MethodSpec`).

Light on purpose: Snakemake imports it when it parses the workflow.  ``PARABEL``: the model
(``model/omikuji``), ``predictions_test.parquet`` and the stage records.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..layout import PREDICTIONS, at, record
from ..methods import BASE_SETTINGS, MethodSpec

PARABEL = "{dataset}/parabel"


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    return at(res, PARABEL, dataset=dataset) + "/" + PREDICTIONS


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    folder = at(res, PARABEL, dataset=dataset)
    return [f"{folder}/{record('train')}", f"{folder}/{record('predict')}"]


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    pb = settings["parabel"]
    return dict(encoder="tfidf", cluster_leaf_size=pb["min_branch_size"], beam=pb["beam"],
                negatives="parent-positives", ensemble=pb["n_trees"])


SPEC = MethodSpec(
    paper='Parabel (Prabhu et al., WWW 2018), through omikuji',
    name="parabel", section="parabel", sections=("split", "ingest", "tfidf", "parabel", "evaluate"),
    predictions=predictions, records=records, concepts=concepts,
    predictor="xmc_steps.parabel.serve:scores", rules="linear.smk",
    patterns={"PARABEL": PARABEL},
    params=(("parabel", "xmc_steps.parabel.model:ParabelParams", ()),),
    tree="xmc_steps.parabel.model:ParabelParams",
    rule_settings={"parabel_train": BASE_SETTINGS + ["tfidf"], "parabel_predict": BASE_SETTINGS + ["tfidf"]},
    passes={"parabel_train": ["parabel"], "parabel_predict": ["parabel"]})
