"""X-Transformer neural matcher (§3.3): a transformer that maps a text to its label clusters.

The stage: trains the matcher (:mod:`xmc_steps.xtransformer.matcher`), re-fits its head, runs the
guard (:mod:`xmc_steps.xtransformer.guard`) and writes the embeddings and the top-b clusters of every
split.  What the model is and why each setting: docs/methods/xtransformer.md.

CLI::

    python -m xmc_steps.stages.matcher --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --cluster-assign C.npz \\
        [--linear-clusters lin_train.npz lin_valid.npz lin_test.npz | --baseline-clusters lin_valid.npz] \\
        --out DIR --params JSON [common args]

``--cluster-assign`` is a CSR ``L x K`` 0/1 matrix, or a cluster tree file of
:mod:`xmc_steps.cluster_tree` (``ClusterTree.save``), whose finest cluster level is used.
``--linear-clusters`` are the linear tree's top clusters of the train, valid and test
documents (``python -m xmc_steps.stages.xr_linear clusters``): the guard's baseline and the linear
half of ``head+linear``; ``--baseline-clusters`` gives the valid ones only (the guard's
baseline).  Without either the guard has the frequency
baseline only.

``--params`` keys (:class:`~xmc_steps.xtransformer.params.MatcherParams`): encoder, pooling, last_k,
max_length, train (:class:`xmc_steps.trainer.TrainParams`: epochs, steps, batch_size, grad_accum,
lr (encoder), warmup, warmup_steps, weight_decay, max_grad_norm, length_bucket, checkpoint_every,
log_every, seed; the keys given change :data:`~xmc_steps.xtransformer.params.TRAIN_DEFAULTS`),
lr_head (head; default = train.lr), head_init, head_init_l2, head_refit, scorer, topb, allow_weak,
eval_every, eval_max_docs, eval_batch_size, amp, device, allow_cpu_fallback, threads.

Outputs in ``--out``: ``model.safetensors`` (state dict of
:class:`~xmc_steps.xtransformer.matcher.MatcherModel`: ``encoder.model.*`` and ``head.weight``),
``matcher.json`` (format, encoder, pooling,
last_k, K, dim, max_length, params, training summary), ``guard.json`` (the guard's
numbers and the validation curve), ``curve.png`` (that curve with the baselines),
``emb_{train,valid,test}.npz`` (key ``emb``, float32 N x dim),
``clusters_{train,valid,test}.npz`` (CSR N x K with the top-b scores per row).  Training
checkpoints go to ``--out/checkpoints/`` (layout in :mod:`xmc_steps.neural`); they
survive a failed or preempted run so that rerunning the same command resumes, and are
removed once every output is written.  Validation P@1 and recall@b of the cluster
ranking (``valid_cluster_p_at_1``, ``valid_cluster_recall_at_b``; a fixed subset of at
most ``eval_max_docs`` valid documents) are logged at step 0 and every ``eval_every``
steps (default: ten points per run); the final model is the one after the last step (no selection).
:func:`xmc_steps.xtransformer.load_matcher` loads a trained matcher back.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import scipy.sparse as sp

from .. import encoders, io, neural
from ..curves import CurveLog, plot_curve
from ..layout import CURVE, GUARD, WEIGHTS
from ..neural_stage import (load_tokens, record_training, remove_checkpoints, save_trained, stage_params,
                           training_device)
from ..stage import StageError, add_common_args, cli_main, stage_run
from ..guard import enforce
from ..xtransformer.guard import top1_precision
from ..xtransformer.matcher import (FORMAT, cluster_targets, finish_matcher, head_linear_topb, load_cluster_assignment,
                                   topb_from_emb, train_matcher)
from ..xtransformer.params import MatcherParams

SPLITS = ("train", "valid", "test")


def check_inputs(params: MatcherParams, tokens: Mapping[str, neural.TokenData], Y_train: sp.spmatrix,
                 Y_valid: sp.spmatrix, C: sp.spmatrix) -> int:
    """The checks done before any model is loaded; returns the effective max_length."""
    L, K = C.shape
    if K < 2:
        raise StageError(f"the cluster assignment has K = {K} cluster(s); the matcher needs K >= 2")
    if K > L:
        raise StageError(f"the cluster assignment has more clusters (K = {K}) than labels (L = {L})")
    if len(tokens["valid"]) == 0:
        raise StageError("the matcher's guard needs validation documents, and there are none "
                         "(split.valid_fraction must be > 0 for xtransformer)")
    for name, Y in (("train", Y_train), ("valid", Y_valid)):
        if Y.shape[1] != L:
            raise StageError(f"Y_{name} has {Y.shape[1]} labels but the cluster assignment has {L} rows")
        if Y.shape[0] != len(tokens[name]):
            raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
    return neural.check_tokens(params.encoder, tokens, params.max_length, "matcher")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.matcher", description=__doc__.splitlines()[0])
    p.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid,test}.npz")
    p.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    p.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    p.add_argument("--cluster-assign", required=True,
                   help="C (.npz CSR L x K, 0/1): label -> cluster; or a cluster tree (its finest level is used)")
    p.add_argument("--baseline-clusters", default=None,
                   help="the linear tree's top clusters of the valid documents (.npz CSR N_valid x K), "
                        "a baseline of the guard")
    p.add_argument("--linear-clusters", nargs=3, default=None, metavar=("TRAIN", "VALID", "TEST"),
                   help="the linear tree's top clusters of the train, valid and test documents (.npz CSR): the "
                        "guard's baseline (valid) and the linear half of scorer head+linear; replaces "
                        "--baseline-clusters")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.linear_clusters and args.baseline_clusters:
        p.error("give --linear-clusters or --baseline-clusters, not both")
    out = Path(args.out)
    names = [WEIGHTS, "matcher.json", GUARD, CURVE] + [
        f"{k}_{s}.npz" for k in ("emb", "clusters") for s in SPLITS]
    with stage_run("matcher", args, outputs=[str(out / n) for n in names]) as st:
        params = stage_params(st, MatcherParams, "matcher", "xtransformer.matcher")
        st.params.clear()
        st.params.update(params.to_dict())
        with st.timed("load"):
            tokens = load_tokens(args.tokens_dir, SPLITS)
            Y_train, Y_valid = io.load_csr(args.labels_train), io.load_csr(args.labels_valid)
            C = load_cluster_assignment(args.cluster_assign)
            linear: dict[str, sp.csr_matrix] = {}
            given = dict(zip(SPLITS, args.linear_clusters)) if args.linear_clusters else (
                {"valid": args.baseline_clusters} if args.baseline_clusters else {})
            for s, path in given.items():
                try:
                    linear[s] = io.load_csr(path)
                except (OSError, ValueError, KeyError) as e:
                    raise StageError(f"the linear tree's {s} clusters {path}: {e}") from e
            linear_valid = linear.get("valid")
            if params.scorer == "head+linear" and len(linear) < len(SPLITS):
                raise StageError("xtransformer.matcher.scorer head+linear needs the linear tree's clusters of "
                                 "every split (--linear-clusters TRAIN VALID TEST)")
        width = check_inputs(params, tokens, Y_train, Y_valid, C)
        if params.max_length is None:
            params.max_length = width
            st.params["max_length"] = width
        if np.any(np.diff(C.indptr) == 0):
            st.log.warning("%d labels belong to no cluster", int(np.sum(np.diff(C.indptr) == 0)))
        M_train, M_valid = cluster_targets(Y_train, C), cluster_targets(Y_valid, C)
        K = C.shape[1]
        st.log.info("matcher: encoder %s (%s pooling), K = %d clusters, %d train / %d valid / %d test documents, "
                    "max_length %d, M_train nnz %d", params.encoder, params.pooling, K, len(tokens["train"]),
                    len(tokens["valid"]), len(tokens["test"]), width, M_train.nnz)
        # the validation curve survives a kill: kept beside the checkpoints, and a point at or
        # after the step a run starts from (a fresh start evaluates step 0) replaces the older run's
        ckpt_dir = out / "checkpoints"
        curve = CurveLog(ckpt_dir / "curve.json")
        log_step = st.step_logger({"loss": "train_loss"})

        def on_step(step: int, logs: dict[str, float]) -> None:
            log_step(step, logs)
            if "valid_cluster_recall_at_b" in logs:
                curve.add(step, logs, ("valid_cluster_recall_at_b", "valid_cluster_p_at_1"))

        with training_device(st, params):
            with st.timed("train"):
                try:
                    model, trainer = train_matcher(tokens["train"], M_train, params, ckpt_dir, st.log, on_step,
                                                   valid=(tokens["valid"], M_valid))
                except OSError as e:
                    raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
            record_training(st, trainer)
            st.metric("train_epochs", trainer.step * params.train.batch_size * params.train.grad_accum / max(len(tokens["train"]), 1))

            n_pred, t_pred = 0, 0.0
            embs = {}
            for s in ("valid", "train", "test"):
                with st.timed(f"predict_{s}"):
                    t0 = time.perf_counter()
                    embs[s] = neural.embed(model.encoder, tokens[s], params.eval_batch_size, trainer.device, params.amp,
                                           progress=st.log.info)
                    t_pred += time.perf_counter() - t0
                    n_pred += len(tokens[s])
            with st.timed("head_and_guard"):
                report, head = finish_matcher(model, embs["train"], M_train, embs["valid"], M_valid, params,
                                              trainer.device, linear_valid, fuse=len(linear) == len(SPLITS))
            if "scorers" in head:
                st.log.info("scorer: valid cluster recall@%d %s; writing the %s scores", report.b,
                            ", ".join(f"{k} {v:.4f}" for k, v in head.get("scorers", {}).items()), report.scorer)
            if "refit" in head:
                st.log.info("head: valid cluster recall@%d %.4f as trained, %.4f re-fit by least squares on the "
                            "fine-tuned embeddings: keeping the %s head", report.b, head["trained"], head["refit"],
                            head["kept"])
                st.metric("valid_cluster_recall_at_b_trained_head", head["trained"])
                st.metric("valid_cluster_recall_at_b_refit_head", head["refit"])
            W = model.head.weight.detach().float().cpu().numpy()
            preds = {}
            for s in SPLITS:
                with st.timed(f"predict_{s}"):
                    t0 = time.perf_counter()
                    top = (head_linear_topb(embs[s], W, linear[s], params.topb, trainer.device)
                           if report.scorer == "head+linear" else topb_from_emb(embs[s], W, params.topb, trainer.device))
                    preds[s] = (top, embs[s])
                    t_pred += time.perf_counter() - t0
            st.metric("valid_cluster_p_at_1", top1_precision(preds["valid"][0], M_valid))
            st.metric("valid_cluster_recall_at_b", report.matcher)
            for name, v in head.get("scorers", {}).items():
                st.metric(f"valid_cluster_recall_at_b_scorer_{name.replace('+', '_')}", v)
            for name, v in report.baselines.items():
                st.metric(f"valid_cluster_recall_at_b_{name}", v)
            st.log.info("guard: valid cluster recall@%d: matcher %.4f; %s", report.b, report.matcher,
                        ", ".join(f"{k} {v:.4f}" for k, v in report.baselines.items()))
            if report.union is not None:
                st.log.info("guard: with the linear tree's top-%d: recall %.4f (%.1f clusters per document) against the "
                            "tree alone with as many clusters %.4f", report.b, report.union, report.union_clusters,
                            report.linear_same_budget)
                st.metric("valid_cluster_recall_union", report.union)
                st.metric("valid_cluster_recall_linear_same_budget", report.linear_same_budget)
            io.write_json(out / GUARD, {**report.to_dict(), "head": head, "curve": curve.to_dict(),
                                               "allow_weak": params.allow_weak})
            st.output("guard", out / GUARD)
            plot_curve(out / CURVE, curve.points,
                       {"valid_cluster_recall_at_b": f"matcher recall@{report.b} (valid subset)",
                        "valid_cluster_p_at_1": "matcher P@1 (valid subset)"},
                       {f"{name} recall@{report.b}": v for name, v in report.baselines.items()},
                       ("final, all valid", report.matcher), f"matcher over K = {K} clusters", "valid cluster metric")
            st.output("curve", out / CURVE)
            enforce(None if report.passed else report.message(), params.allow_weak, "xtransformer.matcher", st.log)
            meta = {"format": FORMAT, "encoder": params.encoder, "encoder_path": str(encoders.resolve(params.encoder)),
                    "pooling": params.pooling, "last_k": model.encoder.last_k, "K": K, "dim": model.encoder.dim,
                    "max_length": width, "params": params.to_dict(), "train_steps": trainer.step,
                    "n_train": len(tokens["train"]), "device": str(trainer.device)}
            save_trained(st, out, model, "matcher.json", meta, FORMAT)
            for s in SPLITS:
                scores, emb = preds[s]
                io.save_arrays(out / f"emb_{s}.npz", emb=emb)
                io.save_csr(out / f"clusters_{s}.npz", scores)
                st.output(f"emb_{s}", out / f"emb_{s}.npz")
                st.output(f"clusters_{s}", out / f"clusters_{s}.npz")
            st.metric("predict_seq_per_s", n_pred / max(t_pred, 1e-9))
            st.online_cost(st.timings.get("predict_test", 0.0), len(tokens["test"]))   # encoder pass + top-b
        remove_checkpoints(ckpt_dir)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
