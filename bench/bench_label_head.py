"""Bytes communicated per step, and the communication's share of the step, for a label head trained data-parallel:
the rows a step touched (``xmc_steps.distributed.RowExchange``, what the trainer does for ELIAS's ``W_L`` and
LightXML's label embeddings) beside DDP's dense all-reduce of the whole head, 2 gloo processes on the CPU.

The step is the label head's part of an ELIAS step at the configured sizes: each rank scores its ``--batch``
texts (fixed random embeddings standing for the encoder's) against a shortlist of ``--shortlist`` labels each
(ELIAS's K = 2000, drawn uniformly: the fewest shared rows, the most bytes), BCE with one positive per text,
backward into the dense ``L x d`` gradient, the gradient averaged over the ranks (one way or the other), then a
plain SGD update of the whole head (a dense pass over ``L x d``, as AdamW's, with no moments: AdamW's step is
longer, so the shares printed are upper bounds).  Both exchanges run in one process pair, alternating steps, so
they are timed over the same seconds of a shared machine::

    python bench/bench_label_head.py [--labels 20000 501070] [--dim 768] [--batch 16] [--shortlist 2000] \\
        [--steps 6]

Bytes are what each rank sends: the row exchange's counts, ids and rows (padded to the largest count, to each of
the other ranks), the dense all-reduce's ``2 (W - 1) / W x L x d x 4`` (a ring's).  Prints one JSON line per
label count and exchange, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(a.world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import numpy as np
    import torch
    import torch.nn.functional as F

    from xmc_steps import distributed

    torch.set_num_threads(a.threads)
    distributed.init_from_env("cpu")
    world = distributed.world_size()
    rows_out = []
    for L in a.labels:
        torch.manual_seed(0)
        W = torch.nn.Parameter(torch.randn(L, a.dim) * 0.02)
        emb = torch.randn(a.batch, a.dim)
        rng = np.random.default_rng([rank, L])
        exchange = distributed.RowExchange()
        times: dict[str, list[dict[str, float]]] = {"rows": [], "dense": []}
        stats: dict[str, dict] = {}
        for step in range(2 * (a.steps + 1)):
            mode = "rows" if step % 2 == 0 else "dense"
            idx = torch.from_numpy(rng.integers(0, L, size=(a.batch, a.shortlist)))
            target = torch.zeros(a.batch, a.shortlist)
            target[:, 0] = 1.0
            distributed.barrier()
            t0 = time.perf_counter()
            scores = torch.einsum("bd,bkd->bk", emb, W[idx])
            loss = F.binary_cross_entropy_with_logits(scores, target)
            loss.backward()
            t1 = time.perf_counter()
            if mode == "rows":
                exchange.touch(W, idx)           # the shortlists' rows, as ELIAS declares them
                exchange(W)
                stats["rows"] = dict(exchange.stats)
            else:
                torch.distributed.all_reduce(W.grad, op=torch.distributed.ReduceOp.SUM)
                W.grad.div_(world)
                stats["dense"] = {"rows": int(distributed.touched_rows(W.grad).numel()), "dense": True,
                                  "bytes": int(2 * (world - 1) / world * W.grad.numel() * 4)}
            t2 = time.perf_counter()
            with torch.no_grad():
                W.add_(W.grad, alpha=-0.1)
            W.grad = None
            t3 = time.perf_counter()
            if step >= 2:                           # the first step of each exchange is a warm-up
                times[mode].append({"compute": t1 - t0, "comm": t2 - t1, "update": t3 - t2, "step": t3 - t0})
        for mode in ("rows", "dense"):
            ts = times[mode]
            step_s = float(np.median([t["step"] for t in ts]))
            comm_s = float(np.median([t["comm"] for t in ts]))
            rows_out.append({"labels": L, "dim": a.dim, "exchange": mode, "rank": rank,
                             "rows_touched": stats["rows"]["rows"], "bytes_per_step": stats[mode]["bytes"],
                             "went_dense": bool(stats[mode]["dense"]), "step_s": step_s, "comm_s": comm_s,
                             "comm_share": comm_s / step_s if step_s > 0 else float("nan")})
        del W
    gathered = distributed.all_gather_object(rows_out)
    if rank == 0:
        Path(out).write_text(json.dumps([r for part in gathered for r in part]))
    distributed.barrier()
    distributed.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", type=int, nargs="+", default=[20_000, 501_070])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batch", type=int, default=16, help="texts per rank and step")
    ap.add_argument("--shortlist", type=int, default=2000, help="labels scored per text (ELIAS's K)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per exchange")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()

    import tempfile

    import torch.multiprocessing as mp

    os.environ["XMC_ROW_EXCHANGE"] = "rows"       # the row exchange whatever its bytes: both figures printed
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        mp.start_processes(_worker, args=(a, _free_port(), out), nprocs=a.world, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    table = {}
    for r in rows:
        print(json.dumps(r))
        key = (r["labels"], r["exchange"])
        # the slowest rank's figures: a step ends when every rank's does
        if key not in table or r["step_s"] > table[key]["step_s"]:
            table[key] = r
    print()
    print(f"| labels | d | rows touched per rank | bytes/step, rows | bytes/step, dense all-reduce | rows / dense | "
          f"comm share, rows | comm share, dense | step s, rows | step s, dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for L in a.labels:
        r, d = table[(L, "rows")], table[(L, "dense")]
        print(f"| {L:,} | {a.dim} | {r['rows_touched']:,} | {r['bytes_per_step'] / 1e6:,.1f} MB"
              f"{' (dense)' if r['went_dense'] else ''} | {d['bytes_per_step'] / 1e6:,.1f} MB | "
              f"{r['bytes_per_step'] / d['bytes_per_step']:.3f} | {100 * r['comm_share']:.0f} % | "
              f"{100 * d['comm_share']:.0f} % | {r['step_s']:.2f} | {d['step_s']:.2f} |")


if __name__ == "__main__":
    main()
