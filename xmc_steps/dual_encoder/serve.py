"""The dual encoder's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): the
texts' embeddings searched against the label embeddings (the index built once per process), as the predict
stage scores the test split; ``dual-encoder-ranker`` re-ranks that shortlist with the per-label classifiers
as its stage does (the combination the validation split chose; ELIAS++'s one re-rank, :func:`xmc_steps.elias_plus.predict`), and
``dual-encoder-ensemble`` averages it with xr-linear's scores."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import scipy.sparse as sp

from .. import elias_plus, io, neural
from ..layout import WEIGHTS
from ..neural import Amp
from ..prediction import SavedPredictParams
from ..serving import Features, Target, cached, ensemble_choice, ensemble_of
from .params import DualEncoderParams, Search
from .spec import DUAL_ENCODER_RANKER, model_dir, predictions


@dataclass
class PredictParams(SavedPredictParams):
    """What the dual encoder's prediction takes (its defaults: :class:`DualEncoderParams`'s)."""

    topk: int = DualEncoderParams.topk
    shortlist_topk: int | None = DualEncoderParams.shortlist_topk
    eval_batch_size: int = DualEncoderParams.eval_batch_size
    amp: Amp = DualEncoderParams.amp
    search: Search = DualEncoderParams.search
    exact_max_labels: int = DualEncoderParams.exact_max_labels

    _what = "dual encoder prediction parameter"


def load(model_dir: str | os.PathLike, device: Any, params: PredictParams):
    """``(model, label embeddings, label index)`` of a trained folder (the index as ``params`` search it)."""
    from .model import load_dual_encoder, load_label_index

    model, label_emb = load_dual_encoder(model_dir, device)
    return model, label_emb, load_label_index(model_dir, label_emb, params.search, params.exact_max_labels)


def predict(model_dir: str | os.PathLike, tokens: neural.TokenData,
            params: Mapping[str, Any] | PredictParams | None = None, device: Any = "auto",
            progress: Callable[..., Any] | None = None, with_emb: bool = False, loaded: tuple | None = None,
            k: int | None = None) -> dict[str, Any]:
    """The dual encoder's one prediction path (the predict stage's and serving's): the ``k`` (default
    ``topk``) labels nearest each text (:func:`xmc_steps.dual_encoder.model.predict`), the seconds, the
    texts' embeddings with ``with_emb``, and the parameters used (``params``: the saved ones, overridden by
    ``params``, :meth:`~xmc_steps.prediction.SavedPredictParams.effective`).  ``loaded``: the folder's
    :func:`load` when the caller has it."""
    from .model import JSON, predict as run

    p = PredictParams.effective(io.read_json(Path(model_dir) / JSON), params)
    dev = neural.resolve_device(device)
    model, _, index = loaded if loaded is not None else load(model_dir, dev, p)
    r = run(model, tokens, None, int(k or p.topk), p.eval_batch_size, dev, p.amp, progress=progress,
            with_emb=with_emb, index=index)
    return {**r, "params": p, "index": index}


def _nearest(t: Target, f: Features, k: int, device: str) -> tuple[sp.csr_matrix, object]:
    """The ``k`` nearest labels of the texts (CSR scores) and the texts' embeddings: :func:`predict` with what
    the predict rule overrides (``search``, ``exact_max_labels``, ``eval_batch_size``, ``amp``)."""
    from .model import JSON

    de = t.settings["dual_encoder"]
    folder = Path(model_dir(t.res, t.dataset, t.settings))
    t.need(folder / JSON, folder / WEIGHTS)
    meta = io.read_json(folder / JSON)
    over = {k_: de[k_] for k_ in ("search", "exact_max_labels", "eval_batch_size", "amp") if k_ in de}
    dev = neural.resolve_device(device)
    loaded = cached(("dual-encoder", str(folder), str(dev)),
                    lambda: load(folder, dev, PredictParams.effective(meta, over)))
    r = predict(folder, f.tokens(meta["encoder"], meta["max_length"]), {**over, "topk": k}, dev, with_emb=True,
                loaded=loaded)
    return r["scores"], r["emb"]


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    k100 = int(t.settings["evaluate"]["topk"])
    if variant == "ranker":
        P, emb = _nearest(t, f, k100, device)
        folder = Path(model_dir(t.res, t.dataset, t.settings, DUAL_ENCODER_RANKER))
        rdir, fusion = folder / "model", folder / "fusion"
        t.need(rdir / "ranker.json", *elias_plus.combination_files(fusion))
        ranker = cached(("dual-encoder-ranker", str(rdir)), lambda: elias_plus.load_ranker(rdir))
        return elias_plus.predict(rdir, f.tfidf, emb, P, {"topk": k100, "uncalibrated":
                                                          t.settings["dual_encoder"]["ranker"]["uncalibrated"]},
                                  fusion, ranker=ranker)[0]
    if variant == "ensemble":
        from ..xr_linear.serve import scores as xr_linear_scores

        members = [_nearest(t, f, k100, device)[0], xr_linear_scores(t, None, f, k100, device)]
        return ensemble_of(members, t.settings["dual_encoder"]["ensemble"], topk,
                           ensemble_choice(t, predictions(t.res, t.dataset, t.settings, "ensemble")))
    return _nearest(t, f, topk, device)[0]
