"""The harness every stage CLI runs in.

A stage CLI parses its own arguments, then wraps its work in :func:`stage_run`::

    with stage_run("tfidf", args) as st:
        ...                      # the work; st.log is a logging.Logger
        st.params.update(...)    # parameters worth recording
        st.metric("vocab_size", n)
        st.step_metric("loss", value, step)
        st.output("train", path)

On a clean exit the harness writes the stage record (``--record``, JSON: wall time,
peak memory, parameters, metrics, outputs, MLflow run id) and logs the same to MLflow
through :mod:`xmc_steps.tracking`.  On an exception it removes the outputs the
stage declared (``--out``/``st.output`` paths that are files), so a failed job leaves
no artifact behind, and re-raises: the CLI exits non-zero with a one-line message
(see :func:`cli_main`).

After a kill.  On start, the harness removes the temporaries that an earlier, killed run of
the same outputs left beside them (:func:`xmc_steps.io.remove_stale_temporaries`: only those
whose writer process is gone).  A stage run from its own command line (:func:`cli_main`
without ``argv``, as the rules run it) ends itself when the process that started it dies
(:func:`xmc_steps.proc.guard_against_orphaning`), so a ``kill -9`` of Snakemake leaves no
stage computing on.  A run left RUNNING in MLflow by a kill is marked KILLED by the next run
of the same stage (:mod:`xmc_steps.tracking`).

Common CLI flags (added by :func:`add_common_args`): ``--log``, ``--record``,
``--params`` (JSON object), ``--dataset``, ``--method``, ``--rule`` (Snakemake's ``{rule}``),
``--config-hash``, ``--threads`` (Snakemake's ``{threads}``: the parameter ``threads``, over
``--params``), ``--phase``, ``--no-tracking``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from . import clock, io, proc
from .errors import StageError  # noqa: F401  (stages import it from here too)


def add_neural_training_args(p: argparse.ArgumentParser, tree_help: str) -> argparse.ArgumentParser:
    """The inputs of a neural training stage (ELIAS, LightXML, GUDN): token ids, label splits, the cluster
    tree (``tree_help``: what the method reads of it) and the output folder."""
    p.add_argument("--tokens-dir", required=True, help="folder with tokens_{train,valid}.npz")
    p.add_argument("--labels-train", required=True, help="Y_train (.npz CSR N x L)")
    p.add_argument("--labels-valid", required=True, help="Y_valid (.npz CSR)")
    p.add_argument("--tree", help=f"cluster tree (.npz of the cluster stage, xmc_steps.stages.cluster): {tree_help}")
    p.add_argument("--out", required=True, help="output folder")
    return p


def add_neural_predict_args(p: argparse.ArgumentParser, out_help: str) -> argparse.ArgumentParser:
    """The inputs of a neural prediction stage: the trained model's folder, one split's token ids and the
    predictions table (``out_help``: what it holds)."""
    p.add_argument("--model", required=True, help="a train output folder")
    p.add_argument("--tokens", required=True, help="tokens_{split}.npz")
    p.add_argument("--out", required=True, help=out_help)
    return p


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--log", help="log file (also echoed to stderr)")
    p.add_argument("--record", help="stage record JSON to write on success")
    p.add_argument("--params", default="{}", metavar="JSON",
                   help="the stage's settings as a JSON object (the DAG passes the config sections the rule "
                        "reads); every setting of a method, with its default, bounds and what it does: "
                        "xmc params <method> (python -m xmc_steps.cli params <method>); the shared sections: "
                        "docs/configuration.md")
    p.add_argument("--dataset", default="", help="dataset name (for tracking)")
    p.add_argument("--method", default="", help="method name, empty for shared stages")
    p.add_argument("--rule", default="", help="Snakemake rule name (for tracking)")
    p.add_argument("--config-hash", default="", help="hash of the effective config")
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    p.add_argument("--phase", choices=("data", "train", "predict", "eval"), default=None,
                   help="what the stage's cost counts towards in results (default: by stage name)")
    p.add_argument("--threads", type=int, default=None,
                   help="the threads the scheduler gave this job (Snakemake's {threads}); sets the parameter "
                        "threads, over any value in --params")
    return p


def parse_params(args: argparse.Namespace) -> dict[str, Any]:
    try:
        params = json.loads(args.params) if isinstance(args.params, str) else dict(args.params)
    except json.JSONDecodeError as e:
        raise StageError(f"--params is not valid JSON: {e}") from e
    if not isinstance(params, dict):
        raise StageError("--params must be a JSON object")
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise StageError(f"--threads must be >= 1, got {threads}")
        params["threads"] = threads
    return params


def peak_rss_mb() -> float:
    """Peak resident memory of this process and its waited-for children, in MiB."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(self_kb, child_kb) / 1024.0


