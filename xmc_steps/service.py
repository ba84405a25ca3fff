"""A trained target answering over HTTP, as MLflow's scoring server does: ``xmc serve --model results/<dataset>/<method>``.

The model is loaded once and stays warm: one text is answered in milliseconds (the predict CLI
starts an interpreter and loads the model per call, seconds).  Both servers, this one and
``mlflow models serve`` on the target's registered model (:mod:`xmc_steps.mlflow_model`), answer
through :func:`answer`, which is :func:`xmc_steps.serving.predict_scores` and
:func:`~xmc_steps.serving.top_labels`: the predict CLI's path, so the labels and scores are the same.

Protocol (MLflow's scoring protocol, the subset a text model needs):

* ``GET /ping``, ``GET /health``: 200 once the model is loaded; ``GET /version``: the package's version;
* ``POST /invocations`` with a JSON body: ``{"inputs": ["text", ...]}`` (or ``{"inputs": {"text": [...]}}``),
  ``{"dataframe_split": {"columns": ["text"], "data": [["text"], ...]}}``, ``{"dataframe_records":
  [{"text": "..."}, ...]}`` or ``{"instances": [...]}``, optionally ``"params": {"top_k": 5}``; answered
  ``{"predictions": [{"labels": [id, ...], "names": [text, ...], "scores": [s, ...]}, ...]}``, one per
  text, in order, best first.  A bad request is 400 with ``{"error_code": "BAD_REQUEST", "message": ...}``.

Requests are answered one at a time (a lock around the scoring: the models are not thread-safe and
each batch already uses the threads it was given); a request of many texts is one batch.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Mapping

from . import proc
from .serving import PredictError, Target, predict_scores, top_labels

__all__ = ["RequestError", "answer", "parse_request", "make_server", "TEXT_COLUMN", "DEFAULT_TOP_K"]

log = logging.getLogger("xmc_steps.service")

#: the input column of the signature (``mlflow_model``) and of dataframe requests
TEXT_COLUMN = "text"
DEFAULT_TOP_K = 10
#: the most texts one request may hold (a larger batch is the predict CLI's job)
MAX_TEXTS = 100_000


class RequestError(ValueError):
    """A request the server cannot answer: the message says why (HTTP 400)."""


def answer(target: Target, texts: list[str], top_k: int = DEFAULT_TOP_K, device: str = "auto") -> list[dict[str, list]]:
    """``[{"labels", "names", "scores"}]`` of each text, best first: the predict CLI's labels and scores
    (:func:`~xmc_steps.serving.top_labels`, rounded as it rounds them).  An empty text has no labels."""
    keep = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    with proc.stdout_to_stderr():                 # what native code prints is not an answer
        P = predict_scores(target, [texts[i] for i in keep], int(top_k), device)
    rows = dict(zip(keep, range(len(keep))))
    out = []
    for i in range(len(texts)):
        labs = top_labels(target, P, rows[i]) if i in rows else []
        out.append({"labels": [d["label"] for d in labs], "names": [d["name"] for d in labs],
                    "scores": [d["score"] for d in labs]})
    return out


def _texts_of(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        if TEXT_COLUMN not in value:
            raise RequestError(f"{where}: expected a '{TEXT_COLUMN}' column, got {', '.join(map(str, value)) or 'none'}")
        return _texts_of(value[TEXT_COLUMN], where)
    if not isinstance(value, list):
        raise RequestError(f"{where}: expected a list of texts")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, Mapping):
            v = v.get(TEXT_COLUMN)
        elif isinstance(v, list) and len(v) == 1:
            v = v[0]
        if not isinstance(v, str):
            raise RequestError(f"{where}[{i}]: not a text ({type(v).__name__})")
        out.append(v)
    return out


def parse_request(body: bytes) -> tuple[list[str], dict[str, Any]]:
    """``(texts, params)`` of an ``/invocations`` body in one of MLflow's JSON formats."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the body is not JSON ({e})") from None
    if not isinstance(doc, Mapping):
        raise RequestError("the body is not a JSON object")
    params = doc.get("params") or {}
    if not isinstance(params, Mapping):
        raise RequestError("params: expected an object")
    if "dataframe_split" in doc:
        split = doc["dataframe_split"]
        if not isinstance(split, Mapping) or not isinstance(split.get("data"), list):
            raise RequestError("dataframe_split: expected {columns, data}")
        cols = split.get("columns") or [TEXT_COLUMN]
        if TEXT_COLUMN not in cols:
            raise RequestError(f"dataframe_split: no '{TEXT_COLUMN}' column (columns: {', '.join(map(str, cols))})")
        j = cols.index(TEXT_COLUMN)
        texts = _texts_of([row[j] if isinstance(row, list) and len(row) > j else row for row in split["data"]],
                          "dataframe_split.data")
    elif "dataframe_records" in doc:
        texts = _texts_of(doc["dataframe_records"], "dataframe_records")
    elif "inputs" in doc or "instances" in doc:
        key = "inputs" if "inputs" in doc else "instances"
        texts = _texts_of(doc[key], key)
    else:
        raise RequestError("expected one of inputs, instances, dataframe_split, dataframe_records")
    if len(texts) > MAX_TEXTS:
        raise RequestError(f"{len(texts)} texts in one request; at most {MAX_TEXTS} (the predict CLI answers files)")
    out: dict[str, Any] = {}
    if "top_k" in params:
        try:
            out["top_k"] = int(params["top_k"])
        except (TypeError, ValueError):
            raise RequestError(f"params.top_k: not an integer ({params['top_k']!r})") from None
        if out["top_k"] < 1:
            raise RequestError("params.top_k must be at least 1")
    return texts, out


def make_server(target: Target, host: str = "127.0.0.1", port: int = 5000, top_k: int = DEFAULT_TOP_K,
                device: str = "auto") -> ThreadingHTTPServer:
    """An HTTP server (not started: ``serve_forever``) answering ``target`` at ``host:port``."""
    lock = threading.Lock()
    from . import __version__ as version

    class Handler(BaseHTTPRequestHandler):
        server_version = "xmc-serve"

        def log_message(self, fmt: str, *args: Any) -> None:      # requests on stderr, at debug level
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, doc: Any) -> None:
            body = json.dumps(doc, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path in ("/ping", "/health"):
                self._send(200, {"status": "ok", "model": f"{target.dataset}/{target.method}"})
            elif self.path == "/version":
                self._send(200, {"version": version})
            else:
                self._send(404, {"error_code": "NOT_FOUND", "message": f"no such path {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/invocations":
                self._send(404, {"error_code": "NOT_FOUND", "message": f"no such path {self.path} (POST /invocations)"})
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
                texts, params = parse_request(self.rfile.read(n))
                with lock:
                    preds = answer(target, texts, params.get("top_k", top_k), device)
            except (RequestError, PredictError) as e:
                self._send(400, {"error_code": "BAD_REQUEST", "message": str(e)})
                return
            except Exception as e:  # an answer that failed: the server stays up
                log.exception("request failed")
                self._send(500, {"error_code": "INTERNAL_ERROR", "message": f"{type(e).__name__}: {e}"})
                return
            self._send(200, {"predictions": preds})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(model: str, host: str, port: int, top_k: int, device: str) -> int:
    """Load ``model``, answer one warm-up text, then serve until interrupted (``xmc serve``)."""
    target = Target.load(model)
    answer(target, ["warm up"], 1, device)        # load the model, TF-IDF and tokenizer now, not on the first request
    server = make_server(target, host, port, top_k, device)
    print(f"serving {target.dataset}/{target.method} on http://{host}:{server.server_address[1]} "
          "(POST /invocations; Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
