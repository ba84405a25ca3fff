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

Temporary names carry their writer (:func:`xmc_steps.proc.owner_tag`: pid and host),
``.<name>.p<pid>-<host>.<random>.tmp[<suffix>]`` (``.old`` for a folder moved aside by
:func:`atomic_dir`), so that the next run of a stage can remove what a killed run left
(:func:`remove_stale_temporaries`, called by the stage harness for its declared outputs)
without touching the temporaries of a writer that is still alive.

Modes.  ``tempfile.mkstemp``/``mkdtemp`` create 0600 files and 0700 folders; an artifact
is meant to be shared like any file the user writes, so the temporary is given
``0o666 & ~umask`` (files) or ``0o777 & ~umask`` (folders) before it takes the final
name.  The umask is read once, at import (``os.umask`` can only be read by setting it).

Text read from the user's files goes through :func:`strip_bom` (a UTF-8 byte-order
mark, as Windows editors write, is not part of the first line's content).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import scipy.sparse as sp

from .proc import owner_tag, parse_owner_tag, pid_gone


def _read_umask() -> int:
    """The umask, from ``/proc/self/status`` where Linux shows it (nothing changed), else by setting
    and restoring it (the most restrictive mask in between, for any thread creating a file then)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    old = os.umask(0o077)
    os.umask(old)
    return old


#: The process's umask at import (applied to the temporaries mkstemp/mkdtemp create 0600/0700).
UMASK = _read_umask()

UTF8_BOM = b"\xef\xbb\xbf"


def file_mode(directory: bool = False) -> int:
    """The mode a new file (``0o666``) or folder (``0o777``) gets under the umask."""
    return (0o777 if directory else 0o666) & ~UMASK


def strip_bom(data: bytes) -> bytes:
    """``data`` without a leading UTF-8 byte-order mark."""
    return data[len(UTF8_BOM):] if data.startswith(UTF8_BOM) else data


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{owner_tag()}."


def stale_temporaries(path: str | os.PathLike) -> list[tuple[Path, int, bool]]:
    """``(temporary, pid, made on this host)`` of every temporary that :func:`atomic_path` or
    :func:`atomic_dir` left beside ``path`` (a file or folder name; live writers included)."""
    path = Path(path)
    pat = re.compile(rf"\.{re.escape(path.name)}\.(p\d+-[0-9a-f]{{8}})\.[A-Za-z0-9_]+\.(?:tmp|old)")
    out = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
        for entry in path.parent.iterdir():
            m = pat.match(entry.name)
            owner = parse_owner_tag(m.group(1)) if m else None
            if owner is not None:
                out.append((entry, *owner))
    return out


def remove_stale_temporaries(paths: list[str | os.PathLike], log=None) -> list[Path]:
    """Remove the temporaries beside each of ``paths`` whose writer has ended (a killed run's);
    keep those of live processes and of other hosts (named in the log).  Returns what was removed."""
    removed = []
    for path in paths:
        for tmp, pid, here in stale_temporaries(path):
            if not here or not pid_gone(pid):
                if log is not None:
                    log.info("left %s: its writer (pid %d%s) may still be running", tmp, pid,
                             "" if here else " on another host")
                continue
            with contextlib.suppress(FileNotFoundError):
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()
            removed.append(tmp)
            if log is not None:
                log.info("removed %s, left by an earlier run (pid %d) that did not finish", tmp, pid)
    return removed


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
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=f".tmp{suffix}", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


@contextlib.contextmanager
def scratch_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty private folder named as :func:`atomic_dir`'s temporaries beside ``path`` (so
    :func:`remove_stale_temporaries` of ``path`` removes one a killed writer left); removed on exit."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``path``; on success it takes ``path``'s place.

    A model folder is thus never half-written: on any exception the temporary folder is removed
    and ``path`` is left as it was.  An existing ``path`` is moved aside first and deleted only
    after the new folder is in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, file_mode(directory=True))
        yield tmp
        old = None
        if path.exists() or path.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".old", dir=path.parent))
            os.replace(path, old / path.name)
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:
                os.replace(old / path.name, path)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8-sig") as fh:      # -sig: a byte-order mark is skipped
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
    """Read a Parquet file as a pyarrow Table: every column, or ``columns`` in that order (one the file
    lacks is a ValueError naming it).  Through ``ParquetFile``: ``pq.read_table``'s dataset layer imports
    pandas, a fifth of a second of every command's start that reads a table (``xmc predict``'s)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        if columns is not None:
            have = f.schema_arrow.names
            missing = [c for c in columns if c not in have]
            if missing:
                raise ValueError(f"{path}: no column {', '.join(missing)} (it has {', '.join(have)})")
        return f.read(columns=columns)


