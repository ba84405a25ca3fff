"""ELIAS++ (§3.5): a sparse ranker over ELIAS's top predictions, and score calibration.

Readings and measured choices: docs/methods/elias.md, "ELIAS++" (the sparse ranker, the calibration
and its features, how deep: ``n_candidates`` and ``calibrate_top``).

The stage (train, calibrate, predict) is :mod:`xmc_steps.stages.elias_plus`; this module is the
scoring it and :mod:`xmc_steps.serving` share: :func:`predict`, the one re-rank of a trained ranker
(ELIAS's and the dual encoder's), its prediction parameters saved with it (``ranker.json``'s
``params``) and overridable (:data:`PREDICT_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, get_args

import numpy as np
import scipy.sparse as sp

from . import io
from .errors import StageError
from .params import Params, bounded
from .ranker import SOLVER_MOVED, RankerParams, append_bias, ranker_features, train_rankers
from .search import Transform, masked_product, top_entries, topk_per_row, transform

if TYPE_CHECKING:
    from .second_stage import Choice

FORMAT = "xmc-elias-plus-v1"

#: how the calibrate stage scores a candidate from the ranker's margin ``h``, the first model's score ``s``
#: (the shortlist's) and the label's training frequency: ``shortlist`` (``s``: the input alone, the second
#: stage off), ``product`` (``s`` x transform(h)), ``ranker`` (transform(h)), ``calibrated`` (ELIAS++ §3.5: a
#: tree's probability over (h, s, frequency) on the top ``calibrate_top``), ``fusion`` (NGAME's score fusion:
#: ``beta * (tree + s) + transform(h)``, the tree over (transform(h), s, frequency) on every candidate)
Choice = Literal["shortlist", "product", "ranker", "calibrated", "fusion"]
Combine = Literal["auto", Choice]
COMBINES = get_args(Choice)
#: the grids ``fusion_beta`` and ``fusion_depth`` are chosen from on validation when unset (NGAME's code: 1, 7)
BETAS = (0.1, 0.3, 1.0, 3.0, 10.0)
DEPTHS = (3, 5, 7)


@dataclass
class EliasPlusParams(Params):
    """ELIAS++ (the ``elias.plus`` section): the candidates re-ranked, the ranker features, the
    calibration tree, and the rankers' solver (:class:`RankerParams`, ``elias.plus.solver``).
    Each label's ranker trains on the documents whose candidates hold it (the candidates play the
    role of TFN negatives), so there is no negatives setting."""

    n_candidates: int = bounded(300, ge=1)  # the first stage's top candidates the ranker trains on and scores
    calibrate_top: int = bounded(100, ge=1)  # the calibration orders the ranker's top this many (the answer)
    neural_weight: float = bounded(1.0, gt=0)  # the embedding's weight beside the TF-IDF in the ranker's features
    transform: Transform = bounded("l3-hinge", setting=False)  # the ranker's score transform (the default's)
    uncalibrated: Literal["product", "ranker"] = "product"  # the score without calibration (the -ranker target)
    max_depth: int | None = bounded(5, ge=1)   # the calibration tree's; None: grown until its leaves are pure
                                   # (scikit-learn's default, §3.5's "standard decision tree")
    calibrate_docs: int | None = bounded(None, ge=1)  # the calibration fits on this many validation documents
                                   # (a seeded sample, seed: ``seed``; §3.5: 5,000); None: every one
    topk: int = bounded(100, setting=False)  # labels written per document (the rule passes evaluate.topk)
    seed: int = bounded(0, ge=0)   # the calibration tree's
    threads: int = bounded(1, ge=1, setting=False)  # labels' rankers trained in parallel (the stage's --threads)
    combine: Combine = "auto"      # the score the calibrate stage fits on the validation split (COMBINES);
                                   # auto: the best of ``choices`` there, the input's own order among them
    choices: list[Choice] = bounded(default_factory=lambda: ["shortlist", "calibrated"],
                                    schema={"minItems": 1})  # the scores auto chooses from: shortlist | product
                                   # | ranker | calibrated (§3.5) | fusion (NGAME's)
    fusion_beta: float | None = bounded(None, ge=0)  # fusion's beta; None: chosen on validation (BETAS)
    fusion_depth: int | None = bounded(None, ge=1)   # fusion's tree depth; None: chosen on validation (DEPTHS)
    allow_weak: bool = False       # a forced ``combine`` that loses to its input on validation only warns
    solver: RankerParams = field(default_factory=RankerParams)  # each label's ranker on its candidate documents
                                   # (as xr_linear.solver)

    _what = "ELIAS++ parameter"
    _moved = {k: v for k, v in SOLVER_MOVED.items() if k != "seed"}

    def __post_init__(self) -> None:
        bad = [c for c in self.choices if c not in COMBINES]
        if bad or not self.choices:
            raise ValueError(f"{self._what} choices must be a non-empty list of {', '.join(COMBINES)}, got {bad or '[]'}")


def candidates(scores: sp.csr_matrix, n: int) -> sp.csr_matrix:
    """The top-``n`` ELIAS predictions per row (scores kept)."""
    return topk_per_row(sp.csr_matrix(scores, dtype=np.float32), n)


def train(Xr: sp.csr_matrix, Y: sp.csr_matrix, cand: sp.csr_matrix, p: EliasPlusParams, progress=None) -> sp.csr_matrix:
    """Sparse rankers ``W`` ((d+1) x L): label ``l`` on the rows whose candidates hold ``l``."""
    L = Y.shape[1]
    return train_rankers(Xr, Y, np.arange(L), cand, p.solver, progress=progress, threads=p.threads)


def ranker_scores(Xr: sp.csr_matrix, W: sp.spmatrix, cand: sp.csr_matrix, bias: float) -> np.ndarray:
    """Raw ranker margins ``h`` for every stored candidate, in ``cand``'s order."""
    return masked_product(append_bias(Xr, bias), sp.csc_matrix(W), cand)


