"""`python -m xmc_steps.stages.predict`: new text through a trained target, as its stages score the test split."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from xmc_steps import io, registry
from xmc_steps import serving as xp
from xmc_steps.stages import predict as predict_stage


def test_read_texts_names_file_and_line():
    assert list(xp.read_texts([b"a b\n", b"c\r\n"], "in.txt")) == [(1, "a b"), (2, "c")]
    with pytest.raises(xp.PredictError, match=r"in\.txt, line 2: not UTF-8"):
        list(xp.read_texts([b"ok\n", b"caf\xe9\n"], "in.txt"))
    with pytest.raises(xp.PredictError, match=r"in\.txt, line 3: empty line"):
        list(xp.read_texts([b"a\n", b"b\n", b"  \n"], "in.txt"))
    assert list(xp.read_texts([b"a\n", b"\n"], "in.txt", skip_empty=True)) == [(1, "a"), (2, "")]


def test_incomplete_model_folder_is_named(tmp_path):
    with pytest.raises(xp.PredictError, match=r"config/xr-linear\.json .*snakemake --cores all"):
        xp.Target.load(tmp_path / "results" / "toy" / "xr-linear")


def test_cli_errors_name_the_problem(tmp_path, capsys, monkeypatch):
    assert predict_stage.main(["--model", str(tmp_path / "results" / "toy" / "lightxml")]) == 2
    assert "incomplete model folder" in capsys.readouterr().err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert predict_stage.main(["--model", str(tmp_path / "results" / "toy" / "lightxml"), "--device", "cuda"]) == 2
    assert "--device cuda: device 'cuda' requested but CUDA is not available" in capsys.readouterr().err
    assert predict_stage.main(["--model", "x", "--top-k", "0"]) == 2


def _stored(tmp, method: str):
    """The DAG's test predictions of a target (CSR) and its test texts."""
    res = str(tmp / "results")
    settings = io.read_json(tmp / "results" / "toy" / "config" / f"{method}.json")["settings"]
    path = registry.get(method).predictions(res, "toy", settings, registry.split_method(method)[1])
    L = io.read_table(tmp / "results" / "toy" / "ingest" / "labels.parquet", ["label_id"]).num_rows
    texts = io.read_table(tmp / "results" / "toy" / "ingest" / "docs_test.parquet", ["text"]).column("text").to_pylist()
    return io.read_predictions(path, L), texts


def _same_as_dag(tmp, method: str, k: int = 3, exact: bool = True) -> None:
    stored, texts = _stored(tmp, method)
    target = xp.Target.load(tmp / "results" / "toy" / method)
    P = xp.predict_scores(target, texts, topk=k)
    assert P.shape == stored.shape
    agree = 0
    for i in range(len(texts)):
        ours = [d["label"] for d in xp.top_labels(target, P, i)]
        theirs = [d["label"] for d in xp.top_labels(target, stored, i)][:k]
        agree += ours[0] == theirs[0]
        if exact:
            assert ours == theirs, (method, i, ours, theirs)
            a, b = stored.indptr[i], stored.indptr[i + 1]
            want = dict(zip(stored.indices[a:b], stored.data[a:b]))
            got = dict(zip(P.indices[P.indptr[i]:P.indptr[i + 1]], P.data[P.indptr[i]:P.indptr[i + 1]]))
            np.testing.assert_allclose([got[j] for j in got], [want[j] for j in got], rtol=1e-4, atol=1e-5)
    # neural scores may differ in the last bits (other batches): the best label must not
    assert agree >= 0.95 * len(texts), (method, agree, len(texts))


