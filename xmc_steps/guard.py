"""The guard every method's training run calls: a model that learned nothing fails its stage with the
numbers (DESIGN: "a stage that learned nothing fails with the numbers").

What is shared, whatever the method:

* the trivial baselines (:mod:`xmc_steps.baselines`: the most frequent training targets, the recall of
  a top-k answer) and the linear tree as an index at the same budget (:func:`index_candidates`,
  :func:`linear_tree_valid`: XR-Linear over the same tree, fit on the train split, on the valid split);
  the frequency prior's ranking metrics (:func:`frequency_prior`);
* the width the guard compares at (:func:`guard_width`: the shortlist, at most half the labels);
* the report of a shortlist against the baselines (:class:`GuardReport`, :func:`check`: within the noise
  of the paired per-document difference, two standard errors; an earlier stage's per-document recalls
  when given), :class:`Baselines` (``best_baseline`` of any report with a ``baselines`` dict);
* the failure message (:func:`failure_message`: both numbers, the settings to change and
  ``<section>.allow_weak``) and what a stage does with it (:func:`enforce`);
* the P@1 test against the frequency prior and the model's own linear start (:func:`prior_check`).

What each method adds is its :class:`Advice` (which settings to change) and, for the X-Transformer
matcher, its own criteria over clusters (:mod:`xmc_steps.xtransformer.guard`).  The readings behind
each method's guard: docs/methods/<method>.md, "The guard".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp

from .baselines import most_frequent_top, recall_of_top, row_recalls
from .errors import StageError
from .search import topk_per_row

__all__ = ["Advice", "Baselines", "GuardReport", "best_of", "check", "check_stage", "enforce", "failure_message",
           "frequency_prior", "guard_width", "index_candidates", "linear_tree_valid", "message",
           "most_frequent_top", "prior_check", "recall_of_top", "report_dict", "row_recalls"]


# --------------------------------------------------------------------------- the trivial baselines


def guard_width(K: int, n_labels: int) -> int:
    """The number of shortlisted labels the guard compares at: ``K``, but at most half the labels
    (a shortlist of most labels holds most positives whatever it learned)."""
    return max(1, min(int(K), int(n_labels) // 2))


def index_candidates(cluster_scores: sp.spmatrix, assignment: np.ndarray, width: int) -> sp.csr_matrix:
    """The linear tree as an index: every label of a document's beam clusters (``cluster_scores``,
    N x C, the finest level's beam), scored by its cluster's beam score, the top ``width`` kept
    (within a cluster the order is :func:`xmc_steps.search.topk_per_row`'s tie-break): the candidates
    an index over the same partition offers at the same budget, as ELIAS's stage-1 shortlist does
    (every label of a cluster has the cluster's path score there)."""
    assignment = np.asarray(assignment, dtype=np.int64)
    L, C = len(assignment), cluster_scores.shape[1]
    member = sp.csr_matrix((np.ones(L, dtype=np.float32), (assignment, np.arange(L))), shape=(C, L))
    S = sp.csr_matrix(cluster_scores, dtype=np.float32, copy=True)
    S.data = np.maximum(S.data, 1e-30)              # a beam score of 0 still offers the cluster's labels
    return topk_per_row((S @ member).tocsr(), int(width))


def linear_tree_valid(linear_model: str | os.PathLike, tfidf_valid: str | os.PathLike, width: int, n_valid: int,
                      beam: int | None = None) -> tuple[sp.csr_matrix, sp.csr_matrix, int]:
    """The guard's linear tree on the valid split: ``(its index candidates, its top labels by its rankers,
    the beam)``, ``width`` labels a row of each.  ``beam`` unset: the fewest clusters whose labels (``L / C``
    each) number ``width``.  A file that cannot be read is a :class:`StageError`."""
    from .xr_linear import XRLinearModel

    try:
        model = XRLinearModel.load(linear_model)
        X = sp.csr_matrix(_load_csr(tfidf_valid))
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"the guard's linear tree {linear_model} / {tfidf_valid}: {e}") from e
    if X.shape[0] != n_valid:
        raise StageError(f"{tfidf_valid} has {X.shape[0]} rows but tokens_valid has {n_valid}")
    assignment = model.tree.assignment(-1)
    if beam is None:
        L, C = len(assignment), model.tree.n_clusters
        beam = max(1, min(C, math.ceil(int(width) * C / max(L, 1) - 1e-9)))
    index = index_candidates(model.predict_clusters(X, beam=beam), assignment, width)
    return index, model.predict(X, beam=beam, topk=width), int(beam)


def _load_csr(path):
    from . import io

    return io.load_csr(path)


def frequency_prior(Y_train: sp.spmatrix, Y: sp.spmatrix, k: int = 100) -> dict[str, float]:
    """P@1, P@5 and R@``k`` of the trivial predictor that ranks every text's labels by training frequency
    (:func:`most_frequent_top`; ties: lower label): what a model that learned nothing from the text reaches."""
    from . import metrics

    scores = most_frequent_top(Y_train, Y.shape[0], k)
    p = metrics.precision(scores, Y, 5)
    return {"p_at_1": float(p[0]), "p_at_5": float(p[4]), f"recall_at_{k}": float(metrics.recall(scores, Y, k)[-1])}


# --------------------------------------------------------------------------- the message


@dataclass(frozen=True)
class Advice:
    """What a method's failed guard tells the user: who failed (``subject``), the settings to change
    (``remedies``, a sentence), the config section whose ``allow_weak`` keeps the model, whether a rerun
    resumes from the kept checkpoints (``resumable``), and how the failure is said (``failed``)."""

    subject: str = "the model"
    remedies: str = "Train it longer or from a better start"
    section: str | None = None
    kept: str = "this model"
    resumable: bool = False
    failed: str = "learned too little"


def failure_message(what: str, advice: Advice = Advice()) -> str:
    """``<subject> <failed>: <what>. <remedies>, or set <section>.allow_weak: true ...``: the one form of
    every guard's failure (``what`` names the model's number and the baseline's)."""
    key = f"{advice.section}.allow_weak" if advice.section else "allow_weak"
    tail = ("; the trained weights stay in the output folder's checkpoints/, so a rerun does not train again"
            if advice.resumable else "")
    return f"{advice.subject} {advice.failed}: {what}. {advice.remedies}, or set {key}: true to go on with " \
           f"{advice.kept}{tail}"


def enforce(message: str | None, allow_weak: bool, section: str | None, log) -> None:
    """A failed guard (``message`` not ``None``) is a :class:`StageError`, or a warning with ``allow_weak``."""
    if message is None:
        return
    if not allow_weak:
        raise StageError(message)
    log.warning("%s (continuing: %s is true)", message, f"{section}.allow_weak" if section else "allow_weak")


# --------------------------------------------------------------------------- the report


def best_of(baselines: Mapping[str, float]) -> tuple[str, float]:
    """The best baseline's ``(name, figure)`` (ties: the first named)."""
    name = max(baselines, key=lambda k: baselines[k])
    return name, float(baselines[name])


class Baselines:
    """``best_baseline`` of a report with a ``baselines`` dict (name -> the baseline's figure)."""

    baselines: dict[str, float]

    @property
    def best_baseline(self) -> tuple[str, float]:
        return best_of(self.baselines)

    def baselines_text(self) -> str:
        return ", ".join(f"{k} {v:.4f}" for k, v in self.baselines.items())


@dataclass
class GuardReport(Baselines):
    """Valid shortlist recall@``width`` of a model next to the trivial indexes (and an earlier stage's)."""

    stage: int
    width: int
    K: int
    shortlist: float
    baselines: dict[str, float]
    previous: float | None = None        # the earlier stage's recall at the same width (ELIAS's stage 2)
    p_at_1: float | None = None
    info: dict[str, float] = field(default_factory=dict)   # recorded beside the baselines, not judged
    noise: float | None = None           # two standard errors of the per-document difference to the earlier stage
    margins: dict[str, float] = field(default_factory=dict)  # the same against each baseline
    advice: Advice = field(default=Advice(), compare=False, repr=False)

    @property
    def beats_baselines(self) -> bool:
        """Not below any baseline by more than the noise of the per-document difference (two standard
        errors; without per-document figures, strictly above the best)."""
        if not self.margins:
            return self.shortlist > self.best_baseline[1]
        return all(self.shortlist >= v - self.margins.get(k, 0.0) for k, v in self.baselines.items())

    @property
    def keeps_stage1(self) -> bool:
        """Not below the earlier stage by more than the noise of the paired difference (two standard errors)."""
        return self.previous is None or self.shortlist >= self.previous - (self.noise or 0.0)

    @property
    def passed(self) -> bool:
        return self.beats_baselines and self.keeps_stage1

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "width": self.width, "K": self.K, "shortlist_recall": self.shortlist,
                "p_at_1": self.p_at_1, "baselines": dict(self.baselines), "best_baseline": self.best_baseline[0],
                "stage1_shortlist_recall": self.previous, "stage1_noise": self.noise, "margins": dict(self.margins),
                "passed": self.passed, "recorded": dict(self.info)}

    def message(self) -> str:
        what = []
        if not self.beats_baselines:
            name, v = self.best_baseline
            what.append(f"valid recall@{self.width} is {self.shortlist:.4f}, below the better trivial index "
                        f"({name} {v:.4f}; baselines at the same budget: {self.baselines_text()}) by more than the "
                        f"noise of the difference ({self.margins.get(name, 0.0):.4f})")
        if not self.keeps_stage1:
            what.append(f"stage {self.stage}'s valid recall@{self.width} {self.shortlist:.4f} fell below stage 1's "
                        f"{self.previous:.4f} by more than the noise of the difference ({self.noise or 0.0:.4f})")
        return failure_message("; and ".join(what), self.advice)


