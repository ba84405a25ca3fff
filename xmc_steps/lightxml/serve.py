"""LightXML's predictor for :mod:`xmc_steps.serving` (``python -m xmc_steps.stages.predict``): the
trained network(s) score the texts as the predict stage scores the test split (generator x
discriminator, Eq. 6); an ensemble's members are combined as the ensemble stage combines them.
:func:`network_scores` is shared with GUDN, whose model is a LightXML network."""

from __future__ import annotations

from pathlib import Path

import scipy.sparse as sp

from .. import io
from ..layout import WEIGHTS
from ..serving import Features, Target, cached, ensemble_of
from .model import load_lightxml, predict
from .spec import lightxml_members


def network_scores(t: Target, folder: str, net: dict, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """One trained LightXML network (LightXML's or GUDN's, ``net`` its settings section): Eq. 6's scores."""
    t.need(Path(folder) / "lightxml.json", Path(folder) / WEIGHTS)
    meta = io.read_json(Path(folder) / "lightxml.json")
    model = cached(("lightxml", folder, device), lambda: load_lightxml(folder, device))
    tokens = f.tokens(meta["encoder"], meta["max_length"])
    return predict(model, tokens, topk, int(net.get("eval_batch_size", 128) or 128), device, net.get("amp", "auto"),
                   progress=None)["scores"]


def scores(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    members = lightxml_members(t.settings, variant)
    k = max(topk, int(t.settings["evaluate"]["topk"])) if len(members) > 1 else topk   # as the DAG's members
    net = t.settings["lightxml"]
    out = [network_scores(t, m.dir(t.res, t.dataset), net, f, k, device) for m in members]
    return ensemble_of(out, net["ensemble"]["method"], topk)
