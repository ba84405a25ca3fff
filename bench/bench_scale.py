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
``xmc_steps`` from another folder.  With ``--train-only`` each level's line also splits its time
into the solver's (liblinear's calls, counted by :class:`SolverLog`) and the rest, and gives the
solver's *work* (the sum over its calls of stored entries x iterations) and its time per unit
of work, beside the label structure that decides the work (:func:`live_structure`: the labels with a
training positive and, per level, the clusters holding one).  Training time can only be linear in N
where the work is: one-vs-all solves exist only for labels with a positive, and each reads the
instances its parent's beam sends it.  ``--pecos PY`` times the reference library's XR-Linear on the
same features at each fraction (``bench/pecos_reference.py``, 1 thread).
"""

from __future__ import annotations

import argparse
import json
import logging
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


class SolverLog:
    """Records every liblinear call of package ``pkg`` (``xmc_steps.liblinear_direct``'s solver) while
    active: seconds, iterations, rows, columns, stored entries and positives of each."""

    def __init__(self, pkg: str = "xmc_steps"):
        import importlib

        self.mod = importlib.import_module(f"{pkg}.liblinear_direct")._ll
        self.calls: list[tuple[float, int, int, int, int, int]] = []

    def __enter__(self):
        import numpy as np

        self.orig = orig = self.mod.train_wrap

        def train_wrap(X, y, *rest):
            t0 = time.perf_counter()
            out = orig(X, y, *rest)
            it = int(np.ravel(out[1])[0])
            self.calls.append((time.perf_counter() - t0, it, X.shape[0], X.shape[1], int(X.nnz), int((y > 0).sum())))
            return out

        self.mod.train_wrap = train_wrap
        return self

    def __exit__(self, *exc):
        self.mod.train_wrap = self.orig


def level_work(calls, bounds, level_seconds) -> list[dict]:
    """Per level (``bounds``: the number of calls recorded when each level ended, ``level_seconds``
    its wall time): solver calls, solver seconds, the rest, mean iterations, mean rows of a call,
    the solver's work (sum of stored entries x iterations) and its nanoseconds per unit."""
    import numpy as np

    out, start = [], 0
    for end, secs in zip(bounds, level_seconds):
        c = np.asarray(calls[start:end], dtype=np.float64).reshape(-1, 6)
        work = float((c[:, 4] * c[:, 1]).sum())
        out.append({"calls": len(c), "seconds": round(secs, 2), "solver_s": round(float(c[:, 0].sum()), 2),
                    "other_s": round(secs - float(c[:, 0].sum()), 2),
                    "iterations_mean": round(float(c[:, 1].mean()), 2) if len(c) else 0.0,
                    "rows_mean": round(float(c[:, 2].mean()), 1) if len(c) else 0.0,
                    "work": int(work),
                    "ns_per_work": round(1e9 * float(c[:, 0].sum()) / work, 3) if work else None})
        start = end
    return out


def live_structure(Y, tree) -> dict:
    """The labels with a training positive, and per cluster level the clusters that hold one (a level
    whose live clusters are few sends each of them most instances: its rankers' solves read ~N rows)."""
    import numpy as np
    import scipy.sparse as sp

    live = np.diff(sp.csc_matrix(Y).indptr) > 0
    return {"labels_with_positive": int(live.sum()),
            "live_clusters_by_level": [int(len(np.unique(tree.assignment(lev)[live])))
                                       for lev in range(1, tree.depth)]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="wiki500k", choices=sorted(synth.SHAPES))
    ap.add_argument("--fraction", type=float, nargs="+", default=[0.02])
    ap.add_argument("--linear-only", action="store_true", help="only the stages xr-linear needs")
    ap.add_argument("--train-only", action="store_true", help="time XRLinearModel.train alone (after a DAG run)")
    ap.add_argument("--repeat", type=int, default=1, help="--train-only: trainings per fraction")
    ap.add_argument("--code", default=None, help="import xmc_steps from this folder")
    ap.add_argument("--baseline", default=None, help="--train-only: also time the package at this git revision")
    ap.add_argument("--pecos", default=None, help="--train-only: also time the reference XR-Linear with this python")
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
            if args.pecos:
                name = f"{args.shape}-f{f:g}".replace(".", "")
                p = subprocess.run([args.pecos, str(ROOT / "bench" / "pecos_reference.py"), "--results",
                                    str(Path(args.work).resolve() / "results"), "--dataset", name, "--threads", "1"],
                                   check=True, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                _emit({"fraction": f, **json.loads(p.stdout.strip().splitlines()[-1])})
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
    log = logging.getLogger("bench_scale.train")
    log.setLevel(logging.INFO)
    log.propagate = False
    secs, by_level = [], []
    for _ in range(args.repeat):
        with SolverLog(pkg) as solver:
            log.addHandler(lines := LevelLines(solver.calls))
            t0 = time.perf_counter()
            XRLinearModel.train(X, Y, tree, XRLinearParams(threads=1), log=log)
            secs.append(round(time.perf_counter() - t0, 2))
            log.removeHandler(lines)
        by_level.append(lines.seconds)
    work = level_work(solver.calls, lines.calls_at_end, lines.seconds)        # the last training's
    return {"stage": "xr_linear_train (in process)", "fraction": fraction, "seconds": secs,
            "seconds_by_level": by_level, "docs": X.shape[0], "labels": Y.shape[1], "nnz": int(X.nnz),
            "tree": tree.level_sizes, **live_structure(Y, tree), "solver_by_level": work}


class LevelLines(logging.Handler):
    """The lines ``XRLinearModel.train`` logs after each level: the level's seconds (their last
    argument) and how many solver calls (``calls``, a :class:`SolverLog`'s list) had been made by then."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls, self.seconds, self.calls_at_end = calls, [], []

    def emit(self, record):
        self.seconds.append(round(float(record.args[-1]), 2))
        self.calls_at_end.append(len(self.calls))


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
