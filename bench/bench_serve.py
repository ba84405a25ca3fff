"""Warm serving cost of trained targets: ``xmc serve``'s HTTP server with the model loaded once, and the
predict CLI's cost for one text in a fresh process.

    python bench/bench_serve.py --results results --dataset debtags [--methods xr-linear parabel] \
        [--requests 1000] [--rounds 5] [--batch 256] [--batches 20] [--cli-runs 5] [--out table.md] \
        [--doc docs/benchmarks.md]

For each target ``results/<dataset>/<method>``: a server (:mod:`xmc_steps.service`, the same code as
``xmc serve``: parse, TF-IDF, the method's scoring, the JSON answer) on 127.0.0.1, one warm-up request
("first request": the model, TF-IDF and label table load), then ``--requests`` requests of one text each
(the dataset's test documents in turn), one after another over HTTP: p50, p99 and mean of the end-to-end
latency.  The requests go in ``--rounds`` rounds, each round every target in turn on the same texts, so
that a machine whose load changes during the run weighs on every target alike (the table gives the
p50 of each round, lowest and highest, beside the p50 of all).  Then the same single texts called in
process (:func:`xmc_steps.service.answer`, no HTTP), p50; then ``--batches`` requests of ``--batch``
texts each: texts per second.  Then ``--cli-runs`` times, per target, the predict CLI on one text in a
fresh interpreter (``python -m xmc_steps.stages.predict --model ... --input one.txt``), wall seconds
(median, lowest, highest), which is what ``xmc predict`` costs.

Prints Markdown tables, writes them to ``--out``, and with ``--doc`` replaces the part of that page
between ``<!-- bench_serve:begin -->`` and ``<!-- bench_serve:end -->`` with them and a line saying when,
where and at what load they were measured.  A timing script, not a test: on a shared machine rerun it
for a quiet number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_steps import io, layout, service  # noqa: E402
from xmc_steps.serving import Target  # noqa: E402

BEGIN, END = "<!-- bench_serve:begin -->", "<!-- bench_serve:end -->"


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


def bench(res: str, dataset: str, methods: list[str], n_requests: int, rounds: int, batch: int,
          n_batches: int) -> list[dict]:
    """One row per method; the methods' requests interleaved round by round."""
    texts = _texts(res, dataset)
    targets = {m: Target.load(Path(res) / dataset / m) for m in methods}
    servers, urls = {}, {}
    for m, target in targets.items():
        servers[m] = service.make_server(target, "127.0.0.1", 0, 10, "cpu")
        threading.Thread(target=servers[m].serve_forever, daemon=True).start()
        urls[m] = f"http://127.0.0.1:{servers[m].server_address[1]}/invocations"
    rows = {m: {"dataset": dataset, "method": m, "labels": t.n_labels, "batch": batch, "requests": n_requests}
            for m, t in targets.items()}
    try:
        for m in methods:
            t0 = time.perf_counter()
            _post(urls[m], texts[:1])                                # loads the model, TF-IDF and tokenizer
            rows[m]["first_request_s"] = round(time.perf_counter() - t0, 2)
        lat: dict[str, list[list[float]]] = {m: [] for m in methods}
        per = max(1, n_requests // max(1, rounds))
        for r in range(max(1, rounds)):
            for m in methods:
                got = []
                for i in range(r * per, (r + 1) * per):
                    t0 = time.perf_counter()
                    _post(urls[m], [texts[i % len(texts)]])
                    got.append((time.perf_counter() - t0) * 1000)
                lat[m].append(got)
        inproc: dict[str, list[float]] = {m: [] for m in methods}
        for i in range(min(n_requests, 200)):
            for m in methods:
                t0 = time.perf_counter()
                service.answer(targets[m], [texts[i % len(texts)]], 10, "cpu")
                inproc[m].append((time.perf_counter() - t0) * 1000)
        batches = [[texts[(j * batch + k) % len(texts)] for k in range(batch)] for j in range(n_batches)]
        spent = {m: 0.0 for m in methods}
        for b in batches:
            for m in methods:
                t0 = time.perf_counter()
                _post(urls[m], b)
                spent[m] += time.perf_counter() - t0
    finally:
        for s in servers.values():
            s.shutdown()
            s.server_close()
    for m in methods:
        flat = [x for got in lat[m] for x in got]
        per_round = [_pct(got, 0.5) for got in lat[m]]
        rows[m].update(p50_ms=round(_pct(flat, 0.5), 2), p99_ms=round(_pct(flat, 0.99), 2),
                       mean_ms=round(statistics.fmean(flat), 2), round_p50_ms=[round(x, 2) for x in per_round],
                       in_process_p50_ms=round(_pct(inproc[m], 0.5), 2),
                       texts_per_s=round(n_batches * batch / spent[m], 1) if n_batches else None)
    return [rows[m] for m in methods]


def cli_times(res: str, dataset: str, methods: list[str], runs: int) -> dict[str, list[float]]:
    """Wall seconds of the predict CLI on one text, a fresh interpreter per run, the targets in turn."""
    text = _texts(res, dataset)[0]
    out: dict[str, list[float]] = {m: [] for m in methods}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "one.txt"
        one.write_text(text.replace("\n", " ") + "\n", encoding="utf-8")
        for _ in range(runs):
            for m in methods:
                cmd = [sys.executable, "-m", "xmc_steps.stages.predict", "--model", str(Path(res) / dataset / m),
                       "--top-k", "3", "--input", str(one)]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                out[m].append(time.perf_counter() - t0)
                if r.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return out


def table(rows: list[dict]) -> str:
    head = ("| target | labels | first request (s) | p50 (ms) | p50 per round, low-high (ms) | p99 (ms) | mean (ms) "
            "| in process p50 (ms) | texts/s at batch {b} |\n|---|---|---|---|---|---|---|---|---|\n"
            ).format(b=rows[0]["batch"] if rows else 256)
    return head + "".join(
        f"| {r['dataset']}/{r['method']} | {r['labels']} | {r['first_request_s']} | {r['p50_ms']} "
        f"| {min(r['round_p50_ms'])}-{max(r['round_p50_ms'])} | {r['p99_ms']} | {r['mean_ms']} "
        f"| {r['in_process_p50_ms']} | {r['texts_per_s']} |\n" for r in rows)


def cli_table(dataset: str, times: dict[str, list[float]]) -> str:
    out = "| predict CLI, one text, fresh process | median (s) | lowest-highest (s) | runs |\n|---|---|---|---|\n"
    for m, xs in times.items():
        out += f"| {dataset}/{m} | {statistics.median(xs):.2f} | {min(xs):.2f}-{max(xs):.2f} | {len(xs)} |\n"
    return out


def _shown(argv: list[str]) -> list[str]:
    """``argv`` without ``--out``/``--doc`` and their values (where the tables went, not how they were made)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--out", "--doc"):
            skip = True
        elif not x.startswith(("--out=", "--doc=")):
            out.append(x)
    return out


def where(load_before: tuple[float, ...], load_after: tuple[float, ...], argv: list[str]) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"Measured {datetime.date.today().isoformat()} with `python bench/bench_serve.py {' '.join(_shown(argv))}` on "
            f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}; load average "
            f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (1 minute).")


def write_doc(path: Path, text: str) -> None:
    page = path.read_text(encoding="utf-8")
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section to replace")
    a, b = page.index(BEGIN) + len(BEGIN), page.index(END)
    path.write_text(page[:a] + "\n" + text + page[b:], encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--dataset", default="debtags")
    p.add_argument("--methods", nargs="+", default=["xr-linear", "parabel"])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5, help="the single-text requests in this many rounds, targets in turn")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--cli-runs", type=int, default=5, help="predict CLI runs per target (0: none)")
    p.add_argument("--out", help="also write the tables here")
    p.add_argument("--doc", help=f"replace this page's part between {BEGIN} and {END} with the tables")
    a = p.parse_args(argv)
    load0 = os.getloadavg()
    rows = bench(a.results, a.dataset, a.methods, a.requests, a.rounds, a.batch, a.batches)
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
    text = table(rows)
    if a.cli_runs > 0:
        times = cli_times(a.results, a.dataset, a.methods, a.cli_runs)
        print(json.dumps({m: [round(x, 2) for x in xs] for m, xs in times.items()}), file=sys.stderr)
        text += "\n" + cli_table(a.dataset, times)
    text += "\n" + where(load0, os.getloadavg(), argv) + "\n"
    sys.stdout.write(text)
    if a.out:
        Path(a.out).write_text(text, encoding="utf-8")
    if a.doc:
        write_doc(Path(a.doc), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
