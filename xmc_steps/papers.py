"""The papers' reported figures (``workflow/reported.json``): the lookup of one dataset and target's
entry, shared by the evaluate stage (the ``reported`` field of a results file) and the leaderboard."""

from __future__ import annotations

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
