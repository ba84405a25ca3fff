"""X-Transformer's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): each
member's matcher as its stage's end-of-training pass scores the test split (:func:`.matcher.predict_matcher`,
the matcher's saved :class:`~.matcher.PredictParams`: batch, autocast, top-b), the linear tree's beam, and
Eq. 2 as the predict stage (:func:`.ranker.predict_model`)."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp

from .. import io, neural
from ..layout import GUARD, WEIGHTS
from ..serving import Features, Target, cached, ensemble_choice, ensemble_of
from ..xr_linear.model import XRLinearModel
from . import ranker
from .matcher import load_matcher, predict_matcher
from .spec import linear_model_dir, predictions, xt_members, xt_spec


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """Each member as its stages score the test split: the matcher's encoder pass and top-b clusters (by
    the scorer its guard chose; :func:`~.matcher.predict_matcher`), the linear tree's beam, Eq. 2 over the candidate clusters
    (:func:`xmc_steps.xtransformer.ranker.predict_model`, the predict stage's, with the rule's overrides)."""
    xt = t.settings["xtransformer"]
    spec = xt_spec(t.settings, variant)
    members = xt_members(t.settings, variant)
    k = max(topk, int(t.settings["evaluate"]["topk"])) if len(members) > 1 else topk
    topb = int(xt["matcher"]["topb"])
    fit = "+".join(xt["fit_on"])
    dev = neural.resolve_device(device)
    out = []
    for m in members:
        mdir, rdir = Path(m.matcher_dir(t.res, t.dataset)), Path(m.ranker_dir(t.res, t.dataset)) / "model"
        ldir = Path(linear_model_dir(t.res, t.dataset, t.settings, m.emb, m.tree, fit))
        t.need(mdir / "matcher.json", mdir / WEIGHTS, mdir / GUARD, rdir / "ranker.json", ldir)
        meta = io.read_json(mdir / "matcher.json")
        matcher = cached(("matcher", str(mdir), str(dev)), lambda: load_matcher(mdir, dev))
        linear = cached(("xr-linear", str(ldir)), lambda: XRLinearModel.load(ldir))
        lin_top = linear.predict_clusters(f.tfidf, beam=topb, transform=linear.params.transform, keep=topb)
        # the matcher's saved batch and autocast (the DAG's embedding of the test split), the settings' topb
        mp = predict_matcher(mdir, f.tokens(meta["encoder"], meta["max_length"]), {"topb": topb}, dev, matcher, lin_top)
        emb, head, top = mp["emb"], mp["head"], mp["clusters"]
        model = cached(("xt-ranker", str(rdir)), lambda: ranker.load(rdir))
        over = {"topb": topb, "topk": k, "candidates": m.candidates, "combiner": m.combiner,
                "transform": xt["ranker"]["transform"]}
        out.append(ranker.predict_model(rdir, f.tfidf, emb, head, top, lin_top, over, model)[0])
    choice = ensemble_choice(t, predictions(t.res, t.dataset, t.settings, variant)) if len(members) > 1 else None
    return ensemble_of(out, spec["ensemble"], topk, choice)
