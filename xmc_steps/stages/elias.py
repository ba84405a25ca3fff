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

``train``'s ``--params`` is the ``elias`` section its rule passes (:class:`xmc_steps.elias.params.EliasSection`;
the stage derives its own parameters from it, :meth:`~xmc_steps.elias.params.EliasSection.stage_params`), or a
stage's flat :class:`~xmc_steps.elias.params.EliasParams` (a run by hand).  ``predict``'s is
:class:`xmc_steps.elias.serve.PredictSettings`.

The training run is :func:`xmc_steps.elias.run.run_training` (as LightXML's is
:func:`xmc_steps.lightxml.run.run_training`); the prediction is :func:`xmc_steps.elias.serve.predict`,
serving's too: the parameters saved with the model (``elias.json``'s ``predict``), overridden by the
rule's settings (``elias.predict``, and the depth: ``evaluate.topk`` or ELIAS++'s deeper ``n_candidates``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from typing import TYPE_CHECKING

from ..stage import add_neural_predict_args, add_neural_training_args, add_common_args, cli_main, stage_run

if TYPE_CHECKING:
    from ..elias.params import EliasParams

# torch, transformers and scikit-learn load inside the commands, so that --help answers at once

# --------------------------------------------------------------------------- CLI


def _parse_params(st, args: argparse.Namespace, rule: str, stage: int) -> EliasParams:
    """Stage ``stage``'s parameters from the ``elias`` section its rule passes (or a stage's own, flat:
    :func:`xmc_steps.elias.params.stage_params`)."""
    from ..elias.params import stage_params as of_section
    from ..neural_stage import stage_params

    return stage_params(st, lambda d: of_section(d, stage), rule, "elias")


def _train_main(args: argparse.Namespace) -> None:
    from ..elias.run import TrainingFiles, outputs, run_training
    from ..neural_stage import train_split_only

    out = Path(args.out)
    stage = int(args.stage)
    with stage_run(f"elias_stage{stage}", args, outputs=[str(out / n) for n in outputs(stage)]) as st:
        params = _parse_params(st, args, f"elias_stage{stage}", stage)
        train_split_only(params.train, "ELIAS", " (ELIAS++'s ranker and its calibration need held-out validation documents)")
        run_training(st, out, stage, params, TrainingFiles(args.tokens_dir, args.labels_train, args.labels_valid,
                                                           args.tree, args.init, args.linear_model, args.tfidf_valid))


def _predict_main(args: argparse.Namespace) -> None:
    from .. import io
    from ..elias.serve import PredictSettings, effective_params, load, predict
    from ..neural_stage import prediction_inputs, sharded_inference, stage_params

    outs = [args.out, args.emb_out] + ([args.shortlist_out] if args.shortlist_out else [])
    with stage_run("elias_predict", args, outputs=outs) as st:
        settings = stage_params(st, PredictSettings, "elias_predict", "elias")   # the rule's settings
        meta, tokens, device = prediction_inputs(st, settings, args.model, "elias.json", args.tokens)
        with st.timed("load"):
            model = load(args.model, device)
        with st.timed("predict"):
            # under torchrun every rank predicts its batches and rank 0 alone writes (neural_stage)
            overrides = settings.overrides()
            r = sharded_inference(tokens, effective_params(meta, overrides).eval_batch_size,
                                  lambda part: predict(args.model, part, overrides, device, progress=st.log.info,
                                                       model=model))
        if r is None:
            return
        p = r["params"]
        shortlist_topk = p.shortlist_topk or p.topk
        st.params.update({**p.to_dict(), "shortlist_topk": shortlist_topk, "model": str(args.model),
                          "stage": meta.get("stage")})
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], p.topk, r["seconds"])
        io.save_arrays(args.emb_out, emb=r["emb"])
        st.output("emb", args.emb_out)
        if args.shortlist_out:
            io.write_predictions(args.shortlist_out, r["shortlist"], shortlist_topk)
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
