"""Ingest: a dataset folder -> documents and labels as Parquet, label matrices as NPZ (:func:`ingest`;
the stage is :mod:`xmc_steps.stages.ingest`).

Outputs (in ``--out``, a folder):

* ``docs_{train,valid,test}.parquet``: ``doc_id`` (from ``{split}_ids.txt`` or the
  1-based source line), ``source_line`` (1-based line in the upstream file), ``text``,
  ``labels`` (list of label indices);
* ``Y_{train,valid,test}.npz``: CSR 0/1 label matrices (documents x labels);
* ``X_dataset_{train,valid,test}.npz``: the dataset's own features, where it has them (the BoW
  layout's; the xmc-base layout's ``tfidf-attnxml/``), rows carved as the documents';
* ``labels.parquet``: one row per label index: ``label_id``, ``label_text``,
  ``train_freq`` (positives among all training documents, train + valid);
* ``ingest.json``: counts (documents, empty documents, documents without labels,
  labels unseen in train, replaced bytes) — also written to the log.

Rules: files are split on ``\\n`` only (a stray ``\\r``, form feed or Unicode line
separator inside a document never shifts texts against labels; a trailing ``\\r`` is
dropped); texts and labels files must have the same number of lines (the error names
both files and both counts); bytes that are not UTF-8 are an error naming file, line
and column unless ``encoding_errors: replace`` (then U+FFFD, counted); with
``label_ids.txt`` present every label must be listed there (file, line and label are
named otherwise); labels are separated by white space, and a label ``a,b`` that ``label_ids.txt`` does not
declare is a file separated by commas, an error naming file and line; empty documents and documents without labels are legal and counted, but a
train or test split without documents, or without a single label, is an error naming its file
(nothing could be trained or evaluated on it; without the check it would fail stages later, at
TF-IDF or evaluation).  A UTF-8 byte-order mark at the start of a file is dropped (Windows
editors write one; it would otherwise become part of the first label id, text or BoW header).
The xmc-base layout's matrices are checked as the text files are: ``Y.{trn,tst}.npz`` has one row
per line of ``X.{trn,tst}.txt``, its labels are columns listed in ``output-items.txt`` (one
label text per line), the features have one row per line and as many columns in both splits, and
each of those is an error naming the file (and the row, which is the text's line).
The validation split is carved from train with ``split.seed`` and ``split.valid_fraction`` (or
``split.valid_size`` documents, where set).
"""

from __future__ import annotations

import math
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from . import io
from .datasets import DatasetFiles
from .errors import StageError
from .layout import DATASET_FEATURES, LABELS


def read_lines(path: Path, errors: str = "strict") -> tuple[list[str], int]:
    """Lines of a UTF-8 text file split on ``\\n`` only; returns (lines, replaced-bytes count)."""
    data = io.strip_bom(Path(path).read_bytes())
    if data.endswith(b"\n"):
        data = data[:-1]
    raw = data.split(b"\n") if data else []
    out: list[str] = []
    replaced = 0
    for i, b in enumerate(raw, start=1):
        if b.endswith(b"\r"):
            b = b[:-1]
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            if errors != "replace":
                raise StageError(
                    f"{path}:{i}: bytes that are not UTF-8 at column {e.start + 1} "
                    f"({b[e.start:e.start + 4]!r}); fix the file or set ingest.encoding_errors: replace"
                ) from None
            s = b.decode("utf-8", errors="replace")
            replaced += s.count("\ufffd") - b.decode("utf-8", errors="ignore").count("\ufffd")
            out.append(s)
    return out, replaced


def _check_same_length(a: Path, na: int, b: Path, nb: int, why: str) -> None:
    """Two files read line by line side by side have as many lines; else an error naming both,
    both counts and ``why`` (what each line of ``b`` is for)."""
    if na != nb:
        raise StageError(f"line counts differ: {a} has {na} lines but {b} has {nb}; {why}")


def check_split(split: str, n_docs: int, n_labelled: int, docs_file: Path, labels_file: Path) -> None:
    """A train or test split has documents, and at least one of them a label; else a
    :class:`StageError` naming the file (see the module docstring)."""
    if n_docs == 0:
        raise StageError(f"{docs_file}: the {split} split has no documents")
    if n_labelled == 0:
        raise StageError(f"{labels_file}: no document of the {split} split ({n_docs} documents) has a label")


