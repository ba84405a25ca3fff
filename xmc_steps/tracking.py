"""MLflow tracking of stage jobs.

Layout in the tracking store:

* one **experiment per dataset** (experiment name = dataset name, e.g. ``debtags``; MLflow 3's
  UI opens on its GenAI view: switch to "Model training", or open
  ``/#/experiments/<id>?workflowType=machine_learning``, for the runs table);
* one **parent run per (dataset, method) target**, run name ``{method}``, tags
  ``xmc.dataset``, ``xmc.method``, ``xmc.config_hash`` (that of the latest stage logged)
  and ``xmc.run_type = target``.  It is found again by its tags and reused by every
  stage job of the target, across Snakemake invocations.  The evaluate stage gives it the
  target's test metrics, its effective hyper-parameters under names shared across methods
  (:mod:`xmc_steps.target_params`), the git commit (tag ``mlflow.source.git.commit``), and
  the results JSON, plots and leaderboard row as artifacts; a parent whose parameters
  belong to an earlier configuration is superseded, not overwritten (:func:`annotate_parent`);
* stages shared by several methods (``method == ""``: TF-IDF, clustering, ...) go under
  one parent run per dataset named ``shared`` (``xmc.method = shared``), so they are
  logged once; :func:`link_shared` records on a method's parent which shared runs it
  used (``xmc.uses.<stage> = <run id>``);
* one **child run per stage job** (``mlflow.parentRunId`` = the parent, run name = the
  rule, ``xmc.run_type = stage``), tagged with rule, stage, dataset, method, config hash
  and git commit, holding the flattened parameters (dotted keys), the final metrics,
  ``wall_s``, ``peak_rss_mb`` and ``time_s.<phase>`` as metrics, the per-step training
  curves, and the output paths as ``artifact.<name>`` params and tags (the stage's files
  are not copied; they stay under ``results/``).

Store: :func:`tracking_uri` — ``MLFLOW_TRACKING_URI`` if set, else a local SQLite file
``<results_dir>/mlflow.db`` (``results_dir`` = ``XMC_RESULTS_DIR`` or ``results``).
Browse it with ``mlflow ui --backend-store-uri sqlite:///results/mlflow.db``.

Concurrency.  Snakemake runs many stage jobs at once and they all write the same SQLite
file, which allows one writer at a time and answers the others "database is locked".
So every logging sequence runs under an inter-process :class:`filelock.FileLock` on
``<results_dir>/mlflow.db.lock`` (next to the database for any ``sqlite:///`` URI):

* the first creation of the database (MLflow runs its schema migrations when the store
  is first opened in a process) happens inside the lock;
* the get-or-create of the experiment and of the parent run happens inside the lock,
  so a parent is never created twice;
* the child run is created and filled with few, batched calls (``log_batch`` chunks of
  at most 1000 entities / 100 params+tags), then terminated — all inside the lock, so
  a job holds it for a fraction of a second;
* each store call is additionally retried with exponential backoff (bounded) when the
  error says the database is locked/busy — e.g. an ``mlflow ui`` reader holding a
  shared lock; every retried call is a single transaction, so a retry never
  duplicates anything.

With a tracking server (``http(s)://`` or any non-SQLite database URI) the server
serialises writes itself; the lock (``<results_dir>/mlflow.lock``) is then only taken
around the get-or-create of the experiment and parent run.  On a cluster that lock
file must be on a file system shared by the jobs of a target for this to hold.

Runs left RUNNING.  A stage's child run is created and terminated within a second, but a job
killed in that second leaves it RUNNING for ever.  The child therefore carries, from its creation,
who wrote it and for which outputs (``xmc.pid``, ``xmc.host``, ``xmc.outputs_key``: a hash of the
output paths, beside rule, dataset and method).  Before the next run of the same stage (same rule,
dataset, method and outputs) creates its child, it marks every RUNNING child of that stage whose
process is gone (:func:`xmc_steps.proc.pid_gone`: on this host and ended) as KILLED, tagged
``xmc.killed_note``.  Runs of another host, of a live process, or without those tags (older
versions) are left as they are.

Failure policy.  If tracking still fails after the retries (or the lock cannot be had
within ``XMC_TRACKING_LOCK_TIMEOUT`` seconds, default 600), :func:`log_stage` raises a
:class:`RuntimeError` naming the URI and the cause.  The harness calls it after the
stage body, outside its cleanup block, so the stage's computed outputs are left in
place (though no record is written and the job fails): a run is never lost silently,
and rerunning the job (or setting ``XMC_TRACKING=0``) recovers.  ``XMC_TRACKING=0``
disables tracking entirely (checked by the harness).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

from .params import flatten
from .proc import HOST, pid_gone

__all__ = [
    "tracking_uri",
    "results_dir",
    "lock_path",
    "log_stage",
    "link_shared",
    "parent_run_id",
    "annotate_parent",
    "log_artifacts",
    "flatten_params",
    "git_commit",
    "mark_killed_runs",
    "model_lock",
    "outputs_key",
    "stage_entities",
    "SHARED",
]

#: Method name used for the parent run of stages shared by several methods.
SHARED = "shared"

# MLflow's limits (mlflow.utils.validation); repeated here so importing this module
# stays cheap (mlflow itself is imported only when something is logged).
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250
MAX_ENTITIES_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100

RETRY_ATTEMPTS = 8
RETRY_BASE_S = 0.1
RETRY_MAX_S = 5.0

_T = TypeVar("_T")
_KEY_BAD_CHARS = re.compile(r"[^\w\-. /:]")
_git_commit_cache: str | None = None


# ----------------------------------------------------------------------- locations


def results_dir() -> Path:
    """``XMC_RESULTS_DIR`` or ``results`` (relative to the cwd), as an absolute path."""
    return Path(os.environ.get("XMC_RESULTS_DIR") or "results").resolve()


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<results_dir>/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    return f"sqlite:///{results_dir() / 'mlflow.db'}"


def artifact_root() -> Path:
    """Where run artifacts go with the default SQLite store: ``<results_dir>/mlartifacts``."""
    return results_dir() / "mlartifacts"


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other URIs or in-memory)."""
    if not uri.startswith("sqlite:"):
        return None
    path = uri[len("sqlite:") :]
    if path.startswith("///"):
        path = path[3:]
        # sqlite:////abs/path -> "/abs/path"; sqlite:///rel/path -> "rel/path"
    else:
        return None
    path = path.split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path).resolve()


