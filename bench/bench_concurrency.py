"""Concurrent Snakemake invocations on one ``results/`` folder: does every MLflow run arrive, and does any
invocation fail on a lock?

    python bench/bench_concurrency.py --n 16 --store sqlite      # the default store, results/mlflow.db
    python bench/bench_concurrency.py --n 16 --store server      # a local `mlflow server` (scripts/mlflow-server.sh)
    python bench/bench_concurrency.py --n 4 --layout same [--nolock]   # N invocations of ONE target (not supported)

In a fresh folder (``--work``, default a temporary one) it writes ``--n`` tiny synthetic datasets
(:mod:`xmc_steps.synth`, one per invocation: ``c00``, ``c01``, ...), starts the ``--n`` invocations at
once (``nice``; each ``snakemake results/cNN/<target>.json --cores 1`` with the project's config, all
in the same folder, so one ``results/`` and one ``.snakemake/``), waits for them, and then checks the
store against the stage records the jobs wrote (``*record.json``: each names its MLflow run):

* every record's run is in the store and FINISHED, with every parameter and final metric that
  :func:`xmc_steps.tracking.stage_entities` derives from the record;
* each dataset has exactly one parent run per target and one ``shared`` (none created twice), and the
  store holds no stage run beyond the records' (``stage_runs_in_store``: a job run twice shows here);
* no invocation's output or stage log mentions a lock error (Snakemake's ``LockException``, SQLite's
  "database is locked" reaching a job, the tracking lock's timeout); the tracking's own retries on a
  busy database (which succeed) are counted apart.

``--layout same`` starts the ``--n`` invocations on one dataset's target instead (``--nolock``: without
Snakemake's lock): it shows what happens to a target that several invocations build at once.

Prints one JSON line of figures (also written to ``<work>/figures.json``).  Every invocation uses
one core; on a machine with fewer cores than ``--n`` they share them (the figure is about
correctness, not speed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_steps import synth, tracking  # noqa: E402

#: the smallest data the linear targets run on: 16 labels, 240 documents
TINY = synth.Shape("tiny", n_train=240, n_test=60, n_labels=16, labels_per_doc=2.0, words_per_doc=24.0, vocab=400,
                   topic_words=4, signal=0.5)
#: lock errors: Snakemake's lock, SQLite's lock reaching a job, the tracking lock's timeout
LOCK_ERROR = re.compile(r"LockException|cannot be locked|database is locked(?!, retry)|could not acquire the lock")
LOCK_RETRY = re.compile(r"database locked, retry")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(work: Path) -> tuple[subprocess.Popen, str]:
    """``scripts/mlflow-server.sh`` on a free port of 127.0.0.1, its store under ``work/server``."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, XMC_PYTHON=sys.executable,
               XMC_MLFLOW_BACKEND_STORE_URI=f"sqlite:///{work / 'server' / 'mlflow.db'}",
               XMC_MLFLOW_ARTIFACTS=str(work / "server" / "artifacts"))
    env.pop("MLFLOW_TRACKING_URI", None)
    (work / "server").mkdir(parents=True, exist_ok=True)
    log = open(work / "mlflow-server.log", "w")
    p = subprocess.Popen(["bash", str(ROOT / "scripts" / "mlflow-server.sh"), "--port", str(port)],
                         cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return p, url
        except OSError:
            pass
        if p.poll() is not None or time.time() > deadline:
            raise SystemExit(f"mlflow server did not come up:\n{(work / 'mlflow-server.log').read_text()[-3000:]}")
        time.sleep(0.5)


def stop_server(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def write_config(work: Path, datasets: list[str]) -> Path:
    """The override config: the datasets in ``work/data``, one thread per job, a tiny tree."""
    import yaml

    over = {"data_dir": str(work / "data"), "results_dir": "results",
            "datasets": {d: {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1} for d in datasets}}
    path = work / "override.yaml"
    path.write_text(yaml.safe_dump(over))
    return path


def launch(work: Path, target: str, override: Path, env: dict, nice: int, nolock: bool, tag: str) -> subprocess.Popen:
    cmd = ["nice", "-n", str(nice), sys.executable, "-m", "snakemake", target, "--snakefile", str(ROOT / "Snakefile"),
           "--cores", "1", "--configfile", str(ROOT / "config.yaml"), str(override)] + (["--nolock"] if nolock else [])
    out = open(work / "invocations" / f"{tag}.log", "w")
    return subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)


def check_store(uri: str, work: Path, datasets: list[str], methods: list[str]) -> dict:
    """Compare the store with the stage records under ``work/results`` (see the module docstring)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    fig = {"runs_expected": 0, "runs_found": 0, "runs_not_finished": 0, "params_expected": 0, "params_found": 0,
           "metrics_expected": 0, "metrics_found": 0, "parents_expected": 0, "parents_found": 0,
           "parent_metrics_expected": 0, "parent_metrics_found": 0, "stage_runs_in_store": 0, "missing": []}
    for d in datasets:
        exp = client.get_experiment_by_name(d)
        runs = client.search_runs([exp.experiment_id], max_results=10000) if exp else []
        by_id = {r.info.run_id: r for r in runs}
        fig["stage_runs_in_store"] += sum(r.data.tags.get("xmc.run_type") == "stage" for r in runs)
        folder = work / "results" / d
        for rec_path in sorted([*folder.rglob("*record.json"), *(folder / "records").glob("*.json")]):
            rec = json.loads(rec_path.read_text())
            if "mlflow_run_id" not in rec:
                continue
            params, _, metrics = tracking.stage_entities(rec)
            fig["runs_expected"] += 1
            fig["params_expected"] += len(params)
            fig["metrics_expected"] += len(metrics)
            run = by_id.get(rec["mlflow_run_id"])
            if run is None:
                fig["missing"].append(str(rec_path.relative_to(work)))
                continue
            fig["runs_found"] += 1
            fig["runs_not_finished"] += run.info.status != "FINISHED"
            fig["params_found"] += sum(run.data.params.get(k) == v for k, v in params.items())
            fig["metrics_found"] += sum(k in run.data.metrics for k in metrics)
        parents = {}
        for r in runs:
            if r.data.tags.get("xmc.run_type") == "target":
                parents.setdefault(r.data.tags.get("xmc.method"), []).append(r)
        want = [*methods, tracking.SHARED]
        fig["parents_expected"] += len(want)
        fig["parents_found"] += sum(len(parents.get(m, [])) for m in want)
        for m in methods:                       # the evaluate stage's test metrics on the target's parent
            res = folder / f"{m}.json"
            if res.exists() and len(parents.get(m, [])) == 1:
                numeric = [k for k, v in json.loads(res.read_text())["metrics"].items() if isinstance(v, (int, float))]
                fig["parent_metrics_expected"] += len(numeric)
                fig["parent_metrics_found"] += sum(k in parents[m][0].data.metrics for k in numeric)
    return fig


def grep_logs(work: Path) -> tuple[int, int, list[str]]:
    """(lock errors, tracking retries, the first few error lines) over invocation and stage logs."""
    errors, retries, lines = 0, 0, []
    files = list((work / "invocations").glob("*.log")) + list((work / "logs").rglob("*.log"))
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            if LOCK_ERROR.search(line):
                errors += 1
                if len(lines) < 5:
                    lines.append(f"{f.name}: {line.strip()[:200]}")
            retries += bool(LOCK_RETRY.search(line))
    return errors, retries, lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16, help="concurrent invocations")
    p.add_argument("--store", choices=("sqlite", "server"), default="sqlite")
    p.add_argument("--layout", choices=("datasets", "same"), default="datasets",
                   help="one dataset per invocation, or all on one target")
    p.add_argument("--nolock", action="store_true", help="pass --nolock to every invocation")
    p.add_argument("--method", default="xr-linear", help="the target's method (a linear one is fastest)")
    p.add_argument("--work", help="folder to run in (default: a temporary one, removed unless --keep)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--nice", type=int, default=10)
    args = p.parse_args(argv)

    work = Path(args.work or tempfile.mkdtemp(prefix="xmc-concurrency-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "invocations").mkdir(exist_ok=True)
    datasets = [f"c{i:02d}" for i in range(args.n)] if args.layout == "datasets" else ["c00"]
    for i, d in enumerate(datasets):
        synth.write(TINY, 1.0, work / "data" / d, seed=i)
    override = write_config(work, datasets)
    env = dict(os.environ, XMC_TRACKING="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    server = None
    if args.store == "server":
        server, url = start_server(work)
        env["MLFLOW_TRACKING_URI"] = url
        uri = url
    else:
        uri = f"sqlite:///{work / 'results' / 'mlflow.db'}"
    try:
        t0 = time.perf_counter()
        procs = []
        for i in range(args.n):
            d = datasets[i] if args.layout == "datasets" else datasets[0]
            procs.append(launch(work, f"results/{d}/{args.method}.json", override, env, args.nice,
                                nolock=args.nolock, tag=f"i{i:02d}"))
        rcs = [q.wait() for q in procs]
        wall = time.perf_counter() - t0
        store = check_store(uri, work, datasets, [args.method])
    finally:
        if server is not None:
            stop_server(server)
    errors, retries, lines = grep_logs(work)
    fig = {"n": args.n, "store": args.store, "layout": args.layout, "nolock": args.nolock, "method": args.method,
           "invocations_ok": sum(rc == 0 for rc in rcs), "wall_s": round(wall, 1), **store,
           "lock_errors": errors, "tracking_lock_retries": retries, "lock_error_lines": lines,
           "cpus": os.cpu_count(), "work": str(work)}
    (work / "figures.json").write_text(json.dumps(fig, indent=2) + "\n")
    print(json.dumps(fig))
    if not args.work and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return fig


if __name__ == "__main__":
    main()