def read_label_index(files: DatasetFiles, errors: str) -> tuple[list[str] | None, dict[str, str]]:
    """Label ids from ``label_ids.txt`` (or None) and label names by id."""
    names: dict[str, str] = {}
    ids = None
    if files.label_ids:
        ids, _ = read_lines(files.label_ids, errors)
        ids = [x.strip() for x in ids]
        for i, x in enumerate(ids, start=1):
            if not x:
                raise StageError(f"{files.label_ids}:{i}: empty label id")
        first: dict[str, int] = {}
        for i, x in enumerate(ids, start=1):
            if x in first:
                dup = len(ids) - len(set(ids))
                raise StageError(f"{files.label_ids}:{i}: label id {x!r} repeats line {first[x]}"
                                 + (f" ({dup} duplicated label ids in all)" if dup > 1 else ""))
            first[x] = i
        if files.label_texts:
            texts, _ = read_lines(files.label_texts, errors)
            _check_same_length(files.label_ids, len(ids), files.label_texts, len(texts),
                               "label_texts.txt needs exactly one line (the label's text) per label id, in the same order")
            names = dict(zip(ids, texts))
    if files.label_map and not names:
        lines, _ = read_lines(files.label_map, errors)
        for i, line in enumerate(lines, start=1):
            if not line:
                continue
            if "\t" not in line:
                raise StageError(f"{files.label_map}:{i}: expected 'label_id<TAB>name'")
            k, v = line.split("\t", 1)
            names[k] = v
    return ids, names


def check_separators(path: Path, label_lists: list[list[str]], known: set[str] | None = None) -> None:
    """Labels are separated by white space: a label ``a,b`` (a comma between two non-empty parts) that
    ``label_ids.txt`` does not declare (``known``) is a file separated by commas, an error naming the
    file and line (read as it is, it would become one label per distinct list).  A label id that holds
    a comma is declared in ``label_ids.txt``."""
    for ln, row in enumerate(label_lists, start=1):
        for tok in row:
            if "," in tok and _COMMA_LIST.fullmatch(tok) and (known is None or tok not in known):
                raise StageError(f"{path}:{ln}: labels separated by commas ({tok[:60]!r}); separate them by "
                                 "spaces, or list ids that hold a comma in label_ids.txt")


_COMMA_LIST = re.compile(r"[^,]+(,[^,]+)+")


def parse_raw_split(files: DatasetFiles, split: str, errors: str, known: set[str] | None = None):
    """Texts, label lists, ids and replaced bytes of a raw split; ``known``: the declared label ids."""
    tpath, lpath = files.texts[split], files.labels[split]
    texts, rep_t = read_lines(tpath, errors)
    labels, rep_l = read_lines(lpath, errors)
    _check_same_length(tpath, len(texts), lpath, len(labels), "each document needs exactly one labels line")
    for ln, line in enumerate(labels, start=1):
        if "\r" in line:     # a texts file may hold a stray CR; a labels line never does
            raise StageError(f"{lpath}:{ln}: a carriage return inside a labels line (a file with "
                             "old Mac line ends, CR only?); lines end with LF or CRLF")
    label_lists = [line.split() for line in labels]
    check_separators(lpath, label_lists, known)
    if split in files.ids:
        ids, _ = read_lines(files.ids[split], errors)
        _check_same_length(tpath, len(texts), files.ids[split], len(ids), "each document needs exactly one id line")
    else:
        ids = [str(i) for i in range(1, len(texts) + 1)]
    return texts, label_lists, ids, rep_t + rep_l


def _is_uint(s: str) -> bool:
    """``s`` is a non-negative integer in ASCII digits (``str.isdigit`` also accepts '²', which
    ``int`` rejects)."""
    return s.isascii() and s.isdigit()


#: the largest feature or label count (indices are stored as int32)
MAX_INDEX = 2**31 - 1


