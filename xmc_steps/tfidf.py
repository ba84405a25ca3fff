"""TF-IDF: documents -> L2-normalised sparse TF-IDF features (the :mod:`xmc_steps.stages.tfidf` stage's
library: the model, fitting and transforming).

Fitted on the training documents only (train + valid: the validation split is carved
from the upstream train file and TF-IDF is unsupervised; test never contributes to the
vocabulary or the idf).  Word n-grams (default uni+bigrams), minimum document
frequency and vocabulary cap from config; sublinear tf (1 + log tf); smoothed idf;
rows L2-normalised.  For a BoW-layout dataset the given features are used as they are,
rows L2-normalised (their vocabulary is not known; ``vocab.parquet`` then lists
feature indices with idf 1).

Streaming (:func:`fit_streaming`): the documents are read in chunks of about
:data:`CHUNK_BYTES` of text; each chunk's n-grams are counted (document and term
frequency) and the counts are spilled to disk, split by a hash of the n-gram into
``ceil(text bytes / PARTITION_BYTES)`` partitions; each partition is then summed on
its own (Arrow's hash aggregation) and pruned by ``min_df``.  At no point are all
n-grams of the corpus in memory: the peak is one chunk's n-grams or one partition's
sums, whichever is larger, so Wiki-500K's hundreds of millions of distinct bigrams
(most of them seen once) never sit in one Python dict (measured on 12,700 synthetic
Wiki-500K-shaped documents of 800 words, ``bench/bench_scale.py --fraction 0.005``: peak
1.3 GB with 16 MB chunks, a chunk's n-gram dictionary being most of it).  The result is the same
vocabulary, idf and matrices as scikit-learn's ``TfidfVectorizer`` fitted on all the
documents at once (the transform is scikit-learn's, with the idf set from the counts);
the one reading we choose is the ``max_features`` tie-break: among n-grams of equal
corpus frequency the alphabetically first are kept (scikit-learn's unstable sort leaves
that order unspecified).  Chunk and partition sizes are derived from the text size,
so they need no setting and do not change the result.

Outputs of the stage in ``--out``: ``X_{train,valid,test}.npz`` (CSR float32, sorted indices),
``vocab.parquet`` (``term``, ``idf`` in feature-index order).
"""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import scipy.sparse as sp

from . import io

SPLITS = ("train", "valid", "test")
CHUNK_BYTES = 16 << 20        # text per counting / transform chunk
#: the name the spill folder's temporaries are made beside (the stage declares ``<out>/tfidf-spill``, so a
#: rerun removes what a killed fit left)
SPILL = "tfidf-spill"
PARTITION_BYTES = 64 << 20    # text per spill partition: bounds one partition's distinct n-grams


#: the tokens: runs of two or more word characters (scikit-learn's default pattern, stated here so that
#: :func:`word_analyzer` and the vectorizer read the same one)
TOKEN_PATTERN = r"(?u)\b\w\w+\b"


def make_vectorizer(params: dict[str, Any], vocabulary=None):
    from sklearn.feature_extraction.text import TfidfVectorizer

    lo, hi = params.get("ngram_range", [1, 2])
    return TfidfVectorizer(
        ngram_range=(int(lo), int(hi)),
        min_df=int(params.get("min_df", 2)),
        max_features=params.get("max_features"),
        sublinear_tf=bool(params.get("sublinear_tf", True)),
        lowercase=bool(params.get("lowercase", True)),
        token_pattern=TOKEN_PATTERN,
        norm="l2",
        dtype=np.float32,
        vocabulary=vocabulary,
    )


def word_analyzer(params: dict[str, Any]) -> Callable[[str], list[str]]:
    """The n-grams of one text as ``make_vectorizer(params).build_analyzer()`` lists them, without
    importing scikit-learn (about 0.6 s of the predict command's start): the text lower-cased (unless
    ``lowercase`` is off), its :data:`TOKEN_PATTERN` tokens, then the word n-grams of ``ngram_range`` in
    scikit-learn's order (the tokens themselves when 1 is in the range, then every 2-gram, 3-gram, ...
    in text order, joined by one space).  ``tests/test_predict.py`` compares the two."""
    lo, hi = (int(x) for x in params.get("ngram_range", [1, 2]))
    lower = bool(params.get("lowercase", True))
    findall = re.compile(TOKEN_PATTERN).findall

    def analyze(doc: str) -> list[str]:
        words = findall(doc.lower() if lower else doc)
        if hi == 1:
            return words
        grams = list(words) if lo == 1 else []
        join = " ".join
        for n in range(max(lo, 2), min(hi, len(words)) + 1):
            grams.extend(join(words[i:i + n]) for i in range(len(words) - n + 1))
        return grams
    return analyze


