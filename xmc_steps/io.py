"""Artifact I/O shared by every stage.

The artifact contracts every stage keeps:

* tables are Parquet (pyarrow), written with :func:`write_table`;
* sparse matrices are scipy CSR with sorted indices in ``.npz``
  (:func:`save_csr` / :func:`load_csr`), dense arrays in ``.npz`` via
  :func:`save_arrays` / :func:`load_arrays`;
* JSON documents via :func:`write_json`.

Every writer goes through :func:`atomic_path`: the data is written to a temporary
name in the same folder and renamed over the final name only once complete, so a
killed job never leaves a half-written artifact behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import scipy.sparse as sp


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` on success.

    On any exception the temporary file is removed and ``path`` is left untouched.
    ``suffix`` defaults to the final name's suffix so libraries that dispatch on the
    extension (numpy's ``savez`` appends ``.npz``) keep working.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix if suffix is None else suffix
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def save_csr(path: str | os.PathLike, matrix: sp.spmatrix) -> None:
    """Save a sparse matrix as CSR with sorted indices (``.npz``)."""
    m = sp.csr_matrix(matrix)
    m.sum_duplicates()
    m.sort_indices()
    with atomic_path(path) as tmp:
        sp.save_npz(tmp, m, compressed=False)


def load_csr(path: str | os.PathLike) -> sp.csr_matrix:
    m = sp.load_npz(path).tocsr()
    if not m.has_sorted_indices:
        m.sort_indices()
    return m


def save_arrays(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """Save named dense arrays in one ``.npz``."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def write_table(path: str | os.PathLike, columns: Mapping[str, Any]) -> None:
    """Write a Parquet table from a mapping of column name -> array/list."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(dict(columns))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_table(path: str | os.PathLike, columns: list[str] | None = None):
    """Read a Parquet table as a pyarrow Table."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns)


def topk_to_csr(labels: list | np.ndarray, scores: list | np.ndarray, n_labels: int) -> sp.csr_matrix:
    """Convert per-document top-k lists (label indices, scores) to a CSR score matrix."""
    lens = np.fromiter((len(r) for r in labels), dtype=np.int64, count=len(labels))
    indptr = np.zeros(len(labels) + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    ind = np.concatenate([np.asarray(r, dtype=np.int32) for r in labels]) if len(labels) else np.zeros(0, np.int32)
    val = np.concatenate([np.asarray(r, dtype=np.float32) for r in scores]) if len(scores) else np.zeros(0, np.float32)
    m = sp.csr_matrix((val, ind, indptr), shape=(len(labels), n_labels))
    m.sort_indices()
    return m


def csr_to_topk(scores: sp.csr_matrix, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row, the top-``k`` (label index, score) pairs, best first; ties -> lower index."""
    scores = sp.csr_matrix(scores)
    out_l, out_s = [], []
    for i in range(scores.shape[0]):
        a, b = scores.indptr[i], scores.indptr[i + 1]
        idx, val = scores.indices[a:b], scores.data[a:b]
        order = np.lexsort((idx, -val))[:k]
        out_l.append(idx[order].astype(np.int32))
        out_s.append(val[order].astype(np.float32))
    return out_l, out_s


def write_predictions(path: str | os.PathLike, scores: sp.csr_matrix, k: int) -> None:
    """Write a prediction table: ``doc`` (row index), ``labels`` and ``scores`` lists (best first)."""
    labels, vals = csr_to_topk(scores, k)
    write_table(path, {"doc": np.arange(len(labels), dtype=np.int64), "labels": labels, "scores": vals})


def read_predictions(path: str | os.PathLike, n_labels: int) -> sp.csr_matrix:
    """Read a prediction table back as a CSR score matrix (N x n_labels)."""
    t = read_table(path).to_pydict()
    return topk_to_csr(t["labels"], t["scores"], n_labels)
