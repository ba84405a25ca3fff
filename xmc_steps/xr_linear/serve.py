"""XR-Linear's one prediction path: :func:`predict` (a model folder, TF-IDF features, :class:`PredictParams`),
called by the predict stage (:mod:`xmc_steps.stages.xr_linear` ``predict``) and by :mod:`xmc_steps.serving`
alike (:func:`scores`): beam search down the trained tree.

The prediction parameters (``beam``, ``topk``, ``transform``) are saved with the model (``params.json``'s
``predict``, :meth:`XRLinearModel.save`), as PECOS saves its ``pred_params``; a caller overrides any of them
(the predict rule's ``xr_linear`` section; serving's ``xr_linear`` settings and its ``topk``).  A model saved
before they were falls back to its training parameters (``params.json``'s ``params``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import scipy.sparse as sp

from .. import io
from ..layout import at
from ..serving import Features, Target, cached
from .model import PredictParams, XRLinearModel
from .spec import XR_LINEAR

META = "params.json"

__all__ = ["META", "PredictParams", "predict", "scores"]


def predict(model_dir: str | os.PathLike, X: sp.spmatrix, params: Mapping[str, Any] | PredictParams | None = None,
            model: XRLinearModel | None = None) -> dict[str, Any]:
    """The top-``topk`` labels of ``X`` by the model in ``model_dir`` (``scores``, CSR) and the parameters used
    (``params``: the saved ones overridden by ``params``, :meth:`~xmc_steps.prediction.SavedPredictParams.effective`).
    ``model``: the folder's model when the caller has loaded it."""
    folder = Path(model_dir)
    p = PredictParams.effective(io.read_json(folder / META), params)
    if model is None:
        model = XRLinearModel.load(folder)
    return {"scores": model.predict(X, beam=p.beam, topk=p.topk, transform=p.transform), "params": p}


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """The texts' top-``topk`` labels: :func:`predict` with the target's ``xr_linear`` beam and transform (as its
    predict rule passes them) and ``topk``."""
    folder = Path(at(t.res, XR_LINEAR, dataset=t.dataset)) / "model"
    t.need(folder)
    model = cached(("xr-linear", str(folder)), lambda: XRLinearModel.load(folder))
    s = t.settings["xr_linear"]
    return predict(folder, f.tfidf, {"beam": s["beam"], "transform": s["transform"], "topk": topk}, model)["scores"]
