"""The passes at the end of training sharded over processes: the training stages tests/test_distributed.py runs
once in one process and once as 2 processes under ``torchrun`` (gloo), to compare what rank 0 writes.

``python -m torch.distributed.run --nproc-per-node 2 tests/ddp_finish.py FOLDER ENCODER`` runs, on every rank, the
training stages of the X-Transformer matcher (its embeddings of train, valid and test, then the top-b clusters
written from them), ELIAS stage 1 (the fine-tuned embeddings of the training texts: the head re-fit and
``clusters_train.npz``), LightXML with ``head_refit`` (the same embeddings, the generator re-fit on them) and the
dual encoder (its label table) over ``FOLDER``'s toy data with the tiny test encoder ``ENCODER`` (no dropout), 2
steps each at a global batch of 8, writing ``FOLDER/<tag>/<stage>/`` (tag ``w2``), as the rules start them under
torchrun.  :func:`make` writes the data; :func:`run` runs the stages in the calling process (tag ``w1``).

Every stage's :func:`xmc_steps.neural_stage.sharded_embed` is wrapped here: each rank records how many texts of the
pass it embedded, and rank 0 embeds all of them again in one pass with the same (trained) weights and records
whether the gathered rows are those, bit for bit (``FOLDER/<tag>/passes_rank<r>.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

#: documents of each split, their width, labels, clusters (labels 2c and 2c + 1), the inference batch (24 training
#: texts in 6 batches: 3 a rank)
N_TRAIN, N_VALID, N_TEST, WIDTH, L, K, BATCH = 24, 8, 8, 12, 8, 4, 4
STAGES = ("matcher", "elias", "lightxml", "dual_encoder")
#: the modules whose end-of-training passes go through neural_stage.sharded_embed (the matcher's: embed_texts)
MODULES = {"matcher": "xmc_steps.xtransformer.matcher", "elias": "xmc_steps.elias.run",
           "lightxml": "xmc_steps.lightxml.run", "dual_encoder": "xmc_steps.dual_encoder.run"}


def make(folder: str) -> None:
    """Toy tokens of 4 topics (topic t: labels 2t and 2t + 1, the second on every other text), their labels, the
    tree of 4 clusters and the label table (a text per label)."""
    import scipy.sparse as sp
    from tiny_encoder import toy_tokens

    from xmc_steps import io
    from xmc_steps.cluster_tree import ClusterTree

    d = Path(folder) / "in"
    n = N_TRAIN + N_VALID + N_TEST
    ids, lengths, cls = toy_tokens(n, WIDTH, K, seed=5)
    rows = [[2 * t, 2 * t + 1] if i % 2 else [2 * t] for i, t in enumerate(cls)]
    Y = sp.csr_matrix((np.ones(sum(map(len, rows)), np.float32), np.concatenate(rows),
                       np.concatenate([[0], np.cumsum([len(r) for r in rows])])), shape=(n, L))
    bounds = {"train": slice(0, N_TRAIN), "valid": slice(N_TRAIN, N_TRAIN + N_VALID),
              "test": slice(N_TRAIN + N_VALID, n)}
    for s, sl in bounds.items():
        io.save_arrays(d / f"tokens_{s}.npz", input_ids=ids[sl], lengths=lengths[sl])
        io.save_csr(d / f"Y_{s}.npz", Y[sl])
    ClusterTree.from_assignments([np.arange(L) // 2]).save(d / "tree.npz")
    words = ["apple", "engine", "violin", "river"]
    texts = [f"{words[j // 2]} {'one' if j % 2 else 'two'}" for j in range(L)]
    io.write_table(d / "labels.parquet", {"label_id": [f"L{j}" for j in range(L)], "label_text": texts,
                                          "train_freq": np.asarray(Y[:N_TRAIN].sum(0)).ravel().astype(np.int64)})


def _argv(stage: str, d: Path, out: Path, encoder: str) -> tuple[object, list[str]]:
    from xmc_steps.stages import dual_encoder, elias, lightxml, matcher

    common = {"encoder": encoder, "device": "cpu", "threads": 1, "amp": "off", "eval_batch_size": BATCH,
              "allow_weak": True}
    train = {"steps": 2, "batch_size": 8, "lr": 1e-3, "warmup_steps": 1, "checkpoint_every": 0, "log_every": 1,
             "seed": 0}
    data = ["--tokens-dir", str(d), "--labels-train", str(d / "Y_train.npz"), "--labels-valid", str(d / "Y_valid.npz"),
            "--out", str(out), "--no-tracking", "--record", str(out / "record.json")]
    if stage == "matcher":
        p = {**common, "max_length": WIDTH, "lr_head": 1e-2, "topb": 2, "eval_every": 2, "train": train}
        return matcher.main, data + ["--cluster-assign", str(d / "tree.npz"), "--params", json.dumps(p)]
    if stage == "elias":
        p = {**common, "b": 1, "K": 4, "alpha": 2.0, "eval_every": 2, "lr_encoder": 1e-3, "lr_clf": 1e-2,
             "head_refit_select": "per_head", "train": {**train, "lr": None}}
        return elias.main, ["train", "--stage", "1"] + data + ["--tree", str(d / "tree.npz"), "--params", json.dumps(p)]
    if stage == "lightxml":
        p = {**common, "last_k": 2, "flat_max_labels": 4, "topb": 2, "hidden": 16, "dropout": 0.0, "eval_every": 2,
             "head_refit": True, "head_init_l2": 1.0, "train": train}
        return lightxml.main, ["train"] + data + ["--tree", str(d / "tree.npz"), "--params", json.dumps(p)]
    p = {**common, "pooling": "mean", "label_max_length": 6, "topk": 3, "eval_every": 2, "cluster_size": 4,
         "train": train}
    return dual_encoder.main, ["train"] + data + ["--label-table", str(d / "labels.parquet"),
                                                  "--params", json.dumps(p)]


def run(folder: str, encoder: str, tag: str, stages: tuple[str, ...] = STAGES) -> None:
    """The training ``stages`` with ``encoder`` over ``folder``'s data, each into ``folder/tag/<stage>``."""
    import importlib

    import torch

    from xmc_steps import distributed, neural, neural_stage
    from xmc_steps.stage import cli_main

    torch.set_num_threads(1)
    folder = Path(folder)
    passes: list[dict] = []

    def checked(stage: str):
        def sharded_embed(module, tokens, batch_size, device, amp="auto", progress=None):
            mine = [0]
            real = neural.embed

            def counted(enc, part, *a, **k):
                mine[0] += len(part)
                return real(enc, part, *a, **k)

            neural.embed = counted
            try:
                emb, secs = neural_stage.sharded_embed(module, tokens, batch_size, device, amp, progress)
            finally:
                neural.embed = real
            rec = {"stage": stage, "texts": len(tokens), "mine": mine[0], "world": distributed.world_size()}
            if emb is not None:            # rank 0: the one-process pass with the same weights
                rec["exact"] = bool(np.array_equal(emb, neural.embed(module, tokens, batch_size, device, amp,
                                                                     progress=None)))
            passes.append(rec)
            return emb, secs

        return sharded_embed

    for stage in stages:
        mod = importlib.import_module(MODULES[stage])
        mod.sharded_embed = checked(stage)
        out = folder / tag / stage
        out.mkdir(parents=True, exist_ok=True)
        main, argv = _argv(stage, folder / "in", out, encoder)
        try:
            rc = cli_main(main, argv)
        finally:
            mod.sharded_embed = neural_stage.sharded_embed
        assert rc == 0, (stage, rc)
    (folder / tag / f"passes_rank{distributed.rank_from_env()}.json").write_text(json.dumps(passes))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run(sys.argv[1], sys.argv[2], "w2")