def _serialises_writes_itself(uri: str) -> bool:
    """True for stores that handle concurrent writers (servers, client/server databases)."""
    return _sqlite_path(uri) is None and not uri.startswith(("file:", "/", ".")) and "://" in uri


def lock_path(uri: str | None = None) -> Path:
    """The inter-process lock file for ``uri``: next to a SQLite file, else under results_dir."""
    uri = uri or tracking_uri()
    db = _sqlite_path(uri)
    if db is not None:
        return db.with_name(db.name + ".lock")
    return results_dir() / "mlflow.lock"


def _lock_timeout() -> float:
    try:
        return float(os.environ.get("XMC_TRACKING_LOCK_TIMEOUT", "600"))
    except ValueError:
        return 600.0


@contextlib.contextmanager
def _file_lock(uri: str) -> Iterator[None]:
    import filelock

    from .io import file_mode

    path = lock_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(path), timeout=_lock_timeout(), mode=file_mode())
    try:
        lock.acquire()
    except filelock.Timeout as e:
        raise RuntimeError(
            f"MLflow tracking at {uri}: could not acquire the lock {path} within "
            f"{_lock_timeout():.0f} s (another job holding it?)"
        ) from e
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def model_lock(uri: str | None = None) -> Iterator[None]:
    """The store's lock (:func:`lock_path`) around a sequence of MLflow calls made outside this module
    (a model logged and registered, :mod:`xmc_steps.mlflow_model`), so parallel jobs never fail on a
    locked SQLite database."""
    uri = uri or tracking_uri()
    _preimport(uri)
    with _file_lock(uri):
        yield


# ----------------------------------------------------------------------- helpers


