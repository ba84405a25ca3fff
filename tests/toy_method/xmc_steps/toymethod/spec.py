"""The toy method's spec: its folder, predictions, records, concepts and predictor."""

from __future__ import annotations

from typing import Any, Mapping

from ..layout import PREDICTIONS, at, record
from ..methods import BASE_SETTINGS, MethodSpec

TOYMETHOD = "{dataset}/toymethod"


def predictions(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> str:
    return at(res, TOYMETHOD, dataset=dataset) + "/" + PREDICTIONS


def records(res: str, dataset: str, settings: Mapping[str, Any], variant: str | None) -> list[str]:
    return [at(res, TOYMETHOD, dataset=dataset) + "/" + record("train")]


def concepts(settings: Mapping[str, Any], variant: str | None, n_labels: int | None) -> dict[str, Any]:
    return {"encoder": "none", "ensemble": 1}


SPEC = MethodSpec(
    name="toymethod", section="toymethod", sections=("split", "ingest", "toymethod", "evaluate"),
    predictions=predictions, records=records, concepts=concepts,
    predictor="xmc_steps.toymethod.serve:scores", rules="toymethod.smk",
    tree="xmc_steps.toymethod.params:ToyParams",
    rule_settings={"toymethod_train": BASE_SETTINGS}, passes={"toymethod_train": ["toymethod"]},
    patterns={"TOYMETHOD": TOYMETHOD})
