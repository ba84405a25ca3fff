"""Ingest: layouts, alignment rules and every bad-input error of the foundation issue."""

import json

import numpy as np
import pytest

from conftest import write_raw_dataset
from xmc_steps import config, io
from xmc_steps.stages.ingest import main as ingest_main
from xmc_steps.errors import StageError

SETTINGS = config.dataset_settings(config.load(config.SCHEMA_PATH.parents[2] / "config.yaml"), "x")


def run_ingest(tmp_path, name="toy", data_dir=None, settings=None, extra=()):
    out = tmp_path / "out"
    argv = ["--name", name, "--data-dir", str(data_dir or tmp_path / "data"), "--out", str(out),
            "--params", json.dumps(settings or SETTINGS), "--record", str(out / "record.json"), *extra]
    ingest_main(argv)
    return out


TRAIN = [(f"doc {i} about apples", ["a", "b"] if i % 2 else ["c"]) for i in range(20)]
TEST = [("apples again", ["a"]), ("", ["b"]), ("no labels here", [])]


def test_raw_layout_roundtrip(tmp_path):
    write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    out = run_ingest(tmp_path)
    labels = io.read_table(out / "labels.parquet").to_pydict()
    assert labels["label_id"] == ["a", "b", "c"]
    assert sum(labels["train_freq"]) == sum(len(l) for _, l in TRAIN)
    docs = {s: io.read_table(out / f"docs_{s}.parquet").to_pydict() for s in ("train", "valid", "test")}
    assert len(docs["train"]["text"]) + len(docs["valid"]["text"]) == 20
    assert len(docs["valid"]["text"]) == 2  # 10% of 20
    # texts stay aligned with labels, also after the validation carve-out
    for s in ("train", "valid"):
        for line, text, labs in zip(docs[s]["source_line"], docs[s]["text"], docs[s]["labels"]):
            want = TRAIN[line - 1]
            assert text == want[0]
            assert [labels["label_id"][j] for j in labs] == sorted(want[1])
    Y = io.load_csr(out / "Y_test.npz")
    assert Y.shape == (3, 3) and Y.nnz == 2
    report = json.loads((out / "ingest.json").read_text())
    assert report["splits"]["test"]["empty_docs"] == 1
    assert report["splits"]["test"]["docs_without_labels"] == 1


def test_valid_split_is_deterministic(tmp_path):
    write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    a = io.read_table(run_ingest(tmp_path) / "docs_valid.parquet").to_pydict()["source_line"]
    b = io.read_table(run_ingest(tmp_path) / "docs_valid.parquet").to_pydict()["source_line"]
    assert a == b


def test_line_count_mismatch_names_both_files(tmp_path):
    d = write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    (d / "train_labels.txt").write_text("a\n" * 19)
    with pytest.raises(StageError) as e:
        run_ingest(tmp_path)
    msg = str(e.value)
    assert "train_texts.txt has 20 lines" in msg and "train_labels.txt has 19" in msg
    assert not (tmp_path / "out" / "docs_train.parquet").exists()


def test_non_utf8_names_file_and_line(tmp_path):
    d = write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    raw = (d / "test_texts.txt").read_bytes().split(b"\n")
    raw[1] = b"caf\xe9 latte"
    (d / "test_texts.txt").write_bytes(b"\n".join(raw))
    with pytest.raises(StageError, match=r"test_texts.txt:2: bytes that are not UTF-8 at column 4"):
        run_ingest(tmp_path)
    assert not list(tmp_path.glob("out/*"))  # nothing of the failed job is left
    # the documented replacement policy
    s = json.loads(json.dumps(SETTINGS))
    s["ingest"]["encoding_errors"] = "replace"
    out = run_ingest(tmp_path, settings=s)
    assert json.loads((out / "ingest.json").read_text())["replaced_bytes"] == 1
    assert io.read_table(out / "docs_test.parquet").to_pydict()["text"][1] == "caf\ufffd latte"


def test_label_missing_from_label_ids(tmp_path):
    write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST + [("x", ["zzz"])], label_ids=["a", "b", "c"],
                      label_texts=["A", "B", "C"])
    with pytest.raises(StageError, match=r"test_labels.txt:4: label 'zzz' is not in .*label_ids.txt"):
        run_ingest(tmp_path)


def test_label_texts_used(tmp_path):
    write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST, label_ids=["c", "b", "a", "d"], label_texts=["C", "B", "A", "D"])
    out = run_ingest(tmp_path)
    t = io.read_table(out / "labels.parquet").to_pydict()
    assert t["label_id"] == ["c", "b", "a", "d"] and t["label_text"] == ["C", "B", "A", "D"]
    assert t["train_freq"][3] == 0  # listed but never used: legal


