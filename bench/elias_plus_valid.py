"""ELIAS++ (§3.5) on the validation split, without fitting and scoring on the same rows: one table.

The pipeline fits ELIAS++'s calibration tree on valid, so its valid rows would be in-sample. This
script prints, for a trained chain, one JSON line per row, each measured on valid:

- ``stage2``: stage 2's own predictions (``pred_valid.parquet``);
- ``ranker``: the sparse ranker's uncalibrated combination (``plus.uncalibrated``), which never
  saw valid (the ``elias-ranker`` method);
- ``elias++``: the calibrated scores, cross-fitted: the valid rows are split into ``--folds``
  folds (fixed seed), each fold scored by a tree fit on the others (the ``elias`` method).

So defaults of the training stages (batching, schedules) can be compared on the final method's
valid P@k, never on test::

    python bench/elias_plus_valid.py --plus results/reuters-all5/elias/<tree>/minilm-64/plus \\
        --stage2 results/reuters-all5/elias/<tree>/minilm-64/stage2 \\
        --tfidf results/reuters-all5/features/tfidf/X_valid.npz --labels results/reuters-all5/ingest/Y_valid.npz

Progress goes to stderr; stdout carries only the JSON lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import elias_plus, io, metrics  # noqa: E402
from xmc_steps.elias_plus import EliasPlusParams  # noqa: E402
from xmc_steps.ranker import ranker_features  # noqa: E402
from xmc_steps.search import topk_per_row  # noqa: E402


def _row(name: str, scores: sp.csr_matrix, Y: sp.csr_matrix) -> dict:
    p = metrics.precision(scores, Y, 5)
    r = metrics.recall(scores, Y, 100)
    return {"row": name, "n": int(Y.shape[0]), "p@1": round(float(p[0]) * 100, 2), "p@3": round(float(p[2]) * 100, 2),
            "p@5": round(float(p[4]) * 100, 2), "r@100": round(float(r[-1]) * 100, 2)}


def cross_fitted(h: np.ndarray, cand: sp.csr_matrix, y: np.ndarray, freq: np.ndarray, p: EliasPlusParams,
                 folds: int, seed: int = 0) -> np.ndarray:
    """Calibrated score of every candidate, each row's from a tree fit on the other folds' rows."""
    n = cand.shape[0]
    fold_of_row = np.random.default_rng(seed).permutation(n) % folds
    row_of = np.repeat(np.arange(n), np.diff(cand.indptr))
    F = elias_plus.calibration_features(h, cand.data, cand.indices, freq)
    out = np.zeros(len(h), dtype=np.float64)
    for f in range(folds):
        test = fold_of_row[row_of] == f
        tree = elias_plus.fit_calibration(F[~test], y[~test].astype(np.int64), p.max_depth, p.seed)
        out[test] = elias_plus.apply_tree(tree, F[test])
    return out


def valid_table(plus: Path, stage2: Path, tfidf: str, labels: str, folds: int) -> list[dict]:
    W, meta = elias_plus.load_ranker(plus / "ranker")
    p = EliasPlusParams.from_dict(EliasPlusParams.upgrade(meta["params"]))
    L = meta["n_labels"]
    Y = sp.csr_matrix(io.load_csr(labels), dtype=np.float32)
    pred = io.read_predictions(stage2 / "pred_valid.parquet", L)
    Xr = ranker_features(io.load_csr(tfidf), io.load_arrays(stage2 / "emb_valid.npz")["emb"], "tfidf+neural",
                         p.neural_weight)
    cand = elias_plus.candidates(pred, p.n_candidates)
    h = elias_plus.ranker_scores(Xr, W, cand, p.solver.bias)
    unc = elias_plus.uncalibrated_scores(cand.data, h, p)
    top, h_top, unc_top = elias_plus.calibration_subset(cand, h, unc, p.calibrate_top)
    y = elias_plus.candidate_truth(top, Y)
    cal = cross_fitted(h_top, top, y, elias_plus.label_train_freq(plus / "ranker"), p, folds) + 1e-6 * unc_top

    def scored(c, data):
        out = c.copy()
        out.data = np.asarray(data, dtype=np.float32)
        return topk_per_row(out, p.topk)

    return [_row("stage2", pred, Y), _row("ranker", scored(cand, unc), Y),
            _row(f"elias++ ({folds}-fold calibration)", scored(top, cal), Y)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plus", required=True, help="the chain's plus/ folder (ranker/ inside)")
    ap.add_argument("--stage2", required=True, help="the chain's stage2/ folder (pred_valid.parquet, emb_valid.npz)")
    ap.add_argument("--tfidf", required=True, help="X_valid.npz")
    ap.add_argument("--labels", required=True, help="Y_valid.npz")
    ap.add_argument("--folds", type=int, default=5)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    for row in valid_table(Path(a.plus), Path(a.stage2), a.tfidf, a.labels, a.folds):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
