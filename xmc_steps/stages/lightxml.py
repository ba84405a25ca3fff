"""LightXML (Jiang et al., AAAI 2021) stage: train, predict (the method: :mod:`xmc_steps.lightxml`).

CLI::

    python -m xmc_steps.stages.lightxml train --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --tree tree.npz --out DIR --params JSON [common args]
    python -m xmc_steps.stages.lightxml predict --model DIR --tokens tokens_test.npz --out predictions.parquet \\
        --params JSON [common args]

``train`` writes ``model.safetensors``, ``lightxml.json`` (format, encoder, L, K, flat, the
parameters, the validation figures next to the frequency prior's), ``curve.png`` (valid P@1 over the
steps, the prior as a line).  The clusters are the finest level of ``--tree`` unless the label
set is small (``L <= flat_max_labels``: one label per cluster, the tree is not used).  The stage
fails when the model's valid P@1 is not above the frequency prior's (``allow_weak: true`` makes
that a warning).  Checkpoints go to ``OUT/checkpoints`` and are removed once every output is
written (:func:`xmc_steps.lightxml.run.run_training`).  ``predict`` writes the top-``topk`` (default
100) labels by ``p`` (:func:`xmc_steps.io.write_predictions`) and ``predict_latency_ms_per_doc``: it is
:func:`xmc_steps.lightxml.serve.predict`, serving's too (the parameters saved with the model, overridden by
the rule's settings).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StageError
from ..stage import add_neural_predict_args, add_neural_training_args, add_common_args, cli_main, stage_run

if TYPE_CHECKING:
    from ..lightxml.params import LightXMLParams

# torch and transformers load inside the commands, so that --help answers at once


def _parse_params(st, args: argparse.Namespace, rule: str) -> LightXMLParams:
    from ..lightxml.params import LightXMLParams
    from ..neural_stage import stage_params

    return stage_params(st, LightXMLParams, rule, "lightxml")


def _train_main(args: argparse.Namespace) -> None:
    from ..lightxml.run import OUTPUTS, fit_params, load_training_data, run_training

    out = Path(args.out)
    with stage_run("lightxml_train", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = _parse_params(st, args, "lightxml_train")
        with st.timed("load"):
            data = load_training_data(args.tokens_dir, args.labels_train, args.labels_valid, args.tree,
                                      params.flat_max_labels, params.train.fit_valid)
        params, width = fit_params(params, data)
        st.params.clear()
        st.params.update(params.to_dict())
        run_training(st, out, params, data, width, method="lightxml", config_section="lightxml")


def _predict_main(args: argparse.Namespace) -> None:
    from ..lightxml.serve import PredictParams, load, predict
    from ..neural_stage import prediction_inputs, sharded_inference

    with stage_run("lightxml_predict", args, outputs=[args.out]) as st:
        overrides = {k: st.params[k] for k in PredictParams.keys() if k in st.params}   # the rule's settings
        params = _parse_params(st, args, "lightxml_predict")
        meta, tokens, device = prediction_inputs(st, params, args.model, "lightxml.json", args.tokens)
        with st.timed("load"):
            try:
                model = load(args.model, device)
            except (OSError, ValueError, KeyError) as e:
                raise StageError(f"--model {args.model}: {e}") from e
        with st.timed("predict"):
            # under torchrun every rank predicts its batches and rank 0 alone writes (neural_stage)
            r = sharded_inference(tokens, PredictParams.effective(meta, overrides).eval_batch_size,
                                  lambda part: predict(args.model, part, overrides, device, progress=st.log.info,
                                                       model=model))
        if r is None:
            return
        p = r["params"]
        st.params.update({**p.to_dict(), "model": str(args.model)})
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], p.topk, r["seconds"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.lightxml", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a LightXML model")
    add_neural_training_args(t, "its finest level gives the clusters")
    add_common_args(t)
    q = sub.add_parser("predict", help="top-k predictions of a trained model")
    add_neural_predict_args(q, "predictions Parquet (top-k labels by p)")
    add_common_args(q)
    args = p.parse_args(argv)
    if args.cmd == "train":
        _train_main(args)
    else:
        _predict_main(args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
