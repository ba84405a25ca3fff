"""Property-based tests (hypothesis) of the dataset readers: the raw-text layout, the BoW layout,
label texts and id files (:mod:`xmc_steps.ingest`, found by :mod:`xmc_steps.datasets`).

Whatever the bytes (random, truncated, with CRLF or old-Mac CR line ends, byte-order marks, NULs,
huge lines, empty files, one line too many or too few), a reader either parses them correctly or
raises :class:`StageError` naming the file; no other exception, and never texts silently shifted
against labels.  Alignment is checked independently of the reader: document ``i`` says ``doc<i>``
in its text and carries the label ``L<i>``, so a shift shows whatever the reader does.

Example counts are modest (the file runs in well under a minute on two cores); each test counts
the examples it ran in ``TRIED`` and prints the count (``pytest -s``).  Measured on the 2-core
development machine: 8 tests, 1,092 examples (40 of them whole ingests), about 9 s.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xmc_steps import config, io  # noqa: E402
from xmc_steps.datasets import locate  # noqa: E402
from xmc_steps.ingest import ingest, parse_bow, parse_raw_split, read_label_index, read_lines  # noqa: E402
from xmc_steps.errors import StageError  # noqa: E402

SETTINGS = config.dataset_settings(config.load(config.SCHEMA_PATH.parents[2] / "config.yaml"), "x")
TRIED: Counter = Counter()
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    print("\nhypothesis examples tried:", dict(TRIED), "total", sum(TRIED.values()))


class Folder:
    """A fresh temporary folder per example (pytest's tmp_path is one per test, not per example)."""

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix="xmc-prop-"))
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _expect_error_naming(e: StageError, *paths: Path) -> None:
    msg = str(e)
    assert any(str(p) in msg for p in paths), msg
    assert "Traceback" not in msg


# --------------------------------------------------------------------------- strategies

# anything but a line feed: CR, NUL, form feed, U+2028, U+FEFF, any plane (no lone surrogates: not encodable)
noise = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=30)
# no comma: a label "a,b" is a file separated by commas (an error, xmc_steps.ingest.check_separators)
label_token = st.text(st.characters(whitelist_categories=("L", "N", "P", "S"), blacklist_characters=","),
                      min_size=1, max_size=6)


@st.composite
def raw_docs(draw, min_docs=0, max_docs=12):
    n = draw(st.integers(min_docs, max_docs))
    docs = []
    for i in range(n):
        text = f"doc{i} " + draw(noise)
        if draw(st.integers(0, 30)) == 0:
            text += "x" * 100_000                                   # a huge line
        extra = draw(st.lists(label_token, max_size=3))
        labels = [] if draw(st.integers(0, 5)) == 0 else [f"L{i}"] + extra
        docs.append((text, labels))
    return docs


@st.composite
def line_style(draw):
    return {"crlf": draw(st.booleans()), "bom": draw(st.booleans()), "final_newline": draw(st.booleans())}


def encode_lines(lines: list[str], style: dict) -> bytes:
    end = "\r\n" if style["crlf"] else "\n"
    body = end.join(lines) + (end if style["final_newline"] and lines else "")
    return (BOM if style["bom"] else b"") + body.encode("utf-8")


def reference_lines(data: bytes) -> list[str]:
    """The documented reading of a UTF-8 file, restated on str: a leading byte-order mark dropped, lines
    split on LF only, a final LF ends the last line, one trailing CR per line dropped.  (So a file whose
    last line is empty and unterminated has one line fewer than was meant: the reader cannot know, and
    the count check catches the difference.)"""
    text = data.decode("utf-8")
    text = text[1:] if text.startswith("\ufeff") else text
    text = text[:-1] if text.endswith("\n") else text
    return [x[:-1] if x.endswith("\r") else x for x in text.split("\n")] if text else []


def _write_raw(folder: Path, train, test, styles) -> dict[str, bytes]:
    written = {}
    for split, docs in (("train", train), ("test", test)):
        written[f"{split}_texts"] = encode_lines([t for t, _ in docs], styles[f"{split}_texts"])
        written[f"{split}_labels"] = encode_lines([" ".join(l) for _, l in docs], styles[f"{split}_labels"])
    for name, data in written.items():
        (folder / f"{name}.txt").write_bytes(data)
    return written


def _check_aligned(texts, labels) -> None:
    assert len(texts) == len(labels)
    for i, (t, labs) in enumerate(zip(texts, labels)):
        assert t.startswith(f"doc{i} "), (i, t[:20])
        assert not labs or labs[0] == f"L{i}", (i, labs)


# --------------------------------------------------------------------------- line reader


@FAST
@given(data=st.binary(max_size=300), bom=st.booleans())
def test_read_lines_on_random_bytes(data, bom):
    TRIED["read_lines"] += 1
    with Folder() as d:
        p = d / "f.txt"
        p.write_bytes((BOM if bom else b"") + data)
        try:
            lines, _ = read_lines(p)
        except StageError as e:
            _expect_error_naming(e, p)
            assert ": bytes that are not UTF-8 at column" in str(e)
            with pytest.raises(UnicodeDecodeError):
                data.decode("utf-8")
            return
        assert lines == reference_lines(p.read_bytes())
        replaced, n = read_lines(p, "replace")
        assert replaced == lines and n == 0


