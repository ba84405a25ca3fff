"""Parabel's one prediction path: :func:`predict` (a model folder, TF-IDF features, :class:`PredictParams`),
called by the predict stage (:mod:`xmc_steps.stages.parabel` ``predict``) and by :mod:`xmc_steps.serving`
alike (:func:`scores`): omikuji's beam search over the trained forest.

The prediction parameters (``beam``, ``topk``) are saved with the model (``parabel.json``'s ``predict``,
written by the train stage), as PECOS saves its ``pred_params``; a caller overrides either (the predict rule's
``parabel`` section; serving's ``parabel.beam`` and its ``topk``).  A model saved before they were (no
``parabel.json``) falls back to :class:`~xmc_steps.parabel.model.ParabelParams`' defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import scipy.sparse as sp

from .. import io
from ..layout import at
from ..serving import Features, Target, cached
from .model import META, PredictParams, load, predict as run
from .spec import PARABEL

__all__ = ["META", "PredictParams", "saved", "predict", "scores"]


def saved(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The model folder's description (:data:`META`; ``{}`` for a model saved before it was written)."""
    path = Path(model_dir) / META
    return io.read_json(path) if path.is_file() else {}


def predict(model_dir: str | os.PathLike, X: sp.spmatrix, n_labels: int,
            params: Mapping[str, Any] | PredictParams | None = None, model: Any = None, threads: int = 1
            ) -> dict[str, Any]:
    """The top-``topk`` labels of ``X`` (``scores``, CSR ``N x n_labels``) by the forest in ``model_dir`` and the
    parameters used (``params``: the saved ones overridden by ``params``,
    :meth:`~xmc_steps.prediction.SavedPredictParams.effective`).  ``model``: the folder's forest when the caller
    has loaded it (:func:`~xmc_steps.parabel.model.load`; else loaded with ``threads``)."""
    p = PredictParams.effective(saved(model_dir), params)
    if model is None:
        model = load(Path(model_dir) / "omikuji", threads)
    return {"scores": run(model, X, p.topk, p.beam, n_labels), "params": p}


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """The texts' top-``topk`` labels: :func:`predict` with the target's ``parabel.beam`` (as its predict rule
    passes it) and ``topk``."""
    folder = Path(at(t.res, PARABEL, dataset=t.dataset)) / "model"
    t.need(folder / "omikuji")
    model = cached(("parabel", str(folder)), lambda: load(folder / "omikuji", int(t.settings.get("threads", 2))))
    over = {"beam": int(t.settings["parabel"]["beam"]), "topk": topk}
    return predict(folder, f.tfidf, t.n_labels, over, model)["scores"]
