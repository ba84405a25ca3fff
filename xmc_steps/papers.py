"""The papers' reported figures (``workflow/reported.json``): the lookup of one dataset and target's
entry, shared by the evaluate stage (the ``reported`` field of a results file) and the leaderboard; and
what paper mode runs that is not the papers' (``workflow/paper_departures.json``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any


def select_reported(obj: Any, dataset: str, method: str) -> dict[str, Any] | None:
    """The paper's figures for (dataset, method) from a ``--reported`` JSON document.

    Accepted layouts: ``{dataset: {method: {...}}}`` (the whole table), ``{method:
    {...}}`` (one dataset's file) and a flat ``{...}`` of figures (already selected).
    A flat object is recognised by having no object-valued entry other than
    ``"source"``-like metadata.  Returns ``None`` when the pair is absent.
    """
    if not isinstance(obj, dict) or not obj:
        return None
    if dataset in obj and isinstance(obj[dataset], dict):
        obj = obj[dataset]
        if method in obj and isinstance(obj[method], dict):
            return dict(obj[method])
        return None
    if method in obj and isinstance(obj[method], dict):
        return dict(obj[method])
    if any(isinstance(v, dict) for v in obj.values()):
        return None  # a table that lacks this dataset/method
    return dict(obj)



#: What paper mode (``--configfile config.yaml config.paper.yaml``) runs that is not the paper's, each with
#: its reason, by the config.paper.yaml section of a method and a dataset (``"*"``: every dataset): data, as
#: the papers' figures are (``workflow/reported.json``); the overlay's comments say the same where each value
#: is set.  The leaderboard prints them beside a row run with the paper's settings (``paper_departures``),
#: so that "paper's settings: yes" names what is ours.
DEPARTURES_PATH = Path(__file__).resolve().parents[1] / "workflow" / "paper_departures.json"


@functools.cache
def _departures() -> dict[str, Any]:
    return json.loads(DEPARTURES_PATH.read_text(encoding="utf-8")) if DEPARTURES_PATH.exists() else {}


def paper_mode_departures(section: str, dataset: str) -> list[str]:
    """What paper mode runs that is not the paper's for a method's config section and a dataset
    (:data:`DEPARTURES_PATH`: the entries for every dataset first)."""
    own = _departures().get(section) or {}
    return list(own.get("*", [])) + list(own.get(dataset, []))
