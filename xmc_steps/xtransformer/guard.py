"""The matcher's guard: what the shared guard (:mod:`xmc_steps.guard`: the trivial baselines,
``best_baseline``, the failure message, :func:`~xmc_steps.guard.enforce`) needs over clusters: the
cluster metrics (P@1, recall@b), the trivial matchers (the most frequent clusters, the linear tree's
beam), the matcher's :class:`GuardReport` and its two tests (:func:`check_matcher`, the matcher stage's;
:func:`alone_failure` / :func:`check_guard`, the rankers' with ``candidates: matcher``).  Why and how:
docs/methods/xtransformer.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp

from .. import io
from ..baselines import most_frequent_top, recall_of_top
from ..errors import StageError
from ..guard import Advice, Baselines, best_of, enforce, failure_message
from ..guard import guard_width as shared_guard_width
from ..negatives import binarize
from ..search import topk_per_row

# --------------------------------------------------------------------------- cluster metrics


def _is_positive(M: sp.csr_matrix, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``M[rows[j], cols[j]] != 0`` for each j (M CSR with sorted indices)."""
    out = np.zeros(len(rows), dtype=bool)
    for j, (r, c) in enumerate(zip(np.asarray(rows).tolist(), np.asarray(cols).tolist())):
        a, b = M.indptr[r], M.indptr[r + 1]
        k = a + np.searchsorted(M.indices[a:b], c)
        out[j] = k < b and M.indices[k] == c and M.data[k] != 0
    return out


def top1_precision(scores: sp.csr_matrix, M: sp.spmatrix) -> float:
    """P@1 of a top-b score matrix from :func:`~xmc_steps.xtransformer.matcher.predict_clusters` (every row
    has b entries) against ``M``."""
    n = scores.shape[0]
    if n == 0:
        return 0.0
    b = scores.indptr[1] - scores.indptr[0]
    data, ind = scores.data.reshape(n, b), scores.indices.reshape(n, b)
    top = ind[np.arange(n), np.argmax(data, axis=1)]
    M = sp.csr_matrix(M)
    M.sort_indices()
    return float(_is_positive(M, np.arange(n), top).mean())


#: recall of a top-b cluster matrix against ``M`` (:func:`xmc_steps.baselines.recall_of_top`)
cluster_recall = recall_of_top
#: the trivial matcher: the ``b`` clusters with most training documents, for every row
frequency_topb = most_frequent_top


#: the ``b`` the guard compares at, ``guard_width(topb, K)``: ``topb``, but at most half the clusters (at
#: ``K <= 2 topb`` the top-``topb`` holds most clusters and recall@topb cannot tell a matcher from a guess)
guard_width = shared_guard_width


# --------------------------------------------------------------------------- the guard


#: what a failed matcher guard tells the user (:func:`xmc_steps.guard.failure_message`)
ADVICE = Advice("the matcher", "Train it longer or from a better start (xtransformer.matcher.epochs, lr, lr_head, "
                "head_init: linear), give it fewer clusters (xtransformer.cluster.leaf_size)", "xtransformer.matcher",
                "this matcher", resumable=True)


@dataclass
class GuardReport(Baselines):
    """Valid cluster recall@b of the matcher next to the trivial baselines (:func:`check_matcher`)."""

    b: int
    K: int
    matcher: float
    baselines: dict[str, float]
    scorer: str = "head"                 # which scores ``matcher`` is the recall of (head | head+linear)
    head: float | None = None            # the head's own recall, when the scorer is head+linear
    union: float | None = None           # recall of the matcher's top-b together with the tree's top-b
    linear_same_budget: float | None = None   # the tree's recall with as many clusters per document
    union_clusters: float | None = None  # clusters per document in that union (mean)

    @property
    def head_learned(self) -> bool:
        """With ``head+linear``, the head alone must still beat the most frequent clusters: the
        linear tree's half of the score must not carry a head that learned nothing."""
        return self.head is None or self.head > self.baselines["most_frequent"]

    @property
    def adds_to_tree(self) -> bool:
        """The matcher's top-b finds clusters the tree's own next ones would not: the union the
        rankers search (``candidates: union``) beats the tree alone at the same number of clusters."""
        return self.union is not None and self.linear_same_budget is not None and self.union > self.linear_same_budget

    @property
    def passed(self) -> bool:
        return self.head_learned and (self.matcher > self.best_baseline[1] or
                                      (self.matcher > self.baselines["most_frequent"] and self.adds_to_tree))

    @property
    def passed_alone(self) -> bool:
        """The test for ``candidates: matcher`` (the paper's Eq. 2), where the rankers search the
        matcher's top-b alone: it must beat every trivial baseline on its own, the union criterion
        (:attr:`adds_to_tree`) not counting (:func:`alone_failure`)."""
        return self.head_learned and self.matcher > self.best_baseline[1]

    def to_dict(self) -> dict[str, Any]:
        out = {"b": self.b, "K": self.K, "matcher_recall_at_b": self.matcher, "scorer": self.scorer,
               "head_recall_at_b": self.matcher if self.head is None else self.head,
               "baselines": dict(self.baselines), "best_baseline": self.best_baseline[0], "passed": self.passed,
               "passed_alone": self.passed_alone}
        if self.union is not None:
            out["union"] = {"recall": self.union, "linear_same_budget": self.linear_same_budget,
                            "clusters_per_doc": self.union_clusters, "adds_to_tree": self.adds_to_tree}
        return out

    def message(self) -> str:
        base = self.baselines_text()
        name, v = self.best_baseline
        if not self.head_learned:
            what = (f"the matcher's head alone has valid cluster recall@{self.b} {self.head:.4f}, not above the "
                    f"most frequent clusters ({self.baselines['most_frequent']:.4f}), although head+linear reaches "
                    f"{self.matcher:.4f}")
        else:
            what = (f"valid cluster recall@{self.b} is {self.matcher:.4f} ({self.scorer}), not above the better "
                    f"trivial baseline ({name} {v:.4f}; baselines: {base})")
            if self.union is not None:
                what += (f", and with the linear tree's top-{self.b} it reaches {self.union:.4f} "
                         f"({self.union_clusters:.1f} clusters per document), not above the tree alone with as "
                         f"many clusters ({self.linear_same_budget:.4f})")
        return failure_message(f"{what} at K = {self.K} clusters", ADVICE)