def uncalibrated_scores(elias: np.ndarray, h: np.ndarray, p: EliasPlusParams) -> np.ndarray:
    th = transform(h, p.transform)
    return (elias * th if p.uncalibrated == "product" else th).astype(np.float32)


def candidate_truth(cand: sp.csr_matrix, Y: sp.spmatrix) -> np.ndarray:
    """Whether each stored candidate (in ``cand``'s order) is a positive of its row in ``Y``."""
    rows = np.repeat(np.arange(cand.shape[0]), np.diff(cand.indptr))
    return np.asarray(sp.csr_matrix(Y)[rows, cand.indices]).ravel() > 0


def calibration_subset(cand: sp.csr_matrix, h: np.ndarray, score: np.ndarray, k: int
                       ) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """``(candidates, h, uncalibrated score)`` cut to each row's top-``k`` by the uncalibrated score
    (``calibrate_top``; ties -> lower label index); the whole of them when no row holds more than ``k``."""
    if np.diff(cand.indptr).max(initial=0) <= k:
        return cand, h, score
    keep, indptr = top_entries(sp.csr_matrix((np.asarray(score, dtype=np.float32), cand.indices, cand.indptr),
                                             shape=cand.shape), k)
    return sp.csr_matrix((cand.data[keep], cand.indices[keep], indptr), shape=cand.shape), h[keep], score[keep]


def calibration_features(h: np.ndarray, elias: np.ndarray, label_idx: np.ndarray, train_freq: np.ndarray) -> np.ndarray:
    return np.column_stack([h, elias, train_freq[label_idx]]).astype(np.float64)


