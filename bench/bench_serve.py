"""Warm serving cost of trained targets: ``xmc serve``'s HTTP server with the model loaded once.

    python bench/bench_serve.py --results results --dataset debtags [--methods xr-linear parabel] \
        [--requests 1000] [--batch 256] [--batches 20] [--out docs-table.md]

For each target ``results/<dataset>/<method>``: one warm-up request, then ``--requests`` requests of
one text each (the dataset's test documents in turn), one after another over HTTP on 127.0.0.1
(:mod:`xmc_steps.service`, the same code as ``xmc serve``: parse, TF-IDF, the method's scoring, the
JSON answer): p50, p99 and mean of the end-to-end latency; then ``--batches`` requests of ``--batch``
texts each: texts per second.  Also the same single texts called in process
(:func:`xmc_steps.service.answer`, no HTTP), p50.  Prints a Markdown table (and writes it to
``--out``); a timing script, not a test (the machine may be shared: rerun for a quiet number).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_steps import io, layout, service  # noqa: E402
from xmc_steps.serving import Target  # noqa: E402


def _texts(res: str, dataset: str) -> list[str]:
    t = io.read_table(Path(layout.at(res, layout.INGEST, dataset=dataset)) / "docs_test.parquet", ["text"])
    return [str(x) for x in t.column("text").to_pylist() if x and str(x).strip()]


def _post(url: str, texts: list[str]) -> dict:
    req = urllib.request.Request(url, data=json.dumps({"inputs": texts}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench(res: str, dataset: str, method: str, n_requests: int, batch: int, n_batches: int) -> dict:
    target = Target.load(Path(res) / dataset / method)
    texts = _texts(res, dataset)
    server = service.make_server(target, "127.0.0.1", 0, 10, "cpu")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/invocations"
    try:
        t0 = time.perf_counter()
        _post(url, texts[:1])                                   # loads the model, TF-IDF and tokenizer
        first_s = time.perf_counter() - t0
        lat = []
        for i in range(n_requests):
            t0 = time.perf_counter()
            _post(url, [texts[i % len(texts)]])
            lat.append((time.perf_counter() - t0) * 1000)
        inproc = []
        for i in range(min(n_requests, 200)):
            t0 = time.perf_counter()
            service.answer(target, [texts[i % len(texts)]], 10, "cpu")
            inproc.append((time.perf_counter() - t0) * 1000)
        batches = [[texts[(j * batch + k) % len(texts)] for k in range(batch)] for j in range(n_batches)]
        t0 = time.perf_counter()
        for b in batches:
            _post(url, b)
        tput = n_batches * batch / (time.perf_counter() - t0)
    finally:
        server.shutdown()
        server.server_close()
    return {"dataset": dataset, "method": method, "labels": target.n_labels, "first_request_s": round(first_s, 2),
            "p50_ms": round(_pct(lat, 0.5), 2), "p99_ms": round(_pct(lat, 0.99), 2),
            "mean_ms": round(statistics.fmean(lat), 2), "in_process_p50_ms": round(_pct(inproc, 0.5), 2),
            "batch": batch, "texts_per_s": round(tput, 1), "requests": n_requests}


def table(rows: list[dict]) -> str:
    head = ("| target | labels | first request (s) | p50 (ms) | p99 (ms) | mean (ms) | in process p50 (ms) "
            "| texts/s at batch {b} |\n|---|---|---|---|---|---|---|---|\n").format(b=rows[0]["batch"] if rows else 256)
    return head + "".join(
        f"| {r['dataset']}/{r['method']} | {r['labels']} | {r['first_request_s']} | {r['p50_ms']} | {r['p99_ms']} "
        f"| {r['mean_ms']} | {r['in_process_p50_ms']} | {r['texts_per_s']} |\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--dataset", default="debtags")
    p.add_argument("--methods", nargs="+", default=["xr-linear", "parabel"])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--out", help="also write the table here")
    a = p.parse_args(argv)
    rows = []
    for m in a.methods:
        r = bench(a.results, a.dataset, m, a.requests, a.batch, a.batches)
        print(json.dumps(r), file=sys.stderr)
        rows.append(r)
    t = table(rows)
    sys.stdout.write(t)
    if a.out:
        Path(a.out).write_text(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
