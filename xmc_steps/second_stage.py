"""A stage whose input is another model's ranking (a re-ranker, a calibration, an ensemble) measured
against that input on the validation split, so it never silently loses to it.

* :func:`measure`: P@1, P@5 and R@100 of a ranking (percentages) and the per-document figures a paired
  comparison needs;
* :func:`choose`: among named rankings of the validation documents, the best by P@1 + P@5 among those
  not below the input on P@1 nor on P@5: the input itself is always a candidate, so the choice never
  ends below it on validation;
* :func:`forced_check`: a combination forced by the config (paper mode) that loses to its input by more
  than the noise (two standard errors of the paired per-document difference, measured on the same
  documents) fails its stage naming both numbers, unless ``allow_weak``.

The record (:meth:`Choice.record`) holds the whole validation table, the input, the chosen row and
whether the second stage was switched off (the input chosen); the stage writes it into its record and
its MLflow run, and the leaderboard names switched-off stages.  Readings: docs/methods/second-stage.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp

from . import metrics
from .errors import StageError
from .guard import Advice, enforce, failure_message

#: the validation figures every second stage reports, in percent
KEYS = ("p_at_1", "p_at_5", "recall_at_100")
#: the figures the choice must not lose on (the targets' metrics)
GUARDED = ("p_at_1", "p_at_5")
#: paired standard errors the forced check allows (the guards' two)
NOISE_SE = 2.0


@dataclass
class Measured:
    """One ranking's validation figures (percent) and its per-document values (for the paired noise)."""

    figures: dict[str, float]
    per_doc: dict[str, np.ndarray] = field(repr=False)


def measure(scores: sp.spmatrix, truth: sp.spmatrix, k: int = 100) -> Measured:
    """P@1, P@5 and R@``k`` (as ``recall_at_100``'s key when ``k`` is 100) of ``scores`` against ``truth``
    over the documents that have labels, in percent."""
    Y = sp.csr_matrix(truth)
    if scores.shape != Y.shape:
        raise StageError(f"a ranking of shape {scores.shape} against labels of shape {Y.shape}")
    labelled = np.diff(Y.indptr) > 0
    hits = metrics.document_hits(scores, Y, max(5, k))[labelled]
    n_true = np.diff(Y.indptr)[labelled].astype(np.float64)
    per = {"p_at_1": hits[:, 0].astype(np.float64), "p_at_5": hits[:, :5].sum(axis=1) / 5.0,
           "recall_at_100": hits[:, :k].sum(axis=1) / np.maximum(n_true, 1.0)}
    return Measured({key: float(100.0 * v.mean()) if len(v) else 0.0 for key, v in per.items()}, per)


def noise(a: Measured, b: Measured, key: str) -> float:
    """Two standard errors (percent) of the mean per-document difference of ``key`` between two rankings of
    the same documents."""
    d = a.per_doc[key] - b.per_doc[key]
    return float(NOISE_SE * 100.0 * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def _score(m: Mapping[str, float]) -> float:
    return sum(m[k] for k in GUARDED)


@dataclass
class Choice:
    """What :func:`choose` found: the validation ``table`` (name -> figures), the ``input``'s name, the
    ``chosen`` name, and the noise of the chosen against the input."""

    table: dict[str, dict[str, float]]
    input: str
    chosen: str
    noise: dict[str, float]
    forced: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def switched_off(self) -> bool:
        """The input alone was chosen: the second stage adds nothing on validation."""
        return self.chosen == self.input

    def record(self) -> dict[str, Any]:
        return {"input": self.input, "chosen": self.chosen, "switched_off": self.switched_off,
                "forced": self.forced, "valid": {"input": self.table[self.input], "chosen": self.table[self.chosen]},
                "noise": self.noise, "table": self.table, **self.extra}

    def summary(self) -> str:
        i, c = self.table[self.input], self.table[self.chosen]
        fig = ", ".join(f"{k} {c[k]:.2f} (input {i[k]:.2f})" for k in KEYS)
        state = "the input alone: the second stage is switched off" if self.switched_off else self.chosen
        return f"validation choice: {state}; {fig}"


def choose(rankings: Mapping[str, Measured], input_name: str, allowed: list[str] | None = None) -> Choice:
    """The best of ``allowed`` (default: all) by P@1 + P@5 among those not below ``input_name`` on P@1 nor
    on P@5 (ties: the input, then the first named).  The input is always allowed."""
    if input_name not in rankings:
        raise ValueError(f"the input {input_name!r} is not among the rankings")
    names = [n for n in (allowed if allowed is not None else list(rankings)) if n != input_name]
    base = rankings[input_name].figures
    best = input_name
    for n in names:
        m = rankings[n].figures
        if all(m[k] >= base[k] for k in GUARDED) and _score(m) > _score(rankings[best].figures):
            best = n
    return Choice({n: dict(r.figures) for n, r in rankings.items()}, input_name, best,
                  {k: noise(rankings[best], rankings[input_name], k) for k in KEYS})


def forced(rankings: Mapping[str, Measured], input_name: str, name: str) -> Choice:
    """The choice the config forced (``name``), with its noise against the input."""
    c = choose(rankings, input_name, [])
    c.chosen, c.forced = name, True
    c.noise = {k: noise(rankings[name], rankings[input_name], k) for k in KEYS}
    return c


def weak_message(c: Choice, what: str, section: str) -> str | None:
    """The failure message of a forced second stage that loses to its input by more than the noise on a
    guarded figure, else ``None``."""
    i, m = c.table[c.input], c.table[c.chosen]
    lost = [k for k in GUARDED if m[k] < i[k] - c.noise[k]]
    if not c.forced or not lost:
        return None
    fig = "; ".join(f"valid {k} {m[k]:.2f} against the input's {i[k]:.2f} (noise {c.noise[k]:.2f})" for k in lost)
    return failure_message(f"{fig}", Advice(f"{what} ({c.chosen})", f"Let the validation split choose "
                                            f"({section}.combine: auto)", section, kept="the forced combination",
                                            failed=f"loses to its input ({c.input})"))


def forced_check(c: Choice, what: str, section: str, allow_weak: bool, log) -> None:
    """:func:`weak_message` enforced (a :class:`~xmc_steps.errors.StageError`, or a warning with ``allow_weak``)."""
    enforce(weak_message(c, what, section), allow_weak, section, log)
