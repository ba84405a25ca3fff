"""GUDN's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): its
backbone, a LightXML network, scores the texts alone (the guide network reads label texts in
training only)."""

from __future__ import annotations

import scipy.sparse as sp

from ..lightxml.serve import network_scores
from ..serving import Features, Target
from .spec import gudn_dir


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    return network_scores(t, gudn_dir(t.res, t.dataset, t.settings, variant), t.settings["gudn"]["backbone"], f,
                          topk, device)