def calibration_inputs(cand: sp.csr_matrix, h: np.ndarray, score: np.ndarray, p: EliasPlusParams,
                       train_freq: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """What the calibration tree sees, at fit (the calibrate stage) and at prediction (:func:`plus_scores`)
    alike: ``(candidates, features, uncalibrated score)`` of each row's top-``p.calibrate_top`` candidates."""
    cand, h, score = calibration_subset(cand, h, score, p.calibrate_top)
    return cand, calibration_features(h, cand.data, cand.indices, train_freq), score


def calibration_rows(n: int, docs: int | None, seed: int = 0) -> np.ndarray | None:
    """The validation rows the calibration fits on (``calibrate_docs``): ``docs`` of the ``n`` rows, a
    seeded sample in row order; ``None`` (every row) when ``docs`` is ``None`` or not below ``n``."""
    if docs is None or docs >= n:
        return None
    return np.sort(np.random.default_rng(seed).permutation(n)[:docs])


def fit_calibration(F: np.ndarray, y: np.ndarray, max_depth: int | None, seed: int = 0) -> dict[str, np.ndarray]:
    """Fit the decision tree; return its arrays (see :func:`apply_tree`)."""
    from sklearn.tree import DecisionTreeClassifier

    if len(np.unique(y)) < 2:
        raise StageError("score calibration needs both positive and negative candidates on the validation split")
    t = DecisionTreeClassifier(max_depth=max_depth, random_state=seed).fit(F, y)
    tr = t.tree_
    value = tr.value[:, 0, :]
    pos_col = int(np.where(t.classes_ == 1)[0][0])
    prob = value[:, pos_col] / np.maximum(value.sum(axis=1), 1e-12)
    return {"left": tr.children_left.astype(np.int64), "right": tr.children_right.astype(np.int64),
            "feature": tr.feature.astype(np.int64), "threshold": tr.threshold.astype(np.float64),
            "prob": prob.astype(np.float64)}


def apply_tree(tree: dict[str, np.ndarray], F: np.ndarray) -> np.ndarray:
    """Positive-class probability of each row of ``F`` (sklearn's ``x <= threshold`` goes left)."""
    node = np.zeros(len(F), dtype=np.int64)
    active = tree["left"][node] >= 0
    while active.any():
        i = np.where(active)[0]
        nd = node[i]
        go_left = F[i, tree["feature"][nd]] <= tree["threshold"][nd]
        node[i] = np.where(go_left, tree["left"][nd], tree["right"][nd])
        active = tree["left"][node] >= 0
    return tree["prob"][node]


@dataclass
class Combination:
    """A fitted score of the candidates (:data:`Combine`): its ``kind``, its tree (``calibrated``, ``fusion``),
    fusion's ``beta`` and the tree's ``depth``; what the calibrate stage writes and prediction applies."""

    kind: str
    tree: dict[str, np.ndarray] | None = None
    beta: float | None = None
    depth: int | None = None
    n_fit: int = 0                 # the candidates the tree was fit on, and the positives among them
    positives: int = 0

    @property
    def name(self) -> str:
        if self.kind == "fusion":
            return f"fusion(depth={self.depth},beta={self.beta:g})"
        return self.kind


def fusion_features(clf: np.ndarray, shortlist: np.ndarray, label_idx: np.ndarray, train_freq: np.ndarray) -> np.ndarray:
    """NGAME's score fusion inputs per candidate: the classifier's score, the shortlist's and the label's
    training frequency (NGAME: its inverse propensity, a decreasing function of it: the tree's partitions
    are the same)."""
    return np.column_stack([clf, shortlist, train_freq[label_idx]]).astype(np.float64)


def combination_scores(c: Combination, cand: sp.csr_matrix, h: np.ndarray, p: EliasPlusParams,
                       train_freq: np.ndarray | None) -> sp.csr_matrix:
    """The candidates' scores under ``c`` (``h``: the ranker's margins in ``cand``'s order); ``calibrated``
    keeps each row's top-``calibrate_top`` by the uncalibrated score (ties: by that score)."""
    s = np.asarray(cand.data, dtype=np.float32)
    th = transform(h, p.transform)
    if c.kind == "shortlist":
        score = s
    elif c.kind == "product":
        score = s * th
    elif c.kind == "ranker":
        score = th
    elif c.kind == "calibrated":
        cand, F, uncal = calibration_inputs(cand, h, uncalibrated_scores(s, h, p), p, train_freq)
        score = apply_tree(c.tree, F) + 1e-6 * uncal
    elif c.kind == "fusion":
        score = c.beta * (apply_tree(c.tree, fusion_features(th, s, cand.indices, train_freq)) + s) + th
    else:
        raise StageError(f"unknown combination {c.kind!r} (known: {', '.join(COMBINES)})")
    out = cand.copy()
    out.data = np.asarray(score, dtype=np.float32)
    return out


def fit_combination(kind: str, cand: sp.csr_matrix, h: np.ndarray, Y: sp.spmatrix, p: EliasPlusParams,
                    train_freq: np.ndarray, depth: int | None = None, beta: float | None = None) -> Combination:
    """``kind`` fitted on the rows of ``cand`` (labels ``Y``): the tree of ``calibrated`` (depth ``max_depth``)
    or of ``fusion`` (``depth``, ``beta``); nothing to fit for the others."""
    if kind == "calibrated":
        c, F, _ = calibration_inputs(cand, h, uncalibrated_scores(cand.data, h, p), p, train_freq)
        y = candidate_truth(c, Y).astype(np.int64)
        return Combination(kind, fit_calibration(F, y, p.max_depth, p.seed), depth=p.max_depth, n_fit=len(y),
                           positives=int(y.sum()))
    if kind == "fusion":
        F = fusion_features(transform(h, p.transform), np.asarray(cand.data), cand.indices, train_freq)
        y = candidate_truth(cand, Y).astype(np.int64)
        return Combination(kind, fit_calibration(F, y, depth, p.seed), beta=beta, depth=depth, n_fit=len(y),
                           positives=int(y.sum()))
    return Combination(kind)


def configurations(p: EliasPlusParams) -> list[tuple[str, int | None, float | None]]:
    """``(kind, depth, beta)`` of every combination the calibrate stage measures: ``combine``, or with
    ``auto`` each of ``choices`` (fusion over the unset ``fusion_depth`` x ``fusion_beta`` grids), and
    ``shortlist`` (the input) always."""
    kinds = list(p.choices) if p.combine == "auto" else [p.combine]
    out: list[tuple[str, int | None, float | None]] = [("shortlist", None, None)]
    for kind in dict.fromkeys(kinds):
        if kind == "fusion":
            out += [(kind, d, b) for d in ([p.fusion_depth] if p.fusion_depth else DEPTHS)
                    for b in ([p.fusion_beta] if p.fusion_beta is not None else BETAS)]
        elif kind != "shortlist":
            out.append((kind, p.max_depth if kind == "calibrated" else None, None))
    return out


def candidate_rows(cand: sp.csr_matrix, h: np.ndarray, rows: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray]:
    """``cand``'s ``rows`` and their margins (kept aligned)."""
    H = sp.csr_matrix((np.asarray(h, dtype=np.float64), cand.indices, cand.indptr), shape=cand.shape)[rows]
    return cand[rows], H.data


def select(cand: sp.csr_matrix, h: np.ndarray, Y: sp.spmatrix, p: EliasPlusParams, train_freq: np.ndarray,
           what: str, section: str, log, out_of_fold: dict | None = None) -> tuple[Combination, "Choice"]:
    """The combination the calibrate stage keeps, chosen on the validation rows given (``cand``, ``h``, ``Y``):
    every :func:`configurations` entry scored out of fold (two seeded halves of the rows, each scored by
    the trees fit on the other), measured (:mod:`xmc_steps.second_stage`), the best kept by
    :func:`~xmc_steps.second_stage.choose` (or ``combine`` when forced, checked against the input), then
    re-fit on all the rows.  ``out_of_fold`` (a dict): receives ``"scores"``, the kept combination's
    out-of-fold top-``topk`` scores of these rows (what an ensemble of such models chooses on)."""
    from . import second_stage

    cand = sp.csr_matrix(cand)
    Y = sp.csr_matrix(Y)
    n = cand.shape[0]
    half = np.random.default_rng(p.seed).permutation(n) % 2 == 0
    folds = [np.where(half)[0], np.where(~half)[0]]
    back = np.argsort(np.concatenate([folds[1], folds[0]]))
    trees: dict[tuple[str, int | None], list[Combination]] = {}
    rankings, fitted, ranked = {}, {}, {}
    for kind, depth, beta in configurations(p):
        c = Combination(kind, beta=beta, depth=depth)
        if kind in ("calibrated", "fusion"):
            if (kind, depth) not in trees:
                try:
                    trees[(kind, depth)] = [fit_combination(kind, *candidate_rows(cand, h, f), Y[f], p, train_freq, depth, beta)
                                            for f in folds]
                except StageError as e:    # a half without a positive (or a negative) candidate: too few documents
                    trees[(kind, depth)] = None
                    if p.combine == kind:
                        raise StageError(f"{what}: {kind} cannot be measured out of fold on {n} validation documents "
                                         f"({e})") from e
                    log.warning("validation: %s not measured (%s); it is not a candidate", c.name, e)
            if trees[(kind, depth)] is None:
                continue
            parts = []
            for fit_on, score_on in ((0, 1), (1, 0)):
                t = trees[(kind, depth)][fit_on]
                parts.append(combination_scores(Combination(kind, t.tree, beta, depth), *candidate_rows(cand, h, folds[score_on]),
                                                p, train_freq))
            scores = sp.vstack(parts, format="csr")[back]
        else:
            scores = combination_scores(c, cand, h, p, train_freq)
        ranked[c.name] = topk_per_row(scores, p.topk)
        rankings[c.name] = second_stage.measure(ranked[c.name], Y)
        fitted[c.name] = (kind, depth, beta)
        log.info("validation (out of fold) %s: %s", c.name,
                 ", ".join(f"{k} {v:.2f}" for k, v in rankings[c.name].figures.items()))
    if p.combine == "auto":
        choice = second_stage.choose(rankings, "shortlist")
    else:
        name = [nm for nm, (k, _, _) in fitted.items() if k == p.combine][0]
        choice = second_stage.forced(rankings, "shortlist", name)
        second_stage.forced_check(choice, what, section, p.allow_weak, log)
    kind, depth, beta = fitted[choice.chosen]
    log.info("%s", choice.summary())
    if out_of_fold is not None:
        out_of_fold["scores"] = ranked[choice.chosen]
    return fit_combination(kind, cand, h, Y, p, train_freq, depth, beta), choice


def plus_scores(Xr: sp.csr_matrix, W: sp.spmatrix, cand: sp.csr_matrix, p: EliasPlusParams,
                combination: Combination | dict[str, np.ndarray] | None = None,
                train_freq: np.ndarray | None = None) -> sp.csr_matrix:
    """The re-ranked candidates (top-``p.topk`` per row) under ``combination`` (what the calibrate stage
    chose and fit on validation, or a calibration tree's arrays; ``calibrated``'s answer holds at most
    ``calibrate_top`` labels), else the uncalibrated combination (``p.uncalibrated``) of all."""
    h = ranker_scores(Xr, W, cand, p.solver.bias)
    c = (Combination(p.uncalibrated) if combination is None else combination
         if isinstance(combination, Combination) else Combination("calibrated", combination))
    return topk_per_row(combination_scores(c, cand, h, p, train_freq), p.topk)


def load_ranker(model: str | Path):
    """The sparse ranker a ``train`` call wrote: ``(W as CSC, its ranker.json)``."""
    meta = io.read_json(Path(model) / "ranker.json")
    if meta.get("format") != FORMAT:
        raise StageError(f"{model}: not an ELIAS++ ranker")
    return sp.csc_matrix(io.load_csr(Path(model) / "W.npz")), meta   # the scorer's layout, once


def label_train_freq(model: str | Path) -> np.ndarray:
    """Positives per label in the ranker's training labels (the calibration's third feature)."""
    path = Path(model) / "label_freq.npz"
    if not path.exists():
        raise StageError(f"{path}: missing; this ELIAS++ ranker predates the stored training frequencies, "
                         "train it again (rule elias_plus_ranker)")
    return io.load_arrays(path)["freq"].astype(np.float64)


#: the settings the calibrate stage takes from its rule (the others are the ranker's, saved with it)
FIT_KEYS = ("max_depth", "seed", "calibrate_top", "calibrate_docs", "combine", "choices", "fusion_beta",
            "fusion_depth", "allow_weak", "topk")

#: the saved parameters a prediction may override (the predict rule's settings, serving's)
PREDICT_KEYS = ("topk", "uncalibrated", "calibrate_top")


def predict_params(meta: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> EliasPlusParams:
    """The ranker's saved parameters (``meta``: its ``ranker.json``) with ``overrides``' :data:`PREDICT_KEYS`."""
    over = {k: v for k, v in (overrides or {}).items() if k in PREDICT_KEYS and v is not None}
    return EliasPlusParams.from_dict({**EliasPlusParams.upgrade(meta["params"]), **over})


def predict(model: str | Path, tfidf: sp.spmatrix, emb: np.ndarray, scores: sp.spmatrix,
            overrides: Mapping[str, Any] | None = None, calibration: str | Path | None = None,
            ranker: tuple[sp.csc_matrix, Mapping[str, Any]] | None = None) -> tuple[sp.csr_matrix, EliasPlusParams]:
    """ELIAS++'s re-rank (the predict stage's and serving's, for ELIAS and the dual encoder alike): the
    ranker in ``model`` over each row's top-``n_candidates`` of ``scores`` (the first model's, N x L), on
    [``emb`` ⊕ ``tfidf``], calibrated by the tree in ``calibration`` when given (:func:`plus_scores`).
    Returns the scores and the parameters used (:func:`predict_params`).  ``ranker``: ``model``'s
    :func:`load_ranker` when the caller has loaded it."""
    W, meta = ranker if ranker is not None else load_ranker(model)
    p = predict_params(meta, overrides)
    Xr = ranker_features(tfidf, emb, "tfidf+neural", p.neural_weight)
    cand = candidates(sp.csr_matrix(scores), p.n_candidates)
    if cand.shape[0] != Xr.shape[0]:
        raise StageError(f"the candidates hold {cand.shape[0]} rows but the features {Xr.shape[0]}")
    c = load_combination(calibration) if calibration is not None else None
    return plus_scores(Xr, W, cand, p, c, label_train_freq(model) if c is not None else None), p


def save_combination(folder: Path, c: Combination, info: Mapping[str, Any]) -> None:
    """``calibration.npz`` (the tree, where the combination has one) and ``calibration.json`` (its kind,
    beta and depth, and ``info``: the validation table and choice) into ``folder``."""
    if c.tree is not None:
        io.save_arrays(folder / "calibration.npz", **c.tree)
    io.write_json(folder / "calibration.json", {"format": FORMAT, "combine": c.kind, "beta": c.beta,
                                                "depth": c.depth, "n_fit": c.n_fit, "positives": c.positives, **info})


def combination_files(folder: str | Path) -> list[Path]:
    """The files of a :func:`save_combination` folder that prediction reads (a served model's copy needs them)."""
    folder = Path(folder)
    meta = io.read_json(folder / "calibration.json") if (folder / "calibration.json").exists() else {}
    tree = meta.get("combine", "calibrated") in ("calibrated", "fusion")
    return [folder / "calibration.json"] + ([folder / "calibration.npz"] if tree else [])


def load_combination(folder: str | Path) -> Combination:
    """What :func:`save_combination` wrote (a folder of before the choice holds a ``calibrated`` tree)."""
    meta_path = Path(folder) / "calibration.json"
    meta = io.read_json(meta_path) if meta_path.exists() else {}
    kind = meta.get("combine", "calibrated")
    tree = io.load_arrays(Path(folder) / "calibration.npz") if kind in ("calibrated", "fusion") else None
    return Combination(kind, tree, meta.get("beta"), meta.get("depth"))