@FAST
@given(data=st.binary(max_size=200))
def test_read_lines_replace_policy_never_fails(data):
    TRIED["read_lines_replace"] += 1
    with Folder() as d:
        p = d / "f.txt"
        p.write_bytes(data)
        lines, replaced = read_lines(p, "replace")
        body = io.strip_bom(data)
        body = body[:-1] if body.endswith(b"\n") else body
        assert len(lines) == (body.count(b"\n") + 1 if body else 0) and replaced >= 0
        assert all("\n" not in x for x in lines)


# --------------------------------------------------------------------------- raw-text layout


@FAST
@given(docs=raw_docs(), ts=line_style(), ls=line_style(), ids=st.booleans(), ids_style=line_style(),
       cut=st.sampled_from(["none", "texts-", "labels-", "labels+", "ids-"]))
def test_raw_split_parses_aligned_or_names_the_file(docs, ts, ls, ids, ids_style, cut):
    """Texts, labels and ids files in any line style: aligned as written, or a mismatch error."""
    TRIED["raw_split"] += 1
    with Folder() as d:
        texts = [t for t, _ in docs]
        labels = [" ".join(l) for _, l in docs]
        id_lines = [f"id{i}" for i in range(len(docs))]
        if cut == "texts-" and texts:
            texts = texts[:-1]
        if cut == "labels-" and labels:
            labels = labels[:-1]
        if cut == "labels+":
            labels = labels + ["L0"]
        if cut == "ids-" and id_lines:
            id_lines = id_lines[:-1]
        t_bytes, l_bytes, i_bytes = encode_lines(texts, ts), encode_lines(labels, ls), encode_lines(id_lines, ids_style)
        (d / "train_texts.txt").write_bytes(t_bytes)
        (d / "train_labels.txt").write_bytes(l_bytes)
        (d / "test_texts.txt").write_text("t\n")
        (d / "test_labels.txt").write_text("a\n")
        if ids:
            (d / "train_ids.txt").write_bytes(i_bytes)
        files = locate("prop", d.parent, str(d))
        want_t, want_l, want_i = (reference_lines(b) for b in (t_bytes, l_bytes, i_bytes))
        mismatch = len(want_t) != len(want_l) or (ids and len(want_i) != len(want_t))
        try:
            got_t, got_l, got_ids, replaced = parse_raw_split(files, "train", "strict")
        except StageError as e:
            assert mismatch, str(e)
            _expect_error_naming(e, d / "train_texts.txt")
            assert "line counts differ" in str(e)
            return
        assert not mismatch
        assert got_t == want_t and [" ".join(x) for x in got_l] == want_l
        assert got_ids == (want_i if ids else [str(i) for i in range(1, len(want_t) + 1)])
        _check_aligned(got_t, got_l)


@FAST
@given(texts=st.binary(max_size=200), labels=st.binary(max_size=200), policy=st.sampled_from(["strict", "replace"]))
def test_raw_split_on_random_bytes(texts, labels, policy):
    TRIED["raw_split_bytes"] += 1
    with Folder() as d:
        for split in ("train", "test"):
            (d / f"{split}_texts.txt").write_bytes(texts)
            (d / f"{split}_labels.txt").write_bytes(labels)
        files = locate("prop", d.parent, str(d))
        try:
            got_t, got_l, _, _ = parse_raw_split(files, "train", policy)
        except StageError as e:
            _expect_error_naming(e, d / "train_texts.txt", d / "train_labels.txt")
            return
        assert len(got_t) == len(got_l)


@SLOW
@given(train=raw_docs(max_docs=10), test=raw_docs(max_docs=4), data=st.data())
def test_ingest_keeps_every_document_with_its_labels(train, test, data):
    """The whole ingest (validation carve-out included): each document's text, labels and source line
    stay together, or the error names the file (an empty split, a split without labels)."""
    TRIED["ingest"] += 1
    styles = {f"{s}_{k}": data.draw(line_style()) for s in ("train", "test") for k in ("texts", "labels")}
    with Folder() as d:
        src = d / "prop"
        src.mkdir()
        written = _write_raw(src, train, test, styles)
        want = {k: reference_lines(v) for k, v in written.items()}
        files = locate("prop", d, str(src))
        out = d / "out"

        class Log:
            def info(self, *a): pass
            warning = info

        try:
            ingest(files, SETTINGS, out, Log())
        except StageError as e:
            bad = [s for s, docs in (("train", train), ("test", test))
                   if not docs or not any(l for _, l in docs) or len(want[f"{s}_labels"]) != len(docs)]
            assert bad, str(e)
            _expect_error_naming(e, *(src / f"{s}_{k}.txt" for s in bad for k in ("texts", "labels")))
            return
        label_ids = io.read_table(out / "labels.parquet").to_pydict()["label_id"]
        for part, src_docs in (("train", train), ("valid", train), ("test", test)):
            t = io.read_table(out / f"docs_{part}.parquet").to_pydict()
            for line, text, labs in zip(t["source_line"], t["text"], t["labels"]):
                want_text, want_labels = src_docs[line - 1]
                assert text == want[f"{'test' if part == 'test' else 'train'}_texts"][line - 1]
                assert text.startswith(f"doc{line - 1} ")
                assert sorted(label_ids[j] for j in labs) == sorted(set(want_labels))
        assert "\ufeff" not in "".join(label_ids)


