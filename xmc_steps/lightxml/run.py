"""A LightXML network's training run as a stage runs it (:mod:`xmc_steps.stages.lightxml` and, with its
guide network, :mod:`xmc_steps.stages.gudn`): the inputs read and checked, the parameters fixed for
them, then the model built, trained (:func:`.train.train_lightxml`), validated against the frequency
prior and its own linear start (:func:`xmc_steps.guard.prior_check`), saved and drawn.

A stage reads::

    with stage_run(...) as st:
        params = ...                                     # the stage's own parsing
        with st.timed("load"):
            data = load_training_data(tokens_dir, labels_train, labels_valid, tree, params.flat_max_labels)
        params, width = fit_params(params, data)
        ...                                              # the stage's record of its parameters, a guide
        run_training(st, out, params, data, width, guide=guide, method="gudn", config_section="gudn.backbone")

``st`` is the stage's context (:func:`xmc_steps.stage.stage_run`): what it logs, times and records.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import scipy.sparse as sp

from .. import encoders, io, neural, resources
from ..curves import plot_curve
from ..errors import StageError
from ..layout import CURVE, WEIGHTS
from ..guard import enforce, frequency_prior, prior_check
from ..neural_stage import (load_tokens, record_training, remove_checkpoints, save_trained, sharded_embed,
                            training_device)
from .model import FORMAT, build_model
from .params import LightXMLParams
from .serve import PredictParams
from .train import Guide, memory_bytes, refit_generator, train_lightxml, valid_metrics

#: what a training run writes into its output folder (besides the stage's record)
OUTPUTS = (WEIGHTS, "lightxml.json", CURVE)


@dataclass
class TrainingData:
    """A training run's inputs: the train and valid token splits and labels, and the clusters
    (``cluster_of``: each label's cluster, ``None`` for a flat model with one label per cluster)."""

    tokens: dict[str, neural.TokenData]
    Y_train: sp.csr_matrix
    Y_valid: sp.csr_matrix
    cluster_of: np.ndarray | None
    K: int

    @property
    def L(self) -> int:
        return self.Y_train.shape[1]


def load_training_data(tokens_dir: str | os.PathLike, labels_train: str | os.PathLike,
                       labels_valid: str | os.PathLike, tree: str | os.PathLike | None,
                       flat_max_labels: int, fit_valid: bool = False) -> TrainingData:
    """``tokens_{train,valid}.npz`` of ``tokens_dir``, the label matrices and, when the label set is
    larger than ``flat_max_labels``, the clusters of the finest level of ``tree``; the shapes checked
    against each other.  Anything missing or inconsistent is a :class:`StageError` naming it.
    ``fit_valid`` (``train.fit_valid``): the training split is train + valid, every training document
    (the valid split stays the validation documents, now also trained on)."""
    tokens = load_tokens(tokens_dir, ("train", "valid"))
    try:
        Y_train, Y_valid = io.load_csr(labels_train), io.load_csr(labels_valid)
    except (OSError, ValueError) as e:
        raise StageError(f"labels: {e}") from e
    L = Y_train.shape[1]
    cluster_of, K = None, L
    if L > flat_max_labels:
        if not tree:
            raise StageError(f"{L} labels > flat_max_labels = {flat_max_labels}: the clustered "
                             "mode needs --tree")
        from ..cluster_tree import ClusterTree

        try:
            t = ClusterTree.load(tree)
        except (OSError, ValueError) as e:
            raise StageError(f"--tree {tree}: {e}") from e
        if t.n_labels != L:
            raise StageError(f"--tree {tree} has {t.n_labels} labels but Y_train has {L}")
        cluster_of, K = t.assignment(-1), t.n_clusters
    for name, Y in (("train", Y_train), ("valid", Y_valid)):
        if Y.shape[1] != L:
            raise StageError(f"Y_{name} has {Y.shape[1]} labels but Y_train has {L}")
        if Y.shape[0] != len(tokens[name]):
            raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
    if fit_valid:
        tokens = {**tokens, "train": neural.TokenData(
            np.concatenate([tokens["train"].input_ids, tokens["valid"].input_ids]),
            np.concatenate([tokens["train"].lengths, tokens["valid"].lengths]))}
        Y_train = sp.vstack([Y_train, Y_valid], format="csr")
    return TrainingData(tokens, Y_train, Y_valid, cluster_of, K)


def fit_params(params: LightXMLParams, data: TrainingData, config_section: str = "lightxml"
               ) -> tuple[LightXMLParams, int]:
    """``params`` resolved for the training split (:meth:`LightXMLParams.resolved`) with ``max_length``
    set to the token files' width when unset, and that width (checked against the encoder);
    ``config_section`` is the settings the errors name (``gudn.backbone`` for GUDN's network)."""
    try:
        params = params.resolved(len(data.tokens["train"]))
    except ValueError as e:
        raise StageError(str(e)) from e
    width = neural.check_tokens(params.encoder, data.tokens, params.max_length, config_section)
    if params.max_length is None:
        params.max_length = width
    return params, width


def run_training(st, out: str | os.PathLike, params: LightXMLParams, data: TrainingData, width: int,
                 guide: Guide | None = None, method: str = "lightxml", config_section: str = "lightxml") -> None:
    """Build, train, validate and save a LightXML network into ``out`` (:data:`OUTPUTS`), with
    ``guide``'s loss added at every step when given (:class:`.train.Guide`; its ``describe()`` goes
    into ``lightxml.json``).  ``params`` as :func:`fit_params` gives them; ``method`` names the model
    and ``config_section`` its settings in every message (the guard's, the errors': ``gudn.backbone`` for
    GUDN).  A model that fails the guard is a
    :class:`StageError` unless ``params.allow_weak``.  The checkpoints (``out/checkpoints``) are removed
    once every output is written."""
    out = Path(out)
    tokens, Y_train, Y_valid, L, K = data.tokens, data.Y_train, data.Y_valid, data.L, data.K
    try:
        model = build_model(params, L, data.cluster_of, K, pretrained=True)
    except OSError as e:
        raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
    except ValueError as e:   # e.g. last_k beyond the encoder's layers
        raise StageError(f"encoder '{params.encoder}': {e} ({config_section}.last_k)") from e
    resources.check_memory(f"LightXML's heads for L = {L:,} labels in {model.n_clusters:,} clusters (training state, "
                           "least-squares starts)", memory_bytes(model, len(tokens["train"]), params.train.batch_size),
                           f"{config_section}.hidden (the L x hidden label embeddings), {config_section}.flat_max_labels "
                           f"or {config_section}.cluster.leaf_size (the generator's clusters)", st.log)
    if params.negatives == "static" and model.flat:
        raise StageError(f"static negatives need label clusters, but {L} labels <= flat_max_labels = "
                         f"{params.flat_max_labels} give one label per cluster (every label scored, no negatives "
                         f"drawn): set {config_section}.flat_max_labels below the label count for a clustered comparison")
    swa_first, swa_every = params.swa_schedule(len(tokens["train"]))
    st.log.info("lightxml: encoder %s ([CLS] of the last %d layers, dropout %g), L = %d, %s, %s negatives, %d steps "
                "(batch %d, lr %g, %s), weight average from step %d every %d, %d train / %d valid documents",
                params.encoder, params.last_k, params.dropout, L,
                "one label per cluster (generator only)" if model.flat else
                f"K = {K} clusters of <= {model.cluster_labels.shape[1]} labels, top-{model.topb}, hidden {model.hidden}",
                params.negatives if params.negatives == "dynamic" else f"static (drawn after step {params.static_step()})",
                params.train.steps, params.train.batch_size, params.train.lr, params.train.schedule,
                swa_first, swa_every, len(tokens["train"]), len(tokens["valid"]))
    curve: dict[int, float] = {}
    log_step = st.step_logger({"loss": "train_loss"})

    def on_step(step: int, logs: Mapping[str, float]) -> None:
        if "valid_p_at_1" in logs:
            curve[step] = logs["valid_p_at_1"]
        log_step(step, dict(logs))

    ckpt_dir = out / "checkpoints"
    with training_device(st, params):
        with st.timed("train"):
            trainer = train_lightxml(model, tokens["train"], Y_train, params, ckpt_dir, st.log, on_step,
                                     valid=(tokens["valid"], Y_valid), guide=guide)
        record_training(st, trainer)
        head = emb_train = None
        if params.head_refit:   # the fine-tuned encoder's representations of the training texts: every rank
            with st.timed("head_refit"):        # its share of the batches, gathered on rank 0
                emb_train, _ = sharded_embed(model.encoder, tokens["train"], params.eval_batch_size, trainer.device,
                                             params.amp, progress=st.log.info)
        if not trainer.is_main:      # with several processes rank 0 alone validates, checks and writes
            return
        if params.head_refit:
            with st.timed("head_refit"):
                head = refit_generator(model, tokens["train"], Y_train, (tokens["valid"], Y_valid), params,
                                       trainer.device, st.log, emb=emb_train)
            st.metric("valid_p_at_1_trained_generator", head["trained"])
            st.metric("valid_p_at_1_refit_generator", head["refit"])
            if "refit_discriminator" in head:
                st.metric("valid_p_at_1_refit_discriminator", head["refit_discriminator"])
        if head is not None:    # the kept generator's valid metrics, computed by the re-fit
            m = head.pop("metrics")
        else:
            with st.timed("valid"):
                m = valid_metrics(model, tokens["valid"], Y_valid, params, trainer.device, progress=st.log.info)
        prior = frequency_prior(Y_train, Y_valid, params.topk)
        for k, v in m.items():
            st.metric(f"valid_{k}", v)
        for k, v in prior.items():
            st.metric(f"valid_prior_{k}", v)
        start = getattr(trainer, "start_valid", None)
        if start is not None:
            st.metric("valid_start_p_at_1", start["p_at_1"])
            st.metric("valid_start_p_at_5", start["p_at_5"])
        msg, verdict = prior_check(method, m, prior, start, trainer.step, config_section)
        enforce(msg, params.allow_weak, config_section, st.log)
        if msg is None:
            st.log.info("%s: %s", method, verdict)
        meta = {"format": FORMAT, "encoder": params.encoder, "encoder_path": str(encoders.resolve(params.encoder)),
                "pooling": "cls-concat-last-k", "last_k": params.last_k, **model.describe(), "max_length": width,
                "params": params.to_dict(), "train_steps": trainer.step, "n_train": len(tokens["train"]),
                "device": str(trainer.device), "valid": m, "valid_prior": prior, "valid_start": start,
                "generator": head or {"kept": "trained"}, "predict": PredictParams.of(params).to_dict(),
                **(guide.describe() if guide is not None else {})}
        save_trained(st, out, model, "lightxml.json", meta, FORMAT)
        plot_curve(out / CURVE, {k: {"valid_p_at_1": v} for k, v in curve.items()},
                   {"valid_p_at_1": "P@1 (valid subset, current weights)"},
                   {"frequency prior": prior["p_at_1"]}, ("final model, all valid", m["p_at_1"]), "LightXML",
                   "valid P@1")
        st.output("curve", out / CURVE)
    remove_checkpoints(ckpt_dir)
