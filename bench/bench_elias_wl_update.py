"""ELIAS's training step with W_L updated every step and every k steps (``wl_update_every``, the
paper's k = 10), at a Wiki-500K-sized label space, CPU or CUDA.

The paper updates W_L every 10 steps because its dense AdamW update over L x D (and the two moments)
dominates a step at 500,000 labels.  This prints one JSON line per k with the mean seconds per step
over steps 11-20 (one W_L update at k = 10, as in any 10 steps of a long run) and, last, the ratio of k = 1 to each k: measured in one run, as ratios are
what a shared machine can compare.  The encoder is a one-layer randomly initialised BERT of MiniLM's
width 384 (``bench_neural.py``'s ``one-layer-384``), so W_L has the real width while the encoder costs little::

    python bench/bench_elias_wl_update.py [--labels 501070] [--clusters 4096] [--k 1 10] \\
        [--batch-size 32] [--device auto]

Synthetic token ids and labels: the figures are about speed, not accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_neural import SYNTHETIC_ENCODERS, make_encoder  # noqa: E402  (bench/ is the script's folder)
from xmc_steps import elias, neural  # noqa: E402
from xmc_steps.trainer import TrainParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", type=int, default=501_070)
    ap.add_argument("--clusters", type=int, default=4096)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--encoder", default="one-layer-384", choices=sorted(SYNTHETIC_ENCODERS))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    L, C, B = a.labels, a.clusters, a.batch_size
    rng = np.random.default_rng(0)
    steps = 20
    n = B * steps
    ids = rng.integers(1000, 20000, size=(n, a.length)).astype(np.int32)
    ids[:, 0] = 101
    tokens = neural.TokenData(ids, np.full(n, a.length, dtype=np.int32))
    Y = sp.csr_matrix((np.ones(3 * n, np.float32), (np.repeat(np.arange(n), 3), rng.integers(0, L, 3 * n))),
                      shape=(n, L))
    Y.data[:] = 1
    index, value = elias.adjacency_from_assignment(rng.permutation(L) % C, C)
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        enc = make_encoder(a.encoder, Path(tmp))
        for k in a.k:
            p = elias.EliasParams(encoder=enc, b=20, K=2000, coverage=1.0, eval_every=0, device=a.device,
                                  wl_update_every=k,
                                  train=TrainParams(steps=steps, batch_size=B, warmup_steps=0, lr=None,
                                                    checkpoint_every=0, log_every=1)).resolved(1, n, L, C)
            m = elias.build_model(p, C, L, index.shape[1], fixed_edges=True)
            m.set_adjacency(index, value)
            stamps = []
            elias.train_elias(m, tokens, Y, p, None, on_step=lambda s, logs: stamps.append(time.perf_counter()))
            per_step = float(np.diff(stamps[-11:]).mean())     # steps 11-20
            times[k] = per_step
            print(json.dumps({"wl_update_every": k, "labels": L, "clusters": C, "encoder": a.encoder, "batch": B,
                              "device": str(neural.resolve_device(a.device)), "s_per_step": round(per_step, 3)}),
                  flush=True)
            del m
    print(json.dumps({"speedup_over_k1": {k: round(times[a.k[0]] / t, 2) for k, t in times.items()}}), flush=True)


if __name__ == "__main__":
    main()
