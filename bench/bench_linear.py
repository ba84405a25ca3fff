"""Benchmark the linear path (XR-Linear, and Parabel for comparison) on one dataset.

Runs the pipeline's own stage functions in one process and prints each stage's wall
time and the process's peak memory after it, then P@1/3/5 and R@100:

    python bench/bench_linear.py [--data ../shared/data/debtags-bookworm] [--threads 2] [--parabel]

Settings are the shipped config's defaults (TF-IDF uni+bigrams, min_df 2, sublinear;
PIFA; B=16, leaf 100; TFN+MAN rankers; beam 10).  Unlike the DAG, the models are fit on
the whole upstream train file (no validation carve-out), as the reference figures in
../shared/data/README.md were.  Timings on a shared machine are noisy: compare ratios
measured in one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import config, metrics  # noqa: E402
from xmc_steps.cluster_tree import hierarchical_kmeans  # noqa: E402
from xmc_steps.datasets import locate  # noqa: E402
from xmc_steps.ingest import ingest  # noqa: E402
from xmc_steps import io  # noqa: E402
from xmc_steps.label_embedding import pifa  # noqa: E402
from xmc_steps.tfidf import fit_transform  # noqa: E402
from xmc_steps.xr_linear import XRLinearModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT.parent / "shared" / "data" / "debtags-bookworm"


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parabel", action="store_true", help="also train and evaluate omikuji/Parabel")
    args = ap.parse_args()
    s = config.dataset_settings(config.load(ROOT / "config.yaml"), args.data.name)
    s["split"]["valid_fraction"] = 0.0
    times: dict[str, float] = {}

    def stage(name, t0):
        times[name] = time.perf_counter() - t0
        print(f"{name:>14s}: {times[name]:7.2f} s   peak {peak_mib():7.0f} MiB", flush=True)

    log = logging.getLogger("bench")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        ingest(locate(args.data.name, args.data.parent, str(args.data)), s, tmp, log)
        texts = {sp: io.read_table(tmp / f"docs_{sp}.parquet", ["text"]).column("text").to_pylist() for sp in ("train", "test")}
        Ytr, Yte = io.load_csr(tmp / "Y_train.npz"), io.load_csr(tmp / "Y_test.npz")
        stage("ingest", t)
        t = time.perf_counter()
        _, X = fit_transform(texts["train"], {"test": texts["test"]}, s["tfidf"])
        Xtr, Xte = X["train"].tocsr(), X["test"].tocsr()
        stage("tfidf", t)
        t = time.perf_counter()
        emb = pifa(Xtr, Ytr)
        stage("label_embedding", t)
        t = time.perf_counter()
        c = s["cluster"]
        tree = hierarchical_kmeans(emb, c["branching"], c["leaf_size"], seed=c["seed"], max_iter=c["max_iter"])
        stage("cluster", t)
        t = time.perf_counter()
        xr = {k: v for k, v in s["xr_linear"].items() if k not in ("fit_on", "topk")} | {"threads": args.threads}
        model = XRLinearModel.train(Xtr, Ytr, tree, xr)
        stage("rankers", t)
        t = time.perf_counter()
        P = model.predict(Xte, beam=xr["beam"], topk=100)
        stage("predict", t)
        w = metrics.inverse_propensity(Ytr)
        res = {"xr-linear": metrics.all_metrics(P, Yte, w, metrics.label_frequency(Ytr))}
        print(f"index+rankers: {times['label_embedding'] + times['cluster'] + times['rankers']:.1f} s "
              f"(threads {args.threads}); tree {tree.level_sizes}")
        if args.parabel:
            from xmc_steps import parabel

            t = time.perf_counter()
            pm = parabel.train(Xtr, Ytr, s["parabel"], tmp, args.threads)
            stage("parabel_train", t)
            t = time.perf_counter()
            pm.init_prediction_thread_pool(args.threads)
            P = parabel.predict(pm, Xte, 100, s["parabel"]["beam"], Ytr.shape[1])
            stage("parabel_predict", t)
            res["parabel"] = metrics.all_metrics(P, Yte, w, metrics.label_frequency(Ytr))
    print(f"data {args.data.name}: train {Xtr.shape[0]} x {Xtr.shape[1]}, test {Xte.shape[0]}, labels {Ytr.shape[1]}; "
          f"peak {peak_mib():.0f} MiB")
    for name, m in res.items():
        print(f"{name:>10s}: P@1 {m['p_at_1']:.2f}  P@3 {m['p_at_3']:.2f}  P@5 {m['p_at_5']:.2f}  R@100 {m['recall_at_100']:.2f}")
    print(json.dumps({"times_s": {k: round(v, 2) for k, v in times.items()}, "peak_mib": round(peak_mib())}))


if __name__ == "__main__":
    main()