def message(report: GuardReport) -> str | None:
    """``None`` when the model passed; else what failed, with the numbers and the settings to change."""
    return None if report.passed else report.message()


def report_dict(report: GuardReport, **extra: Any) -> dict[str, Any]:
    """What a single-stage model's ``guard.json`` holds: the report without the stage fields, and ``extra``."""
    d = report.to_dict()
    for k in ("stage", "stage1_shortlist_recall", "stage1_noise"):
        d.pop(k, None)
    d["recall"] = d.pop("shortlist_recall")
    return {**d, **extra}


def check(top_valid: sp.spmatrix, Y_valid: sp.spmatrix, Y_train: sp.spmatrix, K: int,
          linear_valid: sp.spmatrix | None = None, linear_ranked_valid: sp.spmatrix | None = None,
          p_at_1: float | None = None, previous_rows: np.ndarray | None = None, stage: int = 1,
          advice: Advice = Advice()) -> tuple[GuardReport, np.ndarray]:
    """The guard's numbers and the model's per-document recalls (:func:`xmc_steps.baselines.row_recalls`,
    what a later stage compares with).  ``top_valid`` and ``linear_valid`` (the tree's index candidates,
    :func:`index_candidates`) hold at most ``width`` labels a row (:func:`guard_width` of ``K``);
    ``previous_rows`` are an earlier stage's per-document recalls at that width: the model may not fall
    below it by more than two standard errors of the per-document difference.  ``linear_ranked_valid``
    (the tree's top labels by its rankers) is recorded beside the baselines, not judged."""
    n, L = Y_valid.shape
    w = guard_width(K, L)
    for M in (linear_valid, linear_ranked_valid):
        if M is not None and M.shape != (n, L):
            raise ValueError(f"the linear tree's valid labels have shape {M.shape}, expected {(n, L)}")
    rows = row_recalls(top_valid, Y_valid)
    base_rows = {"most_frequent": row_recalls(most_frequent_top(Y_train, n, w), Y_valid)}
    if linear_valid is not None:
        base_rows["linear_tree"] = row_recalls(linear_valid, Y_valid)
    base, margins = {}, {}
    for name, r in base_rows.items():
        base[name], margins[name] = _paired(rows, r)[1:]
    info = {} if linear_ranked_valid is None else {"linear_tree_ranked": recall_of_top(linear_ranked_valid, Y_valid)}
    previous = noise = None
    if previous_rows is not None:
        previous_rows = np.asarray(previous_rows, dtype=np.float64)
        if previous_rows.shape != rows.shape:
            raise ValueError(f"stage 1's per-document recalls cover {previous_rows.shape[0]} documents, "
                             f"the valid split {rows.shape[0]}")
        _, previous, noise = _paired(rows, previous_rows)
    report = GuardReport(stage, w, int(K), float(np.nanmean(rows)) if np.isfinite(rows).any() else 0.0, base,
                         previous, p_at_1, info, noise, margins, advice)
    return report, rows


