"""One squared-hinge SVM solved by liblinear's dual coordinate descent, called directly.

:func:`fit_one` returns exactly what :func:`xmc_steps.ranker._fit_one` returns (the same bytes:
``tests/test_xr_linear.py`` compares them), without scikit-learn's estimator around the solver.
``LinearSVC.fit`` checks its inputs, encodes the targets and builds class and sample weights
before it calls liblinear; at one call per label that was more than half of xr-linear's training
on yso-finna-sv-50k (48 of 82 s on one core: parameter validation, ``np.unique`` of the targets,
dataframe checks).  Here the solver gets the same arguments (``L2R_L2LOSS_SVC_DUAL``, the
targets as 0/1 doubles in the order ``LinearSVC``'s label encoder gives them, unit class and
sample weights, the seed ``LinearSVC(random_state=seed)`` draws) from arrays built once.

The solver is scikit-learn's bundled liblinear (``sklearn.svm._liblinear.train_wrap``, a private
module); where it cannot be imported (a scikit-learn that moved it), :func:`fit_one` falls back
to ``LinearSVC`` itself, the same solver behind the public class.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
import scipy.sparse as sp

try:        # the solver LinearSVC calls; private, so guarded
    from sklearn.svm import _liblinear as _ll
except ImportError:          # pragma: no cover - a scikit-learn without it
    _ll = None

#: liblinear's solver id of the L2-regularised squared hinge loss in the dual (``LinearSVC``'s
#: ``loss="squared_hinge", dual=True``)
L2R_L2LOSS_SVC_DUAL = 1
_ONES2 = np.ones(2, dtype=np.float64)
_verbosity_set = False


@lru_cache(maxsize=None)
def _solver_seed(seed: int) -> int:
    """The seed ``LinearSVC(random_state=seed)`` hands liblinear: the first draw of a fresh
    ``RandomState(seed)``, as scikit-learn's ``_fit_liblinear`` makes it."""
    return int(np.random.RandomState(seed).randint(np.iinfo("i").max))


@lru_cache(maxsize=8)
def _ones(n: int) -> np.ndarray:
    w = np.ones(n, dtype=np.float64)
    w.flags.writeable = False
    return w


def fit_one(Xs: sp.csr_matrix, y: np.ndarray, C: float, tol: float, max_iter: int, bias: float,
            seed: int) -> tuple[np.ndarray, float]:
    """One squared-hinge SVM on ``Xs`` (CSR float64, 32-bit indices) and ``y`` (+-1, both present);
    returns (feature weights, weight of the bias feature), as :func:`xmc_steps.ranker._fit_one`."""
    global _verbosity_set
    if _ll is None:          # pragma: no cover
        return _fit_estimator(Xs, y, C, tol, max_iter, bias, seed)
    if not _verbosity_set:
        _ll.set_verbosity_wrap(0)
        _verbosity_set = True
    y_ind = (np.asarray(y) > 0).astype(np.float64)     # LabelEncoder: -1 -> 0, +1 -> 1
    raw, _ = _ll.train_wrap(Xs, y_ind, True, L2R_L2LOSS_SVC_DUAL, tol, bias if bias > 0 else -1.0, C, _ONES2,
                            max_iter, _solver_seed(seed), 0.1, np.ones(Xs.shape[0], dtype=np.float64))
    if bias > 0:
        w = raw[:, :-1].ravel()
        intercept = bias * raw[:, -1]                  # LinearSVC's intercept_
        return w, float(intercept[0]) / bias
    return raw.ravel(), 0.0


def _fit_estimator(Xs, y, C, tol, max_iter, bias, seed):   # pragma: no cover - fallback
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.svm import LinearSVC

    clf = LinearSVC(loss="squared_hinge", dual=True, C=C, tol=tol, max_iter=max_iter, fit_intercept=bias > 0,
                    intercept_scaling=bias if bias > 0 else 1.0, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(Xs, y)
    b = float(clf.intercept_[0]) / bias if bias > 0 else 0.0
    return clf.coef_.ravel(), b


def fit_ranker(Xs: sp.csr_matrix, y: np.ndarray, p) -> tuple[np.ndarray, float]:
    """A drop-in for :func:`xmc_steps.ranker._fit_one` (``p``: a ``RankerParams``): the same
    degenerate cases, then :func:`fit_one`.  Same results, byte for byte."""
    n_pos = int((y > 0).sum())
    if n_pos == 0 or n_pos == len(y):
        return np.zeros(Xs.shape[1]), (1.0 if n_pos else -1.0)
    if Xs.shape[1] == 0 or Xs.nnz == 0:
        return np.zeros(Xs.shape[1]), float(2.0 * n_pos / len(y) - 1.0) / (p.bias if p.bias > 0 else 1.0)
    return fit_one(Xs, y, p.C, p.tol, p.max_iter, p.bias, p.seed)
