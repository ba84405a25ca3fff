"""Exact against HNSW label search (:mod:`xmc_steps.ann`): where does HNSW pay, at which efSearch?

    python bench/bench_ann.py [--quick] [--sizes 572 18056 100000 501070] [--threads 1] [--out FILE] [--cache DIR]
    python bench/bench_ann.py --real results/<d>/dual-encoder/minilm-64 [...]   # a trained model's embeddings

For each number of labels L (default 572, 18056, 100000, 501070: the label counts of the
pipeline's datasets up to Wiki-500K; ``--quick`` leaves out 501070) it makes a synthetic,
clustered label embedding and query set (:func:`synth`), builds both kinds of index with
:func:`xmc_steps.ann.build_index` (defaults ``hnsw_m=32, ef_construction=200``) and prints
one JSON line per (L, kind):

* ``build_s`` / ``build_cpu_s``: wall and CPU seconds to build; ``index_mb``: the index's
  serialised size (what it holds in memory, give or take faiss's bookkeeping);
* ``cpu_ms_b256`` / ``cpu_ms_b1`` (and ``wall_ms_*``): CPU (wall) milliseconds per query
  through :func:`xmc_steps.ann.search` with ``k=100``, in batches of 256 (the pipeline's
  predict mode) and one query at a time; the best of ``--repeats`` rounds, the configurations
  timed in turn within each round.  With one thread, CPU time is the work done, which load from
  other jobs on a shared machine hardly changes (wall time it inflates): the comparisons use it;
* ``recall``: recall@100 against the exact index's answer (1 for exact); ``score_at_k``: the
  mean inner product at rank 100 (near 0: the 100th neighbour is noise).  The HNSW line
  reports the smallest efSearch of ``--ef`` whose recall@100 is >= ``--target`` (the largest
  tried if none), with the whole sweep under ``sweep``, and ``speedup_b256`` / ``speedup_b1``:
  exact's CPU time over HNSW's at that efSearch.

A last line (``"summary"``) names the smallest L at which HNSW, at recall@100 >= target, is at
least 2x faster than exact (batch 256 and batch 1), that point interpolated between the sizes
(:func:`crossing`), and the efSearch each L needed.

Cost: the HNSW build is most of it, single-threaded ~7 CPU-minutes at L=501070 (~50 s at
100000); ``--cache DIR`` keeps the builds, with their times, for a rerun.

Synthetic data (d=384, the MiniLM encoders' size), three levels: ``--topics`` (64) unit topic
vectors; ``C = clip(L // 25, 8, 4000)`` centres, each a topic plus isotropic noise of norm ~1,
renormalised (cosine ~0.7 to its topic); each label a centre plus noise of norm ~0.75,
renormalised (cosine ~0.8 to its centre, ~0.64 to a label of the same centre); each query a
random label plus noise of norm ~0.5, renormalised (cosine ~0.9 to that label).  A query's 100
nearest labels are then its own centre's and its topic's, with a score gradient down to rank
100, as in a text embedding where a document's near labels share its subject.
``--topics 0`` drops the topic level (centres drawn uniformly on the sphere): past its own
centre's ~25 labels a query's neighbours are then noise (score ~0.16 at rank 100 at L=100000, ~0.35 with topics),
the hardest case for graph search and not one that recall@100 says much about; docs/ann.md
(the measurements behind :mod:`xmc_steps.ann`'s defaults) shows both.  Timings on a machine shared with other jobs are
upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss  # noqa: E402

from xmc_steps import ann  # noqa: E402

SIZES = (572, 18056, 100000, 501070)
QUICK_SKIP = 501070


def _unit(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def synth(L: int, d: int, n_queries: int, seed: int = 0, topics: int = 64, centre_spread: float = 1.0,
          spread: float = 0.75, query_noise: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """``(labels L x d, queries n_queries x d)``, float32, rows unit norm, clustered (see above;
    ``topics=0``: centres uniform on the sphere)."""
    rng = np.random.default_rng([seed, L, d] + ([topics] if topics else []))   # topics=0: first version's draws
    n_centres = int(np.clip(L // 25, 8, 4000))
    centres = rng.standard_normal((n_centres, d), dtype=np.float32)
    if topics > 0:
        centres *= np.float32(centre_spread / np.sqrt(d))
        centres += _unit(rng.standard_normal((topics, d), dtype=np.float32))[rng.integers(0, topics, n_centres)]
    _unit(centres)
    labels = rng.standard_normal((L, d), dtype=np.float32)
    labels *= np.float32(spread / np.sqrt(d))
    labels += centres[rng.integers(0, n_centres, L)]
    _unit(labels)
    queries = rng.standard_normal((n_queries, d), dtype=np.float32)
    queries *= np.float32(query_noise / np.sqrt(d))
    queries += labels[rng.integers(0, L, n_queries)]
    return labels, _unit(queries)


def _timed_pass(index: ann.Index, queries: np.ndarray, k: int, batch: int):
    """(wall ms per query, CPU ms per query, ids) of one pass over ``queries`` in batches."""
    parts = []
    w, c = time.perf_counter(), time.process_time()
    for a in range(0, len(queries), batch):
        parts.append(ann.search(index, queries[a:a + batch], k)[1])
    w, c = time.perf_counter() - w, time.process_time() - c
    return 1000.0 * w / len(queries), 1000.0 * c / len(queries), np.vstack(parts)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over rows of |found ∩ truth| / |truth| (rows of distinct ids)."""
    k = truth.shape[1]
    both = np.sort(np.hstack([found, truth]), axis=1)
    return float((both[:, 1:] == both[:, :-1]).sum() / (len(truth) * k))


