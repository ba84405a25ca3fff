"""GUDN (Wang et al. 2022) stage: train (:mod:`xmc_steps.gudn`); prediction is LightXML's.

CLI::

    python -m xmc_steps.gudn train --tokens-dir DIR --labels-train Y_train.npz --labels-valid Y_valid.npz \\
        --label-table labels.parquet --ingest-record ingest/record.json --label-texts-file FILE \\
        --tree tree.npz --out DIR --params JSON [common args]
    python -m xmc_steps.lightxml predict --model DIR ...      # text alone: the guide is training-only

``train`` writes what LightXML's does (``model.safetensors``, ``lightxml.json`` with a ``gudn``
entry, ``curve.png``).  ``--ingest-record`` says whether the dataset came with label texts; when
it did not, the stage fails naming ``--label-texts-file`` (the file the dataset lacks).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import encoders, io, neural
from ..neural_stage import stage_params
from ..lightxml.cli import add_train_args, run_train
from ..errors import StageError
from .loss import GuideNetwork
from .params import GUDNParams


def _parse_params(st, args: argparse.Namespace) -> GUDNParams:
    # the scheduler's threads (--threads, a top-level parameter of every stage) drive the backbone's network
    if "threads" in st.params:
        threads = st.params.pop("threads")
        st.params["backbone"] = dict(st.params.get("backbone") or {}, threads=threads)
    return stage_params(st, GUDNParams, "gudn_train", "gudn.backbone", on=lambda p: p.backbone)


def label_sequences(Y: sp.spmatrix, label_texts: list[str], separator: str) -> list[str]:
    """Each row's gold label texts joined into one sequence (in label index order)."""
    Y = sp.csr_matrix(Y)
    Y.sort_indices()
    return [separator.join(label_texts[j] for j in Y.indices[Y.indptr[i]:Y.indptr[i + 1]]) for i in range(Y.shape[0])]


def _setup(args: argparse.Namespace, params: GUDNParams, st, backbone, Y_train) -> tuple[Any, neural.TokenData, dict]:
    try:
        report = io.read_json(args.ingest_record).get("extra", {}).get("report", {})
    except (OSError, ValueError) as e:
        raise StageError(f"--ingest-record {args.ingest_record}: {e}") from e
    if not report.get("has_label_texts"):
        raise StageError(f"GUDN trains on the label texts, and this dataset has none: {args.label_texts_file} is "
                         "missing (one label text per line, aligned with label_ids.txt). Add it, or leave gudn "
                         "out for this dataset")
    table = io.read_table(args.label_table, ["label_text"])
    texts = [str(t) for t in table.column("label_text").to_pylist()]
    if len(texts) != Y_train.shape[1]:
        raise StageError(f"{args.label_table} has {len(texts)} labels but Y_train has {Y_train.shape[1]}")
    seqs = label_sequences(Y_train, texts, params.label_separator)
    tok = encoders.load_tokenizer(backbone.encoder)
    ids, lengths = encoders.tokenize(seqs, tok, params.label_max_length)
    label_tokens = neural.TokenData(ids, lengths)
    st.metric("label_sequence_tokens_mean", float(np.mean(lengths)) if len(lengths) else 0.0)
    st.log.info("gudn: feature guide %s (%s, weight %s), link guide %s; %d label sequences of <= %d tokens (mean %.1f), "
                "e.g. %r", "on" if params.feature_guide else "off", params.feature_loss, params.feature_weight,
                "on" if params.link_guide else "off",
                len(seqs), params.label_max_length, float(np.mean(lengths)) if len(lengths) else 0.0,
                seqs[0][:120] if seqs else "")
    described = {"gudn": {k: v for k, v in params.to_dict().items() if k != "backbone"}}

    def on_gate(ratio: float, on: bool) -> None:
        st.metric("feature_gate_ratio", ratio)
        described["gudn"]["feature_gate"] = {"ratio": ratio, "feature_guide_on": on}

    return GuideNetwork(params, on_gate), label_tokens, described


def _train_main(args: argparse.Namespace) -> None:
    state: dict[str, GUDNParams] = {}

    def parse(st):
        state["p"] = _parse_params(st, args)
        backbone = state["p"].backbone
        _cap_layers(st, backbone)
        return backbone

    run_train(args, "gudn_train", parse, guide_setup=lambda st, b, Y: _setup(args, state["p"], st, b, Y),
              config_section="gudn.backbone")


def _cap_layers(st, backbone) -> None:
    """The paper's 10 layers, or every layer of an encoder that has fewer (MiniLM has 6)."""
    from transformers import AutoConfig

    try:
        n = getattr(AutoConfig.from_pretrained(str(encoders.resolve(backbone.encoder))), "num_hidden_layers", None)
    except Exception:  # noqa: BLE001 - the backbone's own check names an unloadable encoder
        return
    if n is not None and backbone.last_k > n:
        st.log.warning("gudn: last_k = %d but encoder '%s' has %d layers: using all %d", backbone.last_k,
                       backbone.encoder, n, n)
        backbone.last_k = int(n)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.gudn", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = add_train_args(sub.add_parser("train", help="train the LightXML network with GUDN's guide network"))
    t.add_argument("--label-table", required=True, help="labels.parquet of ingest (label_text)")
    t.add_argument("--ingest-record", required=True, help="ingest's record.json (whether the data had label texts)")
    t.add_argument("--label-texts-file", default="label_texts.txt", help="the dataset's label text file (for messages)")
    args = p.parse_args(argv)
    _train_main(args)
