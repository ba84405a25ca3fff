"""XR-Linear: a linear model per level of a label tree, beam search to predict.

The stage: train the model, predict the top-k labels, or write the top clusters (the linear tree
as a matcher).  The model, its training and its beam search: :mod:`xmc_steps.xr_linear`.

CLI::

    python -m xmc_steps.stages.xr_linear train --features X.npz [--features X2.npz ...] \
        --labels Y.npz [--labels Y2.npz ...] --tree tree.npz --out model_dir --params '{...}'
    python -m xmc_steps.stages.xr_linear predict --model model_dir --features X_test.npz \
        --out predictions.parquet --params '{"beam": 10, "topk": 100}'
    python -m xmc_steps.stages.xr_linear clusters --model model_dir --features X_valid.npz X_test.npz \
        --out clusters_valid.npz clusters_test.npz --params '{"topb": 10}'

``clusters`` writes the top-``topb`` nodes of the finest cluster level (CSR ``N x K``, the beam's path
scores): the linear tree used as a matcher, the baseline and second candidate source of the X-Transformer
matcher (:mod:`xmc_steps.xtransformer`).  Its rule passes the matcher's ``topb`` and ``scorer``,
``xtransformer.fit_on`` and the tree's ``fit`` (its path's) unchanged; the stage derives from them its beam,
how many clusters it keeps and whether the test split's count as prediction cost (:func:`clusters_settings`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import scipy.sparse as sp

from .. import io, resources
from ..cluster_tree import ClusterTree
from ..stage import StageError, add_common_args, cli_main, stage_run
from ..xr_linear import XRLinearModel, XRLinearParams, predict_bytes, train_bytes


def _stack(paths: list[str]) -> sp.csr_matrix:
    mats = [io.load_csr(p) for p in paths]
    return mats[0] if len(mats) == 1 else sp.vstack(mats, format="csr")


def _train_cli(args) -> None:
    with stage_run("xr_linear_train", args, outputs=[str(args.out)]) as st:
        if len(args.features) != len(args.labels):
            raise StageError("give as many --labels as --features")
        try:
            params = XRLinearParams.from_dict(st.params)
        except (ValueError, TypeError) as e:
            raise StageError(str(e)) from e
        st.params.clear()
        st.params.update(params.to_dict())
        with st.timed("load"):
            X = _stack(args.features)
            Y = _stack(args.labels)
            tree = ClusterTree.load(args.tree)
        if X.shape[0] != Y.shape[0]:
            raise StageError(f"features have {X.shape[0]} rows but labels have {Y.shape[0]}")
        if Y.shape[1] != tree.n_labels:
            raise StageError(f"labels have {Y.shape[1]} columns but the tree has {tree.n_labels} labels")
        st.log.info("training xr-linear: %d instances, %d features, %d labels, tree %s, params %s",
                    X.shape[0], X.shape[1], Y.shape[1], tree.level_sizes, params.to_dict())
        resources.check_memory(f"xr-linear training on {X.shape[0]:,} documents (tree {tree.level_sizes})",
                               train_bytes(X.shape[0], X.nnz, tree, params),
                               "xr_linear.beam or xr_linear.negatives: tfn (the MAN candidates), or cluster.leaf_size "
                               "(labels per leaf)", st.log)
        with st.timed("train"):
            model = XRLinearModel.train(X, Y, tree, params, log=st.log)
        out = Path(args.out)
        st.output("model", str(out))
        st.extra["model_paths"] = [str(out)]
        with io.atomic_dir(out) as tmp:
            model.save(tmp)
        st.metric("model_nnz", sum(w.nnz for w in model.W))
        st.metric("model_bytes", model.size_bytes())


def _predict_cli(args) -> None:
    """The top-k labels of the features: :func:`xmc_steps.xr_linear.serve.predict` (serving's too), the
    parameters saved with the model overridden by the rule's (its ``xr_linear`` section's beam, topk, transform)."""
    from ..xr_linear.serve import META, PredictParams, predict

    with stage_run("xr_linear_predict", args, outputs=[args.out]) as st:
        try:
            model = XRLinearModel.load(args.model)
            meta = io.read_json(Path(args.model) / META)
        except (OSError, ValueError) as e:
            raise StageError(f"cannot load model {args.model}: {e}") from e
        try:       # the xr_linear section (or any of its keys) is checked; its beam, topk, transform win
            XRLinearParams.from_dict({**model.params.to_dict(), **st.params})
            p = PredictParams.effective(meta, {k: st.params[k] for k in PredictParams.keys() if k in st.params})
        except (ValueError, TypeError) as e:
            raise StageError(f"predict parameters: {e}") from e
        X = _stack(args.features)
        if X.shape[1] != model.n_features:
            raise StageError(f"features have {X.shape[1]} columns, the model expects {model.n_features}")
        st.params.update(p.to_dict())
        resources.check_memory(f"xr-linear predictions of {X.shape[0]:,} documents",
                               predict_bytes(X.shape[0], model.tree, p.beam, p.topk, W=model.W),
                               "xr_linear.topk (predictions kept per document) or xr_linear.beam", st.log)
        t0 = time.perf_counter()
        with st.timed("predict"):
            P = predict(args.model, X, p, model)["scores"]
        dt = time.perf_counter() - t0
        st.log.info("predicted %d documents in %.2f s", X.shape[0], dt)
        st.predictions(args.out, P, p.topk, dt)


#: what ``clusters`` takes, with its defaults for a run by hand: the xtransformer_linear_clusters rule passes
#: ``xtransformer.matcher``'s ``topb`` and ``scorer``, ``xtransformer.fit_on`` and its tree's ``fit``
#: (``train`` or ``fit_on``'s splits joined by ``+``); ``transform``: None, the model's
CLUSTERS = {"topb": 10, "scorer": "head", "fit_on": None, "fit": None, "transform": None}


def clusters_settings(given: dict) -> dict:
    """``clusters``' settings (:data:`CLUSTERS` with the ``given`` ones) and what derives from them: ``beam`` (the
    matcher's ``topb``); ``keep``: the train split's tree keeps ``2 topb``, from which the matcher's guard cuts its
    equal-budget baseline; ``online``: its test clusters are part of predicting new text when they feed Eq. 2 (the
    tree fit on ``fit_on``, the rankers') or the matcher's ``head+linear`` scorer, not when they only serve the
    guard (the latency then counts one linear tree, not two); a tree run by hand (no ``fit``): online."""
    unknown = set(given) - set(CLUSTERS) - {"threads"}
    if unknown:
        raise StageError(f"unknown clusters parameter(s): {sorted(unknown)} (known: {', '.join(CLUSTERS)})")
    cfg = {**CLUSTERS, **{k: v for k, v in given.items() if k in CLUSTERS}}
    fit, topb = cfg["fit"], int(cfg["topb"])
    online = fit is None or fit == "+".join(cfg["fit_on"] or ()) or cfg["scorer"] == "head+linear"
    return {**cfg, "beam": topb, "keep": topb * (2 if fit == "train" else 1), "online": online}


def _clusters_cli(args) -> None:
    """The linear tree as a matcher: the top-``topb`` finest clusters of each document."""
    if len(args.features) != len(args.out):
        raise StageError("give as many --out files as --features")
    with stage_run("xr_linear_clusters", args, outputs=list(args.out)) as st:
        cfg = clusters_settings(st.params)
        try:
            model = XRLinearModel.load(args.model)
        except (OSError, ValueError) as e:
            raise StageError(f"cannot load model {args.model}: {e}") from e
        cfg["transform"] = cfg["transform"] or model.params.transform
        st.params.update(cfg)
        for f, o in zip(args.features, args.out):
            X = io.load_csr(f)
            if X.shape[1] != model.n_features:
                raise StageError(f"{f}: features have {X.shape[1]} columns, the model expects {model.n_features}")
            keep = int(cfg["keep"])
            resources.check_memory(f"{f}: the top-{keep} clusters of {X.shape[0]:,} documents",
                                   predict_bytes(X.shape[0], model.tree, int(cfg["beam"]), keep, W=model.W),
                                   "xtransformer.matcher.topb (clusters kept per document)", st.log)
            t0 = time.perf_counter()
            with st.timed("predict"):
                S = model.predict_clusters(X, beam=int(cfg["beam"]), transform=cfg["transform"], keep=keep)
            if Path(o).stem.endswith("_test") and cfg["online"]:     # part of predicting new text
                st.online_cost(time.perf_counter() - t0, X.shape[0])
            io.save_csr(o, S)
            st.output(Path(o).stem, o)
            st.log.info("%s: top-%d of %d clusters for %d documents (beam %d)", o, keep,
                        S.shape[1], S.shape[0], int(cfg["beam"]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.xr_linear", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train an XR-Linear model")
    t.add_argument("--features", required=True, action="extend", nargs="+", help="features (.npz CSR), rows stacked in order")
    t.add_argument("--labels", required=True, action="extend", nargs="+", help="labels (.npz CSR), aligned with --features")
    t.add_argument("--tree", required=True, help="cluster tree (.npz, the cluster stage xmc_steps.stages.cluster)")
    t.add_argument("--out", required=True, help="model folder")
    add_common_args(t)
    pr = sub.add_parser("predict", help="predict top-k labels")
    pr.add_argument("--model", required=True, help="model folder")
    pr.add_argument("--features", required=True, action="extend", nargs="+", help="features (.npz CSR)")
    pr.add_argument("--out", required=True, help="predictions (.parquet)")
    add_common_args(pr)
    cl = sub.add_parser("clusters", help="the top-topb finest clusters per document (the linear tree as a matcher)")
    cl.add_argument("--model", required=True, help="model folder")
    cl.add_argument("--features", required=True, nargs="+", help="features (.npz CSR), one file per output")
    cl.add_argument("--out", required=True, nargs="+", help="cluster scores (.npz CSR N x K), one per --features")
    add_common_args(cl)
    args = p.parse_args(argv)
    {"train": _train_cli, "predict": _predict_cli, "clusters": _clusters_cli}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