class _Spill:
    """Per-partition Arrow tables of (term, df, tf) counts: in memory for one partition,
    else appended to one Arrow IPC file per partition under ``folder``."""

    def __init__(self, n_partitions: int, folder: Path):
        self.n, self.folder, self.writers, self.memory = n_partitions, folder, {}, []

    def add(self, terms: np.ndarray, df: np.ndarray, tf: np.ndarray) -> None:
        import pyarrow as pa

        if self.n == 1:
            self.memory.append(pa.table({"term": terms.tolist(), "df": df, "tf": tf}))
            return
        part = np.fromiter((hash(t) for t in terms), dtype=np.int64, count=len(terms)) % self.n
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(self.n + 1))
        for p in range(self.n):
            sel = order[bounds[p]:bounds[p + 1]]
            if len(sel) == 0:
                continue
            table = pa.table({"term": terms[sel].tolist(), "df": df[sel], "tf": tf[sel]})
            if p not in self.writers:
                self.writers[p] = pa.ipc.new_file(self.folder / f"part-{p:05d}.arrow", table.schema)
            self.writers[p].write_table(table)

    def partitions(self):
        """Each partition's counts, summed over the chunks: Arrow tables (term, df, tf)."""
        import pyarrow as pa

        for w in self.writers.values():
            w.close()
        for p in range(self.n):
            if self.n == 1:
                tables = self.memory
            elif p in self.writers:
                with pa.memory_map(str(self.folder / f"part-{p:05d}.arrow")) as src:
                    tables = [pa.ipc.open_file(src).read_all()]
            else:
                continue
            if not tables:
                continue
            summed = pa.concat_tables(tables).group_by("term").aggregate([("df", "sum"), ("tf", "sum")])
            yield summed.rename_columns({"df_sum": "df", "tf_sum": "tf"}).select(["term", "df", "tf"])


@dataclass
class TfidfModel:
    """The fitted vocabulary (alphabetical, scikit-learn's feature order) and idf."""

    terms: np.ndarray
    idf: np.ndarray
    params: dict[str, Any]
    n_docs: int

    @cached_property
    def vectorizer(self):
        """scikit-learn's vectorizer on this vocabulary and idf, built once for every split."""
        vec = make_vectorizer(self.params, vocabulary={t: i for i, t in enumerate(self.terms)})
        vec.idf_ = self.idf
        return vec

    @cached_property
    def _counting(self):
        """(analyzer, vocabulary dict) for :meth:`transform_few`: those of :attr:`vectorizer`, without
        building it (no scikit-learn import)."""
        return word_analyzer(self.params), {t: i for i, t in enumerate(self.terms)}

    def transform_few(self, texts: list[str]) -> sp.csr_matrix:
        """:meth:`transform_batches` of ``[texts]`` (the same bytes) without scikit-learn's per-call
        checks: a few texts at a time, as a service or ``python -m xmc_steps.stages.predict`` asks, where
        those checks cost more than the counting (about 3 of 4 ms for one yso-finna-sv-50k text).
        The same steps as ``TfidfVectorizer.transform``: n-gram counts on the vocabulary, ``1 + log``
        of them (sublinear tf), times the idf (in float64, stored as float32), each row divided by its
        L2 norm (squares summed in float64 in column order; rows with no term left as they are): the
        settings :func:`make_vectorizer` gives every vectorizer (counts, not binary; idf; L2 norm), and
        scikit-learn is not imported."""
        analyze, vocab = self._counting
        indptr, idx, cnt = [0], [], []
        for doc in texts:
            counter: dict[int, int] = {}
            for g in analyze(doc):
                j = vocab.get(g)
                if j is not None:
                    counter[j] = counter.get(j, 0) + 1
            keys = sorted(counter)
            idx.extend(keys)
            cnt.extend(counter[j] for j in keys)
            indptr.append(len(idx))
        indices = np.asarray(idx, dtype=np.int32)
        data = np.asarray(cnt, dtype=np.intc).astype(np.float32)
        if bool(self.params.get("sublinear_tf", True)):
            np.log(data, data)
            data += 1.0
        data *= self.idf[indices]
        for a, b in zip(indptr[:-1], indptr[1:]):
            if b > a:
                row = data[a:b]
                total = float(np.cumsum(row * row, dtype=np.float64)[-1])   # in order, as scikit-learn
                if total != 0.0:
                    data[a:b] = (row.astype(np.float64) / math.sqrt(total)).astype(np.float32)
        return sp.csr_matrix((data, indices, np.asarray(indptr, dtype=np.int32)), shape=(len(texts), len(self.terms)))

    def transform_batches(self, batches: Iterable[list[str]]) -> sp.csr_matrix:
        vec = self.vectorizer
        parts = [sp.csr_matrix(vec.transform(b), dtype=np.float32) for b in batches]
        if not parts:
            return sp.csr_matrix((0, len(self.terms)), dtype=np.float32)
        X = sp.vstack(parts, format="csr", dtype=np.float32)
        X.sort_indices()
        return X


