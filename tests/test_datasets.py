"""Finding a dataset (xmc_steps.datasets): each unreadable path is its own one-line error, the
xmc-base layout is read and checked like the others, and tfidf.source picks the features."""

import json
import os

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import write_raw_dataset
from xmc_steps import datasets, io, synth
from xmc_steps.datasets import locate
from xmc_steps.errors import StageError
from test_ingest import SETTINGS, run_ingest

TINY = synth.Shape("tiny", 40, 12, 8, 2.0, 12.0, vocab=60, topic_words=3, signal=0.5)


def _xmc_base(folder):
    synth.write(TINY, 1.0, folder, seed=0, layout="xmc-base")
    return folder


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_a_missing_benchmark_names_its_url_files_folder_and_synth(tmp_path):
    with pytest.raises(StageError) as e:
        locate("wiki500k", tmp_path)
    msg = _one_line(e)
    assert "https://archive.org/download/pecos-dataset/xmc-base/wiki-500k.tar.gz" in msg
    assert str(tmp_path / "xmc-base" / "wiki-500k") in msg and "X.trn.txt" in msg and "tfidf-attnxml/X.tst.npz" in msg
    assert "python -m xmc_steps.stages.synth" in msg
    # the DAG then asks the fetch rule for exactly those files
    fetched = [tmp_path / "xmc-base" / "wiki-500k" / n for n in datasets.XMC_BASE_FILES]
    assert datasets.dataset_inputs("wiki500k", tmp_path) == fetched
    # a seed replica's path (config.dataset_settings) is that folder: the same files
    from xmc_steps import config

    cfg = config.load(config.SCHEMA_PATH.parents[2] / "config.yaml")
    cfg = config.deep_merge(cfg, {"data_dir": str(tmp_path), "defaults": {"seeds": [0, 1]}})
    s = config.dataset_settings(cfg, "wiki500k-seed1")
    assert s["replica_of"] == "wiki500k"
    assert datasets.dataset_inputs("wiki500k", tmp_path, s["path"]) == fetched


def test_a_missing_folder_of_another_dataset_says_where_its_files_go(tmp_path):
    with pytest.raises(StageError) as e:
        datasets.dataset_inputs("mine", tmp_path, str(tmp_path / "nowhere"))
    msg = _one_line(e)
    assert f"{tmp_path / 'nowhere'}/" in msg and "train_texts.txt" in msg and "xmc_steps.stages.synth" in msg
    assert "https://" not in msg


def test_a_missing_test_split_is_named(tmp_path):
    d = write_raw_dataset(tmp_path / "toy", [("a b", ["x"])], [("c", ["x"])])
    (d / "test_labels.txt").unlink()
    with pytest.raises(StageError) as e:
        locate("toy", tmp_path)
    assert _one_line(e) == f"dataset 'toy': {d / 'test_labels.txt'}: missing (the test split's labels, raw-text layout)"
    x = _xmc_base(tmp_path / "xb")
    (x / "X.tst.txt").unlink()
    with pytest.raises(StageError, match=r"X.tst.txt: missing \(the test split's texts, xmc-base layout\)"):
        locate("xb", tmp_path)


def test_a_directory_where_a_file_belongs_and_link_problems_are_named(tmp_path):
    d = write_raw_dataset(tmp_path / "toy", [("a b", ["x"])], [("c", ["x"])])
    (d / "test_texts.txt").unlink()
    (d / "test_texts.txt").mkdir()
    with pytest.raises(StageError) as e:
        locate("toy", tmp_path)
    assert _one_line(e).endswith(f"{d / 'test_texts.txt'}: a directory where a file belongs")
    os.rmdir(d / "test_texts.txt")
    os.symlink(d / "test_texts.txt", d / "test_texts.txt")          # a link to itself
    with pytest.raises(StageError) as e:
        locate("toy", tmp_path)
    assert _one_line(e).endswith(f"{d / 'test_texts.txt'}: a symbolic link loop")
    os.unlink(d / "test_texts.txt")
    os.symlink(tmp_path / "gone.txt", d / "test_texts.txt")
    with pytest.raises(StageError, match=r"test_texts.txt: a broken symbolic link \(to .*gone.txt\)"):
        locate("toy", tmp_path)
    # a dataset folder that is a link loop is named too (is_dir() alone would call it absent)
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(StageError) as e:
        locate("loop", tmp_path, str(tmp_path / "loop"))
    assert _one_line(e) == f"dataset 'loop': {tmp_path / 'loop'}: a symbolic link loop"