def parse_bow(path: Path, errors: str):
    """Parse an XMC-repository BoW file -> (label id lists, CSR features, n_features, n_labels).

    Labels and feature indices are ASCII integers inside the header's ranges, values finite
    float32 numbers; anything else is an error naming the file, line and the offending piece."""
    lines, _ = read_lines(path, errors)
    if not lines:
        raise StageError(f"{path}:1: empty file; expected a header 'N D L'")
    head = lines[0].split()
    if len(head) != 3 or not all(_is_uint(h) for h in head):
        raise StageError(f"{path}:1: expected a header 'N D L' (documents, features, labels), got {lines[0][:80]!r}")
    n, d, n_lab = map(int, head)
    if d > MAX_INDEX or n_lab > MAX_INDEX:
        raise StageError(f"{path}:1: header {lines[0][:80]!r}: at most {MAX_INDEX} features and labels")
    body = lines[1:]
    if len(body) != n:
        raise StageError(f"{path}: header says {n} documents but the file has {len(body)} lines after it")
    indptr = [0]
    ind: list[int] = []
    val: list[float] = []
    labels: list[list[str]] = []
    for ln, line in enumerate(body, start=2):
        parts = line.split(" ")
        first = parts[0] if parts and ":" not in parts[0] else ""
        feats = parts[1:] if first or (parts and parts[0] == "") else parts
        labs = [x for x in first.split(",") if x] if first else []
        for x in labs:
            if not _is_uint(x) or int(x) >= n_lab:
                raise StageError(f"{path}:{ln}: label {x!r} is not an integer in [0, {n_lab})")
        labels.append(labs)
        for f in feats:
            if not f:
                continue
            k, sep, v = f.partition(":")
            try:
                if not _is_uint(k):
                    raise ValueError(k)
                j, x = int(k), float(v)
            except ValueError:
                raise StageError(f"{path}:{ln}: malformed feature {f!r}; expected index:value") from None
            if not math.isfinite(x) or abs(x) > F32_MAX:
                raise StageError(f"{path}:{ln}: feature {f!r}: the value is not a finite float32 number")
            if not sep or j >= d:
                raise StageError(f"{path}:{ln}: feature {f!r} outside [0, {d})")
            ind.append(j)
            val.append(x)
        indptr.append(len(ind))
    X = sp.csr_matrix((np.asarray(val, np.float32), np.asarray(ind, np.int32), np.asarray(indptr, np.int64)), shape=(n, d))
    return labels, X, d, n_lab


F32_MAX = float(np.finfo(np.float32).max)


def read_npz(path: Path) -> sp.csr_matrix:
    """A scipy sparse matrix from ``path`` as CSR; a file that is none is an error naming it."""
    try:
        return sp.csr_matrix(sp.load_npz(path))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise StageError(f"{path}: not a scipy sparse matrix (.npz): {e}") from None


def _check_rows(path: Path, n_rows: int, texts: Path, n_lines: int, what: str) -> None:
    """A matrix read beside a texts file has one row per line; else an error naming both."""
    if n_rows != n_lines:
        raise StageError(f"{path}: {n_rows} rows but {texts} has {n_lines} lines; row i holds the {what} of line i")


def read_xmc_base_labels(path: Path, texts: Path, n_lines: int, n_items: int | None, items: Path | None) -> sp.csr_matrix:
    """An xmc-base label matrix (``Y.{trn,tst}.npz``) checked against its texts' line count and,
    with ``output-items.txt`` (``n_items`` lines), against the labels listed there; entries 0/1."""
    Y = read_npz(path)
    _check_rows(path, Y.shape[0], texts, n_lines, "labels")
    Y.eliminate_zeros()
    Y.sum_duplicates()
    if n_items is not None and Y.nnz and int(Y.indices.max()) >= n_items:
        k = int(np.argmax(Y.indices >= n_items))
        row = int(np.searchsorted(Y.indptr, k, side="right"))
        raise StageError(f"{path}: row {row - 1} (line {row} of {texts}) has label {int(Y.indices[k])}, "
                         f"but {items} lists {n_items} labels")
    Y.data[:] = 1.0
    return Y.astype(np.float32)


def read_xmc_base_features(path: Path, texts: Path, n_lines: int, n_cols: int | None) -> sp.csr_matrix:
    """The xmc-base layout's own features of a split: one row per text line, finite values, the
    train split's column count (``n_cols``) in the test split."""
    X = read_npz(path).astype(np.float32)
    _check_rows(path, X.shape[0], texts, n_lines, "features")
    if n_cols is not None and X.shape[1] != n_cols:
        raise StageError(f"{path}: {X.shape[1]} feature columns, but the train split's features have {n_cols}")
    bad = ~np.isfinite(X.data)
    if bad.any():
        row = int(np.searchsorted(X.indptr, int(np.argmax(bad)), side="right"))
        raise StageError(f"{path}: row {row - 1} (line {row} of {texts}) holds a value that is not a finite float32 number")
    return X


