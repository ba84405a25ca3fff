"""Parabel baseline through the ``omikuji`` package, on the pipeline's TF-IDF features.

omikuji's default hyper-parameters are Parabel's (balanced 2-means trees, 3 trees,
max depth 20, leaves of at most 100 labels, hinge-loss liblinear rankers (dual L2-loss SVM) with
C = 1, eps 0.1, weights below 0.1 dropped); they come from config (``parabel``).

omikuji trains from a file in the Extreme Classification Repository format; the
features are written to a temporary file in the model folder and removed afterwards.
Rows without features are written without a trailing space (omikuji rejects it).

At prediction (:func:`load`), the densest weight vectors are held dense, as omikuji's own ``test``
command does: the same scores, faster.

The stage (``train``, ``predict``): :mod:`xmc_steps.stages.parabel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import io
from ..params import FIT_ON, Params, Split, bounded
from ..prediction import SavedPredictParams

@dataclass
class ParabelParams(Params):
    """The ``parabel`` section: omikuji's hyper-parameters (its defaults are Parabel's) and the beam."""

    n_trees: int = bounded(3, ge=1)  # trees in the forest (Parabel: 3)
    max_depth: int = bounded(20, ge=1)  # the deepest a tree grows
    cluster_k: int = bounded(2, ge=2)  # children per node (2: Parabel's balanced 2-means)
    min_branch_size: int = bounded(100, ge=1)  # a node of at most this many labels is a leaf
    linear_c: float = bounded(1.0, gt=0)  # the rankers' C (hinge-loss liblinear)
    linear_eps: float = bounded(0.1, gt=0)  # the rankers' stopping tolerance
    linear_weight_threshold: float = bounded(0.1, ge=0)  # weights below it are dropped
    linear_max_iter: int = bounded(20, ge=1)  # liblinear's passes over the data
    beam: int = bounded(10, ge=1)  # beam width of the tree search at prediction
    topk: int = bounded(100, ge=1)  # labels kept per test document
    fit_on: list[Split] = bounded(default_factory=lambda: ["train", "valid"], schema=FIT_ON)  # the splits the model
                                    # trains on
    threads: int = bounded(2, ge=1, setting=False)  # omikuji's threads (the stage's --threads)

    _what = "parabel parameter"


@dataclass
class PredictParams(SavedPredictParams):
    """What omikuji's beam search takes (:func:`predict`; defaults :class:`ParabelParams`'s): saved with the
    model (:data:`META`'s ``predict``), read back by :func:`xmc_steps.parabel.serve.predict`."""

    beam: int = bounded(ParabelParams.beam, ge=1)
    topk: int = bounded(ParabelParams.topk, ge=1)

    _what = "parabel prediction parameter"


#: the model folder's description (beside omikuji's ``omikuji`` folder): the training and prediction parameters
META = "parabel.json"


def save_meta(folder: str | Path, params: ParabelParams) -> None:
    """Write :data:`META` into the model ``folder``: ``params`` (less the threads, which change the speed only)
    and the :class:`PredictParams` the model predicts with unless a caller overrides them."""
    io.write_json(Path(folder) / META, {"params": {k: v for k, v in params.to_dict().items() if k != "threads"},
                                        "predict": PredictParams.of(params).to_dict()})


HYPER_KEYS = {
    "n_trees": "n_trees", "max_depth": "max_depth", "cluster_k": "cluster_k", "min_branch_size": "min_branch_size",
    "linear_c": "linear_c", "linear_eps": "linear_eps", "linear_weight_threshold": "linear_weight_threshold",
    "linear_max_iter": "linear_max_iter",
}


def write_xmc_file(path: Path, X: sp.csr_matrix, Y: sp.csr_matrix) -> None:
    """Write features and labels in the Extreme Classification Repository text format."""
    X, Y = sp.csr_matrix(X), sp.csr_matrix(Y)
    with io.atomic_path(path) as tmp, open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}\n")
        for i in range(X.shape[0]):
            labs = ",".join(map(str, Y.indices[Y.indptr[i]:Y.indptr[i + 1]]))
            a, b = X.indptr[i], X.indptr[i + 1]
            feats = " ".join(f"{j}:{v:.6g}" for j, v in zip(X.indices[a:b], X.data[a:b]))
            fh.write(f"{labs} {feats}\n" if feats else f"{labs}\n")


def train(X: sp.csr_matrix, Y: sp.csr_matrix, params: dict[str, Any], workdir: Path, threads: int):
    import omikuji

    hp = omikuji.Model.default_hyper_param()
    for k, attr in HYPER_KEYS.items():
        if k in params:
            setattr(hp, attr, type(getattr(hp, attr))(params[k]))
    data = workdir / "train.omikuji.txt"
    write_xmc_file(data, X, Y)
    try:
        return omikuji.Model.train_on_data(str(data), hp, n_threads=threads)
    finally:
        data.unlink(missing_ok=True)


#: weight vectors denser than this are held dense for prediction (omikuji's ``densify_weights``; 0.1 is the
#: default of omikuji's own ``test`` command).  A dense vector costs 4 bytes per feature against the sparse
#: one's 8 per non-zero, so memory grows at most 5-fold for the vectors it converts (debtags: 70 -> 78 MiB
#: resident); a dot product with it is a look-up per feature of the text instead of a search, the same sums
#: in the same order (the same scores; tests/test_predict.py).  One debtags text: 0.45 against 0.75 ms.
DENSE_ABOVE = 0.1


def load(folder: str | Path, threads: int):
    """The trained forest of ``folder`` (``model/omikuji``) ready to predict: weights above
    :data:`DENSE_ABOVE` dense, a prediction pool of ``threads`` threads."""
    import omikuji

    model = omikuji.Model.load(str(folder))
    model.init_prediction_thread_pool(int(threads))
    model.densify_weights(DENSE_ABOVE)
    return model


def predict(model, X: sp.csr_matrix, topk: int, beam: int, n_labels: int) -> sp.csr_matrix:
    """Top-``topk`` scores per row as CSR (omikuji's beam search, width ``beam``)."""
    X = sp.csr_matrix(X)
    rows, cols, vals = [], [], []
    for i in range(X.shape[0]):
        a, b = X.indptr[i], X.indptr[i + 1]
        feats = list(zip(X.indices[a:b].tolist(), X.data[a:b].tolist()))
        for lab, s in model.predict(feats, beam_size=beam, top_k=topk):
            rows.append(i)
            cols.append(lab)
            vals.append(s)
    return sp.csr_matrix((np.asarray(vals, np.float32), (rows, cols)), shape=(X.shape[0], n_labels))
