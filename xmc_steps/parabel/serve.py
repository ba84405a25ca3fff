"""Parabel's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): the
omikuji forest, as the predict stage scores the test split."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp

from ..layout import at
from ..serving import Features, Target, cached
from .model import load, predict
from .spec import PARABEL


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    folder = Path(at(t.res, PARABEL, dataset=t.dataset)) / "model"
    t.need(folder / "omikuji")
    model = cached(("parabel", str(folder)), lambda: load(folder / "omikuji", int(t.settings.get("threads", 2))))
    return predict(model, f.tfidf, topk, int(t.settings["parabel"]["beam"]), t.n_labels)
