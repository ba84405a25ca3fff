"""Prediction and embedding sharded over processes: the stages tests/test_distributed.py runs once in one process
and once as 2 processes under ``torchrun`` (gloo), to compare what rank 0 writes.

``python -m torch.distributed.run --nproc-per-node 2 tests/ddp_predict.py FOLDER`` runs, on every rank, LightXML's
predict stage (``xmc_steps.stages.lightxml predict``: LightXML's and GUDN's predict rules) over
``FOLDER/model`` and ``FOLDER/tokens_test.npz`` and the pre-trained embed stage (``xmc_steps.stages.embed``) over the
same tokens, writing ``FOLDER/<tag>/`` (tag ``w2``), as the rules start them under torchrun
(:func:`xmc_steps.launch.run_stage`).  The gathered rows travel in messages of 3 texts (``GATHER_ROWS``), so that
a rank's rows take several messages.  :func:`make` writes the model and the tokens; :func:`run` runs the two
stages in the calling process (tag ``w1``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

#: documents, their width, labels and clusters, the prediction batch (37 texts in 10 batches of 4: 5 batches a
#: rank, the shortest batch of 1 text on rank 1)
N, WIDTH, L, K, BATCH, TOPK = 37, 12, 8, 4, 4, 5


def make(folder: str, encoder: str) -> None:
    """A LightXML network over the tiny encoder (random clusters, heads and label embeddings: scores that
    differ across texts) saved as its training stage saves it, and ``N`` texts of varying lengths."""
    from tiny_encoder import toy_tokens

    from xmc_steps import io, lightxml, neural
    from xmc_steps.lightxml.model import FORMAT
    from xmc_steps.lightxml.serve import PredictParams
    from xmc_steps.trainer import TrainParams

    folder = Path(folder)
    (folder / "model").mkdir(parents=True, exist_ok=True)
    params = lightxml.LightXMLParams(encoder=encoder, last_k=2, topb=2, hidden=8, device="cpu", amp="off",
                                     dropout=0.0, eval_batch_size=BATCH, topk=TOPK,
                                     train=TrainParams(steps=1, batch_size=4)).resolved(N)
    model = lightxml.build_model(params, L, np.arange(L) % K, K)
    neural.save_model(model, folder / "model" / "model.safetensors", metadata={"format": FORMAT})
    meta = {"format": FORMAT, "encoder": encoder, "encoder_path": encoder,
            "pooling": "cls-concat-last-k", "last_k": 2, **model.describe(), "max_length": WIDTH,
            "params": params.to_dict(), "predict": PredictParams.of(params).to_dict()}
    io.write_json(folder / "model" / "lightxml.json", meta)
    ids, lengths, _ = toy_tokens(N, WIDTH, 3, seed=11)
    lengths[5] = lengths[9] = 1                     # a text of one token, and ties of length across batches
    io.save_arrays(folder / "tokens_test.npz", input_ids=ids, lengths=lengths)


def run(folder: str, tag: str) -> None:
    """LightXML's predict stage and the embed stage over ``folder``'s model and tokens, into ``folder/tag``."""
    import torch

    from xmc_steps import neural_stage
    from xmc_steps.stage import cli_main
    from xmc_steps.stages import embed, lightxml

    torch.set_num_threads(1)
    folder = Path(folder)
    out = folder / tag
    out.mkdir(exist_ok=True)
    meta = json.loads((folder / "model" / "lightxml.json").read_text())
    common = ["--no-tracking"]
    rc = cli_main(lightxml.main, ["predict", "--model", str(folder / "model"), "--tokens", str(folder / "tokens_test.npz"),
                                  "--out", str(out / "predictions.parquet"), "--record", str(out / "predict.json"),
                                  "--params", json.dumps({"device": "cpu", "threads": 1, "amp": "off"})] + common)
    assert rc == 0, rc
    rc = cli_main(embed.main, ["--tokens", str(folder / "tokens_test.npz"), "--out-dir", str(out), "--record",
                               str(out / "embed.json"), "--params",
                               json.dumps({"encoder": meta["encoder"], "batch_size": BATCH, "device": "cpu",
                                           "amp": "off"})] + common)
    assert rc == 0, rc
    assert neural_stage.GATHER_ROWS == 3 or tag == "w1"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from xmc_steps import neural_stage

    neural_stage.GATHER_ROWS = 3
    run(sys.argv[1], "w2")
