"""X-Transformer neural matcher (§3.3): a transformer that maps a text to its label clusters.

The stage: trains the matcher (:mod:`xmc_steps.xtransformer.matcher`), re-fits its head, runs the
guard (:mod:`xmc_steps.xtransformer.guard`) and writes the embeddings and the top-b clusters of every
split.  What the model is and why each setting: docs/methods/xtransformer.md.

CLI::

    python -m xmc_steps.stages.matcher --tokens-dir DIR --labels-train Y_train.npz \\
        --labels-valid Y_valid.npz --cluster-assign C.npz \\
        [--linear-clusters lin_train.npz lin_valid.npz lin_test.npz | --baseline-clusters lin_valid.npz] \\
        --out DIR --params JSON [common args]

``--cluster-assign`` is a CSR ``L x K`` 0/1 matrix, or a cluster tree file of
:mod:`xmc_steps.cluster_tree` (``ClusterTree.save``), whose finest cluster level is used.
``--linear-clusters`` are the linear tree's top clusters of the train, valid and test
documents (``python -m xmc_steps.stages.xr_linear clusters``): the guard's baseline and the linear
half of ``head+linear``; ``--baseline-clusters`` gives the valid ones only (the guard's
baseline).  Without either the guard has the frequency
baseline only.

``--params`` keys (:class:`~xmc_steps.xtransformer.params.MatcherParams`): encoder, pooling, last_k,
max_length, train (:class:`xmc_steps.trainer.TrainParams`: epochs, steps, batch_size, grad_accum,
lr (encoder), warmup, warmup_steps, weight_decay, max_grad_norm, length_bucket, checkpoint_every,
log_every, seed; the keys given change :data:`~xmc_steps.xtransformer.params.TRAIN_DEFAULTS`),
lr_head (head; default = train.lr), head_init, head_init_l2, head_refit, scorer, topb, allow_weak,
eval_every, eval_max_docs, eval_batch_size, amp, device, allow_cpu_fallback, threads.

Outputs in ``--out``: ``model.safetensors`` (state dict of
:class:`~xmc_steps.xtransformer.matcher.MatcherModel`: ``encoder.model.*`` and ``head.weight``),
``matcher.json`` (format, encoder, pooling,
last_k, K, dim, max_length, params, predict: the
:class:`~xmc_steps.xtransformer.matcher.PredictParams` serving embeds with, training summary), ``guard.json`` (the guard's
numbers and the validation curve), ``curve.png`` (that curve with the baselines),
``emb_{train,valid,test}.npz`` (key ``emb``, float32 N x dim),
``clusters_{train,valid,test}.npz`` (CSR N x K with the top-b scores per row).  Training
checkpoints go to ``--out/checkpoints/`` (layout in :mod:`xmc_steps.neural`); they
survive a failed or preempted run so that rerunning the same command resumes, and are
removed once every output is written.  Validation P@1 and recall@b of the cluster
ranking (``valid_cluster_p_at_1``, ``valid_cluster_recall_at_b``; a fixed subset of at
most ``eval_max_docs`` valid documents) are logged at step 0 and every ``eval_every``
steps (default: ten points per run); the final model is the one after the last step (no selection).
:func:`xmc_steps.xtransformer.load_matcher` loads a trained matcher back.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..stage import add_common_args, cli_main, stage_run

# torch and transformers load inside the command, so that --help answers at once


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.matcher", description=__doc__.splitlines()[0])
    p.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid,test}.npz")
    p.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    p.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    p.add_argument("--cluster-assign", required=True,
                   help="C (.npz CSR L x K, 0/1): label -> cluster; or a cluster tree (its finest level is used)")
    p.add_argument("--baseline-clusters", default=None,
                   help="the linear tree's top clusters of the valid documents (.npz CSR N_valid x K), "
                        "a baseline of the guard")
    p.add_argument("--linear-clusters", nargs=3, default=None, metavar=("TRAIN", "VALID", "TEST"),
                   help="the linear tree's top clusters of the train, valid and test documents (.npz CSR): the "
                        "guard's baseline (valid) and the linear half of scorer head+linear; replaces "
                        "--baseline-clusters")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.linear_clusters and args.baseline_clusters:
        p.error("give --linear-clusters or --baseline-clusters, not both")
    from ..neural_stage import stage_params, train_split_only
    from ..xtransformer.params import MatcherParams
    from ..xtransformer.run import OUTPUTS, TrainingFiles, run_training

    out = Path(args.out)
    with stage_run("matcher", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = stage_params(st, MatcherParams, "matcher", "xtransformer.matcher")
        train_split_only(params.train, "the X-Transformer matcher", " (its rankers: xtransformer.fit_on)")
        run_training(st, out, params, TrainingFiles(args.tokens_dir, args.labels_train, args.labels_valid,
                                                    args.cluster_assign, args.linear_clusters, args.baseline_clusters))


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
