"""GUDN (Wang et al. 2022) stage: train (the method: :mod:`xmc_steps.gudn`); prediction is LightXML's.

CLI::

    python -m xmc_steps.stages.gudn train --tokens-dir DIR --labels-train Y_train.npz --labels-valid Y_valid.npz \\
        --label-table labels.parquet --ingest-record ingest/record.json --label-texts-file FILE \\
        --tree tree.npz --out DIR --params JSON [common args]
    python -m xmc_steps.stages.lightxml predict --model DIR ...   # text alone: the guide is training-only

``train`` writes what LightXML's does (``model.safetensors``, ``lightxml.json`` with a ``gudn``
entry, ``curve.png``): the LightXML network of the ``backbone`` parameters, trained by
:func:`xmc_steps.lightxml.run.run_training` with GUDN's guide network (:class:`xmc_steps.gudn.GuideNetwork`)
on each training text's label sequence.  ``--ingest-record`` says whether the dataset came with label
texts; when it did not, the stage fails naming ``--label-texts-file`` (the file the dataset lacks).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import io
from ..errors import StageError
from ..layout import RECORD
from ..stage import add_neural_training_args, add_common_args, cli_main, stage_run

if TYPE_CHECKING:
    import scipy.sparse as sp

    from .. import neural
    from ..gudn.params import GUDNParams

# torch and transformers load inside the command, so that --help answers at once


def _parse_params(st) -> GUDNParams:
    from ..gudn.params import GUDNParams
    from ..neural_stage import stage_params

    # the scheduler's threads (--threads, a top-level parameter of every stage) drive the backbone's network
    if "threads" in st.params:
        threads = st.params.pop("threads")
        st.params["backbone"] = dict(st.params.get("backbone") or {}, threads=threads)
    return stage_params(st, GUDNParams, "gudn_train", "gudn.backbone", on=lambda p: p.backbone)


def _cap_layers(st, backbone) -> None:
    """The paper's 10 layers, or every layer of an encoder that has fewer (MiniLM has 6)."""
    from transformers import AutoConfig

    from .. import encoders

    try:
        n = getattr(AutoConfig.from_pretrained(str(encoders.resolve(backbone.encoder))), "num_hidden_layers", None)
    except Exception:  # noqa: BLE001 - the backbone's own check names an unloadable encoder
        return
    if n is not None and backbone.last_k > n:
        st.log.warning("gudn: last_k = %d but encoder '%s' has %d layers: using all %d", backbone.last_k,
                       backbone.encoder, n, n)
        backbone.last_k = int(n)


def _label_tokens(st, args: argparse.Namespace, params: GUDNParams, Y_train: sp.spmatrix) -> neural.TokenData:
    """The training texts' label sequences, tokenized; a dataset without label texts is a StageError
    naming ``--label-texts-file``."""
    from ..gudn.labels import label_tokens

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
    seqs, tokens = label_tokens(Y_train, texts, params)
    lengths = tokens.lengths
    st.metric("label_sequence_tokens_mean", float(np.mean(lengths)) if len(lengths) else 0.0)
    st.log.info("gudn: feature guide %s (%s, weight %s), link guide %s; %d label sequences of <= %d tokens (mean %.1f), "
                "e.g. %r", "on" if params.feature_guide else "off", params.feature_loss, params.feature_weight,
                "on" if params.link_guide else "off",
                len(seqs), params.label_max_length, float(np.mean(lengths)) if len(lengths) else 0.0,
                seqs[0][:120] if seqs else "")
    return tokens


def _train_main(args: argparse.Namespace) -> None:
    from ..gudn.loss import GuideNetwork
    from ..lightxml.run import OUTPUTS, fit_params, load_training_data, run_training

    out = Path(args.out)
    with stage_run("gudn_train", args, outputs=[str(out / n) for n in OUTPUTS]) as st:
        params = _parse_params(st)
        _cap_layers(st, params.backbone)
        with st.timed("load"):
            data = load_training_data(args.tokens_dir, args.labels_train, args.labels_valid, args.tree,
                                      params.backbone.flat_max_labels, params.backbone.train.fit_valid)
        backbone, width = fit_params(params.backbone, data, "gudn.backbone")
        own = {k: v for k, v in st.params.items() if k != "backbone"}
        st.params.clear()
        st.params.update({"backbone": backbone.to_dict(), **own})
        with st.timed("label_tokens"):
            guide = GuideNetwork(params, _label_tokens(st, args, params, data.Y_train))
        run_training(st, out, backbone, data, width, guide=guide, method="gudn", config_section="gudn.backbone")
        if guide.gate_ratio is not None:
            st.metric("feature_gate_ratio", guide.gate_ratio)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.gudn", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the LightXML network with GUDN's guide network")
    add_neural_training_args(t, "its finest level gives the clusters")
    add_common_args(t)
    t.add_argument("--label-table", required=True, help="labels.parquet of ingest (label_text)")
    t.add_argument("--ingest-record", required=True, help=f"ingest's {RECORD} (whether the data had label texts)")
    t.add_argument("--label-texts-file", default="label_texts.txt", help="the dataset's label text file (for messages)")
    args = p.parse_args(argv)
    _train_main(args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