@pytest.mark.slow
def test_linear_methods_answer_new_text_as_the_dag(toy_linear_run):
    for method in ("xr-linear", "parabel"):
        _same_as_dag(toy_linear_run, method)
    # the command: JSON lines with names and scores, best first; a file written whole
    src = toy_linear_run / "texts.txt"
    src.write_text("aw1 aw2 aw3 bw0 common filler\nhw1 hw2 hw3 hw4\n")
    out = toy_linear_run / "top.jsonl"
    r = subprocess.run([sys.executable, "-m", "xmc_steps.stages.predict", "--model", str(toy_linear_run / "results/toy/xr-linear"),
                        "--top-k", "2", "--input", str(src), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["line"] for x in rows] == [1, 2] and all(len(x["labels"]) == 2 for x in rows)
    assert rows[0]["labels"][0]["label"] == "a" and rows[1]["labels"][0]["label"] == "h"
    assert rows[0]["labels"][0]["score"] >= rows[0]["labels"][1]["score"] and "name" in rows[0]["labels"][0]
    # a linear target answers without torch, transformers, faiss, scikit-learn, MLflow or pandas (issue 55: the
    # command's start-up was most of its 2.9-4.6 s for one text; what is imported, not a timing)
    for method in ("xr-linear", "parabel"):
        code = ("import sys, runpy\n"
                f"sys.argv = ['x', '--model', {str(toy_linear_run / 'results/toy' / method)!r}, '--input', {str(src)!r}]\n"
                "try:\n    runpy.run_module('xmc_steps.stages.predict', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                "print(sorted(m for m in ('torch', 'transformers', 'faiss', 'sklearn', 'mlflow', 'pandas') "
                "if m in sys.modules), file=sys.stderr)")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0 and r.stdout.count('"line"') == 2, r.stderr
        assert r.stderr.strip().splitlines()[-1] == "[]", (method, r.stderr[-1000:])
    # bad input: a clear error naming the line; nothing written
    src.write_bytes(b"aw1\n\xff\xfe\n")
    out.unlink()
    r = subprocess.run([sys.executable, "-m", "xmc_steps.stages.predict", "--model", str(toy_linear_run / "results/toy/parabel"),
                        "--input", str(src), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 2 and f"{src}, line 2: not UTF-8" in r.stderr and not out.exists()


@pytest.mark.slow
def test_neural_methods_answer_new_text_as_the_dag(neural_toy_run):
    for t in ("xtransformer", "xtransformer-tfidf-tfn", "xtransformer-paper-candidates", "elias", "elias-ensemble",
              "lightxml", "lightxml-ensemble", "dual-encoder", "dual-encoder-ranker", "dual-encoder-ensemble"):
        _same_as_dag(neural_toy_run, t, exact=False)


def _fake_target(tmp_path, monkeypatch, noisy: bool):
    """A target of a registered fake method (labels a, b, c; scores 0.9, 0.5, 0.1 for every text) whose
    scoring writes to file descriptor 1, as omikuji's native logger does, when ``noisy``."""
    import os

    import scipy.sparse as sp

    res = tmp_path / "results"
    (res / "toy" / "config").mkdir(parents=True)
    io.write_json(res / "toy" / "config" / "fake.json", {"settings": {}})
    io.write_table(res / "toy" / "ingest" / "labels.parquet", {"label_id": ["a", "b", "c"], "label_text": ["A", "B", "C"]})

    def fake(t, variant, f, topk, device):
        if noisy:
            os.write(1, b"2026 INFO [omikuji::model] Loading model (native, on fd 1)\n")
        n = len(f.texts)
        return sp.csr_matrix(np.tile(np.array([[0.9, 0.5, 0.1]], np.float32), (n, 1)))

    from xmc_steps import methods, registry

    spec = methods.MethodSpec(name="fake", section="fake", sections=(), predictions=lambda *a: "", records=lambda *a: [],
                              predictor=fake, rules="")
    monkeypatch.setitem(registry.METHODS, "fake", spec)
    return res / "toy" / "fake"


class _Stdin:
    def __init__(self, data: bytes):
        import io as _io

        self.buffer = _io.BytesIO(data)


def test_stdout_carries_only_the_answers_when_native_code_prints(tmp_path, monkeypatch, capfd):
    model = _fake_target(tmp_path, monkeypatch, noisy=True)
    monkeypatch.setattr(sys, "stdin", _Stdin(b"first text\nsecond text\n"))
    assert predict_stage.main(["--model", str(model), "--top-k", "2", "--batch-size", "1"]) == 0
    out, err = capfd.readouterr()
    rows = [json.loads(x) for x in out.splitlines()]            # every stdout line is an answer
    assert [r["line"] for r in rows] == [1, 2] and rows[0]["labels"][0] == {"label": "a", "name": "A", "score": 0.9}
    assert err.count("Loading model (native, on fd 1)") == 2     # the native output went to stderr


def test_ids_with_stdin_input_are_counted_before_anything_is_printed(tmp_path, monkeypatch, capfd):
    model = _fake_target(tmp_path, monkeypatch, noisy=False)
    ids = tmp_path / "ids.txt"
    ids.write_bytes(b"\xef\xbb\xbfdoc-1\n")                     # a byte-order mark is not part of the id
    monkeypatch.setattr(sys, "stdin", _Stdin(b"one\ntwo\nthree\n"))
    assert predict_stage.main(["--model", str(model), "--ids", str(ids)]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "Traceback" not in err
    assert f"error: --ids {ids} has 1 lines, the input 3: one id per text, in order" in err
    # the same message as with --input FILE
    src = tmp_path / "in.txt"
    src.write_bytes(b"one\ntwo\nthree\n")
    assert predict_stage.main(["--model", str(model), "--ids", str(ids), "--input", str(src)]) == 2
    assert f"error: --ids {ids} has 1 lines, the input 3: one id per text, in order" in capfd.readouterr().err
    # as many ids as lines: each answer carries its id
    ids.write_bytes(b"\xef\xbb\xbfdoc-1\ndoc-2\ndoc-3\n")
    monkeypatch.setattr(sys, "stdin", _Stdin(b"\xef\xbb\xbfone\ntwo\nthree\n"))
    assert predict_stage.main(["--model", str(model), "--ids", str(ids), "--top-k", "1"]) == 0
    rows = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert [(r["line"], r["id"]) for r in rows] == [(1, "doc-1"), (2, "doc-2"), (3, "doc-3")]


def test_read_texts_drops_a_byte_order_mark_on_the_first_line_only():
    assert list(xp.read_texts([b"\xef\xbb\xbfa\n", b"\xef\xbb\xbfb\n"], "in.txt")) == [(1, "a"), (2, "\ufeffb")]


@pytest.mark.parametrize("params", [{"ngram_range": [1, 2], "min_df": 1, "sublinear_tf": True},
                                    {"ngram_range": [1, 1], "min_df": 2, "sublinear_tf": False, "lowercase": False}])
def test_few_texts_get_the_tfidf_bytes_of_the_dag_transform(params):
    """TfidfModel.transform_few (a service's or the command's few texts) against transform_batches (the
    DAG's): the same columns and float32 bits, one text at a time and in a batch, with repeated words,
    unknown words and texts with no known word."""
    from xmc_steps.tfidf import fit_transform

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(60)] + ["Åsa", "Det", "det", "n-gram", "x"]
    train = [" ".join(rng.choice(words, int(rng.integers(1, 40)))) for _ in range(200)]
    model, _ = fit_transform(train, {}, params)
    texts = train[:30] + ["", "   ", "unknown words only", "w1 w1 w1 w1 w2 zz", "Det det DET w3"]
    ref = model.transform_batches([texts])
    few = model.transform_few(texts)
    assert np.array_equal(few.indptr, ref.indptr) and np.array_equal(few.indices, ref.indices)
    assert few.dtype == np.float32 and np.array_equal(few.data.view(np.int32), ref.data.view(np.int32))
    for i, t in enumerate(texts):
        got, want = model.transform_few([t]), ref[i]
        assert np.array_equal(got.indices, want.indices) and np.array_equal(got.data.view(np.int32), want.data.view(np.int32))
    assert xp.FEW_TEXTS >= 1


@pytest.mark.parametrize("params", [{}, {"ngram_range": [1, 1]}, {"ngram_range": [1, 3], "lowercase": False},
                                    {"ngram_range": [2, 3]}, {"ngram_range": [3, 3], "lowercase": True}])
def test_the_few_texts_analyzer_lists_scikit_learns_ngrams(params):
    """tfidf.word_analyzer (the predict command's and a service's, without scikit-learn) against the
    vectorizer's own analyzer: the same n-grams in the same order, on texts with upper case that lower-cases
    to more characters, accents, digits, underscores, one-letter words, punctuation and no words at all."""
    from xmc_steps.tfidf import make_vectorizer, word_analyzer

    rng = np.random.default_rng(2)
    pieces = ["vim", "Vim-airline", "İstanbul", "ÅSA", "straße", "x", "a b", "3d", "_x_", "co-op's", "日本語",
              "ÉCOLE", "don't", "\t", "\n", "  ", ":", "..", "e-mail@x.org", "ǅ", "Σίσυφος", "ﬁle"]
    texts = ["", " ", "one", "a", "Two words", "A B C D"] + [
        "".join(rng.choice(pieces, int(rng.integers(1, 30))) + " ") for _ in range(200)]
    ours, theirs = word_analyzer(params), make_vectorizer(params).build_analyzer()
    for t in texts:
        assert ours(t) == theirs(t), t


@pytest.mark.parametrize("dense_above", [0.0, None])
def test_parabel_dense_weights_give_the_scores_of_the_sparse_model(tmp_path, monkeypatch, dense_above):
    """parabel.load holds the densest weight vectors dense (omikuji's densify_weights): every label and
    score bit as omikuji's model as saved, with every vector dense (0.0) and at the default threshold."""
    import omikuji
    import scipy.sparse as sp

    from xmc_steps.parabel import model as pm

    rng = np.random.default_rng(1)
    X = sp.random(240, 300, density=0.05, format="csr", dtype=np.float32, random_state=rng)
    X.data[:] = rng.random(X.nnz, dtype=np.float32) + 0.1
    Y = sp.csr_matrix((rng.random((240, 40)) < 0.08).astype(np.float32))
    pm.train(X, Y, {"min_branch_size": 5}, tmp_path, threads=1).save(str(tmp_path / "omikuji"))
    if dense_above is not None:
        monkeypatch.setattr(pm, "DENSE_ABOVE", dense_above)
    sparse = omikuji.Model.load(str(tmp_path / "omikuji"))
    dense = pm.load(tmp_path / "omikuji", threads=1)
    for i in range(X.shape[0]):
        feats = list(zip(X.indices[X.indptr[i]:X.indptr[i + 1]].tolist(), X.data[X.indptr[i]:X.indptr[i + 1]].tolist()))
        want = sparse.predict(feats, beam_size=4, top_k=40)
        got = dense.predict(feats, beam_size=4, top_k=40)
        assert sorted(got) == sorted(want), i      # labels and float32 scores, exactly
    a, b = pm.predict(sparse, X, 40, 4, 40), pm.predict(dense, X, 40, 4, 40)
    assert (a != b).nnz == 0


def _predict_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmc_steps.stages.predict", *args], cwd=ROOT, capture_output=True,
                          text=True, input=stdin, timeout=1200)


def test_an_unwritable_out_is_one_line_before_any_work(tmp_path):
    """Issue 54: --out under a file, in a missing folder, or naming a folder is named at once (before the model
    is even read: the model here does not exist), in one line, with no traceback."""
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    texts = tmp_path / "texts.txt"
    texts.write_text("a text\n")
    cases = {str(a_file / "out.jsonl"): f"{a_file} is a file, not a folder",
             str(tmp_path / "missing" / "out.jsonl"): f"the folder {tmp_path / 'missing'} does not exist",
             str(tmp_path): "is a folder; give a file name"}
    for out, message in cases.items():
        r = _predict_cli("--model", str(tmp_path / "no-model"), "--input", str(texts), "--out", out)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_an_input_folder_is_named_as_one(tmp_path):
    r = _predict_cli("--model", str(tmp_path / "no-model"), "--input", str(tmp_path))
    assert r.returncode == 2 and f"--input {tmp_path}: is a folder, not a file of texts" in r.stderr
    r = _predict_cli("--model", str(tmp_path / "no-model"), "--input", str(tmp_path / "nope.txt"))
    assert r.returncode == 2 and "no such file" in r.stderr


def test_a_pipe_is_an_input_file(tmp_path, monkeypatch, capfd):
    """``--input <(head -1 f)``: the shell passes /dev/fd/N, a pipe that is no regular file and reads once."""
    import os
    import threading

    model = _fake_target(tmp_path, monkeypatch, noisy=False)
    fifo = tmp_path / "texts.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"first text\nsecond text\n"))
    writer.start()
    try:
        assert predict_stage.main(["--model", str(model), "--input", str(fifo), "--top-k", "1"]) == 0
    finally:
        writer.join(timeout=30)
    rows = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert [r["line"] for r in rows] == [1, 2]
