"""The dual encoder's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): the
texts' embeddings searched against the label embeddings (the index built once per process), as the predict
stage scores the test split; ``dual-encoder-ranker`` re-ranks that shortlist with the per-label classifiers
as its stage does (uncalibrated; ELIAS++'s one re-rank, :func:`xmc_steps.elias_plus.predict`), and
``dual-encoder-ensemble`` averages it with xr-linear's scores."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp

from .. import elias_plus, io, neural
from ..layout import WEIGHTS
from ..serving import Features, Target, cached, ensemble_of
from .model import JSON, load_dual_encoder, load_label_index, predict
from .spec import DUAL_ENCODER_RANKER, model_dir


def _nearest(t: Target, f: Features, k: int, device: str) -> tuple[sp.csr_matrix, object]:
    """The ``k`` nearest labels of the texts (CSR scores) and the texts' embeddings."""
    de = t.settings["dual_encoder"]
    folder = Path(model_dir(t.res, t.dataset, t.settings))
    t.need(folder / JSON, folder / WEIGHTS)
    meta = io.read_json(folder / JSON)
    dev = neural.resolve_device(device)
    model, label_emb = cached(("dual-encoder", str(folder), str(dev)), lambda: load_dual_encoder(folder, dev))
    index = cached(("dual-encoder-index", str(folder)),
                   lambda: load_label_index(folder, label_emb, de["search"], de["exact_max_labels"]))
    r = predict(model, f.tokens(meta["encoder"], meta["max_length"]), None, k, int(de["eval_batch_size"]), dev,
                de["amp"], progress=None, with_emb=True, index=index)      # the predict stage's function
    return r["scores"], r["emb"]


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    k100 = int(t.settings["evaluate"]["topk"])
    if variant == "ranker":
        P, emb = _nearest(t, f, k100, device)
        rdir = Path(model_dir(t.res, t.dataset, t.settings, DUAL_ENCODER_RANKER)) / "model"
        t.need(rdir / "ranker.json")
        ranker = cached(("dual-encoder-ranker", str(rdir)), lambda: elias_plus.load_ranker(rdir))
        return elias_plus.predict(rdir, f.tfidf, emb, P, {"topk": k100, "uncalibrated":
                                                          t.settings["dual_encoder"]["ranker"]["uncalibrated"]},
                                  ranker=ranker)[0]
    if variant == "ensemble":
        from ..xr_linear.serve import scores as xr_linear_scores

        members = [_nearest(t, f, k100, device)[0], xr_linear_scores(t, None, f, k100, device)]
        return ensemble_of(members, t.settings["dual_encoder"]["ensemble"], topk)
    return _nearest(t, f, topk, device)[0]
