"""LightXML (Jiang et al., AAAI 2021) stage: train, predict (:mod:`xmc_steps.lightxml`).

CLI::

    python -m xmc_steps.lightxml train --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --tree tree.npz --out DIR --params JSON [common args]
    python -m xmc_steps.lightxml predict --model DIR --tokens tokens_test.npz --out predictions.parquet \\
        --params JSON [common args]

``train`` writes ``model.safetensors``, ``lightxml.json`` (format, encoder, L, K, flat, the
parameters, the validation figures next to the frequency prior's), ``curve.png`` (valid P@1 over the
steps, the prior as a line).  The clusters are the finest level of ``--tree`` unless the label
set is small (``L <= flat_max_labels``: one label per cluster, the tree is not used).  The stage
fails when the model's valid P@1 is not above the frequency prior's (``allow_weak: true`` makes
that a warning).  Checkpoints go to ``OUT/checkpoints`` and are removed once every output is
written.  ``predict`` writes the top-``topk`` (default 100) labels by ``p``
(:func:`xmc_steps.io.write_predictions`) and ``predict_latency_ms_per_doc``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import encoders, io, neural, resources
from ..curves import plot_curve
from ..neural_stage import (load_tokens, prediction_inputs, record_training, remove_checkpoints, save_trained,
                            stage_params, training_device)
from ..stage import StageError, add_common_args, stage_run
from .model import FORMAT, build_model, load_lightxml, predict
from .params import LightXMLParams
from .train import Guide, frequency_prior, memory_bytes, refit_generator, train_lightxml, valid_metrics


def _parse_params(st, args: argparse.Namespace, rule: str) -> LightXMLParams:
    return stage_params(st, LightXMLParams, rule, "lightxml")


#: ``setup(st, params, Y_train) -> (guide, label_tokens, description)``: what a method that trains the
#: LightXML network with an extra loss adds (:mod:`xmc_steps.gudn`); the description goes into the
#: model's ``lightxml.json``
GuideSetup = Callable[[Any, LightXMLParams, Any], tuple[Guide, neural.TokenData, dict[str, Any]]]


def _train_main(args: argparse.Namespace) -> None:
    run_train(args, "lightxml_train", lambda st: _parse_params(st, args, "lightxml_train"))


def run_train(args: argparse.Namespace, stage: str, parse: Callable[[Any], LightXMLParams],
              guide_setup: GuideSetup | None = None, config_section: str = "lightxml") -> None:
    """The training stage of a LightXML network (``train`` of this CLI and of :mod:`xmc_steps.gudn`):
    ``parse(st)`` gives the backbone's parameters; ``guide_setup`` an extra loss (see
    :data:`GuideSetup`); ``config_section`` names the settings in the guard's message."""
    out = Path(args.out)
    names = ["model.safetensors", "lightxml.json", "curve.png"]
    with stage_run(stage, args, outputs=[str(out / n) for n in names]) as st:
        params = parse(st)
        with st.timed("load"):
            tokens = load_tokens(args.tokens_dir, ("train", "valid"))
            try:
                Y_train, Y_valid = io.load_csr(args.labels_train), io.load_csr(args.labels_valid)
            except (OSError, ValueError) as e:
                raise StageError(f"labels: {e}") from e
            L = Y_train.shape[1]
            cluster_of, K = None, L
            if L > params.flat_max_labels:
                if not args.tree:
                    raise StageError(f"{L} labels > flat_max_labels = {params.flat_max_labels}: the clustered "
                                     "mode needs --tree")
                from ..cluster_tree import ClusterTree

                try:
                    tree = ClusterTree.load(args.tree)
                except (OSError, ValueError) as e:
                    raise StageError(f"--tree {args.tree}: {e}") from e
                if tree.n_labels != L:
                    raise StageError(f"--tree {args.tree} has {tree.n_labels} labels but Y_train has {L}")
                cluster_of, K = tree.assignment(-1), tree.n_clusters
        for name, Y in (("train", Y_train), ("valid", Y_valid)):
            if Y.shape[1] != L:
                raise StageError(f"Y_{name} has {Y.shape[1]} labels but Y_train has {L}")
            if Y.shape[0] != len(tokens[name]):
                raise StageError(f"Y_{name} has {Y.shape[0]} rows but tokens_{name} has {len(tokens[name])}")
        try:
            params = params.resolved(len(tokens["train"]))
        except ValueError as e:
            raise StageError(str(e)) from e
        width = neural.check_tokens(params.encoder, tokens, params.max_length, "lightxml")
        if params.max_length is None:
            params.max_length = width
        own = {k: v for k, v in st.params.items() if k != "backbone"} if guide_setup else {}
        st.params.clear()
        st.params.update(({"backbone": params.to_dict(), **own}) if guide_setup else params.to_dict())
        guide = label_tokens = None
        described: dict[str, Any] = {}
        if guide_setup is not None:
            with st.timed("label_tokens"):
                guide, label_tokens, described = guide_setup(st, params, Y_train)
        try:
            model = build_model(params, L, cluster_of, K, pretrained=True)
        except OSError as e:
            raise StageError(f"encoder '{params.encoder}' cannot be loaded: {e}") from e
        except ValueError as e:   # e.g. last_k beyond the encoder's layers
            raise StageError(f"encoder '{params.encoder}': {e} (lightxml.last_k)") from e
        resources.check_memory(f"LightXML's heads for L = {L:,} labels in {model.n_clusters:,} clusters (training state, "
                               "least-squares starts)", memory_bytes(model, len(tokens["train"]), params.train.batch_size),
                               "lightxml.hidden (the L x hidden label embeddings), lightxml.flat_max_labels or "
                               "lightxml.cluster.leaf_size (the generator's clusters)", st.log)
        if params.negatives == "static" and model.flat:
            raise StageError(f"static negatives need label clusters, but {L} labels <= flat_max_labels = "
                             f"{params.flat_max_labels} give one label per cluster (every label scored, no negatives "
                             "drawn): set lightxml.flat_max_labels below the label count for a clustered comparison")
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
                                         valid=(tokens["valid"], Y_valid), guide=guide, label_tokens=label_tokens)
            record_training(st, trainer)
            head = None
            if params.head_refit:
                with st.timed("head_refit"):
                    head = refit_generator(model, tokens["train"], Y_train, (tokens["valid"], Y_valid), params,
                                           trainer.device, st.log)
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
            msg, verdict = guard(stage.split("_")[0], m, prior, start, trainer.step, config_section)
            if msg is not None:
                if not params.allow_weak:
                    raise StageError(msg)
                st.log.warning("%s (allow_weak: kept)", msg)
            else:
                st.log.info("lightxml: %s", verdict)
            meta = {"format": FORMAT, "encoder": params.encoder, "encoder_path": str(encoders.resolve(params.encoder)),
                    "pooling": "cls-concat-last-k", "last_k": params.last_k, **model.describe(), "max_length": width,
                    "params": params.to_dict(), "train_steps": trainer.step, "n_train": len(tokens["train"]),
                    "device": str(trainer.device), "valid": m, "valid_prior": prior, "valid_start": start,
                    "generator": head or {"kept": "trained"},
                    **described}
            save_trained(st, out, model, "lightxml.json", meta, FORMAT)
            plot_curve(out / "curve.png", {k: {"valid_p_at_1": v} for k, v in curve.items()},
                       {"valid_p_at_1": "P@1 (valid subset, current weights)"},
                       {"frequency prior": prior["p_at_1"]}, ("final model, all valid", m["p_at_1"]), "LightXML",
                       "valid P@1")
            st.output("curve", out / "curve.png")
        remove_checkpoints(ckpt_dir)