def test_unknown_dataset_lists_known(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(StageError) as e:
        run_ingest(tmp_path, name="nosuch")
    assert "unknown dataset 'nosuch'" in str(e.value) and "wiki500k" in str(e.value) and "debtags" in str(e.value)


def test_stray_carriage_returns_and_separators_do_not_shift_lines(tmp_path):
    train = [("first\rline with \x0c form feed and \u2028 separator", ["a"]), ("second", ["b"])] * 5
    write_raw_dataset(tmp_path / "data" / "toy", train, TEST)
    out = run_ingest(tmp_path)
    docs = io.read_table(out / "docs_train.parquet").to_pydict()
    for line, labs in zip(docs["source_line"], docs["labels"]):
        assert list(labs) == ([0] if line % 2 else [1])
    assert len(docs["source_line"]) + len(io.read_table(out / "docs_valid.parquet").to_pydict()["text"]) == 10


def test_bow_layout(tmp_path):
    d = tmp_path / "data" / "eurlex4k"
    d.mkdir(parents=True)
    (d / "train.txt").write_text("3 5 2\n0,1 0:1.0 3:2.0\n1 2:0.5\n 4:1\n")
    (d / "test.txt").write_text("1 5 2\n0 1:1.0\n")
    out = run_ingest(tmp_path, name="eurlex4k")
    X = io.load_csr(out / "X_dataset_test.npz")
    assert X.shape == (1, 5) and X[0, 1] == 1.0
    Y = np.vstack([io.load_csr(out / f"Y_{s}.npz").toarray() for s in ("train", "valid")])
    assert Y.sum() == 3


def test_bow_bad_feature(tmp_path):
    d = tmp_path / "data" / "eurlex4k"
    d.mkdir(parents=True)
    (d / "train.txt").write_text("2 5 2\n0 0:1.0\n1 7:1\n")
    (d / "test.txt").write_text("1 5 2\n0 1:1.0\n")
    with pytest.raises(StageError, match=r"train.txt:3: feature '7:1' outside \[0, 5\)"):
        run_ingest(tmp_path, name="eurlex4k")


BOM = b"\xef\xbb\xbf"


def test_byte_order_marks_are_not_part_of_the_first_line(tmp_path):
    d = write_raw_dataset(tmp_path / "data" / "toy", [("cocoa beans", ["cocoa"]), ("tea leaves", ["tea"])] * 5,
                          [("cocoa", ["cocoa"]), ("tea", ["tea"])])
    for name in ("train_labels.txt", "train_texts.txt", "test_labels.txt"):
        (d / name).write_bytes(BOM + (d / name).read_bytes())
    out = run_ingest(tmp_path)
    assert io.read_table(out / "labels.parquet").to_pydict()["label_id"] == ["cocoa", "tea"]   # not '\ufeffcocoa'
    docs = io.read_table(out / "docs_train.parquet").to_pydict()
    assert all(not t.startswith("\ufeff") for t in docs["text"])
    # label_ids.txt and label_texts.txt with a byte-order mark: the first id is found, its text clean
    (d / "label_ids.txt").write_bytes(BOM + b"cocoa\ntea\n")
    (d / "label_texts.txt").write_bytes(BOM + b"Cocoa\nTea\n")
    t = io.read_table(run_ingest(tmp_path) / "labels.parquet").to_pydict()
    assert t["label_id"] == ["cocoa", "tea"] and t["label_text"] == ["Cocoa", "Tea"]


def test_bow_header_after_a_byte_order_mark(tmp_path):
    d = tmp_path / "data" / "eurlex4k"
    d.mkdir(parents=True)
    (d / "train.txt").write_bytes(BOM + b"2 5 2\n0 0:1.0\n1 2:0.5\n")
    (d / "test.txt").write_bytes(BOM + b"1 5 2\n0 1:1.0\n")
    out = run_ingest(tmp_path, name="eurlex4k")
    assert io.load_csr(out / "X_dataset_test.npz").shape == (1, 5)


@pytest.mark.parametrize("split", ["train", "test"])
def test_an_empty_split_is_rejected_naming_its_file(tmp_path, split):
    d = write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    (d / f"{split}_texts.txt").write_text("")
    (d / f"{split}_labels.txt").write_text("")
    with pytest.raises(StageError, match=rf"{split}_texts.txt: the {split} split has no documents"):
        run_ingest(tmp_path)
    assert not (tmp_path / "out" / "docs_train.parquet").exists()


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_split_without_any_label_is_rejected_naming_its_file(tmp_path, split):
    rows = {"train": TRAIN, "test": TEST}
    rows[split] = [(t, []) for t, _ in rows[split]]
    write_raw_dataset(tmp_path / "data" / "toy", rows["train"], rows["test"])
    n = len(rows[split])
    with pytest.raises(StageError, match=rf"{split}_labels.txt: no document of the {split} split \({n} documents\) has a label"):
        run_ingest(tmp_path)


def test_bow_split_without_documents_or_labels_is_rejected(tmp_path):
    d = tmp_path / "data" / "eurlex4k"
    d.mkdir(parents=True)
    (d / "train.txt").write_text("2 5 2\n0 0:1.0\n1 2:0.5\n")
    (d / "test.txt").write_text("0 5 2\n")
    with pytest.raises(StageError, match=r"test.txt: the test split has no documents"):
        run_ingest(tmp_path, name="eurlex4k")
    (d / "test.txt").write_text("1 5 2\n 1:1.0\n")
    with pytest.raises(StageError, match=r"test.txt: no document of the test split \(1 documents\) has a label"):
        run_ingest(tmp_path, name="eurlex4k")


def test_each_count_mismatch_says_what_its_lines_are(tmp_path):
    d = write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST, label_ids=["a", "b", "c"], label_texts=["A", "B"])
    with pytest.raises(StageError) as e:
        run_ingest(tmp_path)
    assert "label_ids.txt has 3 lines but" in str(e.value) and "label_texts.txt has 2" in str(e.value)
    assert "one line (the label's text) per label id" in str(e.value) and "labels line" not in str(e.value)
    (d / "label_texts.txt").write_text("A\nB\nC\n")
    (d / "test_ids.txt").write_text("x\ny\n")
    with pytest.raises(StageError) as e:
        run_ingest(tmp_path)
    assert "test_ids.txt has 2" in str(e.value) and "each document needs exactly one id line" in str(e.value)
    assert "labels line" not in str(e.value)