def check_matcher(top_valid: sp.spmatrix, M_valid: sp.spmatrix, M_train: sp.spmatrix, b: int,
                  linear_valid: sp.spmatrix | None = None) -> GuardReport:
    """Recall@b of the matcher's top-b valid clusters, of the most frequent clusters and (when
    given) of the linear tree's beam over the same clusters; and the recall of the union of the
    matcher's top-b with the tree's top-b against the tree's own top clusters, as many per
    document as that union holds (``linear_valid`` may list up to 2b clusters per document;
    with fewer, the tree's side of that comparison keeps what it has)."""
    n, K = M_valid.shape
    base = {"most_frequent": cluster_recall(frequency_topb(M_train, n, b), M_valid)}
    top = topk_per_row(sp.csr_matrix(top_valid), b)
    if linear_valid is None:
        return GuardReport(b, K, cluster_recall(top, M_valid), base)
    if linear_valid.shape != (n, K):
        raise StageError(f"the linear tree's valid clusters have shape {linear_valid.shape}, expected {(n, K)}")
    lin = sp.csr_matrix(linear_valid, dtype=np.float32)
    lin_b = topk_per_row(lin, b)
    base["linear_tree"] = cluster_recall(lin_b, M_valid)
    union = binarize(binarize(top) + binarize(lin_b))
    sizes = np.diff(union.indptr)
    same = topk_per_row(lin, sizes)
    return GuardReport(b, K, cluster_recall(top, M_valid), base, union=cluster_recall(union, M_valid),
                       linear_same_budget=cluster_recall(same, M_valid), union_clusters=float(sizes.mean()))


def alone_failure(guard: Mapping[str, Any]) -> str | None:
    """Why a matcher's top-b may not be searched alone (``candidates: matcher``, the paper's Eq. 2),
    from its ``guard.json``; ``None`` when it beats every trivial baseline on its own.

    The matcher stage's own test also lets a matcher pass whose top-b adds to the linear tree's
    (the union the default ``candidates: union`` searches); a stage that searches the matcher's
    top-b alone asks this instead (the X-Transformer rankers' stage, ``--guard``)."""
    base = dict(guard["baselines"])
    name = best_of(base)[0]
    matcher, head = float(guard["matcher_recall_at_b"]), float(guard.get("head_recall_at_b", guard["matcher_recall_at_b"]))
    b = guard.get("b")
    if head <= base["most_frequent"]:
        what = (f"the matcher's head alone has valid cluster recall@{b} {head:.4f}, not above the most frequent "
                f"clusters ({base['most_frequent']:.4f})")
    elif matcher <= base[name]:
        what = (f"the matcher's valid cluster recall@{b} is {matcher:.4f} ({guard.get('scorer', 'head')}), not above "
                f"the better trivial baseline ({name} {base[name]:.4f}; "
                + ", ".join(f"{k} {v:.4f}" for k, v in base.items()) + ")")
        if guard.get("passed"):
            what += "; it passed the matcher's guard only through the union with the linear tree's top-b, which " \
                    "candidates: matcher never searches"
    else:
        return None
    return failure_message(f"candidates: matcher (the paper's Eq. 2) searches the matcher's top-{b} alone, and "
                           f"{what} at K = {guard.get('K')} clusters",
                           Advice("the matcher", "Train the matcher longer or from a better start "
                                  "(xtransformer.matcher.train), search the union with the linear tree "
                                  "(xtransformer.ranker.candidates: union)", ADVICE.section, ADVICE.kept,
                                  failed="is too weak to be searched alone"))


def check_guard(guard_path: str | None, candidates: str, log) -> None:
    """With ``candidates: matcher``, the matcher must have beaten the trivial baselines on its own
    (its ``guard.json``, :func:`alone_failure`): a ``StageError`` with the numbers, or a warning
    when the matcher was trained with ``allow_weak``."""
    if candidates != "matcher" or not guard_path:
        return
    try:
        guard = io.read_json(guard_path)
        why = alone_failure(guard)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"cannot read the matcher's guard {guard_path}: {e}") from e
    if why is None:
        log.info("guard: the matcher beats the trivial baselines on its own (candidates: matcher)")
    enforce(why, bool(guard.get("allow_weak")), ADVICE.section, log)
