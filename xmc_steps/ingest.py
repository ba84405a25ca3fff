"""Ingest: a dataset folder -> documents and labels as Parquet, label matrices as NPZ (:func:`ingest`;
the stage is :mod:`xmc_steps.stages.ingest`).

Outputs (in ``--out``, a folder):

* ``docs_{train,valid,test}.parquet``: ``doc_id`` (from ``{split}_ids.txt`` or the
  1-based source line), ``source_line`` (1-based line in the upstream file), ``text``,
  ``labels`` (list of label indices);
* ``Y_{train,valid,test}.npz``: CSR 0/1 label matrices (documents x labels);
* ``X_bow_{train,valid,test}.npz``: only for the BoW layout, the given features;
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
named otherwise); empty documents and documents without labels are legal and counted, but a
train or test split without documents, or without a single label, is an error naming its file
(nothing could be trained or evaluated on it; without the check it would fail stages later, at
TF-IDF or evaluation).  A UTF-8 byte-order mark at the start of a file is dropped (Windows
editors write one; it would otherwise become part of the first label id, text or BoW header).
The validation split is carved from train with ``split.seed`` and ``split.valid_fraction``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from . import io
from .datasets import DatasetFiles
from .errors import StageError
from .layout import LABELS


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
        dup = len(ids) - len(set(ids))
        if dup:
            raise StageError(f"{files.label_ids}: {dup} duplicated label ids")
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


def parse_raw_split(files: DatasetFiles, split: str, errors: str):
    tpath, lpath = files.texts[split], files.labels[split]
    texts, rep_t = read_lines(tpath, errors)
    labels, rep_l = read_lines(lpath, errors)
    _check_same_length(tpath, len(texts), lpath, len(labels), "each document needs exactly one labels line")
    for ln, line in enumerate(labels, start=1):
        if "\r" in line:     # a texts file may hold a stray CR; a labels line never does
            raise StageError(f"{lpath}:{ln}: a carriage return inside a labels line (a file with "
                             "old Mac line ends, CR only?); lines end with LF or CRLF")
    label_lists = [line.split() for line in labels]
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


def label_matrix(lists: list[list[int]], n_labels: int) -> sp.csr_matrix:
    indptr = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in lists], out=indptr[1:])
    ind = np.fromiter((j for x in lists for j in x), dtype=np.int32, count=int(indptr[-1]))
    Y = sp.csr_matrix((np.ones(len(ind), np.float32), ind, indptr), shape=(len(lists), n_labels))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    return Y


def carve_valid(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(n)`` into (train, valid) index arrays, both sorted; fixed seed."""
    n_valid = int(round(n * fraction))
    if fraction > 0 and n > 1:
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
            texts, lab, ids, rep = parse_raw_split(files, split, errors)
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

    tr_idx, va_idx = carve_valid(len(raw_splits["train"]["texts"]), split_cfg["valid_fraction"], split_cfg["seed"])
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
            io.save_csr(out / f"X_bow_{name}.npz", s["X"][idx])
        n_empty = sum(1 for t in texts if not t.strip()) if files.layout == "raw" else 0
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
                   "replaced_bytes": replaced, "has_label_texts": bool(names)})
    if replaced:
        log.warning("replaced %d bytes that were not UTF-8 with U+FFFD", replaced)
    log.info("%d labels, %d seen only in test", n_labels, int(unseen.sum()))
    io.write_json(out / "ingest.json", report)
    return report


OUTPUT_NAMES = [f"{k}_{s}.{e}" for k, e in (("docs", "parquet"), ("Y", "npz")) for s in ("train", "valid", "test")] + [LABELS, "ingest.json"]