def _quiet_mlflow() -> None:
    # a REST store otherwise prints "View run ... at: <url>" to stdout on every terminate
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    for name in ("mlflow", "alembic", "sqlalchemy", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _is_locked_error(exc: BaseException) -> bool:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = str(e).lower()
        if "locked" in msg or "database is busy" in msg or "sqlite_busy" in msg:
            return True
        e = e.__cause__ or e.__context__
    return False


def _retry(fn: Callable[[], _T], what: str, log: logging.Logger | None = None) -> _T:
    """Call ``fn``; on a "database is locked" error retry with exponential backoff."""
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return fn()
        except Exception as e:  # sqlite3/sqlalchemy OperationalError, MlflowException
            if attempt == RETRY_ATTEMPTS - 1 or not _is_locked_error(e):
                raise
            delay = min(RETRY_MAX_S, RETRY_BASE_S * 2**attempt) * (0.5 + random.random())
            if log is not None:
                log.warning("MLflow %s: database locked, retry %d in %.2f s", what, attempt + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _clean_key(key: str) -> str:
    key = _KEY_BAD_CHARS.sub("_", str(key).replace("@", "_at_"))
    return key[:MAX_ENTITY_KEY_LENGTH] or "_"


def _str_value(v: Any, limit: int) -> str:
    if isinstance(v, str):
        s = v
    elif isinstance(v, (list, tuple, dict)):
        try:
            s = json.dumps(v, sort_keys=True, default=str)
        except (TypeError, ValueError):
            s = str(v)
    else:
        s = str(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dict -> ``{"a.b.c": "value"}`` with keys cleaned and values stringified and truncated."""
    out: dict[str, str] = {}
    for key, v in flatten(params, prefix).items():
        ck = _clean_key(key)
        if ck not in out:
            out[ck] = _str_value(v, MAX_PARAM_VAL_LENGTH)
    return out


def _float(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def git_commit() -> str:
    """``git rev-parse HEAD`` (read-only), else ``XMC_GIT_COMMIT``, else ``unknown``."""
    global _git_commit_cache
    if _git_commit_cache is not None:
        return _git_commit_cache
    commit = ""
    for cwd in (os.getcwd(), str(Path(__file__).resolve().parents[1])):
        try:
            r = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            break
        if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", r.stdout.strip()):
            commit = r.stdout.strip()
            break
    _git_commit_cache = commit or os.environ.get("XMC_GIT_COMMIT", "") or "unknown"
    return _git_commit_cache


def _chunks(metrics: list, params: list, tags: list) -> Iterator[tuple[list, list, list]]:
    """Split into log_batch-sized pieces: <= 100 params+tags and <= 1000 entities per call."""
    pt = [("p", x) for x in params] + [("t", x) for x in tags]
    i_pt = i_m = 0
    while i_pt < len(pt) or i_m < len(metrics):
        piece = pt[i_pt : i_pt + MAX_PARAMS_TAGS_PER_BATCH]
        ms = metrics[i_m : i_m + MAX_ENTITIES_PER_BATCH - len(piece)]
        i_pt += len(piece)
        i_m += len(ms)
        yield ms, [x for k, x in piece if k == "p"], [x for k, x in piece if k == "t"]


# ----------------------------------------------------------------------- store access


def _preimport(uri: str) -> None:
    """Import the store's heavy modules before taking the lock (keeps the lock short)."""
    import mlflow.tracking  # noqa: F401

    _quiet_mlflow()  # after the import: importing mlflow configures its own loggers

    with contextlib.suppress(ImportError):
        if "://" in uri and not uri.startswith(("http:", "https:", "file:", "databricks")):
            import mlflow.store.db.utils  # noqa: F401
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        elif uri.startswith(("http:", "https:")):
            import mlflow.store.tracking.rest_store  # noqa: F401


def _client(uri: str):
    """An MlflowClient for ``uri``.  Opens the store: call it with the lock held."""
    from mlflow.tracking import MlflowClient

    _quiet_mlflow()
    db = _sqlite_path(uri)
    if db is not None and not db.exists():
        # SQLite makes a new database (and, after it, its journals) 0644 whatever the umask; made here first,
        # it gets the umask's mode, so a group that shares results/ (umask 002) can write the store
        from .io import file_mode

        db.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(db, os.O_CREAT | os.O_WRONLY, file_mode()))
    if db is not None and uri not in _OPENED:
        # A new database gets MLflow's "Default" experiment through a hand-built INSERT that quotes its
        # artifact location with Python's repr: a results folder with a quote in its path ("bob's set")
        # breaks that SQL.  Opening the store first with a percent-encoded artifact root makes that
        # location quote-free; MlflowClient then finds the experiment there.
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        SqlAlchemyStore(uri, artifact_root().as_uri())
        _OPENED.add(uri)
    return MlflowClient(tracking_uri=uri)


#: the SQLite stores this process has opened through :func:`_client`
_OPENED: set[str] = set()


#: MLflow's tag holding a run's or an experiment's description (the UI's "Description")
NOTE = "mlflow.note.content"

def experiment_description(dataset: str) -> str:
    """The description of a dataset's experiment: the run layout and what the metrics mean."""
    from .metrics import GLOSSARY

    return (f"XMC dataset '{dataset}': one parent run per (dataset, method) target (its test metrics, costs, "
            "effective settings and the trained model, registered as <dataset>-<method>), one child run per stage "
            "job; stages shared by the methods (ingest, TF-IDF, clusters) under the parent 'shared'.  "
            + GLOSSARY)


def _experiment_id(client, dataset: str, log=None) -> str:
    name = dataset or "default"
    exp = _retry(lambda: client.get_experiment_by_name(name), "get experiment", log)
    if exp is None:
        loc = artifact_root() / name
        exp_id = _retry(
            lambda: client.create_experiment(name, artifact_location=loc.as_uri(),
                                             tags={"xmc.dataset": name, NOTE: experiment_description(name)}),
            "create experiment",
            log,
        )
        return str(exp_id)
    if exp.lifecycle_stage == "deleted":
        _retry(lambda: client.restore_experiment(exp.experiment_id), "restore experiment", log)
    return str(exp.experiment_id)


def _find_parent(client, exp_id: str, dataset: str, method_key: str, log=None) -> str | None:
    flt = (
        f"tags.`xmc.run_type` = 'target' and tags.`xmc.dataset` = '{_q(dataset)}' "
        f"and tags.`xmc.method` = '{_q(method_key)}'"
    )
    runs = _retry(
        lambda: client.search_runs([exp_id], filter_string=flt, max_results=10, order_by=["attributes.start_time ASC"]),
        "search parent",
        log,
    )
    return runs[0].info.run_id if runs else None


def _q(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace("'", "\\'")


def _get_or_create_parent(client, exp_id: str, dataset: str, method_key: str, config_hash: str, log=None,
                          start_ms: int | None = None) -> str:
    rid = _find_parent(client, exp_id, dataset, method_key, log)
    return rid if rid is not None else _create_parent(client, exp_id, dataset, method_key, config_hash, log, start_ms)


def _create_parent(client, exp_id: str, dataset: str, method_key: str, config_hash: str, log=None,
                   start_ms: int | None = None) -> str:
    """A parent run; ``start_ms``: its first stage's start, so that the parent spans its children (the parent
    is created when that stage is logged, at its end)."""
    tags = {
        "xmc.run_type": "target",
        "xmc.dataset": dataset,
        "xmc.method": method_key,
        "xmc.config_hash": config_hash or "",
    }
    tags[NOTE] = (f"The stages shared by the methods on '{dataset}' (ingest, TF-IDF, label embeddings, clusters), "
                  "logged once and referenced by the targets' parents (tags xmc.uses.<stage>)."
                  if method_key == SHARED else f"Target {dataset}/{method_key}: its stage jobs are the child runs; "
                  "the evaluate stage adds the test metrics, costs and the model.")
    run = _retry(lambda: client.create_run(exp_id, start_time=start_ms, tags=tags, run_name=method_key),
                 "create parent run", log)
    return run.info.run_id


# ----------------------------------------------------------------------- public API


def log_stage(record: Mapping[str, Any], step_metrics: Iterable[tuple[str, float, int]] = (), log=None) -> str:
    """Log one finished stage job as a child run of its target's parent run.

    ``record`` is the harness's stage record (stage, rule, dataset, method, config_hash,
    wall_s, peak_rss_mb, timings_s, params, metrics, outputs, tags, extra);
    ``step_metrics`` are ``(name, value, step)`` training-curve points.  Returns the
    child run id.  Raises :class:`RuntimeError` (naming the URI and the cause) if the
    store cannot be written after bounded retries.
    """
    uri = tracking_uri()
    try:
        return _log_stage(uri, record, list(step_metrics), log)
    except Exception as e:
        if isinstance(e, RuntimeError) and str(e).startswith("MLflow tracking at"):
            raise
        raise RuntimeError(
            f"MLflow tracking at {uri} failed for stage {record.get('rule') or record.get('stage')}: "
            f"{type(e).__name__}: {e} (outputs kept; rerun the job, or set XMC_TRACKING=0 to skip tracking)"
        ) from e


def stage_entities(record: Mapping[str, Any], commit: str | None = None, log=None
                   ) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    """``(params, tags, final metrics)`` of the child run that :func:`log_stage` makes from a stage
    ``record``: what a check of the store (``bench/bench_concurrency.py``) expects to find there."""
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME

    stage = str(record.get("stage") or "")
    rule = str(record.get("rule") or stage or "stage")
    dataset = str(record.get("dataset") or "")
    method_key = str(record.get("method") or "") or SHARED
    config_hash = str(record.get("config_hash") or "")
    commit = git_commit() if commit is None else commit
    params = flatten_params(record.get("params") or {})
    for k, v in flatten_params(record.get("extra") or {}, prefix="extra.").items():
        params.setdefault(k, v)
    outputs = {str(k): str(v) for k, v in (record.get("outputs") or {}).items()}
    for name, path in outputs.items():
        params.setdefault(_clean_key(f"artifact.{name}"), _str_value(path, MAX_PARAM_VAL_LENGTH))

    tags: dict[str, str] = {
        MLFLOW_SOURCE_NAME: rule,
        MLFLOW_GIT_COMMIT: commit,
        "xmc.run_type": "stage",
        "xmc.rule": rule,
        "xmc.stage": stage,
        "xmc.dataset": dataset,
        "xmc.method": method_key,
        "xmc.config_hash": config_hash,
        "xmc.git_commit": commit,
        "xmc.pid": str(os.getpid()),
        "xmc.host": HOST,
        "xmc.outputs_key": outputs_key(outputs),
    }
    for k, v in (record.get("tags") or {}).items():
        tags.setdefault(_clean_key(k), _str_value(v, MAX_TAG_VAL_LENGTH))
    for name, path in outputs.items():
        tags[_clean_key(f"artifact.{name}")] = _str_value(path, MAX_TAG_VAL_LENGTH)

    final: dict[str, float] = {}
    for k, v in (record.get("metrics") or {}).items():
        f = _float(v)
        if f is None:
            if log is not None:
                log.warning("MLflow: metric %r is not a number (%r); not logged", k, v)
            continue
        final[_clean_key(k)] = f
    for k in ("wall_s", "peak_rss_mb"):
        f = _float(record.get(k))
        if f is not None:
            final[k] = f
    for k, v in (record.get("timings_s") or {}).items():
        f = _float(v)
        if f is not None:
            final[_clean_key(f"time_s.{k}")] = f
    return params, tags, final


def _log_stage(uri: str, record: Mapping[str, Any], step_metrics: list, log) -> str:
    from mlflow.entities import Metric

    t_start = time.perf_counter()
    stage = str(record.get("stage") or "")
    rule = str(record.get("rule") or stage or "stage")
    dataset = str(record.get("dataset") or "")
    method = str(record.get("method") or "")
    method_key = method or SHARED
    config_hash = str(record.get("config_hash") or "")
    commit = git_commit()

    now_ms = int(time.time() * 1000)
    wall = _float(record.get("wall_s")) or 0.0
    start_ms = now_ms - int(max(wall, 0.0) * 1000)

    # ---- everything that goes into the child run, prepared before taking the lock
    params, tags, final = stage_entities(record, commit, log)
    metrics = [Metric(k, v, now_ms, 0) for k, v in final.items()]
    curve = []
    for name, value, step in step_metrics:
        f = _float(value)
        if f is None:
            continue
        curve.append(Metric(_clean_key(name), f, now_ms, int(step)))

    # ---- the store sequence
    whole = not _serialises_writes_itself(uri)
    _preimport(uri)
    with _file_lock(uri):
        # MlflowClient() opens the store, which creates and migrates a new database:
        # inside the lock, or parallel jobs race on the schema migrations.
        client = _retry(lambda: _client(uri), "open store", log)
        exp_id = _experiment_id(client, dataset, log)
        parent_id = _get_or_create_parent(client, exp_id, dataset, method_key, config_hash, log, start_ms)
        if whole:
            run_id = _write_child(client, exp_id, parent_id, rule, start_ms, tags, params, metrics, curve, config_hash, log)
    if not whole:
        run_id = _write_child(client, exp_id, parent_id, rule, start_ms, tags, params, metrics, curve, config_hash, log)
    if log is not None:
        log.info(
            "MLflow: logged run %s (%s/%s, parent %s) to %s in %.2f s",
            run_id, dataset, method_key, parent_id, uri, time.perf_counter() - t_start,
        )
    return run_id


def _write_child(client, exp_id, parent_id, rule, start_ms, tags, params, metrics, curve, config_hash, log) -> str:
    from mlflow.entities import Param, RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    mark_killed_runs(client, exp_id, tags, log)
    # who wrote the run and for which outputs, from its creation: a kill before the tags' batch
    # below still leaves a run the next job of the stage can recognise (mark_killed_runs)
    create_tags = {MLFLOW_PARENT_RUN_ID: parent_id, "xmc.run_type": "stage",
                   **{k: tags[k] for k in _IDENTITY if k in tags}}
    run = _retry(
        lambda: client.create_run(exp_id, start_time=start_ms, tags=create_tags, run_name=rule),
        "create run",
        log,
    )
    run_id = run.info.run_id
    p_list = [Param(k, v) for k, v in params.items()]
    t_list = [RunTag(k, v) for k, v in tags.items()]
    if NOTE not in tags:
        wall = next((m.value for m in metrics if m.key == "wall_s"), None)
        t_list.append(RunTag(NOTE, f"Stage job {rule} of {tags.get('xmc.dataset', '')}/{tags.get('xmc.method') or SHARED}"
                                   + (f": {wall:.1f} s wall time" if wall is not None else "")
                                   + "; its outputs are the artifact.* params (files under results/)."))
    all_metrics = list(metrics) + list(curve)
    for ms, ps, ts in _chunks(all_metrics, p_list, t_list):
        _retry(lambda: client.log_batch(run_id, metrics=ms, params=ps, tags=ts, synchronous=True), "log_batch", log)
    _retry(lambda: client.set_terminated(run_id, "FINISHED"), "terminate run", log)
    # The parent spans all stage jobs of the target: keep its config hash current and
    # mark it finished as of the latest stage (it is reopened by the next stage's log).
    parent_tags = [RunTag("xmc.last_stage_run", run_id)]
    if config_hash:
        parent_tags.append(RunTag("xmc.config_hash", config_hash))
    _retry(lambda: client.log_batch(parent_id, tags=parent_tags, synchronous=True), "tag parent", log)
    _retry(lambda: client.set_terminated(parent_id, "FINISHED"), "terminate parent", log)
    return run_id


_IDENTITY = ("xmc.rule", "xmc.stage", "xmc.dataset", "xmc.method", "xmc.pid", "xmc.host", "xmc.outputs_key")


def outputs_key(outputs: Mapping[str, str]) -> str:
    """A short hash of a stage's ``{name: path}`` outputs: which job of a rule a run belongs to."""
    import hashlib

    return hashlib.sha1(json.dumps(dict(sorted(outputs.items())), sort_keys=True).encode("utf-8")).hexdigest()[:16]


def mark_killed_runs(client, exp_id: str, tags: Mapping[str, str], log=None) -> list[str]:
    """Mark KILLED the RUNNING stage runs of the same stage as ``tags`` (rule, dataset, method and
    outputs key alike) whose process has ended; returns their ids (see the module docstring)."""
    flt = " and ".join(["attributes.status = 'RUNNING'", "tags.`xmc.run_type` = 'stage'"]
                       + [f"tags.`{k}` = '{_q(tags[k])}'" for k in ("xmc.rule", "xmc.dataset", "xmc.method",
                                                                    "xmc.outputs_key")])
    runs = _retry(lambda: client.search_runs([exp_id], filter_string=flt, max_results=1000), "search running", log)
    killed = []
    for run in runs:
        t = run.data.tags
        try:
            pid = int(t.get("xmc.pid", ""))
        except ValueError:
            continue
        if pid == os.getpid() or not pid_gone(pid, t.get("xmc.host")):
            continue
        note = f"process {pid} on {t.get('xmc.host')} ended before finishing this run; marked by pid {os.getpid()}"
        _retry(lambda: client.set_tag(run.info.run_id, "xmc.killed_note", note), "tag killed run", log)
        _retry(lambda: client.set_terminated(run.info.run_id, "KILLED"), "terminate killed run", log)
        killed.append(run.info.run_id)
        if log is not None:
            log.warning("MLflow: run %s of %s was left RUNNING by process %d, which is gone; marked KILLED",
                        run.info.run_id, t.get("xmc.rule"), pid)
    return killed


def link_shared(dataset: str, method: str, run_ids: Mapping[str, str]) -> str:
    """Tag the (dataset, method) parent run with ``xmc.uses.<stage> = <run id>``.

    ``run_ids`` maps shared stage names (e.g. ``tfidf``, ``cluster``) to the child run
    ids returned by :func:`log_stage` for them.  The parent is created if missing.
    Returns the parent run id.
    """
    return annotate_parent(dataset, method, tags={f"xmc.uses.{k}": v for k, v in run_ids.items()})


def annotate_parent(dataset: str, method: str, tags: Mapping[str, str] | None = None,
                    metrics: Mapping[str, float] | None = None, params: Mapping[str, Any] | None = None,
                    config_hash: str = "", stage_run_ids: Iterable[str] = (), log=None,
                    description: str | None = None, experiment_description: str | None = None) -> str:
    """Add tags, final metrics and parameters to the (dataset, method) parent run (created if
    missing).  Returns the parent run id.  ``description`` becomes the parent's description and
    ``experiment_description`` the dataset experiment's (MLflow's ``mlflow.note.content``).  The
    parent is marked finished now, so that it spans every stage logged under it.

    The evaluate stage puts the target's test metrics and effective hyper-parameters
    (:func:`xmc_steps.target_params.parent_params`) on its parent run, so methods can be
    compared side by side, with what differed between them, in the MLflow UI.

    MLflow never lets a parameter change its value.  A parent whose logged parameters
    disagree with ``params`` belongs to an earlier configuration of the target: it is
    **superseded**, not overwritten: tagged ``xmc.run_type = target-superseded`` (so
    :func:`parent_run_id` no longer finds it) and ``xmc.superseded_by``, and a new parent is
    created for ``config_hash``; the stage runs of this build (``stage_run_ids``, which were
    logged under the old parent) are moved under the new one.  The old parent keeps its
    earlier parameters and metrics, so both configurations stay comparable.
    """
    uri = tracking_uri()
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        _preimport(uri)
        with _file_lock(uri):
            client = _retry(lambda: _client(uri), "open store", log)
            exp_id = _experiment_id(client, dataset, log)
            method_key = method or SHARED
            parent_id = _get_or_create_parent(client, exp_id, dataset, method_key, config_hash, log)
            p_vals = {_clean_key(k): _str_value(v, MAX_PARAM_VAL_LENGTH) for k, v in (params or {}).items()}
            if p_vals:
                have = _retry(lambda: client.get_run(parent_id), "get parent", log).data.params
                changed = sorted(k for k, v in p_vals.items() if k in have and have[k] != v)
                if changed:
                    old_id = parent_id
                    starts = [_retry(lambda: client.get_run(rid), "get stage run", log).info.start_time
                              for rid in dict.fromkeys(stage_run_ids)]
                    parent_id = _create_parent(client, exp_id, dataset, method_key, config_hash, log,
                                               min(starts) if starts else None)
                    _retry(lambda: client.log_batch(old_id, tags=[RunTag("xmc.run_type", "target-superseded"),
                                                                  RunTag("xmc.superseded_by", parent_id)],
                                                    synchronous=True), "supersede parent", log)
                    for rid in dict.fromkeys(stage_run_ids):
                        _retry(lambda: client.set_tag(rid, MLFLOW_PARENT_RUN_ID, parent_id), "move stage run", log)
                    if log:
                        log.info("MLflow: parent run %s of %s/%s had other parameters (%s%s); superseded by %s",
                                 old_id, dataset, method_key, ", ".join(changed[:5]),
                                 ", ..." if len(changed) > 5 else "", parent_id)
                    have = {}
                p_vals = {k: v for k, v in p_vals.items() if k not in have}
            now = int(time.time() * 1000)
            tag_list = [RunTag(_clean_key(k), _str_value(v, MAX_TAG_VAL_LENGTH)) for k, v in (tags or {}).items()]
            if description:
                tag_list.append(RunTag(NOTE, _str_value(description, MAX_TAG_VAL_LENGTH)))
            if experiment_description:
                _retry(lambda: client.set_experiment_tag(exp_id, NOTE, _str_value(experiment_description, MAX_TAG_VAL_LENGTH)),
                       "describe experiment", log)
            met_list = [Metric(_clean_key(k), f, now, 0) for k, v in (metrics or {}).items()
                        if (f := _float(v)) is not None]
            par_list = [Param(k, v) for k, v in p_vals.items()]
            for mets, pars, tgs in _chunks(met_list, par_list, tag_list):
                _retry(lambda: client.log_batch(parent_id, metrics=mets, params=pars, tags=tgs, synchronous=True),
                       "annotate parent", log)
            if stage_run_ids or description:
                _retry(lambda: client.set_terminated(parent_id, "FINISHED"), "terminate parent", log)
        return parent_id
    except Exception as e:
        if isinstance(e, RuntimeError) and str(e).startswith("MLflow tracking at"):
            raise
        raise RuntimeError(f"MLflow tracking at {uri} failed annotating the parent run of {dataset}/{method}: {type(e).__name__}: {e}") from e


def log_artifacts(run_id: str, files: Mapping[str, str | os.PathLike], log=None) -> None:
    """Copy files into a run's artifacts: ``{artifact name: local path}`` (the name may hold
    a folder, ``plots/recall.png``).  With the default SQLite store the artifacts go under
    :func:`artifact_root`; with a tracking server, wherever it keeps them."""
    import shutil
    import tempfile

    uri = tracking_uri()
    try:
        _preimport(uri)
        client = _retry(lambda: _client(uri), "open store", log)
        with tempfile.TemporaryDirectory(prefix="xmc-artifacts-") as tmp:
            for name, path in files.items():
                dest = Path(tmp) / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
            _retry(lambda: client.log_artifacts(run_id, tmp), "log artifacts", log)
    except Exception as e:
        raise RuntimeError(f"MLflow tracking at {uri} failed logging artifacts to run {run_id}: {type(e).__name__}: {e}") from e


def parent_run_id(dataset: str, method: str) -> str | None:
    """The parent run id of the (dataset, method) target (``method=""`` -> shared), or None."""
    uri = tracking_uri()
    db = _sqlite_path(uri)
    if db is not None and not db.exists():
        return None  # do not create a database just to look something up
    _preimport(uri)
    with _file_lock(uri):
        client = _retry(lambda: _client(uri), "open store")
        exp = _retry(lambda: client.get_experiment_by_name(dataset or "default"), "get experiment")
        if exp is None:
            return None
        return _find_parent(client, str(exp.experiment_id), dataset, method or SHARED)