def read_xmc_base(files: DatasetFiles, errors: str) -> tuple[dict[str, dict[str, Any]], int, dict[str, str], int]:
    """The xmc-base layout's splits (as :func:`ingest` holds them), label count, label texts by id
    and replaced bytes (see the module docstring for the checks)."""
    items = None
    if files.label_texts:
        items, _ = read_lines(files.label_texts, errors)
    splits: dict[str, dict[str, Any]] = {}
    replaced, n_cols = 0, None
    for split in ("train", "test"):
        tpath, ypath = files.texts[split], files.label_matrices[split]
        texts, rep = read_lines(tpath, errors)
        replaced += rep
        Y = read_xmc_base_labels(ypath, tpath, len(texts), None if items is None else len(items), files.label_texts)
        check_split(split, len(texts), int((np.diff(Y.indptr) > 0).sum()), tpath, ypath)
        s = {"texts": texts, "Y": Y, "ids": [str(i) for i in range(1, len(texts) + 1)],
             "lines": np.arange(1, len(texts) + 1)}
        if split in files.features:
            s["X"] = read_xmc_base_features(files.features[split], tpath, len(texts), n_cols)
            n_cols = s["X"].shape[1]
        splits[split] = s
    n_labels = len(items) if items is not None else max(s["Y"].shape[1] for s in splits.values())
    for s in splits.values():
        Y = s.pop("Y")
        Y.resize((Y.shape[0], n_labels))
        s["y"] = [Y.indices[Y.indptr[i]:Y.indptr[i + 1]].tolist() for i in range(Y.shape[0])]
    names = dict(zip((str(i) for i in range(n_labels)), items)) if items is not None else {}
    return splits, n_labels, names, replaced


def label_matrix(lists: list[list[int]], n_labels: int) -> sp.csr_matrix:
    indptr = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in lists], out=indptr[1:])
    ind = np.fromiter((j for x in lists for j in x), dtype=np.int32, count=int(indptr[-1]))
    Y = sp.csr_matrix((np.ones(len(ind), np.float32), ind, indptr), shape=(len(lists), n_labels))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    return Y


