"""LightXML's one prediction path: :func:`predict` (a trained network's folder, token ids,
:class:`PredictParams`), called by the predict stage (:mod:`xmc_steps.stages.lightxml` ``predict``, GUDN's
too) and by :mod:`xmc_steps.serving` alike (:func:`scores`: the trained network(s) score the texts as the
predict stage scores the test split, generator x discriminator, Eq. 6; an ensemble's members are combined
as the ensemble stage combines them).  :func:`network_scores` is shared with GUDN, whose model is a
LightXML network.

The prediction parameters are saved with the model (``lightxml.json``'s ``predict``, written by the
training run: ``PredictParams.of(params)``), as PECOS saves its ``pred_params``, and a caller overrides any
of them (the predict rule's settings: ``topk``, ``amp``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import scipy.sparse as sp

from .. import io, neural
from ..layout import WEIGHTS
from ..neural import Amp
from ..prediction import SavedPredictParams
from ..serving import Features, Target, cached, ensemble_choice, ensemble_of
from .params import LightXMLParams
from .spec import lightxml_members, predictions

META = "lightxml.json"


@dataclass
class PredictParams(SavedPredictParams):
    """What a LightXML network's prediction takes (its defaults: :class:`LightXMLParams`'s)."""

    topk: int = LightXMLParams.topk
    eval_batch_size: int = LightXMLParams.eval_batch_size
    amp: Amp = LightXMLParams.amp

    _what = "LightXML prediction parameter"


def load(model_dir: str | os.PathLike, device: Any = "cpu"):
    """The trained network of ``model_dir`` (:func:`xmc_steps.lightxml.model.load_lightxml`)."""
    from .model import load_lightxml

    return load_lightxml(model_dir, device)


def predict(model_dir: str | os.PathLike, tokens: neural.TokenData,
            params: Mapping[str, Any] | PredictParams | None = None, device: Any = "auto",
            progress: Callable[..., Any] | None = None, model: Any = None) -> dict[str, Any]:
    """Top-``topk`` labels by Eq. 6's score and the seconds (:func:`xmc_steps.lightxml.model.predict`) of the
    network in ``model_dir`` for ``tokens``, its saved prediction parameters overridden by ``params``
    (:meth:`~xmc_steps.prediction.SavedPredictParams.effective`; the result's ``params``).  ``model``: the folder's network when the caller
    has loaded it (:func:`load`)."""
    from .model import predict as run

    folder = Path(model_dir)
    p = PredictParams.effective(io.read_json(folder / META), params)
    dev = neural.resolve_device(device)
    if model is None:
        model = load(folder, dev)
    return {**run(model, tokens, p.topk, p.eval_batch_size, dev, p.amp, progress=progress), "params": p}


def network_scores(t: Target, folder: str, net: Mapping[str, Any], f: Features, topk: int, device: str
                   ) -> sp.csr_matrix:
    """One trained LightXML network (LightXML's or GUDN's, ``net`` its settings section) on the texts:
    :func:`predict` with what the predict rule overrides (``topk``, ``amp``)."""
    t.need(Path(folder) / META, Path(folder) / WEIGHTS)
    meta = io.read_json(Path(folder) / META)
    dev = neural.resolve_device(device)
    model = cached(("lightxml", folder, str(dev)), lambda: load(folder, dev))
    tokens = f.tokens(meta["encoder"], meta["max_length"])
    return predict(folder, tokens, {"topk": topk, "amp": net.get("amp")}, dev, model=model)["scores"]


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    members = lightxml_members(t.settings, variant)
    k = max(topk, int(t.settings["evaluate"]["topk"])) if len(members) > 1 else topk   # as the DAG's members
    net = t.settings["lightxml"]
    choice = ensemble_choice(t, predictions(t.res, t.dataset, t.settings, variant)) if len(members) > 1 else None
    out = [network_scores(t, m.dir(t.res, t.dataset), net, f, k, device) for m in members]
    return ensemble_of(out, net["ensemble"]["method"], topk, choice)
