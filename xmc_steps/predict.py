"""Ask a trained target about new text: the top labels, with their names and scores.

    python -m xmc_steps.predict --model results/debtags/lightxml --top-k 10 < texts.txt
    python -m xmc_steps.predict --model results/debtags/xr-linear --input texts.txt --out top.jsonl

``--model`` is a target of the DAG, ``results/<dataset>/<method>`` (any method or variant the
DAG evaluates: ``xr-linear``, ``parabel``, ``xtransformer[-<variant>]``, ``elias[-<row>]``,
``lightxml[-ensemble|-static]``, ``gudn[-<ablation>]``).  The target's effective settings
(``results/<dataset>/config/<method>.json``, written by the DAG) say which trained artifacts
make it up (:mod:`xmc_steps.layout`); each is checked before anything is computed, and a
missing one is an error naming it and the command that builds it.

The input is one text per line (``--input FILE`` or stdin), UTF-8.  A line that is not valid
UTF-8 or is empty (nothing but white space) is an error naming the file and the line, unless
``--skip-empty``: such lines are then answered with no labels.  The texts go through the same
code as the DAG's test split: the fitted TF-IDF (``features/tfidf/vocab.parquet`` and the
tfidf settings), the encoder's tokenizer at the target's length, then the method's own scoring
functions (the ones its predict stage calls), and ensembles combine their members as the
ensemble stage does.

Output: one JSON object per input line, in order: ``{"line": n, "labels": [{"label": id,
"name": text, "score": s}, ...]}`` (best first; with ``--ids FILE``, one id per input line, also
``"id"``) on stdout, or with ``--out FILE`` written to that file, which appears only when every
line is done (no half-written file); ``--out X.parquet`` writes a table instead, one row per text
and label (``line``, ``id``, ``rank``, ``label``, ``name``, ``score``).  Lines are read and
answered in batches of ``--batch-size`` with a progress bar on stderr.  ``--device`` picks CPU or
CUDA for the neural methods (``auto``: CUDA when visible).

stdout carries the answers and nothing else: while a batch is scored, file descriptor 1 points at
stderr (:func:`xmc_steps.proc.stdout_to_stderr`), since native code (omikuji's Rust logger) prints
to the descriptor itself.  ``--ids`` with stdin input reads the input first (its lines must be
counted against the ids before any answer is printed).  A UTF-8 byte-order mark at the start of the
input or of the ids file is not part of the first line.
"""

from __future__ import annotations

import argparse
import io as _io
import json
import logging
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TextIO

import numpy as np
import scipy.sparse as sp

from . import io, layout, proc

__all__ = ["PredictError", "Target", "Features", "read_texts", "predict_scores", "top_labels", "answers",
           "write_jsonl", "write_parquet", "main"]

log = logging.getLogger("xmc_steps.predict")


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
        base, _ = layout.split_method(method)
        if base not in PREDICTORS:
            raise PredictError(f"--model {model}: no predictor for method '{method}' (known: {', '.join(PREDICTORS)})")
        labels_path = Path(layout.at(res, layout.INGEST, dataset=dataset)) / "labels.parquet"
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


def _cached(key: Any, make: Callable[[], Any]) -> Any:
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
                          idf=np.asarray(t.column("idf").to_numpy(), dtype=np.float64),
                          params=json.loads(params_json), n_docs=0)
    return _cached(("tfidf", res, dataset, params_json), make)


def _tokenizer(name: str):
    from . import encoders

    return _cached(("tokenizer", name), lambda: encoders.load_tokenizer(name))


# --------------------------------------------------------------------------- the methods

#: method (without variant) -> scores of a batch: f(target, variant, features, topk, device) -> CSR N x L
PREDICTORS: dict[str, Callable[..., sp.csr_matrix]] = {}


def predictor(name: str):
    def register(fn):
        PREDICTORS[name] = fn
        return fn
    return register


