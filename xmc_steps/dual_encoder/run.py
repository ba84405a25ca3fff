"""The dual encoder's training run as its stage runs it (:mod:`xmc_steps.stages.dual_encoder` ``train``), as
ELIAS's is :mod:`xmc_steps.elias.run` and LightXML's :mod:`xmc_steps.lightxml.run`: the inputs read and
checked, the parameters fixed for them, the label texts tokenized, the model built and trained
(:func:`.train.train_dual_encoder`), the label index built, the guard (:mod:`xmc_steps.guard`), the model
saved (with its prediction parameters) and the curve drawn.

A stage reads::

    with stage_run("dual_encoder_train", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = ...                                     # the stage's own parsing
        run_training(st, out, params, TrainingFiles(tokens_dir, labels_train, labels_valid, label_table))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import encoders, io, neural
from ..curves import plot_curve
from ..errors import StageError
from ..guard import check, enforce, guard_width, linear_tree_valid, message, report_dict
from ..layout import CURVE, GUARD, WEIGHTS
from ..neural_stage import (curve_logger, load_tokens, record_training, remove_checkpoints, sharded_embed,
                            training_device)
from .model import JSON, LABEL_EMB, LABEL_INDEX, build_label_index, build_model, label_tokens, save_dual_encoder
from .params import DualEncoderParams
from .serve import PredictParams
from .train import GUARD_ADVICE, frequency_prior, train_dual_encoder, valid_metrics

#: what a training run writes into its output folder (besides the stage's record)
OUTPUTS = (WEIGHTS, JSON, LABEL_EMB, LABEL_INDEX, GUARD, CURVE)


@dataclass
class TrainingFiles:
    """A training run's input files: the token folder (``tokens_{train,valid}.npz``), the label matrices, the
    label table (the label texts) and the guard's linear tree with the valid TF-IDF it searches (both or
    neither; without them the guard has the frequency baseline only)."""

    tokens_dir: str | os.PathLike
    labels_train: str | os.PathLike
    labels_valid: str | os.PathLike
    label_table: str | os.PathLike
    linear_model: str | os.PathLike | None = None
    tfidf_valid: str | os.PathLike | None = None


def _label_texts(path: str, L: int, log) -> list[str]:
    try:
        table = io.read_table(path, ["label_id", "label_text"])
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"--label-table {path}: {e}") from e
    ids = [str(x) for x in table.column("label_id").to_pylist()]
    texts = [str(t) for t in table.column("label_text").to_pylist()]
    if len(texts) != L:
        raise StageError(f"--label-table {path} has {len(texts)} labels but Y_train has {L}")
    same = sum(a == b for a, b in zip(ids, texts))
    if same == L and L:
        log.warning("dual_encoder: no label has a text besides its id (the dataset came without label texts): "
                    "the label ids are encoded as the label texts")
    return texts


def _check_memory(st, params: DualEncoderParams, n_train: int, L: int) -> None:
    """Refuse before training when the host arrays the run holds in proportion to N and L would not fit: the
    training texts' embeddings (NGAME's clustering), the label embeddings (the kept fp16 copy, the index, the
    validation's) and the search's scores (:func:`xmc_steps.resources.check_memory`)."""
    from ..resources import check_memory, dense_bytes

    try:
        D = int(io.read_json(encoders.resolve(params.encoder) / "config.json")["hidden_size"])
    except (OSError, ValueError, KeyError):
        return                                           # the encoder's own loading says what is wrong
    need = dense_bytes(n_train, D) + 3 * dense_bytes(L, D) + dense_bytes(L, D, dtype=np.float16)
    check_memory(f"the dual encoder's embeddings ({n_train:,} training texts, {L:,} labels, width {D})", need,
                 "a smaller encoder (dual_encoder.encoder) or a machine with more memory "
                 "(resources.dual_encoder_train.mem_mb)", st.log)


def run_training(st, out: str | os.PathLike, params: DualEncoderParams, files: TrainingFiles) -> None:
    """Train the dual encoder into ``out`` (:data:`OUTPUTS`); ``st`` is the stage's context.  A model below
    the guard's baselines is a :class:`StageError` unless ``params.allow_weak``; the checkpoints
    (``out/checkpoints``) are removed once every output is written."""
    out = Path(out)
    if bool(files.linear_model) != bool(files.tfidf_valid):
        raise StageError("--linear-model and --tfidf-valid go together (the guard's linear tree on the valid "
                         "split)")
    with st.timed("load"):
        tokens = load_tokens(files.tokens_dir, ("train", "valid"))
        try:
            Y_train, Y_valid = io.load_csr(files.labels_train), io.load_csr(files.labels_valid)
        except (OSError, ValueError) as e:
            raise StageError(f"labels: {e}") from e
        L = Y_train.shape[1]
        texts = _label_texts(files.label_table, L, st.log)
    for name, Y in (("train", Y_train), ("valid", Y_valid)):
        if Y.shape[1] != L:
            raise StageError(f"Y_{name} has {Y.shape[1]} labels but Y_train has {L}")
        if Y.shape[0] != len(tokens[name]):
            raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
    n = len(tokens["train"])
    try:
        params = params.resolved(n, L)
    except ValueError as e:
        raise StageError(str(e)) from e
    width = neural.check_tokens(params.encoder, tokens, params.max_length, "dual_encoder")
    if params.max_length is None:
        params.max_length = width
    limit = encoders.max_positions(params.encoder)
    if limit is not None and params.label_max_length > limit:
        raise StageError(f"dual_encoder.label_max_length = {params.label_max_length} exceeds the {limit} positions "
                         f"of encoder '{params.encoder}'")
    st.params.clear()
    st.params.update(params.to_dict())
    _check_memory(st, params, n, L)
    with st.timed("label_tokens"):
        ltok = label_tokens(texts, params.encoder, params.label_max_length)
    st.metric("label_tokens_mean", float(np.mean(ltok.lengths)) if L else 0.0)
    try:
        model = build_model(params, pretrained=True)
    except OSError as e:
        raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
    w = guard_width(params.topk, L)
    st.log.info("dual_encoder: encoder %s (%s pooling, dim %d), %s loss (temperature %g%s), %s batches%s, %s, "
                "%d steps (batch %d, lr %g), label texts of <= %d tokens (mean %.1f), L = %d, %d train / %d valid "
                "texts; the guard at recall@%d", params.encoder, params.pooling, model.dim, params.loss,
                params.temperature, f", margin {params.margin}" if params.loss == "triplet" else "",
                params.batching,
                f" (clusters of <= {params.cluster_size}, re-clustered every {params.refresh_every} epochs)"
                if params.batching == "ngame" else "",
                f"{params.hard_negatives} mined negatives per text from its {params.mine_depth} nearest labels "
                f"(labels re-encoded every {params.label_refresh_every:g} epochs)" if params.hard_negatives
                else "in-batch negatives only", params.train.steps, params.train.batch_size, params.train.lr,
                params.label_max_length, float(np.mean(ltok.lengths)) if L else 0.0, L, n, len(tokens["valid"]), w)
    ckpt_dir = out / "checkpoints"
    curve, on_step = curve_logger(st, ckpt_dir, ("valid_recall", "valid_p_at_1"))

    with training_device(st, params) as device:
        with st.timed("train"):
            trainer = train_dual_encoder(model, tokens["train"], Y_train, ltok, params, ckpt_dir, w, st.log,
                                         on_step, valid=(tokens["valid"], Y_valid))
        record_training(st, trainer)
        with st.timed("label_emb"):     # every rank encodes its share of the label texts, gathered on rank 0
            label_emb, _ = sharded_embed(model, ltok, params.eval_batch_size, trainer.device, params.amp, st.log.info)
        if not trainer.is_main:      # with several processes rank 0 alone validates, checks and writes
            return
        with st.timed("label_emb"):
            index = build_label_index(label_emb, params.search, params.exact_max_labels, params.train.seed)
        st.extra["label_index"] = index.kind
        with st.timed("valid"):
            m, top = valid_metrics(model, tokens["valid"], Y_valid, None, params, w, trainer.device,
                                   st.log.info, index=index)
        prior = frequency_prior(Y_train, Y_valid, w)
        with st.timed("guard"):
            lin_index = lin_ranked = beam = None
            if files.linear_model:
                lin_index, lin_ranked, beam = linear_tree_valid(files.linear_model, files.tfidf_valid, w,
                                                                len(tokens["valid"]))
            try:
                report, _ = check(top, Y_valid, Y_train, params.topk, lin_index, lin_ranked, m["p_at_1"],
                                  advice=GUARD_ADVICE)
            except ValueError as e:
                raise StageError(str(e)) from e
        for k, v in m.items():
            st.metric(f"valid_{k}", v)
        for k, v in prior.items():
            st.metric(f"valid_prior_{k}", v)
        for k, v in {**report.baselines, **report.info}.items():
            st.metric(f"valid_recall_{k}", v)
        start = trainer.start_valid
        if start is not None:
            st.metric("valid_start_recall", start["recall"])
            st.metric("valid_start_p_at_1", start["p_at_1"])
        st.log.info("guard: valid recall@%d %.4f (P@1 %.4f, P@5 %.4f); %s%s%s", w, report.shortlist, m["p_at_1"],
                    m["p_at_5"],
                    ", ".join(f"{k} {v:.4f}" for k, v in report.baselines.items()),
                    "".join(f"; recorded: {k} {v:.4f}" for k, v in report.info.items()),
                    "" if start is None else f"; the pre-trained start {start['recall']:.4f} (valid subset)")
        io.write_json(out / GUARD, report_dict(report, recall_at=w, linear_beam=beam, start=start,
                                               allow_weak=params.allow_weak, curve=curve.to_dict()))
        st.output("guard", out / GUARD)
        lines = {f"{k} recall@{w}": v for k, v in report.baselines.items()}
        plot_curve(out / CURVE, curve.points, {"valid_recall": f"recall@{w} (valid subset)",
                                               "valid_p_at_1": "P@1 (valid subset)"},
                   lines, ("final, all valid", report.shortlist),
                   f"dual encoder ({params.loss}, {params.batching}): L = {L}", "valid metric")
        st.output("curve", out / CURVE)
        enforce(message(report), params.allow_weak, "dual_encoder", st.log)
        meta = {"encoder": params.encoder, "max_length": width, "label_max_length": params.label_max_length,
                "params": params.to_dict(), "train_steps": trainer.step, "n_train": n, "device": str(device),
                "valid": m, "valid_prior": prior, "valid_start": start, "guard": report_dict(report),
                "predict": PredictParams.of(params).to_dict()}
        save_dual_encoder(st, out, model, label_emb, {**meta, "label_index": index.kind}, index)
    remove_checkpoints(ckpt_dir)