def count_chunk(texts: list[str], analyze) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One chunk's n-grams (in order of first appearance) with their document and term
    frequencies; ``analyze`` is the vectorizer's analyzer (the same n-grams it would count).
    Unsorted on purpose: only the n-grams that survive ``min_df`` are sorted, once."""
    from array import array

    vocab: dict[str, int] = {}
    get = vocab.setdefault
    ids = array("q")
    lens = np.zeros(len(texts), np.int64)
    for i, doc in enumerate(texts):
        grams = analyze(doc)
        lens[i] = len(grams)
        ids.extend([get(g, len(vocab)) for g in grams])
    V = len(vocab)
    term = np.frombuffer(ids, dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
    tf = np.bincount(term, minlength=V)
    pairs = np.unique(np.repeat(np.arange(len(texts), dtype=np.int64), lens) * max(V, 1) + term)
    df = np.bincount(pairs % max(V, 1), minlength=V) if V else np.zeros(0, np.int64)
    return np.array(list(vocab), dtype=object), df.astype(np.int64), tf.astype(np.int64)


def select_vocabulary(counts, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Prune the summed (term, df, tf) tables by ``min_df``, cap at ``max_features`` (most
    frequent first, ties alphabetical); return (terms alphabetical, their df)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    min_df = int(params.get("min_df", 2))
    kept = [t.filter(pc.greater_equal(t.column("df"), min_df)) for t in counts]
    kept = pa.concat_tables(kept) if kept else pa.table({"term": pa.array([], pa.string()), "df": pa.array([], pa.int64()),
                                                          "tf": pa.array([], pa.int64())})
    kept = kept.take(pc.sort_indices(kept, [("term", "ascending")]))   # UTF-8 byte order = code-point order = Python's
    limit = params.get("max_features")
    if limit is not None and kept.num_rows > int(limit):
        tf = kept.column("tf").to_numpy()
        keep = np.sort(np.argsort(-tf, kind="stable")[: int(limit)])
        kept = kept.take(pa.array(keep))
    return np.array(kept.column("term").to_pylist(), dtype=object), kept.column("df").to_numpy().astype(np.int64)


def smoothed_idf(df: np.ndarray, n_docs: int) -> np.ndarray:
    """scikit-learn's smoothed idf, in float32 as its float32 vectorizer computes it:
    ``ln((1 + n) / (1 + df)) + 1``."""
    d = df.astype(np.float32) + np.float32(1.0)
    return np.log((n_docs + 1) / d) + np.float32(1.0)


def fit_streaming(batches: Iterable[list[str]], params: dict[str, Any], n_partitions: int = 1,
                  spill_dir: str | Path | None = None, log=None) -> TfidfModel:
    """Fit the vocabulary and idf over ``batches`` of texts (see the module docstring).  The counts spill
    under ``spill_dir`` (a folder ``.tfidf-spill.<writer>.*.tmp``, :func:`io.scratch_dir`; the system's
    temporary folder without one)."""
    n_partitions = max(1, int(n_partitions))
    scratch = io.scratch_dir(Path(spill_dir) / SPILL) if spill_dir is not None else tempfile.TemporaryDirectory()
    with scratch as tmp:
        spill = _Spill(n_partitions, Path(tmp))
        analyze = make_vectorizer(params).build_analyzer()
        n_docs = 0
        for i, texts in enumerate(batches):
            spill.add(*count_chunk(texts, analyze))
            n_docs += len(texts)
            if log:
                log.info("tfidf counting: chunk %d, %d documents so far", i + 1, n_docs)
        terms, df = select_vocabulary(spill.partitions(), params)
    if len(terms) == 0:
        raise ValueError(f"no n-gram reaches min_df = {params.get('min_df', 2)} in the {n_docs} training documents")
    return TfidfModel(terms=terms, idf=smoothed_idf(df, n_docs), params=dict(params), n_docs=n_docs)


def fit_transform(train_texts: list[str], other: dict[str, list[str]], params: dict[str, Any]):
    """In-memory convenience: fit on ``train_texts``; return (model, {"train": X, **{name: X}})."""
    model = fit_streaming([train_texts], params)
    out = {"train": model.transform_batches([train_texts])}
    for name, texts in other.items():
        out[name] = model.transform_batches([texts])
    return model, out


def chunk_rows(paths: list[Path]) -> tuple[int, int]:
    """(documents per chunk, spill partitions) from the text size of the Parquet files."""
    rows = size = 0
    for p in paths:
        r, b = io.column_bytes(p, "text")
        rows, size = rows + r, size + b
    per_doc = max(1.0, size / max(1, rows))
    return max(64, int(CHUNK_BYTES / per_doc)), max(1, math.ceil(size / PARTITION_BYTES))