def carve_valid(n: int, fraction: float, seed: int, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(n)`` into (train, valid) index arrays, both sorted; fixed seed.  ``size`` (``split.valid_size``)
    is the number of validation documents instead of ``fraction`` of them (at most ``n - 1``)."""
    n_valid = int(round(n * fraction)) if size is None else int(size)
    if (fraction > 0 if size is None else size > 0) and n > 1:
        n_valid = min(max(n_valid, 1), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


def ingest(files: DatasetFiles, settings: dict[str, Any], out: Path, log) -> dict[str, Any]:
    """Run the ingest stage; returns the report written to ``ingest.json``."""
    errors = settings["ingest"]["encoding_errors"]
    split_cfg = settings["split"]
    report: dict[str, Any] = {"dataset": files.name, "folder": str(files.folder), "layout": files.layout, "splits": {}}
    raw_splits: dict[str, dict[str, Any]] = {}
    replaced = 0
    if files.layout == "raw":
        label_ids, names = read_label_index(files, errors)
        for split in ("train", "test"):
            texts, lab, ids, rep = parse_raw_split(files, split, errors, set(label_ids) if label_ids else None)
            replaced += rep
            check_split(split, len(texts), sum(1 for row in lab if row), files.texts[split], files.labels[split])
            raw_splits[split] = {"texts": texts, "labels": lab, "ids": ids, "lines": np.arange(1, len(texts) + 1)}
            log.info("read %s: %d documents from %s", split, len(texts), files.texts[split])
        if label_ids is None:
            label_ids = sorted({x for s in raw_splits.values() for row in s["labels"] for x in row})
        index = {x: i for i, x in enumerate(label_ids)}
        for split, s in raw_splits.items():
            lpath = files.labels[split]
            conv = []
            for ln, row in enumerate(s["labels"], start=1):
                try:
                    conv.append([index[x] for x in row])
                except KeyError as e:
                    raise StageError(f"{lpath}:{ln}: label {e.args[0]!r} is not in {files.label_ids}") from None
            s["y"] = conv
        n_labels = len(label_ids)
    elif files.layout == "xmc-base":
        raw_splits, n_labels, names, replaced = read_xmc_base(files, errors)
        label_ids = [str(i) for i in range(n_labels)]
    else:
        n_labels = None
        for split in ("train", "test"):
            lab, X, d, n_lab = parse_bow(files.bow[split], errors)
            check_split(split, X.shape[0], sum(1 for row in lab if row), files.bow[split], files.bow[split])
            if n_labels is not None and n_lab != n_labels:
                raise StageError(f"{files.bow[split]}: header says {n_lab} labels but the train file says {n_labels}")
            n_labels = n_lab
            raw_splits[split] = {"texts": [""] * X.shape[0], "labels": lab, "y": [[int(x) for x in r] for r in lab],
                                 "ids": [str(i) for i in range(1, X.shape[0] + 1)], "lines": np.arange(2, X.shape[0] + 2), "X": X}
        label_ids = [str(i) for i in range(n_labels)]
        names = {}
        if files.label_texts:
            lt, _ = read_lines(files.label_texts, errors)
            if len(lt) != n_labels:
                raise StageError(f"{files.label_texts}: {len(lt)} lines but the data has {n_labels} labels")
            names = dict(zip(label_ids, lt))

    tr_idx, va_idx = carve_valid(len(raw_splits["train"]["texts"]), split_cfg["valid_fraction"], split_cfg["seed"],
                                 split_cfg.get("valid_size"))
    parts = {"train": ("train", tr_idx), "valid": ("train", va_idx), "test": ("test", np.arange(len(raw_splits["test"]["texts"])))}
    Ys = {}
    for name, (src, idx) in parts.items():
        s = raw_splits[src]
        y = [s["y"][i] for i in idx]
        texts = [s["texts"][i] for i in idx]
        Y = label_matrix(y, n_labels)
        Ys[name] = Y
        io.write_table(out / f"docs_{name}.parquet", {
            "doc_id": [s["ids"][i] for i in idx],
            "source_line": np.asarray(s["lines"])[idx].astype(np.int64),
            "text": texts,
            "labels": [np.asarray(sorted(set(r)), dtype=np.int32) for r in y],
        })
        io.save_csr(out / f"Y_{name}.npz", Y)
        if "X" in s:
            io.save_csr(out / DATASET_FEATURES.format(split=name), s["X"][idx])
        n_empty = sum(1 for t in texts if not t.strip()) if files.layout != "bow" else 0
        n_nolab = int((np.diff(Y.indptr) == 0).sum())
        report["splits"][name] = {"docs": len(idx), "empty_docs": n_empty, "docs_without_labels": n_nolab,
                                  "label_occurrences": int(Y.nnz), "labels_used": int((Y.getnnz(axis=0) > 0).sum())}
        log.info("%s: %d documents, %d empty, %d without labels", name, len(idx), n_empty, n_nolab)
    freq = np.asarray(Ys["train"].getnnz(axis=0) + Ys["valid"].getnnz(axis=0), dtype=np.int64)
    io.write_table(out / LABELS, {
        "label_id": label_ids,
        "label_text": [names.get(x, x) for x in label_ids],
        "train_freq": freq,
    })
    unseen = (Ys["test"].getnnz(axis=0) > 0) & (freq == 0)
    report.update({"n_labels": n_labels, "labels_unseen_in_train": int(unseen.sum()),
                   "replaced_bytes": replaced, "has_label_texts": bool(names),
                   "has_own_features": "X" in raw_splits["train"]})
    if replaced:
        log.warning("replaced %d bytes that were not UTF-8 with U+FFFD", replaced)
    log.info("%d labels, %d seen only in test", n_labels, int(unseen.sum()))
    io.write_json(out / "ingest.json", report)
    return report


OUTPUT_NAMES = [f"{k}_{s}.{e}" for k, e in (("docs", "parquet"), ("Y", "npz")) for s in ("train", "valid", "test")] + [LABELS, "ingest.json"]