def numeric_column(table, name: str) -> np.ndarray:
    """Column ``name`` of a pyarrow Table as a NumPy array (a copy).  An integer or floating column
    without nulls is read from its Arrow buffer: pyarrow's ``to_numpy`` imports pandas where it is
    installed, a fifth of a second of a command's start (``xmc predict``'s); other columns go through it."""
    col = table.column(name).combine_chunks()
    import pyarrow as pa

    if col.null_count == 0 and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        dt = np.dtype(f"{'f' if pa.types.is_floating(col.type) else ('i' if pa.types.is_signed_integer(col.type) else 'u')}"
                      f"{col.type.bit_width // 8}")
        if len(col) == 0:
            return np.zeros(0, dtype=dt)
        return np.frombuffer(col.buffers()[1], dtype=dt, count=len(col), offset=col.offset * dt.itemsize).copy()
    return col.to_numpy(zero_copy_only=False)


def iter_column(path: str | os.PathLike, column: str, batch_rows: int) -> Iterator[list]:
    """A Parquet column in batches of ``batch_rows`` Python values, without reading the
    whole file (the streaming stages' input: TF-IDF at Wiki-500K's millions of documents)."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=max(1, int(batch_rows)), columns=[column]):
        yield batch.column(0).to_pylist()


def column_bytes(path: str | os.PathLike, column: str) -> tuple[int, int]:
    """(rows, uncompressed bytes of ``column``) of a Parquet file, from its metadata only."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    idx = meta.schema.names.index(column)
    size = sum(meta.row_group(g).column(idx).total_uncompressed_size for g in range(meta.num_row_groups))
    return meta.num_rows, int(size)


def csr_to_topk(scores: sp.csr_matrix, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row, the top-``k`` (label index, score) pairs, best first; ties -> lower index."""
    offsets, idx, val = _topk_flat(scores, k)
    return ([idx[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            [val[a:b] for a, b in zip(offsets[:-1], offsets[1:])])


def row_ranks(M: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, order, rank)`` of a CSR matrix's entries: ``rows`` the row of each entry,
    ``order`` the entry positions sorted row by row, best first (ties -> lower column), and
    ``rank`` the place within its row of each entry of that order (0 = best)."""
    rows = np.repeat(np.arange(M.shape[0], dtype=np.int64), np.diff(M.indptr))
    if M.data.dtype == np.float32 and M.has_sorted_indices and M.shape[0] < 2**31:
        # one int64 key per entry, (row, descending score), sorted stably: the column order
        # of a row with sorted indices breaks ties, as the three-key lexsort below does
        b = (M.data + np.float32(0.0)).view(np.int32).astype(np.int64)      # + 0.0: -0.0 -> 0.0
        b = np.where(b < 0, b ^ 0x7FFFFFFF, b)                              # float order as integers
        order = np.argsort((rows << 32) + (0x7FFFFFFF - b), kind="stable")
    else:
        order = np.lexsort((M.indices, -M.data, rows))
    rank = np.arange(M.nnz, dtype=np.int64) - M.indptr[:-1].astype(np.int64)[rows]
    return rows, order, rank


def _topk_flat(scores: sp.csr_matrix, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(offsets, label ids, scores)``: every row's top-``k``, best first (ties -> lower index),
    row after row, without a Python loop over the rows."""
    scores = sp.csr_matrix(scores)
    _, order, rank = row_ranks(scores)
    keep = order[rank < k]
    offsets = np.zeros(scores.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.minimum(np.diff(scores.indptr), max(int(k), 0)), out=offsets[1:])
    return offsets, scores.indices[keep].astype(np.int32), scores.data[keep].astype(np.float32)


def write_predictions(path: str | os.PathLike, scores: sp.csr_matrix, k: int) -> None:
    """Write a prediction table: ``doc`` (row index), ``labels`` and ``scores`` lists (best first);
    the list columns are built from flat arrays and offsets (no per-row Python objects)."""
    import pyarrow as pa

    offsets, idx, val = _topk_flat(scores, k)
    off = pa.array(offsets.astype(np.int32) if offsets[-1] < 2**31 else offsets)
    lists = pa.ListArray if off.type == pa.int32() else pa.LargeListArray
    write_table(path, {"doc": np.arange(len(offsets) - 1, dtype=np.int64),
                       "labels": lists.from_arrays(off, pa.array(idx)),
                       "scores": lists.from_arrays(off, pa.array(val))})


def read_predictions(path: str | os.PathLike, n_labels: int) -> sp.csr_matrix:
    """Read a prediction table back as a CSR score matrix (N x n_labels), from the list columns'
    flat values and offsets (no per-row Python objects)."""
    t = read_table(path, ["labels", "scores"])
    lab, sco = (t.column(c).combine_chunks() for c in ("labels", "scores"))
    if len(lab) and (lab.null_count or sco.null_count):
        raise ValueError(f"{path}: a row has no label list")
    off = np.asarray(lab.offsets, dtype=np.int64)
    if not np.array_equal(off, np.asarray(sco.offsets, dtype=np.int64)):
        raise ValueError(f"{path}: the labels and scores lists differ in length")
    ind = np.array(lab.flatten(), dtype=np.int32)          # copies: arrow buffers are read-only
    val = np.array(sco.flatten(), dtype=np.float32)
    if len(ind) and (ind.min() < 0 or ind.max() >= n_labels):
        raise ValueError(f"{path}: label ids must lie in 0..{n_labels - 1}")
    m = sp.csr_matrix((val, ind, off - off[0]), shape=(len(off) - 1, n_labels))
    m.sum_duplicates()
    return m
