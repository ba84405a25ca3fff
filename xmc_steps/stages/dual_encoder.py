"""Dual encoder (NGAME, WSDM 2023; DEXML, ICLR 2024) stage: train, predict (the method: :mod:`xmc_steps.dual_encoder`).

CLI::

    python -m xmc_steps.stages.dual_encoder train --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --label-table labels.parquet [--linear-model DIR --tfidf-valid X_valid.npz] \\
        --out DIR --params JSON [common args]
    python -m xmc_steps.stages.dual_encoder predict --model DIR --tokens tokens_{split}.npz \\
        --out pred_{split}.parquet [--emb-out emb_{split}.npz] [--shortlist-out shortlist_{split}.parquet] \\
        --params JSON [common args]

``train`` reads the token ids of the texts (``tokens_{train,valid}.npz`` of ``--tokens-dir``: the shared
tokenize stage's, the encoder's tokenizer at ``max_length``), the label matrices and the label texts
(``label_text`` of ingest's ``labels.parquet``: the label id itself where the dataset has no label texts),
which it tokenizes with the encoder's tokenizer at ``label_max_length``.  It writes ``model.safetensors``,
``dual_encoder.json`` (format, encoder, pooling, dim, L, the widths, the parameters, the validation figures
next to the baselines'), ``label_emb.npz`` (``emb``: the trained label embeddings, L x dim),
``label_index.faiss`` (the search index over them, :mod:`xmc_steps.ann`: exact or HNSW by ``search`` and
``exact_max_labels``), ``guard.json`` (the guard's numbers: :mod:`xmc_steps.guard`) and
``curve.png`` (valid recall@w and P@1 over the steps, the baselines as lines).  The stage fails when the model's valid
recall@w is below the most frequent labels' or, with ``--linear-model`` (XR-Linear over the shared tree, fit
on train) and ``--tfidf-valid``, below the linear tree's index at the same budget (``allow_weak: true`` makes
that a warning).  Checkpoints go to ``OUT/checkpoints`` and are removed once every output is written.

``predict`` searches the model's saved index (built again from ``label_emb.npz`` with ``search`` /
``exact_max_labels`` if it is missing) and writes the ``topk`` nearest labels of every text (``--out``,
scores ``(1 + cos) / 2``), with ``--shortlist-out`` the ``shortlist_topk`` nearest (default ``topk``), with
``--emb-out`` the texts' embeddings (``emb``), and the metric ``predict_latency_ms_per_doc`` (the encoder
pass and the search, per document).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .. import encoders, io, neural
from ..curves import plot_curve
from ..dual_encoder.model import (JSON, LABEL_EMB, LABEL_INDEX, build_label_index, build_model, encode,
                                  label_tokens, load_dual_encoder, load_label_index, predict, save_dual_encoder)
from ..dual_encoder.params import DualEncoderParams
from ..dual_encoder.train import GUARD_ADVICE, frequency_prior, train_dual_encoder, valid_metrics
from ..errors import StageError
from ..guard import check, enforce, guard_width, linear_tree_valid, message, report_dict
from ..layout import CURVE, GUARD, WEIGHTS
from ..neural_stage import (curve_logger, load_tokens, prediction_inputs, record_training, remove_checkpoints,
                            stage_params, training_device)
from ..stage import add_neural_predict_args, add_common_args, cli_main, stage_run

#: what a training run writes into its output folder (besides the stage's record)
OUTPUTS = (WEIGHTS, JSON, LABEL_EMB, LABEL_INDEX, GUARD, CURVE)


def _params(st, rule: str) -> DualEncoderParams:
    return stage_params(st, DualEncoderParams, rule, "dual_encoder")


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


def _train_main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    with stage_run("dual_encoder_train", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = _params(st, "dual_encoder_train")
        if bool(args.linear_model) != bool(args.tfidf_valid):
            raise StageError("--linear-model and --tfidf-valid go together (the guard's linear tree on the valid "
                             "split)")
        with st.timed("load"):
            tokens = load_tokens(args.tokens_dir, ("train", "valid"))
            try:
                Y_train, Y_valid = io.load_csr(args.labels_train), io.load_csr(args.labels_valid)
            except (OSError, ValueError) as e:
                raise StageError(f"labels: {e}") from e
            L = Y_train.shape[1]
            texts = _label_texts(args.label_table, L, st.log)
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
            with st.timed("label_emb"):
                label_emb = encode(model, ltok, params.eval_batch_size, trainer.device, params.amp, st.log.info)
                index = build_label_index(label_emb, params.search, params.exact_max_labels, params.train.seed)
            st.extra["label_index"] = index.kind
            with st.timed("valid"):
                m, top = valid_metrics(model, tokens["valid"], Y_valid, None, params, w, trainer.device,
                                       st.log.info, index=index)
            prior = frequency_prior(Y_train, Y_valid, w)
            with st.timed("guard"):
                lin_index = lin_ranked = beam = None
                if args.linear_model:
                    lin_index, lin_ranked, beam = linear_tree_valid(args.linear_model, args.tfidf_valid, w,
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
                    "valid": m, "valid_prior": prior, "valid_start": start, "guard": report_dict(report)}
            save_dual_encoder(st, out, model, label_emb, {**meta, "label_index": index.kind}, index)
        remove_checkpoints(ckpt_dir)


def _predict_main(args: argparse.Namespace) -> None:
    outs = [args.out] + [p for p in (args.emb_out, args.shortlist_out) if p]
    with stage_run("dual_encoder_predict", args, outputs=outs) as st:
        params = _params(st, "dual_encoder_predict")
        _, tokens, device = prediction_inputs(st, params, args.model, JSON, args.tokens)
        with st.timed("load"):
            try:
                model, label_emb = load_dual_encoder(args.model, device)
                index = load_label_index(args.model, label_emb, params.search, params.exact_max_labels)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                raise StageError(f"--model {args.model}: {e}") from e
        short = params.shortlist_topk or params.topk
        k = max(params.topk, short if args.shortlist_out else 0)
        st.params.update({"topk": params.topk, "shortlist_topk": short, "model": str(args.model),
                          "label_index": index.kind})
        with st.timed("predict"):
            r = predict(model, tokens, None, k, params.eval_batch_size, device, params.amp, progress=st.log.info,
                        with_emb=bool(args.emb_out), index=index)
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], params.topk, r["seconds"])
        if args.shortlist_out:
            io.write_predictions(args.shortlist_out, r["scores"], short)
            st.output("shortlist", args.shortlist_out)
        if args.emb_out:
            io.save_arrays(args.emb_out, emb=r["emb"])
            st.output("emb", args.emb_out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.dual_encoder", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a dual encoder")
    t.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid}.npz")
    t.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    t.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    t.add_argument("--label-table", required=True, help="labels.parquet of ingest (label_id, label_text)")
    t.add_argument("--linear-model", help="the guard's linear tree: XR-Linear over the shared tree, fit on the train "
                                          "split (without it the guard has the frequency baseline only)")
    t.add_argument("--tfidf-valid", help="X_valid (.npz CSR TF-IDF) for --linear-model")
    t.add_argument("--out", required=True, help="output folder")
    add_common_args(t)
    q = sub.add_parser("predict", help="the nearest labels of every text")
    add_neural_predict_args(q, "predictions Parquet (the topk nearest labels)")
    q.add_argument("--emb-out", help="the texts' embeddings .npz (key emb)")
    q.add_argument("--shortlist-out", help="shortlist Parquet (the shortlist_topk nearest labels)")
    add_common_args(q)
    args = p.parse_args(argv)
    if args.cmd == "train":
        _train_main(args)
    else:
        _predict_main(args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
