"""X-Transformer's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``)."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp
import torch

from .. import io, neural
from ..layout import GUARD, WEIGHTS
from ..serving import Features, Target, cached, ensemble_choice, ensemble_of
from ..xr_linear.model import XRLinearModel
from . import ranker
from .matcher import head_linear_topb, load_matcher, topb_from_emb
from .spec import linear_model_dir, predictions, xt_members, xt_spec


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """Each member as its stages score the test split: the matcher's encoder pass and top-b clusters (by
    the scorer its guard chose), the linear tree's beam, Eq. 2 over the candidate clusters
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
        tokens = f.tokens(meta["encoder"], meta["max_length"])
        emb = neural.embed(matcher.encoder, tokens, 128, dev, xt["matcher"].get("amp", "auto"), progress=None)
        head = matcher.head.weight.detach().float().cpu().numpy()
        linear = cached(("xr-linear", str(ldir)), lambda: XRLinearModel.load(ldir))
        lin_top = linear.predict_clusters(f.tfidf, beam=topb, transform=linear.params.transform, keep=topb)
        scorer = io.read_json(mdir / GUARD).get("scorer", "head")
        with torch.no_grad():
            top = head_linear_topb(emb, head, lin_top, topb, dev) if scorer == "head+linear" else topb_from_emb(emb, head, topb, dev)
        model = cached(("xt-ranker", str(rdir)), lambda: ranker.load(rdir))
        over = {"topb": topb, "topk": k, "candidates": m.candidates, "combiner": m.combiner,
                "transform": xt["ranker"]["transform"]}
        out.append(ranker.predict_model(rdir, f.tfidf, emb, head, top, lin_top, over, model)[0])
    choice = ensemble_choice(t, predictions(t.res, t.dataset, t.settings, variant)) if len(members) > 1 else None
    return ensemble_of(out, spec["ensemble"], topk, choice)
