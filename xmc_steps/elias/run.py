"""ELIAS's training run as its stage runs it (:mod:`xmc_steps.stages.elias` ``train``), as LightXML's is
:mod:`xmc_steps.lightxml.run`: the inputs read and checked, the parameters fixed for them, the model built,
trained (:func:`.train.train_elias`), re-fit, validated by the guard (:mod:`xmc_steps.guard`), saved and drawn.

A stage reads::

    with stage_run(f"elias_stage{stage}", args, outputs=[str(out / n) for n in outputs(stage)]) as st:
        params = ...                                     # the stage's own parsing
        run_training(st, out, stage, params, TrainingFiles(tokens_dir, labels_train, labels_valid, tree=...))

``st`` is the stage's context (:func:`xmc_steps.stage.stage_run`): what it logs, times and records.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .. import encoders, io, neural
from ..curves import CurveLog, plot_curve
from ..errors import StageError
from ..guard import Advice, check_stage, enforce, guard_width, linear_tree_valid, message
from ..layout import CURVE, GUARD, WEIGHTS
from ..neural_stage import (curve_logger, load_tokens, record_training, remove_checkpoints, save_trained,
                            sharded_embed, training_device)
from ..trainer import digest, list_checkpoints
from .model import (FORMAT, adjacency_from_assignment, build_model, cluster_topb, copy_stage1_weights,
                    init_adjacency, linear_start, partition_start, predict, refit_heads, shortlist_metrics)
from .params import EliasParams
from .serve import saved_predict_params
from .train import train_elias


def outputs(stage: int) -> list[str]:
    """What a stage-``stage`` run writes into its output folder (besides the stage's record)."""
    return [WEIGHTS, "elias.json", GUARD, "guard_recall.npz", CURVE] + (
        ["clusters_train.npz"] if int(stage) == 1 else [])


@dataclass
class TrainingFiles:
    """A training run's input files: the token folder (``tokens_{train,valid}.npz``), the label matrices,
    stage 1's cluster tree or stage 2's stage-1 folder (``init``), and the guard's linear tree with the
    valid TF-IDF it searches (both or neither; without them the guard has the frequency baseline only)."""

    tokens_dir: str | os.PathLike
    labels_train: str | os.PathLike
    labels_valid: str | os.PathLike
    tree: str | os.PathLike | None = None
    init: str | os.PathLike | None = None
    linear_model: str | os.PathLike | None = None
    tfidf_valid: str | os.PathLike | None = None


def advice(stage: int) -> Advice:
    """What a failed ELIAS guard tells the user (:func:`xmc_steps.guard.failure_message`)."""
    key = f"elias.stage{stage}"
    return Advice(f"ELIAS stage {stage}",
                  f"Train it longer or from a better start ({key}.train.epochs, {key}.lr_clf, {key}.lr_encoder, "
                  + ("elias.head_init: linear" if stage == 1 else "elias.stage2.a_init: partition") + "), give the "
                  "index a wider beam or fewer clusters (elias.index.coverage, elias.index.b, elias.cluster.leaf_size)",
                  "elias", resumable=True)


def _check_tokens(params: EliasParams, tokens: Mapping[str, neural.TokenData]) -> int:
    return neural.check_tokens(params.encoder, tokens, params.max_length, "elias")


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



@dataclass
class TrainingData:
    """A stage's inputs, read and checked against each other: the token splits, the label matrices, ``L``
    and ``C``, stage 1's tree or stage 2's ``M`` (Eq. 9, stage 1's ``clusters_train.npz``)."""

    tokens: dict[str, neural.TokenData]
    Y_train: Any
    Y_valid: Any
    L: int
    C: int
    tree: Any = None
    M_train: Any = None


def load_training_data(st, stage: int, params: EliasParams, files: TrainingFiles
                       ) -> tuple[TrainingData, EliasParams]:
    """The inputs of a stage-``stage`` run (:class:`TrainingData`) and ``params`` with stage 2's encoder
    architecture taken from stage 1; anything missing or inconsistent is a :class:`StageError` naming it."""
    with st.timed("load"):
        tokens = load_tokens(files.tokens_dir, ("train", "valid"))
        Y_train, Y_valid = io.load_csr(files.labels_train), io.load_csr(files.labels_valid)
        tree = M_train = None
        if stage == 1:
            if not files.tree:
                raise StageError("stage 1 needs --tree")
            from ..cluster_tree import ClusterTree

            try:
                tree = ClusterTree.load(files.tree)
            except (OSError, ValueError) as e:
                raise StageError(f"--tree {files.tree}: {e}") from e
            L, C = tree.n_labels, tree.n_clusters
        else:
            if not files.init:
                raise StageError("stage 2 needs --init (the stage-1 output folder)")
            init = Path(files.init)
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
        raise StageError(f"{files.init}/clusters_train.npz has shape {M_train.shape}, expected "
                         f"({len(tokens['train'])}, {C})")
    return TrainingData(tokens, Y_train, Y_valid, L, C, tree, M_train), params


def _build(st, stage: int, params: EliasParams, data: TrainingData, init: str | os.PathLike | None):
    """The stage's model (stage 1: ``A`` from the tree's partition; stage 2: stage 1's weights, ``A`` from
    Eqs. 9-10 or the partition start) and what its checkpoints' fingerprint adds."""
    extra_fp: dict[str, Any] = {"stage": stage}
    tree, M_train, Y_train, L, C = data.tree, data.M_train, data.Y_train, data.L, data.C
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
            stage1_index = copy_stage1_weights(model, Path(init))
            if params.a_init == "partition":
                index, value = partition_start(index, stage1_index, params.a_init_mass)
            model.set_adjacency(index, value)
            extra_fp["init"] = digest(np.frombuffer(
                (Path(init) / "elias.json").read_bytes(), dtype=np.uint8))
            extra_fp.update({"a_init": params.a_init, "a_init_mass": params.a_init_mass})
    except OSError as e:
        raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
    return model, extra_fp


def _guard(st, out: Path, stage: int, params: EliasParams, files: TrainingFiles, model, r: Mapping[str, Any],
           m: Mapping[str, float], data: TrainingData, curve: CurveLog, gw: int) -> None:
    """The guard (:func:`xmc_steps.guard.check_stage`: the valid shortlist against the trivial indexes and, in
    stage 2, stage 1), its metrics, ``guard.json``, ``guard_recall.npz`` and the curve; a stage that failed it
    is a :class:`StageError` unless ``params.allow_weak``."""
    tokens, Y_train, Y_valid, L, C = data.tokens, data.Y_train, data.Y_valid, data.L, data.C
    with st.timed("guard"):
        previous_rows = None
        if stage == 2:
            try:
                previous_rows = io.load_arrays(Path(files.init) / "guard_recall.npz")["recall"]
            except (OSError, ValueError, KeyError) as e:
                raise StageError(f"--init {files.init}: stage 1's guard_recall.npz: {e}") from e
        lin_index = lin_ranked = None
        if files.linear_model:
            lin_index, lin_ranked, _ = linear_tree_valid(files.linear_model, files.tfidf_valid, gw,
                                                         len(tokens["valid"]), beam=params.b)
        try:
            report, rows = check_stage(stage, r["shortlist"], Y_valid, Y_train, model.K, lin_index,
                                       previous_rows, m["p_at_1"], lin_ranked, advice(stage))
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
    io.write_json(out / GUARD, {**report.to_dict(), "curve": curve.to_dict(), "allow_weak": params.allow_weak})
    st.output("guard", out / GUARD)
    lines = {f"{k} recall@{gw}": v for k, v in report.baselines.items()}
    if previous is not None:
        lines[f"stage 1 recall@{gw}"] = previous
    plot_curve(out / CURVE, curve.points,
               {"valid_shortlist_recall": f"shortlist recall@{gw} (valid subset)",
                "valid_p_at_1": "P@1 (valid subset)"}, lines, ("final, all valid", report.shortlist),
               f"ELIAS stage {stage}: C = {C}, L = {L}, b = {params.b}, K = {params.K}", "valid metric")
    st.output("curve", out / CURVE)
    enforce(message(report), params.allow_weak, "elias", st.log)


def run_training(st, out: str | os.PathLike, stage: int, params: EliasParams, files: TrainingFiles) -> None:
    """Train ELIAS stage ``stage`` into ``out`` (:func:`outputs`): the inputs read and checked, the
    parameters resolved for them, the model built (stage 1: ``A`` from the tree; stage 2: from stage 1,
    Eqs. 9-10), its linear start, training, stage 1's head re-fit, the guard (:mod:`xmc_steps.guard`;
    a :class:`StageError` unless ``params.allow_weak``), the model saved with its prediction parameters
    (:func:`xmc_steps.elias.serve.saved_predict_params`), the curve and, in stage 1, Eq. 9's ``M``.
    ``st`` is the stage's context; the checkpoints (``out/checkpoints``) are removed once every output
    is written."""
    out = Path(out)
    stage = int(stage)
    data, params = load_training_data(st, stage, params, files)
    tokens, Y_train, Y_valid, L, C = data.tokens, data.Y_train, data.Y_valid, data.L, data.C
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
    model, extra_fp = _build(st, stage, params, data, files.init)
    ckpt_dir = out / "checkpoints"
    unreachable = model.unreachable_labels()
    st.metric("labels_unreachable", unreachable)
    st.log.info("elias stage %d: encoder %s (%s), C = %d, L = %d, kappa = %d, b = %d, K = %d, alpha %g, beta %g, "
                "lambda %g, %d steps, %d train / %d valid documents, %d labels in no row of A",
                stage, params.encoder, params.pooling, C, L, model.kappa, params.b, params.K, params.alpha,
                params.beta, params.lambda_, params.train.steps, len(tokens["train"]), len(tokens["valid"]), unreachable)
    curve, on_step = curve_logger(st, ckpt_dir, ("valid_shortlist_recall", "valid_p_at_1"))

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
        emb_train = None
        if stage == 1:      # the fine-tuned embeddings of the training texts: the re-fit and Eq. 9's M
            with st.timed("embed_train"):      # every rank its share of the batches, gathered on rank 0
                emb_train, _ = sharded_embed(model.encoder, tokens["train"], params.eval_batch_size, trainer.device,
                                             params.amp, progress=st.log.info)
        if not trainer.is_main:      # with several processes rank 0 alone validates, checks and writes
            return
        gw = guard_width(model.K, L)

        def valid_eval() -> tuple[dict[str, Any], dict[str, float]]:
            r = predict(model, tokens["valid"], topk=1, batch_size=params.eval_batch_size, device=trainer.device,
                        amp=params.amp, shortlist_topk=gw, with_emb=False, progress=st.log.info,
                        yhat_power=1.0)                # the trained p (§3.2), as the loss and the curve
            return r, shortlist_metrics(r["shortlist"], r["scores"], Y_valid)

        with st.timed("valid"):
            r, m = valid_eval()
        if stage == 1:
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
        _guard(st, out, stage, params, files, model, r, m, data, curve, gw)
        meta = {"format": FORMAT, "stage": stage, "encoder": params.encoder,
                "encoder_path": str(encoders.resolve(params.encoder)), "pooling": params.pooling,
                "last_k": model.encoder.last_k, **model.describe(), "max_length": width, "params": params.to_dict(),
                "train_steps": trainer.step, "n_train": len(tokens["train"]), "device": str(trainer.device),
                "init": str(files.init) if stage == 2 else None, "labels_unreachable": unreachable,
                "valid": m, "predict": saved_predict_params(params, model).to_dict()}
        save_trained(st, out, model, "elias.json", meta, FORMAT)
        if stage == 1:
            with st.timed("clusters_train"):
                M = cluster_topb(model, emb_train, params.b)
            io.save_csr(out / "clusters_train.npz", M)
            st.output("clusters_train", out / "clusters_train.npz")
    remove_checkpoints(ckpt_dir)
