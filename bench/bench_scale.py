"""Scale benchmark: the pipeline's stages on synthetic data of a large benchmark's shape.

    python bench/bench_scale.py --shape wiki500k --fraction 0.02 [--work bench-out/scale] [--cores 2]

1. writes ``<work>/data/<shape>-f<fraction>/`` with :mod:`xmc_steps.synth` (all L labels,
   ``fraction`` of the documents);
2. runs ``snakemake --cores N`` for ``results/<name>/xr-linear.json`` and the tokens of
   the default encoder (ingest, TF-IDF, tokenize, PIFA, clustering, xr-linear train and
   predict, evaluate) in ``<work>`` with the shipped config;
3. runs ELIAS's index initialisation (Eqs. 9-10, :func:`xmc_steps.elias.init_adjacency`)
   at the shape's label space with C = 2^round(log2(L/100)) clusters and kappa = 10 L/C,
   in a child process of its own;

and prints one JSON object per stage: ``stage``, ``seconds``, ``peak_rss_mb`` (each
stage's own process, from its stage record) and ``output_mb`` (the files it wrote).
Run it at a few fractions to see which stage grows faster than the data (time and
memory against F).  Timings on a shared machine are noisy; compare within one run.

``--linear-only`` builds only what xr-linear needs (no tokens, no ELIAS index).  ``--train-only``
(after a run at the same fraction) times ``XRLinearModel.train`` alone in this process on the DAG's
features and tree, ``--repeat`` times, one thread, and prints ``{"stage": "xr_linear_train (in
process)", "seconds": [...], "docs", "labels", "nnz"}``: put two fractions side by side in one
session (``--fraction 0.005 0.02``) to read the growth against N without the DAG's other jobs;
``--baseline REV`` also times the package as it was at a git revision, ``--code DIR`` imports
``xmc_steps`` from another folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# --code DIR: the package xmc_steps from DIR (e.g. a checkout with a change under test), not this one
_CODE = sys.argv[sys.argv.index("--code") + 1] if "--code" in sys.argv[:-1] else None
sys.path.insert(0, _CODE or str(ROOT))

from xmc_steps import synth  # noqa: E402


def _mb(paths) -> float:
    total = 0
    for p in paths:
        p = Path(p)
        if p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        elif p.exists():
            total += p.stat().st_size
    return round(total / 2**20, 2)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def elias_index(data_dir: Path, n_labels: int, seed: int = 0) -> dict:
    """Eqs. 9-10 on the generated training labels: M from a random top-b (the index only
    needs its sparsity), A' = M^T Y, top-kappa per cluster.  Run in a child process."""
    import numpy as np
    import scipy.sparse as sp

    from xmc_steps import elias, io

    Y = io.load_csr(data_dir / "Y_train.npz")
    C = 2 ** max(1, round(math.log2(max(2, n_labels / 100))))
    kappa = min(n_labels, math.ceil(10 * n_labels / C))
    b = min(20, C)
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.arange(Y.shape[0]), b)
    cols = np.concatenate([rng.choice(C, b, replace=False) for _ in range(Y.shape[0])])
    M = sp.csr_matrix((rng.random(len(rows)).astype(np.float32), (rows, cols)), shape=(Y.shape[0], C))
    t0 = time.perf_counter()
    index, value = elias.init_adjacency(M, Y, kappa=kappa, seed=seed)
    return {"C": C, "kappa": kappa, "b": b, "seconds": time.perf_counter() - t0,
            "index_mb": round((index.nbytes + value.nbytes) / 2**20, 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="wiki500k", choices=sorted(synth.SHAPES))
    ap.add_argument("--fraction", type=float, nargs="+", default=[0.02])
    ap.add_argument("--linear-only", action="store_true", help="only the stages xr-linear needs")
    ap.add_argument("--train-only", action="store_true", help="time XRLinearModel.train alone (after a DAG run)")
    ap.add_argument("--repeat", type=int, default=1, help="--train-only: trainings per fraction")
    ap.add_argument("--code", default=None, help="import xmc_steps from this folder")
    ap.add_argument("--baseline", default=None, help="--train-only: also time the package at this git revision")
    ap.add_argument("--work", default=str(ROOT / "bench-out" / "scale"))
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--elias-only", action="store_true", help=argparse.SUPPRESS)   # the child process
    args = ap.parse_args(argv)
    if args.train_only:
        os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        codes = {"current" if not args.code else f"code {args.code}": "xmc_steps"}
        if args.baseline:
            sys.path.insert(0, str(ROOT / "bench"))
            from bench_predict import _package_at

            codes = {args.baseline: _package_at(args.baseline), **codes}
        for f in args.fraction:
            for code, pkg in codes.items():
                _emit({"code": code, **train_only(args, f, pkg)})
        return
    fractions = args.fraction
    for f in fractions:
        args.fraction = f
        run_fraction(args)


def train_only(args, fraction: float, pkg: str = "xmc_steps") -> dict:
    """``XRLinearModel.train`` of package ``pkg`` alone on the DAG's features, labels and tree at
    ``fraction`` (1 thread)."""
    import importlib

    import scipy.sparse as sp

    io = importlib.import_module(f"{pkg}.io")
    ClusterTree = importlib.import_module(f"{pkg}.cluster_tree").ClusterTree
    xr = importlib.import_module(f"{pkg}.xr_linear")
    XRLinearModel, XRLinearParams = xr.XRLinearModel, xr.XRLinearParams

    name = f"{args.shape}-f{fraction:g}".replace(".", "")
    res = Path(args.work).resolve() / "results" / name
    X = sp.vstack([io.load_csr(res / "features/tfidf/X_train.npz"), io.load_csr(res / "features/tfidf/X_valid.npz")],
                  format="csr")
    Y = sp.vstack([io.load_csr(res / "ingest/Y_train.npz"), io.load_csr(res / "ingest/Y_valid.npz")], format="csr")
    # the tree xr-linear trains on: the DAG's pifa-tfidf tree without a floor on its leaf count
    tree = ClusterTree.load(next(p for p in sorted((res / "index" / "pifa-tfidf").glob("tree-*.npz"))
                                 if "-c" not in p.stem.split("-l", 1)[1]))
    import logging

    class Levels(logging.Handler):          # the per-level seconds XRLinearModel.train logs
        def emit(self, record):
            levels.append(round(float(record.args[-1]), 2))

    log = logging.getLogger("bench_scale.train")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(Levels())
    secs, by_level = [], []
    for _ in range(args.repeat):
        levels: list[float] = []
        t0 = time.perf_counter()
        XRLinearModel.train(X, Y, tree, XRLinearParams(threads=1), log=log)
        secs.append(round(time.perf_counter() - t0, 2))
        by_level.append(levels)
    return {"stage": "xr_linear_train (in process)", "fraction": fraction, "seconds": secs,
            "seconds_by_level": by_level, "docs": X.shape[0], "labels": Y.shape[1], "nnz": int(X.nnz),
            "tree": tree.level_sizes}


def run_fraction(args) -> None:
    shape = synth.SHAPES[args.shape]
    work = Path(args.work).resolve()
    name = f"{args.shape}-f{args.fraction:g}".replace(".", "")
    data = work / "data" / name
    res = work / "results" / name

    if args.elias_only:
        import resource

        out = elias_index(res / "ingest", shape.n_labels, args.seed)
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print(json.dumps(out))
        return

    if not (data / "synth.json").exists():
        t0 = time.perf_counter()
        info = synth.write(shape, args.fraction, data, args.seed)
        _emit({"stage": "synth", "seconds": round(time.perf_counter() - t0, 2), "output_mb": _mb(data.iterdir()),
               **{f"{k}_docs": v["documents"] for k, v in info["written"].items()}, "labels": shape.n_labels})
    cfg = work / "bench.yaml"
    cfg.write_text(json.dumps({"data_dir": str(work / "data"), "results_dir": str(work / "results")}))
    targets = [f"{res}/xr-linear.json"] + ([] if args.linear_only else [f"{res}/features/tokens/minilm-64/record.json"])
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "snakemake", *targets, "--snakefile", str(ROOT / "Snakefile"),
                        "--directory", str(work), "--cores", str(args.cores),
                        "--configfile", str(ROOT / "config.yaml"), str(cfg)],
                       cwd=work, capture_output=True, text=True, env=dict(os.environ, XMC_TRACKING="0"))
    if r.returncode != 0:
        sys.exit(f"snakemake failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    records = sorted(res.rglob("*record.json"))
    for p in records:
        rec = json.loads(p.read_text())
        _emit({"stage": rec.get("rule") or rec.get("stage"), "record": str(p.relative_to(res)),
               "seconds": round(float(rec["wall_s"]), 2), "peak_rss_mb": round(float(rec["peak_rss_mb"]), 1),
               "output_mb": _mb(rec.get("outputs", {}).values())})
    _emit({"stage": "snakemake (all of the above, wall)", "seconds": round(time.perf_counter() - t0, 2)})
    if args.linear_only:
        return

    r = subprocess.run([sys.executable, __file__, "--elias-only", "--shape", args.shape, "--fraction",
                        str(args.fraction), "--work", str(work), "--seed", str(args.seed)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ELIAS index failed:\n{r.stderr[-4000:]}")
    _emit({"stage": "elias_init_adjacency", **json.loads(r.stdout.strip().splitlines()[-1])})


if __name__ == "__main__":
    main()