def get_logger(name: str, log_path: str | None) -> logging.Logger:
    log = logging.getLogger(f"xmc.{name}")
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s")
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    log.addHandler(h)
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_path, mode="a", encoding="utf-8")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    return log


@dataclass
class StageContext:
    stage: str
    args: argparse.Namespace
    log: logging.Logger
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    step_metrics: list[tuple[str, float, int]] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    def metric(self, name: str, value: float) -> None:
        self.metrics[name] = float(value)

    def step_metric(self, name: str, value: float, step: int) -> None:
        self.step_metrics.append((name, float(value), int(step)))

    def output(self, name: str, path: str | os.PathLike) -> str:
        self.outputs[name] = str(path)
        return str(path)

    def step_logger(self, rename: dict[str, str] | None = None) -> Callable[[int, dict[str, float]], None]:
        """An ``on_step(step, logs)`` callback for trainers: every value becomes a curve point."""
        rename = rename or {}

        def on_step(step: int, logs: dict[str, float]) -> None:
            for k, v in logs.items():
                self.step_metric(rename.get(k, k), v, step)

        return on_step

    def progress(self, what: str, total: int, parts: int = 10) -> Callable[[int, int], None]:
        """A ``progress(done, n)`` callback that logs ``"<what>: done/n"`` about ``parts`` times."""
        every = max(1, int(total) // parts)

        def report(done: int, n: int) -> None:
            if done % every == 0 or done == n:
                self.log.info("%s: %d/%d", what, done, n)

        return report

    def online_cost(self, seconds: float, n_docs: int) -> None:
        """Record the part of this stage's work that predicting for new text repeats (the test
        split's tokenisation, TF-IDF transform, encoder pass, linear-tree beam ...), as
        ``online_ms_per_doc``: batched wall time per test document.  The evaluate stage adds
        it to the predict stages' latency for the end-to-end figure.  Calls accumulate."""
        self.extra["online_s"] = float(self.extra.get("online_s", 0.0)) + float(seconds)
        self.extra["online_docs"] = max(int(self.extra.get("online_docs", 0)), int(n_docs))
        self.metric("online_ms_per_doc", 1000.0 * self.extra["online_s"] / max(1, self.extra["online_docs"]))

    def predictions(self, path: str | os.PathLike, scores, topk: int, seconds: float) -> None:
        """Write a prediction table and record its cost (seconds, latency per document)."""
        io.write_predictions(path, scores, topk)
        self.metric("predict_s", seconds)
        self.metric("predict_latency_ms_per_doc", 1000.0 * seconds / max(1, scores.shape[0]))
        self.output("predictions", path)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t


def _remove_outputs(paths: list[str]) -> None:
    for p in paths:
        path = Path(p)
        with contextlib.suppress(FileNotFoundError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    """Where a stage ran: host name, CPU model, logical cores, and the GPU the stage used (the name of
    the current CUDA device when the stage initialised CUDA through torch; ``None`` otherwise).
    A leaderboard mixing CPU and GPU runs says which is which from this."""
    gpu = None
    torch = sys.modules.get("torch")   # a stage that never imported torch used no GPU
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                gpu = torch.cuda.get_device_name(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - a broken CUDA install must not fail the record
            gpu = None
    return {"host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu}


_RUNNING: list[StageContext] = []   # the stage this process is running (a stage is one process)


def started_at() -> float | None:
    """``time.perf_counter()`` when the running stage began (``None`` outside :func:`stage_run`): a
    trainer that resumes adds the wall time of the processes before it to this one's (it reads the
    same from :func:`xmc_steps.clock.started_at`, where :func:`stage_run` registers it)."""
    return _RUNNING[-1].t0 if _RUNNING else None


@contextlib.contextmanager
def _rank_context(ctx: StageContext) -> Iterator[None]:
    """A rank other than 0 of a stage under torchrun: it trains, and writes nothing (no record, no MLflow run,
    no removal of outputs on failure: rank 0's)."""
    _RUNNING.append(ctx)
    clock.stage_began(ctx.t0)
    try:
        yield
    except BaseException as e:
        if isinstance(e, StageError):
            ctx.log.error("%s", e)
        elif not isinstance(e, (KeyboardInterrupt, SystemExit)):
            ctx.log.exception("stage %s failed", ctx.stage)
        raise
    finally:
        _RUNNING.remove(ctx)
        clock.stage_ended(ctx.t0)


@contextlib.contextmanager
def stage_run(stage: str, args: argparse.Namespace, outputs: list[str] | None = None) -> Iterator[StageContext]:
    """Run a stage: logging, timing, peak memory, record, tracking, cleanup on failure.

    ``outputs`` are paths removed if the stage fails (in addition to ``st.output``
    paths and the record); pre-existing files are removed too, since Snakemake would
    otherwise mistake a stale file for the product of this run.
    """
    # under torchrun (several processes) rank 0 alone writes: the log file, the record, MLflow, the outputs'
    # removal on failure; the other ranks log to stderr (torchrun's environment, read without importing torch)
    rank = int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0
    log = get_logger(stage if rank == 0 else f"{stage}.rank{rank}", getattr(args, "log", None) if rank == 0 else None)
    ctx = StageContext(stage=stage, args=args, log=log, params=parse_params(args))
    if getattr(args, "phase", None):
        ctx.extra["phase"] = args.phase
    record_path = getattr(args, "record", None)
    declared = list(outputs or [])
    log.info("stage %s starting (pid %d)", stage, os.getpid())
    if rank > 0:
        with _rank_context(ctx):
            yield ctx
        return
    io.remove_stale_temporaries(declared + ([record_path] if record_path else []), log=log)
    proc.guard_log(log)
    _RUNNING.append(ctx)
    clock.stage_began(ctx.t0)
    try:
        yield ctx
    except BaseException as e:
        _remove_outputs(declared + list(ctx.outputs.values()) + ([record_path] if record_path else []))
        if isinstance(e, StageError):
            log.error("%s", e)
        elif not isinstance(e, (KeyboardInterrupt, SystemExit)):
            log.exception("stage %s failed", stage)
        raise
    finally:
        _RUNNING.remove(ctx)
        clock.stage_ended(ctx.t0)
    wall = time.perf_counter() - ctx.t0
    record = {
        "stage": stage,
        "rule": getattr(args, "rule", "") or stage,
        "dataset": getattr(args, "dataset", ""),
        "method": getattr(args, "method", ""),
        "config_hash": getattr(args, "config_hash", ""),
        "wall_s": round(wall, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "timings_s": {k: round(v, 3) for k, v in ctx.timings.items()},
        "params": ctx.params,
        "metrics": ctx.metrics,
        "outputs": ctx.outputs,
        "tags": ctx.tags,
        "extra": ctx.extra,
        "machine": machine_info(),
        "mlflow_run_id": None,
    }
    if not getattr(args, "no_tracking", False) and os.environ.get("XMC_TRACKING", "1") != "0":
        from . import tracking

        record["mlflow_run_id"] = tracking.log_stage(record, ctx.step_metrics, log=log)
    if record_path:
        io.write_json(record_path, record)
    log.info("stage %s done in %.1f s, peak memory %.0f MiB", stage, wall, record["peak_rss_mb"])


def cli_main(fn: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a stage's ``main``; print a :class:`StageError` as one clear line, exit 2.

    Without ``argv`` this is the process's own command line (``python -m xmc_steps.<stage>``):
    the process then ends when whoever started it dies (:func:`xmc_steps.proc.guard_against_orphaning`).
    A caller running a stage in-process (tests) passes ``argv`` and keeps its process as it was."""
    if argv is None:
        proc.guard_against_orphaning()
    try:
        fn(argv)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
