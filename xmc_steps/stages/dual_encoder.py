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
that a warning).  Checkpoints go to ``OUT/checkpoints`` and are removed once every output is written
(the training run: :func:`xmc_steps.dual_encoder.run.run_training`).

``predict`` searches the model's saved index (built again from ``label_emb.npz`` with ``search`` /
``exact_max_labels`` if it is missing) and writes the ``topk`` nearest labels of every text (``--out``,
scores ``(1 + cos) / 2``), with ``--shortlist-out`` the ``shortlist_topk`` nearest (default ``topk``), with
``--emb-out`` the texts' embeddings (``emb``), and the metric ``predict_latency_ms_per_doc`` (the encoder
pass and the search, per document).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from typing import TYPE_CHECKING

from ..errors import StageError
from ..stage import add_neural_predict_args, add_common_args, cli_main, stage_run

if TYPE_CHECKING:
    from ..dual_encoder.params import DualEncoderParams

# torch, faiss and scikit-learn load inside the commands, so that --help answers at once


def _params(st, rule: str) -> DualEncoderParams:
    from ..dual_encoder.params import DualEncoderParams
    from ..neural_stage import stage_params

    return stage_params(st, DualEncoderParams, rule, "dual_encoder")


def _train_main(args: argparse.Namespace) -> None:
    from ..dual_encoder.run import OUTPUTS, TrainingFiles, run_training
    from ..neural_stage import train_split_only

    out = Path(args.out)
    with stage_run("dual_encoder_train", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = _params(st, "dual_encoder_train")
        train_split_only(params.train, "the dual encoder")
        run_training(st, out, params, TrainingFiles(args.tokens_dir, args.labels_train, args.labels_valid,
                                                    args.label_table, args.linear_model, args.tfidf_valid))


def _predict_main(args: argparse.Namespace) -> None:
    from .. import io
    from ..dual_encoder.model import JSON
    from ..dual_encoder.serve import PredictParams, load, predict
    from ..neural_stage import prediction_inputs, sharded_inference

    outs = [args.out] + [p for p in (args.emb_out, args.shortlist_out) if p]
    with stage_run("dual_encoder_predict", args, outputs=outs) as st:
        overrides = {k: st.params[k] for k in PredictParams.keys() if k in st.params}   # the rule's settings
        params = _params(st, "dual_encoder_predict")
        meta, tokens, device = prediction_inputs(st, params, args.model, JSON, args.tokens)
        p = PredictParams.effective(meta, overrides)
        with st.timed("load"):
            try:
                loaded = load(args.model, device, p)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                raise StageError(f"--model {args.model}: {e}") from e
        short = p.shortlist_topk or p.topk
        k = max(p.topk, short if args.shortlist_out else 0)
        with st.timed("predict"):
            # under torchrun every rank predicts its batches and rank 0 alone writes (neural_stage)
            r = sharded_inference(tokens, p.eval_batch_size,
                                  lambda part: predict(args.model, part, overrides, device, progress=st.log.info,
                                                       with_emb=bool(args.emb_out), loaded=loaded, k=k))
        if r is None:
            return
        st.params.update({**p.to_dict(), "shortlist_topk": short, "model": str(args.model),
                          "label_index": r["index"].kind})
        st.metric("predict_seq_per_s", len(tokens) / max(r["seconds"], 1e-9))
        st.predictions(args.out, r["scores"], p.topk, r["seconds"])
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
