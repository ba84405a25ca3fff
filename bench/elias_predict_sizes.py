"""ELIAS's prediction-time shortlist size K (and beam b) on a validation split: one table.

Embeds the split once with a trained ELIAS model (a stage folder of ``results/<dataset>/elias/``),
then searches the index at every ``--K`` (and ``--b``) and prints one JSON line per setting with
P@1/3/5, R@100 and the shortlist's recall@K of the top-100 labels written, so that
``elias.predict.K`` / ``elias.predict.b`` are chosen on validation, never on test::

    python bench/elias_predict_sizes.py --model results/debtags/elias/<tree>/minilm-64/stage2 \\
        --tokens results/debtags/features/tokens/minilm-64/tokens_valid.npz \\
        --labels results/debtags/ingest/Y_valid.npz --K 100 200 400 572 [--b ...] [--device auto]

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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import io, metrics, neural  # noqa: E402
from xmc_steps.elias import load_elias  # noqa: E402
from xmc_steps.search import padded_to_csr  # noqa: E402


def shortlist_table(model, emb: np.ndarray, Y: sp.csr_matrix, Ks: list[int], bs: list[int | None],
                    topk: int = 100, batch: int = 256) -> list[dict]:
    """P@1/3/5 and R@100 of the top-``topk`` labels by ``p`` at each (b, K), from embeddings ``emb``."""
    rows = []
    dev = next(model.parameters()).device
    for b in bs:
        for K in Ks:
            K_eff = min(int(K), model.n_labels)
            k1 = min(topk, K_eff)
            lab = np.full((len(emb), k1), -1, dtype=np.int64)
            val = np.zeros((len(emb), k1), dtype=np.float32)
            with torch.no_grad():
                for s in range(0, len(emb), batch):
                    e = torch.from_numpy(emb[s:s + batch]).to(dev)
                    labels, _, p = model.shortlist(e, b=b, K=K_eff)
                    pv, pi = torch.topk(p.float().masked_fill(labels < 0, -1.0), k1, dim=1)
                    lab[s:s + batch] = labels.gather(1, pi).cpu().numpy()
                    val[s:s + batch] = pv.cpu().numpy()
            scores = padded_to_csr(lab, val, Y.shape[1])
            p = metrics.precision(scores, Y, 5)
            r = metrics.recall(scores, Y, 100)
            rows.append({"b": b if b is not None else model.b, "K": K_eff, "p@1": round(float(p[0]) * 100, 2),
                         "p@3": round(float(p[2]) * 100, 2), "p@5": round(float(p[4]) * 100, 2),
                         "r@100": round(float(r[-1]) * 100, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--K", type=int, nargs="+", required=True)
    ap.add_argument("--b", type=int, nargs="*", default=[])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = neural.resolve_device(a.device)
    model = load_elias(a.model, device).eval()
    t = io.load_arrays(a.tokens)
    tokens = neural.TokenData(t["input_ids"], t["lengths"])
    Y = sp.csr_matrix(io.load_csr(a.labels), dtype=np.float32)
    emb = neural.embed(model.encoder, tokens, 128, device, "auto", progress=logging.info)
    for row in shortlist_table(model, emb, Y, a.K, a.b or [None]):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
