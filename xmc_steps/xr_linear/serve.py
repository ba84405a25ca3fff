"""XR-Linear's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): beam
search down the trained tree, as the predict stage scores the test split."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp

from ..layout import at
from ..serving import Features, Target, cached
from .model import XRLinearModel
from .spec import XR_LINEAR


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    folder = Path(at(t.res, XR_LINEAR, dataset=t.dataset)) / "model"
    t.need(folder)
    model = cached(("xr-linear", str(folder)), lambda: XRLinearModel.load(folder))
    s = t.settings["xr_linear"]
    return model.predict(f.tfidf, beam=int(s["beam"]), topk=topk, transform=s["transform"])