def test_xmc_base_layout_is_read_with_its_labels_label_texts_and_features(tmp_path):
    x = _xmc_base(tmp_path / "data" / "xb")
    files = locate("xb", tmp_path / "data")
    assert files.layout == "xmc-base" and files.label_texts == x / "output-items.txt"
    out = run_ingest(tmp_path, name="xb")
    labels = io.read_table(out / "labels.parquet").to_pydict()
    items = (x / "output-items.txt").read_text().splitlines()
    assert labels["label_id"] == [str(i) for i in range(8)] and labels["label_text"] == items
    Y_trn = sp.load_npz(x / "Y.trn.npz").tocsr()
    X_trn = sp.load_npz(x / "tfidf-attnxml" / "X.trn.npz").tocsr()
    texts = (x / "X.trn.txt").read_text().splitlines()
    for split in ("train", "valid"):
        docs = io.read_table(out / f"docs_{split}.parquet").to_pydict()
        own = io.load_csr(out / f"X_dataset_{split}.npz")
        for i, (line, text, labs) in enumerate(zip(docs["source_line"], docs["text"], docs["labels"])):
            assert text == texts[line - 1]
            assert list(labs) == sorted(Y_trn[line - 1].indices)
            assert (own[i] != X_trn[line - 1]).nnz == 0
    assert json.loads((out / "ingest.json").read_text())["has_own_features"]


def _ingest_error(tmp_path, name="xb") -> str:
    with pytest.raises(StageError) as e:
        run_ingest(tmp_path, name=name)
    return _one_line(e)


def test_xmc_base_row_counts_label_ids_and_features_are_checked(tmp_path):
    x = _xmc_base(tmp_path / "data" / "xb")
    good = {p: p.read_bytes() for p in x.rglob("*") if p.is_file()}

    def restore():
        for p, b in good.items():
            p.write_bytes(b)

    (x / "X.trn.txt").write_text("".join(line + "\n" for line in (x / "X.trn.txt").read_text().splitlines()[:-1]))
    assert _ingest_error(tmp_path) == f"{x / 'Y.trn.npz'}: 40 rows but {x / 'X.trn.txt'} has 39 lines; row i holds the labels of line i"
    restore()
    (x / "output-items.txt").write_text("".join(f"l{j}\n" for j in range(5)))
    Y = sp.load_npz(x / "Y.trn.npz").tocsr()
    first = next(r for r in range(Y.shape[0]) if (Y[r].indices >= 5).any())
    msg = _ingest_error(tmp_path)
    assert msg.startswith(f"{x / 'Y.trn.npz'}: row {first} (line {first + 1} of {x / 'X.trn.txt'}) has label ")
    assert msg.endswith(f"but {x / 'output-items.txt'} lists 5 labels")
    restore()
    X = sp.load_npz(x / "tfidf-attnxml" / "X.tst.npz").tocsr()
    sp.save_npz(x / "tfidf-attnxml" / "X.tst.npz", X[:-2])
    assert _ingest_error(tmp_path).startswith(f"{x / 'tfidf-attnxml' / 'X.tst.npz'}: 10 rows but {x / 'X.tst.txt'} has 12 lines")
    sp.save_npz(x / "tfidf-attnxml" / "X.tst.npz", sp.hstack([X, X]).tocsr())
    assert "feature columns, but the train split's features have" in _ingest_error(tmp_path)
    (x / "Y.tst.npz").write_bytes(b"not a zip")
    assert _ingest_error(tmp_path).startswith(f"{x / 'Y.tst.npz'}: not a scipy sparse matrix (.npz)")
    restore()
    (x / "tfidf-attnxml" / "X.tst.npz").unlink()       # one split's features alone cannot be used
    assert _ingest_error(tmp_path).endswith("X.tst.npz: missing (the test split's features, xmc-base layout)")


