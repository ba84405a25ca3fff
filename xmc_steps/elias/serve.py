"""ELIAS's one prediction path: :func:`predict` (a trained stage's folder, token ids,
:class:`PredictParams`), called by the predict stage (:mod:`xmc_steps.stages.elias` ``predict``) and by
:mod:`xmc_steps.serving` alike (:func:`scores`, the predictor its spec names: each clustering seed's
model as its stages score the test split, then for ELIAS++ :func:`xmc_steps.elias_plus.predict`).

The prediction parameters are saved with the model (``elias.json``'s ``predict``, written by the training
run: :func:`saved_predict_params`), as PECOS saves its ``pred_params``: the beam ``b`` and shortlist size
``K`` the model was trained with, the ``yhat_power`` and batch of its settings; a caller overrides any of
them (:class:`PredictSettings`: the predict stage with its rule's settings, ``elias.predict`` and the depths
``evaluate.topk`` and ``elias.plus.n_candidates``; serving with the same section and depths)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import scipy.sparse as sp

from .. import elias_plus, io, neural
from ..layout import WEIGHTS
from ..neural import Amp
from ..params import Params, bounded
from ..prediction import SavedPredictParams
from ..serving import Features, Target, cached, ensemble_choice, ensemble_of
from .params import EliasParams
from .spec import ELIAS_PLUS, ELIAS_STAGE, depth, elias_dir, elias_seeds, predictions

META = "elias.json"


@dataclass
class PredictParams(SavedPredictParams):
    """What ELIAS's prediction takes (its defaults: :class:`EliasParams`'s; ``b``, ``K`` ``None``: the
    model's own, as trained)."""

    b: int | None = None
    K: int | None = None
    topk: int = EliasParams.topk
    shortlist_topk: int | None = EliasParams.shortlist_topk
    yhat_power: float = EliasParams.yhat_power
    eval_batch_size: int = EliasParams.eval_batch_size
    amp: Amp = EliasParams.amp

    _what = "ELIAS prediction parameter"


@dataclass
class PredictSettings(Params):
    """What the ``elias_predict`` rule passes its stage (``elias.predict``'s keys, where it runs, and the depths it
    asks for) and serving gives :func:`predict`: :meth:`overrides` of the model's saved :class:`PredictParams`
    (``None``: the saved value)."""

    b: int | None = bounded(None, ge=1)
    K: int | None = bounded(None, ge=1)
    yhat_power: float | None = bounded(None, ge=0)
    topk: int | None = bounded(None, ge=1)  # evaluate.topk
    n_candidates: int | None = bounded(None, ge=1)  # elias.plus.n_candidates: ELIAS++ re-ranks this deep (spec.depth)
    shortlist_topk: int | None = bounded(None, ge=1)
    eval_batch_size: int | None = bounded(None, ge=1)
    amp: Amp | None = None
    device: str = "auto"
    allow_cpu_fallback: bool = True
    threads: int | None = None

    _what = "ELIAS prediction parameter"

    def overrides(self) -> dict[str, Any]:
        """The :class:`PredictParams` keys over the saved ones: these settings, ``topk`` the depth (:func:`depth`)."""
        out = {k: getattr(self, k) for k in PredictParams.keys()}
        out["topk"] = None if self.topk is None and self.n_candidates is None else depth(self.topk or 0, self.n_candidates)
        return out


def saved_predict_params(params: EliasParams, model: Any) -> PredictParams:
    """The prediction parameters a trained model is saved with: its ``b`` and ``K``, the rest of ``params``."""
    return PredictParams.of(params, b=int(model.b), K=int(model.K))


def effective_params(meta: Mapping[str, Any], overrides: Mapping[str, Any] | PredictParams | None = None
                     ) -> PredictParams:
    """The model's saved :class:`PredictParams` (``meta``: its ``elias.json``; a model saved before they
    were: its ``b``, ``K`` and training parameters) with ``overrides``' values that are not ``None``."""
    return PredictParams.effective(meta, overrides, b=meta["b"], K=meta["K"])


def predict(model_dir: str | os.PathLike, tokens: neural.TokenData,
            params: Mapping[str, Any] | PredictParams | None = None, device: Any = "auto",
            progress: Callable[..., Any] | None = None, with_emb: bool = True, model: Any = None) -> dict[str, Any]:
    """Top-``topk`` labels by ``p``, the shortlist's top-``shortlist_topk`` by ``yhat``, ``phi(x)`` and the
    seconds (:func:`xmc_steps.elias.model.predict`) of the model in ``model_dir`` for ``tokens``, with its
    saved prediction parameters overridden by ``params`` (:func:`effective_params`; the result's ``params``,
    and ``meta``, the model's ``elias.json``).  ``model``: the folder's model when the caller has loaded it
    (:func:`load`)."""
    from .model import predict as run

    folder = Path(model_dir)
    meta = io.read_json(folder / META)
    p = effective_params(meta, params)
    dev = neural.resolve_device(device)
    if model is None:
        model = load(folder, dev)
    r = run(model, tokens, p.topk, p.b, p.K, p.eval_batch_size, dev, p.amp, p.shortlist_topk, with_emb=with_emb,
            progress=progress, yhat_power=p.yhat_power)
    return {**r, "params": p, "meta": meta}


def load(model_dir: str | os.PathLike, device: Any = "cpu"):
    """The trained model of ``model_dir`` (:func:`xmc_steps.elias.model.load_elias`)."""
    from .model import load_elias

    return load_elias(model_dir, device)


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """Serving: each seed's :func:`predict` (deep enough for ELIAS++: :class:`PredictSettings`, as the predict stage),
    then for ELIAS++ its re-rank (:func:`xmc_steps.elias_plus.predict`), the seeds ensembled."""
    el = t.settings["elias"]
    k100 = int(t.settings["evaluate"]["topk"])
    stage = 1 if variant == "stage1" else 2
    plain = variant in ("stage1", "stage2")
    dev = neural.resolve_device(device)
    out = []
    for seed in elias_seeds(t.settings, variant):
        sdir = Path(elias_dir(t.res, t.dataset, t.settings, seed, ELIAS_STAGE, stage=stage))
        t.need(sdir / META, sdir / WEIGHTS)
        meta = io.read_json(sdir / META)
        tokens = f.tokens(meta["encoder"], meta["max_length"])
        over = PredictSettings.from_dict({**(el.get("predict") or {}), "topk": k100,
                                          "n_candidates": None if plain else el["plus"]["n_candidates"]}).overrides()
        model = cached(("elias", str(sdir), str(dev)), lambda: load(sdir, dev))
        r = predict(sdir, tokens, over, dev, progress=None, model=model)
        if plain:
            out.append(r["scores"])
            continue
        plus = Path(elias_dir(t.res, t.dataset, t.settings, seed, ELIAS_PLUS))
        calibrated = variant != "ranker"
        cal = plus / "calibration"
        rdir = plus / "ranker"
        t.need(rdir / "ranker.json", *(elias_plus.combination_files(cal) if calibrated else []))
        ranker = cached(("elias-ranker", str(rdir)), lambda: elias_plus.load_ranker(rdir))
        out.append(elias_plus.predict(rdir, f.tfidf, r["emb"], r["scores"],
                                      {"topk": k100, "uncalibrated": el["plus"]["uncalibrated"]},
                                      cal if calibrated else None, ranker)[0])
    seeds = elias_seeds(t.settings, variant)
    choice = ensemble_choice(t, predictions(t.res, t.dataset, t.settings, variant)) if len(seeds) > 1 else None
    return ensemble_of(out, el["ensemble"], topk, choice)
