"""ELIAS's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): each
clustering seed's model as its stages score the test split: ELIAS's top-k (stage 1 or 2), then for
ELIAS++ the sparse ranker over those candidates and the calibration."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp

from .. import elias_plus, io, neural
from ..layout import WEIGHTS
from ..ranker import ranker_features
from ..serving import Features, Target, cached, ensemble_of
from .model import load_elias, predict
from .spec import ELIAS_PLUS, ELIAS_STAGE, elias_dir, elias_seeds


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    el = t.settings["elias"]
    k100 = int(t.settings["evaluate"]["topk"])
    stage = 1 if variant == "stage1" else 2
    dev = neural.resolve_device(device)
    out = []
    for seed in elias_seeds(t.settings, variant):
        sdir = Path(elias_dir(t.res, t.dataset, t.settings, seed, ELIAS_STAGE, stage=stage))
        t.need(sdir / "elias.json", sdir / WEIGHTS)
        meta = io.read_json(sdir / "elias.json")
        model = cached(("elias", str(sdir), str(dev)), lambda: load_elias(sdir, dev))
        pred = el.get("predict") or {}
        b = pred.get("b") if pred.get("b") is not None else model.b
        K = pred.get("K") if pred.get("K") is not None else model.K
        tokens = f.tokens(meta["encoder"], meta["max_length"])
        depth = k100 if variant in ("stage1", "stage2") else max(k100, el["plus"]["n_candidates"])  # ELIAS++'s
        r = predict(model, tokens, depth, b, K, 128, dev, el.get("amp", "auto"), with_emb=True, progress=None,
                    yhat_power=pred.get("yhat_power"))
        if variant in ("stage1", "stage2"):
            out.append(r["scores"])
            continue
        plus = Path(elias_dir(t.res, t.dataset, t.settings, seed, ELIAS_PLUS))
        cal = plus / "calibration" / "calibration.npz"
        t.need(plus / "ranker" / "ranker.json", *([cal] if variant != "ranker" else []))
        W, rmeta = cached(("elias-ranker", str(plus)), lambda: elias_plus.load_ranker(plus / "ranker"))
        p = elias_plus.EliasPlusParams.from_dict({**elias_plus.EliasPlusParams.upgrade(rmeta["params"]), "topk": k100,
                                                  "uncalibrated": el["plus"]["uncalibrated"]})
        Xr = ranker_features(f.tfidf, r["emb"], "tfidf+neural", p.neural_weight)
        cand = elias_plus.candidates(sp.csr_matrix(r["scores"]), p.n_candidates)
        calibrated = variant != "ranker"
        out.append(elias_plus.plus_scores(Xr, W, cand, p, io.load_arrays(cal) if calibrated else None,
                                          elias_plus.label_train_freq(plus / "ranker") if calibrated else None))
    return ensemble_of(out, el["ensemble"], topk)