@predictor("xr-linear")
def _xr_linear(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    from .xr_linear import XRLinearModel

    folder = Path(layout.at(t.res, layout.XR_LINEAR, dataset=t.dataset)) / "model"
    t.need(folder)
    model = _cached(("xr-linear", str(folder)), lambda: XRLinearModel.load(folder))
    s = t.settings["xr_linear"]
    return model.predict(f.tfidf, beam=int(s["beam"]), topk=topk, transform=s["transform"])


@predictor("parabel")
def _parabel(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    from . import parabel

    folder = Path(layout.at(t.res, layout.PARABEL, dataset=t.dataset)) / "model"
    t.need(folder / "omikuji")

    def load():
        import omikuji

        m = omikuji.Model.load(str(folder / "omikuji"))
        m.init_prediction_thread_pool(int(t.settings.get("threads", 2)))
        return m
    model = _cached(("parabel", str(folder)), load)
    return parabel.predict(model, f.tfidf, topk, int(t.settings["parabel"]["beam"]), t.n_labels)


def _lightxml_network(t: Target, folder: str, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """One trained LightXML network (LightXML's or GUDN's): generator x discriminator, Eq. 6's scores."""
    from .lightxml.model import load_lightxml, predict

    t.need(Path(folder) / "lightxml.json", Path(folder) / "model.safetensors")
    meta = io.read_json(Path(folder) / "lightxml.json")
    model = _cached(("lightxml", folder, device), lambda: load_lightxml(folder, device))
    tokens = f.tokens(meta["encoder"], meta["max_length"])
    net = t.settings["lightxml"] if "lightxml" in t.settings else t.settings["gudn"]["backbone"]
    return predict(model, tokens, topk, int(net.get("eval_batch_size", 128) or 128), device, net.get("amp", "auto"),
                   progress=None)["scores"]


def _ensemble(members: list[sp.csr_matrix], method: str, topk: int) -> sp.csr_matrix:
    from .ensemble import combine

    return members[0] if len(members) == 1 else combine(members, method, topk)


@predictor("lightxml")
def _lightxml(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    members = layout.lightxml_members(t.settings, variant)
    k = max(topk, int(t.settings["evaluate"]["topk"])) if len(members) > 1 else topk   # as the DAG's members
    scores = [_lightxml_network(t, m.dir(t.res, t.dataset), f, k, device) for m in members]
    return _ensemble(scores, t.settings["lightxml"]["ensemble"]["method"], topk)


@predictor("gudn")
def _gudn(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    # GUDN predicts from the text alone (the guide network reads label texts in training only)
    return _lightxml_network(t, layout.gudn_dir(t.res, t.dataset, t.settings, variant), f, topk, device)


@predictor("xtransformer")
def _xtransformer(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """Each member as its stages score the test split: the matcher's encoder pass and top-b clusters (by
    the scorer its guard chose), the linear tree's beam, Eq. 2 over the candidate clusters."""
    import torch

    from . import neural, xtransformer
    from .matcher import head_linear_topb, load_matcher, topb_from_emb
    from .ranker import ranker_features
    from .search import matcher_scores
    from .xr_linear import XRLinearModel

    xt = t.settings["xtransformer"]
    spec = layout.xt_spec(t.settings, variant)
    members = layout.xt_members(t.settings, variant)
    k = max(topk, int(t.settings["evaluate"]["topk"])) if len(members) > 1 else topk
    topb = int(xt["matcher"]["topb"])
    fit = "+".join(xt["fit_on"])
    dev = neural.resolve_device(device)
    out = []
    for m in members:
        mdir, rdir = Path(m.matcher_dir(t.res, t.dataset)), Path(m.ranker_dir(t.res, t.dataset)) / "model"
        ldir = Path(layout.linear_model_dir(t.res, t.dataset, t.settings, m.emb, m.tree, fit))
        t.need(mdir / "matcher.json", mdir / "model.safetensors", mdir / "guard.json", rdir / "ranker.json", ldir)
        meta = io.read_json(mdir / "matcher.json")
        matcher = _cached(("matcher", str(mdir), str(dev)), lambda: load_matcher(mdir, dev))
        tokens = f.tokens(meta["encoder"], meta["max_length"])
        emb = neural.embed(matcher.encoder, tokens, 128, dev, xt["matcher"].get("amp", "auto"), progress=None)
        head = matcher.head.weight.detach().float().cpu().numpy()
        linear = _cached(("xr-linear", str(ldir)), lambda: XRLinearModel.load(ldir))
        lin_top = linear.predict_clusters(f.tfidf, beam=topb, transform=linear.params.transform, keep=topb)
        scorer = io.read_json(mdir / "guard.json").get("scorer", "head")
        with torch.no_grad():
            top = head_linear_topb(emb, head, lin_top, topb, dev) if scorer == "head+linear" else topb_from_emb(emb, head, topb, dev)
        W, C, p, rmeta = _cached(("xt-ranker", str(rdir)), lambda: xtransformer.load(rdir))
        p = type(p).from_dict({**p.to_dict(), "topb": topb, "topk": k, "candidates": m.candidates,
                               "combiner": m.combiner, "transform": xt["ranker"]["transform"]})
        Xr = ranker_features(f.tfidf, emb, p.ranker_input, p.neural_weight)
        G = matcher_scores(xtransformer.candidate_clusters(top, lin_top, p.candidates, p.topb), emb, head)
        out.append(xtransformer.predict(Xr, W, C, G, p))
    return _ensemble(out, spec["ensemble"], topk)


@predictor("elias")
def _elias(t: Target, variant: str | None, f: Features, topk: int, device: str) -> sp.csr_matrix:
    """Each clustering seed's model as its stages score the test split: ELIAS's top-k (stage 1 or 2),
    then for ELIAS++ the sparse ranker over those candidates and the calibration."""
    from . import elias_plus, neural
    from .elias.model import load_elias, predict
    from .ranker import ranker_features

    el = t.settings["elias"]
    k100 = int(t.settings["evaluate"]["topk"])
    stage = 1 if variant == "stage1" else 2
    dev = neural.resolve_device(device)
    out = []
    for seed in layout.elias_seeds(t.settings, variant):
        sdir = Path(layout.elias_dir(t.res, t.dataset, t.settings, seed, layout.ELIAS_STAGE, stage=stage))
        t.need(sdir / "elias.json", sdir / "model.safetensors")
        meta = io.read_json(sdir / "elias.json")
        model = _cached(("elias", str(sdir), str(dev)), lambda: load_elias(sdir, dev))
        pred = el.get("predict") or {}
        b = pred.get("b") if pred.get("b") is not None else model.b
        K = pred.get("K") if pred.get("K") is not None else model.K
        tokens = f.tokens(meta["encoder"], meta["max_length"])
        r = predict(model, tokens, k100, b, K, 128, dev, el.get("amp", "auto"), with_emb=True, progress=None)
        if variant in ("stage1", "stage2"):
            out.append(r["scores"])
            continue
        plus = Path(layout.elias_dir(t.res, t.dataset, t.settings, seed, layout.ELIAS_PLUS))
        cal = plus / "calibration" / "calibration.npz"
        t.need(plus / "ranker" / "ranker.json", *([cal] if variant != "ranker" else []))
        W, rmeta = _cached(("elias-ranker", str(plus)), lambda: elias_plus.load_ranker(plus / "ranker"))
        p = elias_plus.EliasPlusParams.from_dict({**elias_plus.EliasPlusParams.upgrade(rmeta["params"]), "topk": k100,
                                                  "uncalibrated": el["plus"]["uncalibrated"]})
        Xr = ranker_features(f.tfidf, r["emb"], "tfidf+neural", p.neural_weight)
        cand = elias_plus.candidates(sp.csr_matrix(r["scores"]), p.n_candidates)
        calibrated = variant != "ranker"
        out.append(elias_plus.plus_scores(Xr, W, cand, p, io.load_arrays(cal) if calibrated else None,
                                          elias_plus.label_train_freq(plus / "ranker") if calibrated else None))
    return _ensemble(out, el["ensemble"], topk)


def predict_scores(target: Target, texts: list[str], topk: int = 10, device: str = "auto") -> sp.csr_matrix:
    """Scores (CSR, ``len(texts)`` x L, at most ``topk`` per row) of ``target`` for ``texts``."""
    base, variant = layout.split_method(target.method)
    if not texts:
        return sp.csr_matrix((0, target.n_labels), dtype=np.float32)
    P = PREDICTORS[base](target, variant, Features(target, texts), int(topk), device)
    from .search import topk_per_row

    return topk_per_row(sp.csr_matrix(P), int(topk))


def top_labels(target: Target, P: sp.csr_matrix, row: int) -> list[dict[str, Any]]:
    """Row ``row`` of ``P`` as ``[{"label", "name", "score"}]``, best first (ties: lower index)."""
    a, b = P.indptr[row], P.indptr[row + 1]
    idx, val = P.indices[a:b], P.data[a:b]
    order = np.lexsort((idx, -val))
    return [{"label": target.label_ids[idx[i]], "name": target.label_names[idx[i]], "score": round(float(val[i]), 6)}
            for i in order]


# --------------------------------------------------------------------------- CLI


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


def _read_ids(path: str, n_lines: int | None) -> list[str]:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a trained target: results/<dataset>/<method>")
    p.add_argument("--top-k", type=int, default=10, help="labels per text (default 10)")
    p.add_argument("--input", default="-", help="texts, one per line (default: stdin)")
    p.add_argument("--out", help="write to this file instead of stdout: JSON lines, or a table (one row per text "
                                 "and label) when it ends in .parquet")
    p.add_argument("--ids", help="a file of ids, one per input line, written beside each answer")
    p.add_argument("--batch-size", type=int, default=256, help="texts per batch (default 256)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:n] (neural methods)")
    p.add_argument("--skip-empty", action="store_true", help="answer empty lines with no labels instead of failing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.top_k < 1 or args.batch_size < 1:
        print("error: --top-k and --batch-size must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.device not in ("auto", "cpu"):
            from .neural import resolve_device

            try:
                resolve_device(args.device)
            except (ValueError, RuntimeError) as e:
                raise PredictError(f"--device {args.device}: {e}") from None
        target = Target.load(args.model)
        if args.input == "-" and args.ids:
            # the ids are checked against the number of texts before anything is answered
            data = sys.stdin.buffer.read()
            stream, name = _io.BytesIO(data), "<stdin>"
            total = sum(1 for _ in _io.BytesIO(data))
        elif args.input == "-":
            stream, name, total = sys.stdin.buffer, "<stdin>", None
        else:
            path = Path(args.input)
            if not path.is_file():
                raise PredictError(f"--input {path}: no such file")
            with open(path, "rb") as fh:
                total = sum(1 for _ in fh)
            stream, name = open(path, "rb"), str(path)
        try:
            ids = _read_ids(args.ids, total) if args.ids else None
            results = answers(target, read_texts(stream, name, args.skip_empty), args.top_k, args.batch_size,
                              args.device, total)
            if args.out and args.out.endswith(".parquet"):
                n = write_parquet(args.out, results, ids)
            elif args.out:
                with io.atomic_path(args.out) as tmp, open(tmp, "w", encoding="utf-8") as out:
                    n = write_jsonl(out, results, ids)
            else:
                write_jsonl(sys.stdout, results, ids)
            if args.out:
                print(f"{n} texts -> {args.out}", file=sys.stderr)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
    except PredictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