# --------------------------------------------------------------------------- label texts


@FAST
@given(ids=st.lists(label_token, max_size=8), names=st.lists(noise, max_size=8), pad=st.booleans(),
       s1=line_style(), s2=line_style())
def test_label_ids_and_texts_align_or_name_the_files(ids, names, pad, s1, s2):
    TRIED["label_texts"] += 1
    with Folder() as d:
        lines = [f" {x} " if pad else x for x in ids]
        names_bytes = encode_lines(names, s2)
        want_names = reference_lines(names_bytes)
        (d / "label_ids.txt").write_bytes(encode_lines(lines, s1))
        (d / "label_texts.txt").write_bytes(names_bytes)
        for split in ("train", "test"):
            (d / f"{split}_texts.txt").write_text("t\n")
            (d / f"{split}_labels.txt").write_text("a\n")
        files = locate("prop", d.parent, str(d))
        try:
            got_ids, got_names = read_label_index(files, "strict")
        except StageError as e:
            assert len(set(ids)) != len(ids) or len(ids) != len(want_names), str(e)
            _expect_error_naming(e, d / "label_ids.txt")
            if len(set(ids)) == len(ids):
                assert "label_texts.txt needs exactly one line" in str(e) and "labels line" not in str(e)
            return
        assert got_ids == ids
        assert [got_names[x] for x in ids] == want_names


# --------------------------------------------------------------------------- BoW layout


@st.composite
def bow_docs(draw):
    n_feat, n_lab = draw(st.integers(1, 20)), draw(st.integers(1, 10))
    docs = []
    for _ in range(draw(st.integers(0, 8))):
        labs = sorted(draw(st.sets(st.integers(0, n_lab - 1), max_size=3)))
        feats = draw(st.dictionaries(st.integers(0, n_feat - 1),
                                     st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False), max_size=5))
        docs.append((labs, feats))
    return n_feat, n_lab, docs


def encode_bow(n_feat, n_lab, docs, style, count_delta=0) -> bytes:
    lines = [f"{len(docs) + count_delta} {n_feat} {n_lab}"]
    for labs, feats in docs:
        f = " ".join(f"{j}:{v!r}" for j, v in feats.items())
        lines.append(f"{','.join(map(str, labs))} {f}".rstrip(" ") if labs else f" {f}")
    return encode_lines(lines, style)


@FAST
@given(doc=bow_docs(), style=line_style(), delta=st.sampled_from([0, 0, 0, -1, 1]))
def test_bow_round_trip_or_count_error(doc, style, delta):
    TRIED["bow"] += 1
    n_feat, n_lab, docs = doc
    with Folder() as d:
        p = d / "train.txt"
        p.write_bytes(encode_bow(n_feat, n_lab, docs, style, delta))
        try:
            labels, X, dd, ll = parse_bow(p, "strict")
        except StageError as e:
            assert delta != 0, str(e)
            _expect_error_naming(e, p)
            return
        assert delta == 0 and (dd, ll) == (n_feat, n_lab) and X.shape == (len(docs), n_feat)
        assert [[int(x) for x in l] for l in labels] == [l for l, _ in docs]
        for i, (_, feats) in enumerate(docs):
            row = dict(zip(X[i].indices.tolist(), X[i].data.tolist()))
            assert row == {j: float(np.float32(v)) for j, v in feats.items()}


@FAST
@given(head=st.sampled_from(["2 5 3", "1 4 2", "0 3 3", "x y z", "", "2 5", "²  5 3"]),
       body=st.lists(st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=25),
                     max_size=3),
       raw=st.binary(max_size=40))
def test_bow_on_garbage(head, body, raw):
    """Random feature and label fields (or random bytes): parsed within the header's ranges, or an
    error naming the file."""
    TRIED["bow_garbage"] += 1
    with Folder() as d:
        p = d / "train.txt"
        p.write_bytes("\n".join([head, *body]).encode("utf-8") + raw)
        try:
            labels, X, n_feat, n_lab = parse_bow(p, "strict")
        except StageError as e:
            _expect_error_naming(e, p)
            return
        assert X.shape[0] == len(labels) and X.shape[1] == n_feat
        assert all(0 <= int(x) < n_lab for l in labels for x in l)
        assert all(math.isfinite(v) for v in X.data)