def check_stage(stage: int, shortlist_valid: sp.spmatrix, Y_valid: sp.spmatrix, Y_train: sp.spmatrix, K: int,
                linear_valid: sp.spmatrix | None = None, previous_rows: np.ndarray | None = None,
                p_at_1: float | None = None, linear_ranked_valid: sp.spmatrix | None = None,
                advice: Advice = Advice()) -> tuple[GuardReport, np.ndarray]:
    """:func:`check` of a staged model (ELIAS's stage 1 or 2), its arguments in the stage's order."""
    return check(shortlist_valid, Y_valid, Y_train, K, linear_valid, linear_ranked_valid, p_at_1, previous_rows,
                 stage, advice)


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """``(mean a, mean b, two standard errors of the mean of a - b)`` over the documents where both are defined."""
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.any():
        return 0.0, 0.0, 0.0
    d = a[ok] - b[ok]
    return float(a[ok].mean()), float(b[ok].mean()), float(2.0 * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


# --------------------------------------------------------------------------- P@1 against the prior


def prior_check(method: str, m: Mapping[str, float], prior: Mapping[str, float], start: Mapping[str, float] | None,
                steps: int, sec: str) -> tuple[str | None, str]:
    """``(message, verdict)``: the message is ``None`` when the trained model's valid P@1 is above the
    frequency prior's and, with a linear start, not below the start's own (fine-tuning that loses what
    the least-squares start knew before the first step has failed as surely as one that learned
    nothing: on a large label space the prior is near 0 and would pass almost anything).  ``sec`` is
    the config section named in the message (``gudn.backbone`` for GUDN's LightXML network)."""
    verdict = (f"valid P@1 {m['p_at_1']:.4f} vs the frequency prior's {prior['p_at_1']:.4f} "
               f"(P@5 {m['p_at_5']:.4f} vs {prior['p_at_5']:.4f})")
    if start is not None:
        verdict += f"; its linear start (step 0) had P@1 {start['p_at_1']:.4f}"
    if m["p_at_1"] <= prior["p_at_1"]:
        return failure_message(f"{verdict} after {steps} steps",
                               Advice(method, f"Train longer or faster ({sec}.train.epochs, {sec}.train.lr), check "
                                              "the encoder and max_length", sec,
                                      failed="learned nothing from the text")), verdict
    if start is not None and m["p_at_1"] < start["p_at_1"]:
        return failure_message(f"{verdict} after {steps} steps",
                               Advice(f"{method} fine-tuning", f"Lower the rates ({sec}.train.lr, {sec}.lr_generator), "
                                      f"train longer ({sec}.train.epochs)", sec,
                                      failed="lost what its least-squares start knew")), verdict
    return None, verdict