def test_bow_rejects_unicode_digits_and_non_finite_values(tmp_path):
    d = tmp_path / "data" / "eurlex4k"
    d.mkdir(parents=True)
    (d / "test.txt").write_text("1 5 2\n0 1:1.0\n")
    for body, msg in (("2 5 ²\n0 0:1\n1 1:1\n", r"train.txt:1: expected a header"),
                      ("2 5 2\n² 0:1\n1 1:1\n", r"train.txt:2: label '²' is not an integer"),
                      ("2 5 2\n0 ²:1\n1 1:1\n", r"train.txt:2: malformed feature '²:1'"),
                      ("2 5 2\n0 0:nan\n1 1:1\n", r"train.txt:2: feature '0:nan': the value is not a finite"),
                      ("2 5 2\n0 0:1e39\n1 1:1\n", r"train.txt:2: feature '0:1e39': the value is not a finite"),
                      ("2 99999999999 2\n0 0:1\n1 1:1\n", r"train.txt:1: header .*at most 2147483647")):
        (d / "train.txt").write_text(body, encoding="utf-8")
        with pytest.raises(StageError, match=msg):
            run_ingest(tmp_path, name="eurlex4k")


def test_a_carriage_return_inside_a_labels_line_is_an_error(tmp_path):
    d = write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    # old Mac line ends: one "line" of texts and of labels; read as is, three documents would become one
    (d / "test_texts.txt").write_bytes(b"apples\rpears\rplums\n")
    (d / "test_labels.txt").write_bytes(b"a\rb\rc\n")
    with pytest.raises(StageError, match=r"test_labels.txt:1: a carriage return inside a labels line"):
        run_ingest(tmp_path)


def test_a_duplicated_label_id_names_its_line_and_the_first(tmp_path):
    write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST, label_ids=["a", "b", "c", "b"],
                      label_texts=["A", "B", "C", "B2"])
    with pytest.raises(StageError, match=r"label_ids.txt:4: label id 'b' repeats line 2$"):
        run_ingest(tmp_path)


def test_valid_size_carves_that_many_documents(tmp_path):
    """``split.valid_size`` (config.paper.yaml: ELIAS's 5,000) replaces ``valid_fraction``; the default
    (null) keeps the fraction, and a size larger than train leaves one training document."""
    from xmc_steps.ingest import carve_valid

    assert [len(a) for a in carve_valid(20, 0.1, 0)] == [18, 2]
    assert [len(a) for a in carve_valid(20, 0.1, 0, None)] == [18, 2]
    assert [len(a) for a in carve_valid(20, 0.1, 0, 5)] == [15, 5]
    assert [len(a) for a in carve_valid(20, 0.1, 0, 5000)] == [1, 19]
    assert [len(a) for a in carve_valid(20, 0.1, 0, 0)] == [20, 0]
    write_raw_dataset(tmp_path / "data" / "toy", TRAIN, TEST)
    out = run_ingest(tmp_path, settings={**SETTINGS, "split": {**SETTINGS["split"], "valid_size": 5}})
    assert len(io.read_table(out / "docs_valid.parquet").to_pydict()["text"]) == 5
    assert len(io.read_table(out / "docs_train.parquet").to_pydict()["text"]) == 15


def test_labels_separated_by_commas_are_an_error_naming_file_and_line(tmp_path):
    train = TRAIN[:3] + [("doc about pears", ["a,b"])] + TRAIN[3:]
    write_raw_dataset(tmp_path / "data" / "toy", train, TEST)
    with pytest.raises(StageError, match=r"train_labels.txt:4: labels separated by commas \('a,b'\)"):
        run_ingest(tmp_path)


def test_a_declared_label_id_may_hold_a_comma(tmp_path):
    train = [(t, ["x,y"] if i == 0 else l) for i, (t, l) in enumerate(TRAIN)]
    write_raw_dataset(tmp_path / "data" / "toy", train, TEST, label_ids=["a", "b", "c", "x,y"])
    out = run_ingest(tmp_path)
    assert "x,y" in io.read_table(out / "labels.parquet").to_pydict()["label_id"]
