"""ELIAS (Gupta et al., NeurIPS 2022) stage: train stage 1 or 2, predict (the method: :mod:`xmc_steps.elias`).

CLI::

    python -m xmc_steps.stages.elias train --stage 1 --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --tree tree.npz --out DIR1 --params JSON [common args]
    python -m xmc_steps.stages.elias train --stage 2 --init DIR1 --tokens-dir DIR --labels-train ... \\
        --labels-valid ... --out DIR2 --params JSON
    python -m xmc_steps.stages.elias predict --model DIR --tokens tokens_test.npz --out predictions.parquet \\
        --emb-out emb_test.npz [--shortlist-out shortlist_test.parquet] --params JSON

``train`` writes ``model.safetensors``, ``elias.json`` (format, stage, encoder, pooling,
C, L, kappa, alpha, beta, b, K, dim, wl_bias, fixed_edges, max_length, params, training
summary) and, in stage 1, ``clusters_train.npz`` (CSR N x C, the top-b ``s_c`` of each
training document: ``M`` of Eq. 9).  Checkpoints go to ``OUT/checkpoints`` and are removed
once every output is written.  ``predict`` writes the top-``topk`` (default 100) labels
by ``p`` (:func:`xmc_steps.io.write_predictions`), ``phi(x)`` (key ``emb``), optionally the
shortlist's top-``shortlist_topk`` (default ``topk``) labels by ``yhat``, and the metric
``predict_latency_ms_per_doc``: wall time of the batched encoder + index + classifier
pass divided by the number of documents (amortised over ``eval_batch_size`` batches).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import scipy.sparse as sp
import torch

from .. import encoders, io, neural
from ..curves import CurveLog, plot_curve
from ..elias.guard import check_stage, guard_width, index_candidates
from ..elias.model import (FORMAT, adjacency_from_assignment, build_model, cluster_topb, copy_stage1_weights,
                           init_adjacency, linear_start, load_elias, partition_start, predict, refit_heads,
                           shortlist_metrics)
from ..elias.params import EliasParams
from ..elias.train import train_elias
from ..errors import StageError
from ..layout import CURVE, GUARD, WEIGHTS
from ..neural_stage import (load_tokens, prediction_inputs, record_training, remove_checkpoints, save_trained,
                            stage_params, train_split_only, training_device)
from ..stage import add_neural_predict_args, add_neural_training_args, add_common_args, cli_main, stage_run
from ..trainer import digest, list_checkpoints

# --------------------------------------------------------------------------- CLI

def _check_tokens(params: EliasParams, tokens: Mapping[str, neural.TokenData]) -> int:
    return neural.check_tokens(params.encoder, tokens, params.max_length, "elias")


def _parse_params(st, args: argparse.Namespace, rule: str) -> EliasParams:
    return stage_params(st, EliasParams, rule, "elias")


def _linear_valid(args: argparse.Namespace, b: int, width: int, n_valid: int
                  ) -> tuple[sp.csr_matrix | None, sp.csr_matrix | None]:
    """The guard's linear tree (the train-split XR-Linear model over the same tree, a beam of ``b``
    clusters) on the valid split: its index candidates (:func:`xmc_steps.elias.guard.index_candidates`) and its top
    labels by its rankers, ``width`` of each; ``(None, None)`` without ``--linear-model``."""
    if not args.linear_model:
        return None, None
    from ..xr_linear import XRLinearModel

    try:
        model = XRLinearModel.load(args.linear_model)
        X = io.load_csr(args.tfidf_valid)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"the guard's linear tree {args.linear_model} / {args.tfidf_valid}: {e}") from e
    if X.shape[0] != n_valid:
        raise StageError(f"{args.tfidf_valid} has {X.shape[0]} rows but tokens_valid has {n_valid}")
    index = index_candidates(model.predict_clusters(X, beam=b), model.tree.assignment(-1), width)
    return index, model.predict(X, beam=b, topk=width)


def _check_memory(st, params: EliasParams, stage: int, n_train: int, L: int, C: int) -> None:
    """Refuse before allocating when the classifiers and their optimiser state (``W_L`` L x D, ``W_C``
    C x D, stage 2's ``A`` C x kappa: each with its gradient and Adam's moments), the least-squares
    start's buffers and the training split's embeddings would not fit (:func:`xmc_steps.resources.check_memory`)."""
    from ..encoders import resolve
    from ..linear_start import least_squares_bytes
    from ..resources import adam_state_bytes, check_memory, dense_bytes

    try:
        D = int(io.read_json(resolve(params.encoder) / "config.json")["hidden_size"])
    except (OSError, ValueError, KeyError):
        return                                          # the encoder's own loading says what is wrong
    need = adam_state_bytes(L * D) + adam_state_bytes(C * D) + dense_bytes(n_train, D)
    if stage == 2:
        need += adam_state_bytes(C * params.kappa) + dense_bytes(C, params.kappa, dtype=np.int64)
    elif params.head_init == "linear" or params.head_refit:
        need += least_squares_bytes(n_train, D, L, chunk=65536)
    check_memory(f"ELIAS stage {stage}: W_L ({L:,} x {D}), W_C ({C:,} x {D}) with their optimiser state and the "
                 f"training split's embeddings", need,
                 "elias.cluster.leaf_size (fewer clusters), a smaller encoder (elias.encoder), or a machine with more "
                 "memory (resources.elias_stage1.mem_mb)", st.log)


def _train_main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    stage = int(args.stage)
    names = [WEIGHTS, "elias.json", GUARD, "guard_recall.npz", CURVE] + (
        ["clusters_train.npz"] if stage == 1 else [])
    with stage_run(f"elias_stage{stage}", args, outputs=[str(out / n) for n in names]) as st:
        params = _parse_params(st, args, f"elias_stage{stage}")
        train_split_only(params.train, "ELIAS", " (ELIAS++'s ranker and its calibration need held-out validation documents)")
        with st.timed("load"):
            tokens = load_tokens(args.tokens_dir, ("train", "valid"))
            Y_train, Y_valid = io.load_csr(args.labels_train), io.load_csr(args.labels_valid)
            meta1 = None
            if stage == 1:
                if not args.tree:
                    raise StageError("stage 1 needs --tree")
                from ..cluster_tree import ClusterTree

                try:
                    tree = ClusterTree.load(args.tree)
                except (OSError, ValueError) as e:
                    raise StageError(f"--tree {args.tree}: {e}") from e
                L, C = tree.n_labels, tree.n_clusters
            else:
                if not args.init:
                    raise StageError("stage 2 needs --init (the stage-1 output folder)")
                init = Path(args.init)
                try:
                    meta1 = io.read_json(init / "elias.json")
                    M_train = io.load_csr(init / "clusters_train.npz")
                except OSError as e:
                    raise StageError(f"--init {init}: {e}") from e
                if meta1.get("format") != FORMAT or meta1.get("stage") != 1:
                    raise StageError(f"--init {init}: not a stage-1 ELIAS model")
                L, C = int(meta1["L"]), int(meta1["C"])
                # the encoder architecture is the stage-1 one
                for k in ("encoder", "pooling", "last_k"):
                    if k in st.params and st.params[k] != meta1[k]:
                        raise StageError(f"stage 2 {k} = {st.params[k]!r} differs from stage 1's {meta1[k]!r}")
                params = dataclasses.replace(params, encoder=meta1["encoder"], pooling=meta1["pooling"],
                                             last_k=meta1["last_k"])
        for name, Y in (("train", Y_train), ("valid", Y_valid)):
            if Y.shape[1] != L:
                src = "tree" if stage == 1 else "stage-1 model"
                raise StageError(f"Y_{name} has {Y.shape[1]} labels but the {src} has {L}")
            if Y.shape[0] != len(tokens[name]):
                raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
        if C < 2:
            raise StageError(f"ELIAS needs at least 2 clusters, got C = {C}")
        if stage == 2 and M_train.shape != (len(tokens["train"]), C):
            raise StageError(f"{args.init}/clusters_train.npz has shape {M_train.shape}, expected "
                             f"({len(tokens['train'])}, {C})")
        try:
            params = params.resolved(stage, len(tokens["train"]), L, C)
        except ValueError as e:
            raise StageError(str(e)) from e
        width = _check_tokens(params, tokens)
        if params.max_length is None:
            params.max_length = width
        st.params.clear()
        st.params.update(params.to_dict())
        st.params["stage"] = stage

        _check_memory(st, params, stage, len(tokens["train"]), L, C)
        extra_fp: dict[str, Any] = {"stage": stage}
        ckpt_dir = out / "checkpoints"
        try:
            if stage == 1:
                index, value = adjacency_from_assignment(tree.assignment(-1), C)
                model = build_model(params, C, L, index.shape[1], fixed_edges=True, pretrained=True)
                model.set_adjacency(index, value)
                extra_fp.update({k: getattr(params, k) for k in ("head_init", "head_init_l2", "head_init_scale")})
            else:
                with st.timed("init_adjacency"):
                    index, value = init_adjacency(M_train, Y_train, params.kappa, params.train.seed)
                model = build_model(params, C, L, params.kappa, fixed_edges=False, pretrained=False)
                stage1_index = copy_stage1_weights(model, Path(args.init))
                if params.a_init == "partition":
                    index, value = partition_start(index, stage1_index, params.a_init_mass)
                model.set_adjacency(index, value)
                extra_fp["init"] = digest(np.frombuffer(
                    (Path(args.init) / "elias.json").read_bytes(), dtype=np.uint8))
                extra_fp.update({"a_init": params.a_init, "a_init_mass": params.a_init_mass})
        except OSError as e:
            raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
        unreachable = model.unreachable_labels()
        st.metric("labels_unreachable", unreachable)
        st.log.info("elias stage %d: encoder %s (%s), C = %d, L = %d, kappa = %d, b = %d, K = %d, alpha %g, beta %g, "
                    "lambda %g, %d steps, %d train / %d valid documents, %d labels in no row of A",
                    stage, params.encoder, params.pooling, C, L, model.kappa, params.b, params.K, params.alpha,
                    params.beta, params.lambda_, params.train.steps, len(tokens["train"]), len(tokens["valid"]), unreachable)
        curve = CurveLog(ckpt_dir / "curve.json")
        log_step = st.step_logger({"loss": "train_loss"})

        def on_step(step: int, logs: dict[str, float]) -> None:
            log_step(step, logs)
            curve.add(step, logs, ("valid_shortlist_recall", "valid_p_at_1"))

        with training_device(st, params) as device:
            if stage == 1 and params.head_init == "linear" and not list_checkpoints(ckpt_dir):   # (a resumed run
                with st.timed("linear_start"):                                                  # has its weights)
                    emb = neural.embed(model.encoder, tokens["train"], params.eval_batch_size, device, params.amp,
                                       progress=st.log.info)
                    linear_start(model, emb, Y_train, params.head_init_l2, params.head_init_scale)
                st.log.info("linear start: W_C (%d x %d) and W_L (%d x %d) fit by least squares on the pre-trained "
                            "encoder's embeddings of %d training texts", C, model.dim, L, model.dim, len(emb))
            with st.timed("train"):
                trainer = train_elias(model, tokens["train"], Y_train, params, ckpt_dir, st.log, on_step,
                                      valid=(tokens["valid"], Y_valid), fingerprint=extra_fp)
            record_training(st, trainer)
            gw = guard_width(model.K, L)

            def valid_eval() -> tuple[dict[str, Any], dict[str, float]]:
                r = predict(model, tokens["valid"], topk=1, batch_size=params.eval_batch_size, device=trainer.device,
                            amp=params.amp, shortlist_topk=gw, with_emb=False, progress=st.log.info,
                            yhat_power=1.0)                # the trained p (§3.2), as the loss and the curve
                return r, shortlist_metrics(r["shortlist"], r["scores"], Y_valid)

            with st.timed("valid"):
                r, m = valid_eval()
            emb_train = None
            if stage == 1:      # the fine-tuned embeddings of the training texts: the re-fit and Eq. 9's M
                with st.timed("embed_train"):
                    emb_train = neural.embed(model.encoder, tokens["train"], params.eval_batch_size, trainer.device,
                                             params.amp, progress=st.log.info)
                if params.head_refit:
                    with st.timed("head_refit"):
                        (r, m), kept, evals = refit_heads(model, emb_train, Y_train, params.head_init_l2,
                                                          params.head_init_scale, valid_eval, (r, m),
                                                          params.head_refit_select)
                    st.log.info("head re-fit (%s): valid shortlist recall@%d / P@1 by (W_C, W_L): %s: keeping the "
                                "%s W_C and the %s W_L", params.head_refit_select, gw,
                                "; ".join(f"{c}, {l} {e[1]['shortlist_recall']:.4f} / {e[1]['p_at_1']:.4f}"
                                          for (c, l), e in evals.items()), kept["Wc"], kept["wl"])
                    for (c, l), e in evals.items():     # valid_*_trained_head, _refit_head, _refit_wc_trained_wl
                        c, l = c.replace("-", ""), l.replace("-", "")
                        name = f"{c}_head" if c == l else f"{c}_wc_{l}_wl"
                        st.metric(f"valid_shortlist_recall_{name}", e[1]["shortlist_recall"])
                        st.metric(f"valid_p_at_1_{name}", e[1]["p_at_1"])
            with st.timed("guard"):
                previous_rows = None
                if stage == 2:
                    try:
                        previous_rows = io.load_arrays(Path(args.init) / "guard_recall.npz")["recall"]
                    except (OSError, ValueError, KeyError) as e:
                        raise StageError(f"--init {args.init}: stage 1's guard_recall.npz: {e}") from e
                lin_index, lin_ranked = _linear_valid(args, params.b, gw, len(tokens["valid"]))
                try:
                    report, rows = check_stage(stage, r["shortlist"], Y_valid, Y_train, model.K, lin_index,
                                               previous_rows, m["p_at_1"], lin_ranked)
                except ValueError as e:
                    raise StageError(str(e)) from e
                previous = report.previous
            st.metric("valid_shortlist_recall", m["shortlist_recall"])
            st.metric("valid_p_at_1", m["p_at_1"])
            for name, v in report.baselines.items():
                st.metric(f"valid_shortlist_recall_{name}", v)
            for name, v in report.info.items():
                st.metric(f"valid_shortlist_recall_{name}", v)
            st.log.info("guard: valid shortlist recall@%d: stage %d %.4f; %s%s%s", gw, stage, report.shortlist,
                        ", ".join(f"{k} {v:.4f}" for k, v in report.baselines.items()),
                        "" if previous is None else f"; stage 1 {previous:.4f}",
                        "".join(f"; recorded: {k} {v:.4f}" for k, v in report.info.items()))
            io.save_arrays(out / "guard_recall.npz", recall=rows.astype(np.float32))
            io.write_json(out / GUARD, {**report.to_dict(), "curve": curve.to_dict(),
                                               "allow_weak": params.allow_weak})
            st.output("guard", out / GUARD)
            lines = {f"{k} recall@{gw}": v for k, v in report.baselines.items()}
            if previous is not None:
                lines[f"stage 1 recall@{gw}"] = previous
            plot_curve(out / CURVE, curve.points,
                       {"valid_shortlist_recall": f"shortlist recall@{gw} (valid subset)",
                        "valid_p_at_1": "P@1 (valid subset)"}, lines, ("final, all valid", report.shortlist),
                       f"ELIAS stage {stage}: C = {C}, L = {L}, b = {params.b}, K = {params.K}", "valid metric")
            st.output("curve", out / CURVE)
            if not report.passed:
                if not params.allow_weak:
                    raise StageError(report.message())
                st.log.warning("%s (continuing: elias.allow_weak is true)", report.message())
            meta = {"format": FORMAT, "stage": stage, "encoder": params.encoder,
                    "encoder_path": str(encoders.resolve(params.encoder)), "pooling": params.pooling,
                    "last_k": model.encoder.last_k, **model.describe(), "max_length": width, "params": params.to_dict(),
                    "train_steps": trainer.step, "n_train": len(tokens["train"]), "device": str(trainer.device),
                    "init": str(args.init) if stage == 2 else None, "labels_unreachable": unreachable,
                    "valid": m}
            save_trained(st, out, model, "elias.json", meta, FORMAT)
            if stage == 1:
                with st.timed("clusters_train"):
                    M = cluster_topb(model, emb_train, params.b)
                io.save_csr(out / "clusters_train.npz", M)
                st.output("clusters_train", out / "clusters_train.npz")
        remove_checkpoints(ckpt_dir)


def _predict_main(args: argparse.Namespace) -> None:
    outs = [args.out, args.emb_out] + ([args.shortlist_out] if args.shortlist_out else [])
    with stage_run("elias_predict", args, outputs=outs) as st:
        params = _parse_params(st, args, "elias_predict")
        meta, tokens, device = prediction_inputs(st, params, args.model, "elias.json", args.tokens)
        with st.timed("load"):
            model = load_elias(args.model, device)
        b = params.b if params.b is not None else model.b
        K = params.K if params.K is not None else model.K
        st.params.update({"b": b, "K": K, "topk": params.topk, "shortlist_topk": params.shortlist_topk or params.topk,
                          "yhat_power": params.yhat_power, "model": str(args.model), "stage": meta.get("stage")})
        with st.timed("predict"):
            r = predict(model, tokens, params.topk, b, K, params.eval_batch_size, device, params.amp,
                        params.shortlist_topk, with_emb=True, progress=st.log.info, yhat_power=params.yhat_power)
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], params.topk, r["seconds"])
        io.save_arrays(args.emb_out, emb=r["emb"])
        st.output("emb", args.emb_out)
        if args.shortlist_out:
            io.write_predictions(args.shortlist_out, r["shortlist"], params.shortlist_topk or params.topk)
            st.output("shortlist", args.shortlist_out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.elias", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train stage 1 or stage 2")
    t.add_argument("--stage", type=int, choices=(1, 2), required=True)
    add_neural_training_args(t, "stage 1: its finest level gives A")
    t.add_argument("--init", help="stage 2: the stage-1 output folder")
    t.add_argument("--linear-model", help="the guard's linear tree: XR-Linear over the same cluster tree, fit on "
                                          "the train split (without it the guard has the frequency baseline only)")
    t.add_argument("--tfidf-valid", help="X_valid (.npz CSR TF-IDF) for --linear-model")
    add_common_args(t)
    q = sub.add_parser("predict", help="top-k predictions, embeddings and shortlist of a trained model")
    add_neural_predict_args(q, "predictions Parquet (top-k labels by p)")
    q.add_argument("--emb-out", required=True, help="embeddings .npz (key emb)")
    q.add_argument("--shortlist-out", help="shortlist Parquet (labels by yhat)")
    add_common_args(q)
    args = p.parse_args(argv)
    if args.cmd == "train":
        _train_main(args)
    else:
        _predict_main(args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
