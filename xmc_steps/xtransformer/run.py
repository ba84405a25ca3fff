"""X-Transformer's matcher training run as its stage runs it (:mod:`xmc_steps.stages.matcher`), as ELIAS's is
:mod:`xmc_steps.elias.run` and LightXML's :mod:`xmc_steps.lightxml.run`: the inputs read and checked, the
matcher trained (:func:`.matcher.train_matcher`), the splits embedded, the head (re-fit, scorer) and the
guard (:func:`.matcher.finish_matcher`; :mod:`.guard` over the shared :mod:`xmc_steps.guard`), the top-b
clusters of every split (:func:`.matcher.embed_texts` and :func:`.matcher.top_clusters`, serving's too), the
model saved with its :class:`.matcher.PredictParams` and the curve drawn.

A stage reads::

    with stage_run("matcher", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = ...                                     # the stage's own parsing
        run_training(st, out, params, TrainingFiles(tokens_dir, labels_train, labels_valid, cluster_assign))
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import scipy.sparse as sp

from .. import encoders, io, neural
from ..curves import CurveLog, plot_curve
from ..errors import StageError
from ..guard import enforce
from ..layout import CURVE, GUARD, WEIGHTS
from ..neural_stage import load_tokens, record_training, remove_checkpoints, save_trained, training_device
from .guard import top1_precision
from .matcher import (FORMAT, PredictParams, cluster_targets, embed_texts, finish_matcher, load_cluster_assignment,
                      top_clusters, train_matcher)
from .params import MatcherParams

SPLITS = ("train", "valid", "test")
#: what a training run writes into its output folder (besides the stage's record)
OUTPUTS = (WEIGHTS, "matcher.json", GUARD, CURVE) + tuple(f"{k}_{s}.npz" for k in ("emb", "clusters") for s in SPLITS)


@dataclass
class TrainingFiles:
    """A matcher run's input files: the token folder (``tokens_{train,valid,test}.npz``), the label matrices,
    the label-to-cluster assignment (or a tree), and the linear tree's top clusters: of every split
    (``linear_clusters``: train, valid, test) or of the valid split only (``baseline_clusters``)."""

    tokens_dir: str | os.PathLike
    labels_train: str | os.PathLike
    labels_valid: str | os.PathLike
    cluster_assign: str | os.PathLike
    linear_clusters: Sequence[str] | None = None
    baseline_clusters: str | os.PathLike | None = None


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


def run_training(st, out: str | os.PathLike, params: MatcherParams, files: TrainingFiles) -> None:
    """Train the matcher into ``out`` (:data:`OUTPUTS`); ``st`` is the stage's context.  A matcher below the
    guard's baselines is a :class:`StageError` unless ``params.allow_weak``; the checkpoints
    (``out/checkpoints``) are removed once every output is written."""
    out = Path(out)
    st.params.clear()
    st.params.update(params.to_dict())
    with st.timed("load"):
        tokens = load_tokens(files.tokens_dir, SPLITS)
        Y_train, Y_valid = io.load_csr(files.labels_train), io.load_csr(files.labels_valid)
        C = load_cluster_assignment(files.cluster_assign)
        linear: dict[str, sp.csr_matrix] = {}
        given = dict(zip(SPLITS, files.linear_clusters)) if files.linear_clusters else (
            {"valid": files.baseline_clusters} if files.baseline_clusters else {})
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
        n_pred, t_pred = 0, 0.0
        embs = {}
        pp = PredictParams.of(params)           # the matcher's prediction, saved with it (serving's too)
        for s in ("valid", "train", "test"):
            # every rank embeds its share of the split's batches and rank 0 gathers them (neural_stage)
            with st.timed(f"predict_{s}"):
                embs[s], secs = embed_texts(model, tokens[s], pp, trainer.device, progress=st.log.info)
                t_pred += secs
                n_pred += len(tokens[s])
        if not trainer.is_main:      # with several processes rank 0 alone re-fits the head, checks and writes
            return
        st.metric("train_epochs", trainer.step * params.train.batch_size * params.train.grad_accum / max(len(tokens["train"]), 1))

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
                top = top_clusters(embs[s], W, pp.topb, report.scorer, linear.get(s), trainer.device)
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
                "max_length": width, "params": params.to_dict(), "predict": pp.to_dict(), "train_steps": trainer.step,
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