def guard(method: str, m: Mapping[str, float], prior: Mapping[str, float], start: Mapping[str, float] | None,
          steps: int, sec: str) -> tuple[str | None, str]:
    """``(message, verdict)``: the message is ``None`` when the trained model's valid P@1 is above the
    frequency prior's and, with a linear start, not below the start's own (fine-tuning that loses what
    the least-squares generator knew before the first step has failed as surely as one that learned
    nothing: on a large label space the prior is near 0 and would pass almost anything)."""
    verdict = (f"valid P@1 {m['p_at_1']:.4f} vs the frequency prior's {prior['p_at_1']:.4f} "
               f"(P@5 {m['p_at_5']:.4f} vs {prior['p_at_5']:.4f})")
    if start is not None:
        verdict += f"; its linear start (step 0) had P@1 {start['p_at_1']:.4f}"
    if m["p_at_1"] <= prior["p_at_1"]:
        return (f"{method} learned nothing from the text: {verdict} after {steps} steps. Train longer or faster "
                f"({sec}.train.epochs, {sec}.train.lr), check the encoder and max_length, or set {sec}.allow_weak: true "
                "to keep this model"), verdict
    if start is not None and m["p_at_1"] < start["p_at_1"]:
        return (f"{method} fine-tuning lost what its least-squares start knew: {verdict} after {steps} steps. Lower "
                f"the rates ({sec}.train.lr, {sec}.lr_generator), train longer ({sec}.train.epochs), or set "
                f"{sec}.allow_weak: true to keep this model"), verdict
    return None, verdict


def _predict_main(args: argparse.Namespace) -> None:
    with stage_run("lightxml_predict", args, outputs=[args.out]) as st:
        params = _parse_params(st, args, "lightxml_predict")
        _, tokens, device = prediction_inputs(st, params, args.model, "lightxml.json", args.tokens)
        with st.timed("load"):
            try:
                model = load_lightxml(args.model, device)
            except (OSError, ValueError, KeyError) as e:
                raise StageError(f"--model {args.model}: {e}") from e
        st.params.update({"topk": params.topk, "model": str(args.model)})
        with st.timed("predict"):
            r = predict(model, tokens, params.topk, params.eval_batch_size, device, params.amp, progress=st.log.info)
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], params.topk, r["seconds"])


def add_train_args(t: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of a LightXML network's training stage (this CLI's and GUDN's ``train``)."""
    t.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid}.npz")
    t.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    t.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    t.add_argument("--tree", help="cluster tree (.npz of xmc_steps.cluster): its finest level gives the clusters")
    t.add_argument("--out", required=True, help="output folder")
    add_common_args(t)
    return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.lightxml", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    add_train_args(sub.add_parser("train", help="train a LightXML model"))
    q = sub.add_parser("predict", help="top-k predictions of a trained model")
    q.add_argument("--model", required=True, help="a train output folder")
    q.add_argument("--tokens", required=True, help="tokens_{split}.npz")
    q.add_argument("--out", required=True, help="predictions Parquet (top-k labels by p)")
    add_common_args(q)
    args = p.parse_args(argv)
    if args.cmd == "train":
        _train_main(args)
    else:
        _predict_main(args)
