"""The toy method's stage: label frequencies on the training labels; the test split's predictions."""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp

from .. import io
from ..layout import PREDICTIONS
from ..stage import add_common_args, cli_main, stage_run
from ..toymethod.params import ToyParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.stages.toymethod", description=__doc__)
    ap.add_argument("--labels-train", required=True)
    ap.add_argument("--n-test", required=True, help="Y_test.npz (only its row count is read)")
    ap.add_argument("--out", required=True)
    add_common_args(ap)
    args = ap.parse_args(argv)
    with stage_run("toymethod_train", args) as st:
        params = ToyParams.from_dict({k: v for k, v in st.params.items() if k != "threads"})
        Y = io.load_csr(args.labels_train)
        freq = (np.asarray(Y.sum(axis=0)).ravel() + params.smoothing) / max(Y.shape[0], 1)
        io.save_arrays(f"{args.out}/prior.npz", freq=freq.astype(np.float32))
        n = io.load_csr(args.n_test).shape[0]
        topk = params.topk
        P = sp.csr_matrix(np.tile(freq.astype(np.float32), (n, 1)))
        io.write_predictions(f"{args.out}/{PREDICTIONS}", P, topk)
        st.metric("n_labels", Y.shape[1])


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