@pytest.mark.parametrize("source", ["pipeline", "dataset"])
def test_tfidf_source_picks_the_pipelines_or_the_datasets_features(tmp_path, source):
    from xmc_steps.stages.tfidf import main as tfidf_main

    x = _xmc_base(tmp_path / "data" / "xb")
    out = run_ingest(tmp_path, name="xb")
    feats = tmp_path / "tfidf"
    params = {**SETTINGS["tfidf"], "source": source, "min_df": 1}
    tfidf_main(["--ingest", str(out), "--out", str(feats), "--params", json.dumps(params), "--dataset", "xb",
                "--record", str(feats / "record.json"), "--no-tracking"])
    X = io.load_csr(feats / "X_test.npz")
    own = sp.load_npz(x / "tfidf-attnxml" / "X.tst.npz")
    assert (X.shape[1] == own.shape[1]) == (source == "dataset")      # the pipeline's has bigrams too
    assert np.allclose(sp.linalg.norm(X, axis=1)[X.getnnz(axis=1) > 0], 1.0, atol=1e-5)


def test_tfidf_source_dataset_without_own_features_is_an_error(tmp_path):
    from xmc_steps.stages.tfidf import main as tfidf_main

    write_raw_dataset(tmp_path / "data" / "toy", [("a b", ["x"]), ("b c", ["y"])], [("c", ["x"])])
    out = run_ingest(tmp_path)
    with pytest.raises(StageError, match=r"X_dataset_train.npz: tfidf.source is dataset, but dataset 'toy' has no "
                                         r"features of its own \(layout raw"):
        tfidf_main(["--ingest", str(out), "--out", str(tmp_path / "f"), "--dataset", "toy", "--no-tracking",
                    "--params", json.dumps({**SETTINGS["tfidf"], "source": "dataset"})])


def test_synth_writes_the_xmc_base_layout_from_the_cli(tmp_path):
    from xmc_steps.stages import synth as synth_stage

    out = tmp_path / "wiki500k-xb"
    synth_stage.main(["--shape", "wiki500k", "--fraction", "0.00003", "--layout", "xmc-base", "--out", str(out)])
    assert all((out / n).is_file() for n in datasets.XMC_BASE_FILES)
    Y = sp.load_npz(out / "Y.trn.npz")
    assert Y.shape == (round(0.00003 * 1_779_881), 501_070)
    assert len((out / "output-items.txt").read_text().splitlines()) == 501_070
    assert locate("wiki500k-xb", tmp_path).layout == "xmc-base"


def test_a_target_on_the_datasets_features_refuses_new_text():
    from types import SimpleNamespace

    from xmc_steps.serving import Features, PredictError

    target = SimpleNamespace(settings={"tfidf": {"source": "dataset"}}, res="results", dataset="eurlex4k")
    with pytest.raises(PredictError, match=r"eurlex4k: .*tfidf.source: dataset.*new text has none"):
        Features(target, ["a new text"]).tfidf


def test_an_ingest_folder_of_an_earlier_version_asks_for_ingest_again(tmp_path):
    from xmc_steps.stages.tfidf import main as tfidf_main

    out = tmp_path / "ingest"
    out.mkdir()
    (out / "ingest.json").write_text(json.dumps({"layout": "bow"}))
    (out / "X_bow_train.npz").write_bytes(b"")
    with pytest.raises(StageError, match=r"X_dataset_train.npz: missing; .* run ingest again"):
        tfidf_main(["--ingest", str(out), "--out", str(tmp_path / "f"), "--dataset", "old", "--no-tracking",
                    "--params", json.dumps(SETTINGS["tfidf"])])
