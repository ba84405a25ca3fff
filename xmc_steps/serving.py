"""Ask a trained target about new text: the library behind ``python -m xmc_steps.stages.predict``.

A :class:`Target` is a trained target of the DAG (``results/<dataset>/<method>``): its effective
settings (``results/<dataset>/config/<method>.json``) and label table.  :class:`Features` computes
what the methods read, for a batch of texts, as the DAG computes it for the test split (the fitted
TF-IDF, token ids per encoder and length).  :func:`predict_scores` hands both to the method's
predictor, which its spec names (:attr:`xmc_steps.methods.MethodSpec.predictor`, in the method's
``serve`` module: it scores with the functions the method's predict stage calls); ensembles combine
their members as the ensemble stage does (:func:`ensemble_of`).  Models and tokenizers are loaded
once per process (:func:`cached`).  :func:`answers`, :func:`write_jsonl` and :func:`write_parquet`
turn the scores into the stage's output.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TextIO

import numpy as np
import scipy.sparse as sp

from . import io, layout, proc, registry

__all__ = ["PredictError", "Target", "Features", "read_texts", "predict_scores", "top_labels", "answers",
           "write_jsonl", "write_parquet", "read_ids", "cached", "ensemble_of",
           "ensemble_choice"]

log = logging.getLogger("xmc_steps.serving")


class PredictError(Exception):
    """Bad input or an incomplete model folder: the message names the file and the problem."""


# --------------------------------------------------------------------------- input


def read_texts(stream: Iterable[bytes], name: str, skip_empty: bool = False) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a byte stream of lines; a line that is not UTF-8, or is empty
    (white space only) without ``skip_empty``, raises :class:`PredictError` naming ``name`` and the
    line (an empty line with ``skip_empty`` yields an empty text)."""
    for n, raw in enumerate(stream, start=1):
        raw = raw.rstrip(b"\n").rstrip(b"\r")
        if n == 1:
            raw = io.strip_bom(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PredictError(f"{name}, line {n}: not UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.strip() and not skip_empty:
            raise PredictError(f"{name}, line {n}: empty line (one text per line; --skip-empty answers such "
                               "lines with no labels)")
        yield n, text


# --------------------------------------------------------------------------- the target


@dataclass
class Target:
    """A trained target of the DAG: where its artifacts are and the settings it was built with."""

    res: str
    dataset: str
    method: str
    settings: Mapping[str, Any]
    label_ids: list[str] = field(repr=False)
    label_names: list[str] = field(repr=False)

    @property
    def n_labels(self) -> int:
        return len(self.label_ids)

    def need(self, *paths: str | Path) -> None:
        """Every path exists, else a :class:`PredictError` naming the first missing one."""
        for p in paths:
            if not Path(p).exists():
                raise PredictError(
                    f"incomplete model folder {self.res}/{self.dataset}/{self.method}: {p} is missing "
                    f"(build the target first: snakemake --cores all {self.res}/{self.dataset}/{self.method}.json)")

    @classmethod
    def load(cls, model: str | Path) -> "Target":
        model = Path(str(model).rstrip("/"))
        method, dataset, res = model.name, model.parent.name, str(model.parent.parent)
        if not method or not dataset:
            raise PredictError(f"--model {model}: expected results/<dataset>/<method>")
        conf = Path(layout.at(res, layout.CONFIG, dataset=dataset, method=method))
        if not conf.exists():
            raise PredictError(f"incomplete model folder {model}: {conf} (the target's settings) is missing; "
                               f"build the target first: snakemake --cores all {model}.json")
        try:
            doc = io.read_json(conf)
            settings = doc["settings"]
        except (ValueError, KeyError, TypeError) as e:
            raise PredictError(f"{conf}: not a target's settings file ({e})") from None
        base, _ = registry.split_method(method)
        if base not in registry.METHODS:
            raise PredictError(f"--model {model}: no predictor for method '{method}' (known: {', '.join(registry.METHODS)})")
        labels_path = Path(layout.at(res, layout.INGEST, dataset=dataset)) / layout.LABELS
        if not labels_path.exists():
            raise PredictError(f"incomplete model folder {model}: {labels_path} is missing")
        table = io.read_table(labels_path, ["label_id", "label_text"])
        ids = [str(x) for x in table.column("label_id").to_pylist()]
        names = [str(x) if x is not None else "" for x in table.column("label_text").to_pylist()]
        return cls(res, dataset, method, settings, ids, names)


# --------------------------------------------------------------------------- features


#: batches of at most this many texts get their TF-IDF from :meth:`~xmc_steps.tfidf.TfidfModel.transform_few`
#: (the same bytes as the DAG's transform, without its fixed cost per call: one text at a time, a service)
FEW_TEXTS = 32


class Features:
    """The inputs the methods read, computed once per batch of texts as the DAG computes them for
    the test split: TF-IDF on the fitted vocabulary, token ids per (encoder key, length)."""

    def __init__(self, target: Target, texts: list[str]):
        self.target, self.texts = target, texts
        self._tokens: dict[tuple[str, int], Any] = {}

    @cached_property
    def tfidf(self) -> sp.csr_matrix:
        if self.target.settings["tfidf"].get("source") == "dataset":
            raise PredictError(f"{self.target.dataset}: this target reads the dataset's own features "
                               "(tfidf.source: dataset), which exist for the dataset's documents only: new text has "
                               "none; train it with tfidf.source: pipeline to answer new text")
        model = _tfidf_model(self.target.res, self.target.dataset, _freeze(self.target.settings["tfidf"]))
        if len(self.texts) <= FEW_TEXTS:       # the same matrix, without scikit-learn's per-call checks
            return model.transform_few(self.texts)
        return model.transform_batches([self.texts])

    def tokens(self, encoder: str, max_length: int):
        """Token ids of the texts for ``encoder`` (a name or folder, as the trained model records it)."""
        key = (encoder, int(max_length))
        if key not in self._tokens:
            from . import encoders, neural

            tok = _tokenizer(encoder)
            ids, lengths = encoders.tokenize(self.texts, tok, int(max_length), progress=None)
            self._tokens[key] = neural.TokenData(ids, lengths)
        return self._tokens[key]


def _freeze(d: Mapping[str, Any]) -> str:
    return json.dumps(d, sort_keys=True)


_CACHE: dict[Any, Any] = {}


def cached(key: Any, make: Callable[[], Any]) -> Any:
    """Models and tokenizers are loaded once per process (a file is answered in many batches)."""
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def _tfidf_model(res: str, dataset: str, params_json: str):
    def make():
        from .tfidf import TfidfModel

        path = Path(layout.at(res, layout.TFIDF, dataset=dataset)) / "vocab.parquet"
        if not path.exists():
            raise PredictError(f"incomplete model folder: {path} (the fitted TF-IDF) is missing")
        t = io.read_table(path, ["term", "idf"])
        return TfidfModel(terms=np.asarray(t.column("term").to_pylist(), dtype=object),
                          idf=io.numeric_column(t, "idf").astype(np.float64),
                          params=json.loads(params_json), n_docs=0)
    return cached(("tfidf", res, dataset, params_json), make)


def _tokenizer(name: str):
    from . import encoders

    return cached(("tokenizer", name), lambda: encoders.load_tokenizer(name))


def ensemble_choice(target: "Target", predictions: str | Path) -> dict[str, Any]:
    """The validation choice an ensemble stage saved beside its ``predictions`` (``ensemble.json``: a member
    alone, or the combination's weights), which serving applies as the stage did."""
    path = Path(predictions).with_name("ensemble.json")
    target.need(path)
    return io.read_json(path)


def ensemble_of(members: list[sp.csr_matrix], method: str, topk: int,
                choice: Mapping[str, Any] | None = None) -> sp.csr_matrix:
    """The members' scores combined as the ensemble stage combines their tables (one member: itself), under
    the ``choice`` the stage made on validation (its ``--choice-out``: one member alone, or the weights)."""
    from .ensemble import ranking

    choice = choice or {}
    if len(members) == 1 and choice.get("member") is None:
        return members[0]
    return ranking(members, method, topk, choice.get("weights"), choice.get("member"))


# --------------------------------------------------------------------------- scores


def predict_scores(target: Target, texts: list[str], topk: int = 10, device: str = "auto") -> sp.csr_matrix:
    """Scores (CSR, ``len(texts)`` x L, at most ``topk`` per row) of ``target`` for ``texts``: its method's
    predictor (``f(target, variant, features, topk, device)``) on the texts' :class:`Features`."""
    spec = registry.get(target.method)
    variant = registry.split_method(target.method)[1]
    if not texts:
        return sp.csr_matrix((0, target.n_labels), dtype=np.float32)
    P = spec.load_predictor()(target, variant, Features(target, texts), int(topk), device)
    from .search import topk_per_row

    return topk_per_row(sp.csr_matrix(P), int(topk))


def top_labels(target: Target, P: sp.csr_matrix, row: int) -> list[dict[str, Any]]:
    """Row ``row`` of ``P`` as ``[{"label", "name", "score"}]``, best first (ties: lower index)."""
    a, b = P.indptr[row], P.indptr[row + 1]
    idx, val = P.indices[a:b], P.data[a:b]
    order = np.lexsort((idx, -val))
    return [{"label": target.label_ids[idx[i]], "name": target.label_names[idx[i]], "score": round(float(val[i]), 6)}
            for i in order]


# --------------------------------------------------------------------------- answers


def _batches(lines: Iterator[tuple[int, str]], size: int) -> Iterator[list[tuple[int, str]]]:
    batch: list[tuple[int, str]] = []
    for item in lines:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def answers(target: Target, lines: Iterator[tuple[int, str]], topk: int, batch_size: int, device: str,
            total: int | None = None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """``(line number, top labels)`` of every line, computed in batches, with a progress bar on stderr."""
    from tqdm import tqdm

    with tqdm(total=total, unit="text", desc=f"{target.dataset}/{target.method}", file=sys.stderr,
              disable=total is not None and total <= batch_size) as bar:
        for batch in _batches(lines, batch_size):
            keep = [i for i, (_, text) in enumerate(batch) if text.strip()]
            with proc.stdout_to_stderr():        # what native code prints is not an answer
                P = predict_scores(target, [batch[i][1] for i in keep], topk, device)
            rows = dict(zip(keep, range(len(keep))))
            for i, (n, _) in enumerate(batch):
                yield n, (top_labels(target, P, rows[i]) if i in rows else [])
            bar.update(len(batch))


def write_jsonl(out: TextIO, results: Iterable[tuple[int, list[dict[str, Any]]]], ids: list[str] | None = None) -> int:
    n = 0
    for n, labels in results:
        row = {"line": n, **({"id": ids[n - 1]} if ids else {}), "labels": labels}
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return n


def write_parquet(path: str | Path, results: Iterable[tuple[int, list[dict[str, Any]]]], ids: list[str] | None = None) -> int:
    """One row per (text, suggested label): ``line``, ``id`` (with ids), ``rank`` (1 = best), ``label``,
    ``name``, ``score``; written whole or not at all."""
    cols: dict[str, list[Any]] = {"line": [], "id": [], "rank": [], "label": [], "name": [], "score": []}
    n = 0
    for n, labels in results:
        for r, d in enumerate(labels, start=1):
            cols["line"].append(n)
            cols["id"].append(ids[n - 1] if ids else str(n))
            cols["rank"].append(r)
            for k in ("label", "name", "score"):
                cols[k].append(d[k])
    io.write_table(path, {**cols, "line": np.asarray(cols["line"], np.int64), "rank": np.asarray(cols["rank"], np.int32),
                          "score": np.asarray(cols["score"], np.float32)})
    return n


def read_ids(path: str, n_lines: int | None) -> list[str]:
    """The ids file's lines (one id per text, as many as ``n_lines`` when it is known)."""
    p = Path(path)
    if not p.is_file():
        raise PredictError(f"--ids {p}: no such file")
    try:
        ids = io.strip_bom(p.read_bytes()).decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise PredictError(f"--ids {p}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if n_lines is not None and len(ids) != n_lines:
        raise PredictError(f"--ids {p} has {len(ids)} lines, the input {n_lines}: one id per text, in order")
    return ids