def _mb(index: ann.Index) -> float:
    return len(faiss.serialize_index(index.faiss_index)) / 2**20


def _build(labels: np.ndarray, **kw):
    w, c = time.perf_counter(), time.process_time()
    index = ann.build_index(labels, **kw)
    return index, round(time.perf_counter() - w, 3), round(time.process_time() - c, 3)


def real(model_dir: Path, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, queries)`` of a trained dual encoder (``results/<d>/dual-encoder/<enc>``): its label
    embeddings (``label_emb.npz``) and its first ``n_queries`` test text embeddings (``emb_test.npz``)."""
    labels = np.load(model_dir / "label_emb.npz")["emb"].astype(np.float32)
    queries = np.load(model_dir / "emb_test.npz")["emb"][:n_queries].astype(np.float32)
    return np.ascontiguousarray(labels), np.ascontiguousarray(queries)


def bench_size(L: int, args, data: tuple[np.ndarray, np.ndarray, str] | None = None) -> list[dict]:
    """The exact and the HNSW line of one L.  Every configuration (exact; HNSW at each efSearch)
    is timed in turn, ``--repeats`` rounds, keeping each one's best: a burst of load from other
    jobs then falls on all of them alike rather than on one.  ``data``: ``(labels, queries, source)``
    of real embeddings instead of the synthetic set (the lines then carry ``source``)."""
    if data is None:
        labels, queries = synth(L, args.d, args.queries, args.seed, topics=args.topics)
    else:
        labels, queries = data[0], data[1]
    single = queries[:args.single]
    k = min(args.k, L)
    exact, ex_build, ex_build_cpu = _build(labels, kind="exact", threads=args.threads)
    cached = (args.cache and data is None
              and args.cache / f"hnsw-L{L}-d{args.d}-topics{args.topics}-seed{args.seed}-m32-efc200.faiss")
    if cached and cached.exists():                                  # a build of an earlier run, with its times
        hnsw = ann.load_index(cached)
        hn_build, hn_build_cpu = json.loads(cached.with_suffix(".json").read_text())
    else:
        hnsw, hn_build, hn_build_cpu = _build(labels, kind="hnsw", threads=args.build_threads, seed=args.seed)
        if cached:
            ann.save_index(hnsw, cached)
            cached.with_suffix(".json").write_text(json.dumps([hn_build, hn_build_cpu]))
    hnsw.threads = args.threads
    configs = [("exact", exact, None)] + [("hnsw", hnsw, ef) for ef in args.ef]
    best: dict = {}
    found: dict = {}
    for name, index, ef in configs:                                  # warm-up (pages, BLAS buffers)
        if ef is not None:
            index.ef_search = ef
        ann.search(index, queries[:256], k)
    for _ in range(max(1, args.repeats)):
        for name, index, ef in configs:
            if ef is not None:
                index.ef_search = ef
            for batch, qs in ((256, queries), (1, single)):
                w, c, ids = _timed_pass(index, qs, k, batch)
                old = best.get((ef, batch), (np.inf, np.inf))
                best[ef, batch] = (min(old[0], w), min(old[1], c))
                if batch == 256:
                    found[ef] = ids
    truth = found[None]

    def timing(ef):
        return {"cpu_ms_b256": round(best[ef, 256][1], 4), "cpu_ms_b1": round(best[ef, 1][1], 4),
                "wall_ms_b256": round(best[ef, 256][0], 4), "wall_ms_b1": round(best[ef, 1][0], 4)}

    last = float(ann.search(exact, queries[:256], k)[0][:, -1].mean())  # mean score at rank k: how far from noise
    ex = {"L": L, "kind": "exact", "score_at_k": round(last, 3), "build_s": ex_build, "build_cpu_s": ex_build_cpu,
          "index_mb": round(_mb(exact), 1), **timing(None), "recall": 1.0}
    sweep = [{"ef": ef, **timing(ef), "recall": round(recall(found[ef], truth), 5)} for ef in args.ef]
    ok = [x for x in sweep if x["recall"] >= args.target]
    pick = ok[0] if ok else sweep[-1]
    hn = {"L": L, "kind": "hnsw", "build_s": hn_build, "build_cpu_s": hn_build_cpu, "index_mb": round(_mb(hnsw), 1),
          **{key: pick[key] for key in ("cpu_ms_b256", "cpu_ms_b1", "wall_ms_b256", "wall_ms_b1", "recall")},
          "ef_search": pick["ef"], "meets_target": bool(ok),
          "speedup_b256": round(ex["cpu_ms_b256"] / pick["cpu_ms_b256"], 2),
          "speedup_b1": round(ex["cpu_ms_b1"] / pick["cpu_ms_b1"], 2), "sweep": sweep}
    if data is not None:
        ex["source"] = hn["source"] = data[2]
    for line in (ex, hn):
        print(json.dumps(line), flush=True)
    return [ex, hn]


def crossing(points: list[tuple[int, float]], level: float = 2.0) -> float | None:
    """The L at which a speedup first reaches ``level``, interpolated linearly in (log L, log
    speedup) between the two sizes that bracket it (``None`` if no size reaches it; the first
    size if it already does)."""
    for (l0, s0), (l1, s1) in zip(points, points[1:]):
        if s0 >= level:
            return float(l0)
        if s1 >= level:
            if s0 <= 0:                                             # the smaller size misses the recall target
                return float(l1)
            t = (np.log(level) - np.log(s0)) / (np.log(s1) - np.log(s0))
            return float(np.exp(np.log(l0) + t * (np.log(l1) - np.log(l0))))
    return float(points[0][0]) if points and points[0][1] >= level else None


def summary(rows: list[dict], target: float, topics: int) -> dict:
    """The last line: the smallest L at which HNSW at recall@100 >= target is >= 2x faster."""
    hn = sorted((r for r in rows if r["kind"] == "hnsw"), key=lambda r: r["L"])

    def first(key):
        return next((r["L"] for r in hn if r["meets_target"] and r[key] >= 2.0), None)

    def interpolated(key):
        x = crossing([(r["L"], r[key] if r["meets_target"] else 0.0) for r in hn])
        return None if x is None else int(round(x))

    return {"summary": True, "target_recall_at_100": target, "topics": topics,
            "hnsw_2x_from_L_b256": first("speedup_b256"), "hnsw_2x_from_L_b1": first("speedup_b1"),
            "hnsw_2x_at_L_interpolated_b256": interpolated("speedup_b256"),
            "hnsw_2x_at_L_interpolated_b1": interpolated("speedup_b1"),
            "ef_for_target": {str(r["L"]): (r["ef_search"] if r["meets_target"] else None) for r in hn},
            "machine": f"{platform.machine()} {os.cpu_count()} cpu", "faiss": faiss.__version__}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--quick", action="store_true", help=f"leave out L={QUICK_SKIP}")
    p.add_argument("--d", type=int, default=384)
    p.add_argument("--topics", type=int, default=64, help="topic level of the synthetic data (0: none)")
    p.add_argument("--queries", type=int, default=1024, help="queries for batch-256 timing and recall")
    p.add_argument("--single", type=int, default=100, help="queries timed one at a time")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--ef", type=int, nargs="+", default=[100, 128, 160, 200, 256, 384, 512])
    p.add_argument("--target", type=float, default=0.99, help="recall@k HNSW must reach")
    p.add_argument("--threads", type=int, default=1, help="search threads")
    p.add_argument("--build-threads", type=int, default=1, help="HNSW build threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    p.add_argument("--cache", type=Path, help="keep HNSW builds here and reuse them (with their build times)")
    p.add_argument("--real", type=Path, nargs="+", metavar="MODEL_DIR",
                   help="trained dual encoders' folders (results/<d>/dual-encoder/<enc>): their label and test "
                        "text embeddings instead of the synthetic sets (--sizes is then ignored)")
    args = p.parse_args(argv)
    if args.real:
        rows = []
        for d in args.real:
            labels, queries = real(d, args.queries)
            rows += bench_size(len(labels), args, (labels, queries, str(d)))
        return rows
    sizes = [L for L in args.sizes if not (args.quick and L == QUICK_SKIP)]
    rows = []
    for L in sizes:
        rows += bench_size(L, args)
    s = summary(rows, args.target, args.topics)
    print(json.dumps(s), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows + [s]))
    return rows + [s]


if __name__ == "__main__":
    main()
