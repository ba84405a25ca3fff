"""The dual encoder's guard: a model that retrieves no better than a trivial index fails its stage
(docs/methods/dual-encoder.md, "The guard").

After training, the model's valid recall at ``w`` labels (``w`` = :func:`xmc_steps.elias.guard.guard_width`
of ``topk``: ``topk``, at most half the labels) is compared, as ELIAS's stages are
(:func:`xmc_steps.elias.guard.check_stage`: the same baselines, the same noise margin of two standard errors
of the per-document difference), with

* the most frequent training labels (``most_frequent``), and
* when given, the linear tree as an index at the same budget (``linear_tree``): XR-Linear over the shared
  PIFA tree, fit on the train split, its beam of ``b`` clusters, their labels by the clusters' beam scores,
  the first ``w`` (:func:`xmc_steps.elias.guard.index_candidates`); ``b`` is the fewest clusters whose labels
  (``L / C`` each) number ``w`` (:func:`xmc_steps.elias.params.default_b` with coverage 1).  The tree's top
  ``w`` labels by its rankers under that beam are recorded beside (``linear_tree_ranked``), not judged.

Below either by more than the noise: :class:`xmc_steps.errors.StageError` with the numbers and the settings
to change, unless ``allow_weak``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import io
from ..elias.guard import GuardReport, check_stage, guard_width, index_candidates
from ..elias.params import default_b
from ..errors import StageError

__all__ = ["GuardReport", "check", "guard_width", "linear_valid", "message", "report_dict"]


def linear_valid(linear_model: str | os.PathLike, tfidf_valid: str | os.PathLike, width: int, n_valid: int
                 ) -> tuple[sp.csr_matrix, sp.csr_matrix, int]:
    """The linear tree on the valid split: ``(its index candidates, its ranked top labels, the beam)``, ``width``
    labels a row of each (module docstring); a file that cannot be read is a :class:`StageError`."""
    from ..xr_linear import XRLinearModel

    try:
        model = XRLinearModel.load(linear_model)
        X = io.load_csr(tfidf_valid)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"the guard's linear tree {linear_model} / {tfidf_valid}: {e}") from e
    if X.shape[0] != n_valid:
        raise StageError(f"{tfidf_valid} has {X.shape[0]} rows but tokens_valid has {n_valid}")
    assignment = model.tree.assignment(-1)
    L, C = len(assignment), model.tree.n_clusters
    beam = default_b(L, C, width, 1.0)
    index = index_candidates(model.predict_clusters(X, beam=beam), assignment, width)
    return index, model.predict(X, beam=beam, topk=width), beam


def check(top_valid: sp.spmatrix, Y_valid: sp.spmatrix, Y_train: sp.spmatrix, topk: int,
          linear_index: sp.spmatrix | None = None, linear_ranked: sp.spmatrix | None = None,
          p_at_1: float | None = None) -> tuple[GuardReport, np.ndarray]:
    """The guard's numbers (:func:`xmc_steps.elias.guard.check_stage` on the model's top ``w`` valid labels,
    ``top_valid``) and the per-document recalls."""
    return check_stage(1, top_valid, Y_valid, Y_train, topk, linear_index, None, p_at_1, linear_ranked)


def message(report: GuardReport, section: str = "dual_encoder") -> str | None:
    """``None`` when the model passed; else what failed, with the numbers and the settings to change."""
    if report.passed:
        return None
    name, v = report.best_baseline
    base = ", ".join(f"{k} {x:.4f}" for k, x in report.baselines.items())
    return (f"the dual encoder retrieves no better than a trivial index: valid recall@{report.width} is "
            f"{report.shortlist:.4f}, below {name}'s {v:.4f} (baselines at the same budget: {base}) by more than the "
            f"noise of the difference ({report.margins.get(name, 0.0):.4f}). Train longer or faster "
            f"({section}.train.epochs, {section}.train.lr), give it harder negatives ({section}.hard_negatives, "
            f"{section}.batching: ngame, {section}.cluster_size), check the label texts, the encoder and max_length, "
            f"or set {section}.allow_weak: true to keep this model")


def report_dict(report: GuardReport, **extra: Any) -> dict[str, Any]:
    """What ``guard.json`` holds: the report without ELIAS's stage fields, and ``extra``."""
    d = report.to_dict()
    for k in ("stage", "stage1_shortlist_recall", "stage1_noise"):
        d.pop(k, None)
    d["recall"] = d.pop("shortlist_recall")
    return {**d, **extra}
