"""Artifacts made from one that is missing: found in Snakemake's own records and removed before it plans.

Snakemake plans from the requested files down and reruns a job only when a file the job below it needs is
missing or older; a missing *intermediate* file whose products still exist is not rebuilt.  And a failed job's
outputs are removed.  So a stage killed while it re-runs (``--forcerun``, a changed setting) leaves the files
made from its outputs describing a model that is gone, and the plain rerun says "Nothing to be done"
(issue 54).  Before Snakemake plans, :func:`remove_stale` reads its per-output records
(``.snakemake/metadata``: for each file it made, the job's input files), finds every existing output one of
whose inputs under the results folder is missing, follows that through the files made from it, and removes
them: the requested target is then missing too, and Snakemake rebuilds the chain down to the missing piece,
exactly as a first build would.  It only removes what could not be used anyway (a file made from a file that
no longer exists); Snakemake's own ``input`` trigger would rerun those jobs for a changed input set too.

Reading: a file another live invocation has locked is neither called missing nor removed (it may be being
rebuilt there); outside the results folder (the data) nothing is looked at; a dry run, ``--touch``, a report,
a summary and the other commands that run no job only list what a run would remove.  The records are
Snakemake's file persistence: a folder ``metadata/`` with one JSON file per output, named by the url-safe
base64 of the output's path (split into ``@``-prefixed folders when long); a record that cannot be read is
skipped, never acted on.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

__all__ = ["metadata_records", "locked_paths", "stale_artifacts", "runs_jobs", "remove_stale"]


def metadata_records(state: str | os.PathLike = ".snakemake") -> dict[str, list[str]]:
    """``{output path: the input paths of the job that made it}`` from Snakemake's records under ``state``."""
    root = Path(state) / "metadata"
    out: dict[str, list[str]] = {}
    for folder, _, files in os.walk(root):
        rel = Path(folder).relative_to(root).parts
        if any(not p.startswith("@") for p in rel):
            continue
        prefix = "".join(p[1:] for p in rel)
        for name in files:
            try:
                path = base64.urlsafe_b64decode(prefix + name).decode()
                with open(Path(folder, name), encoding="utf-8") as f:
                    inputs = json.load(f).get("input") or []
            except (binascii.Error, UnicodeDecodeError, OSError, ValueError, AttributeError):
                continue
            if isinstance(inputs, list) and all(isinstance(i, str) for i in inputs):
                out[path] = inputs
    return out


def locked_paths(state: str | os.PathLike = ".snakemake") -> set[str]:
    """The files named in Snakemake's lock files under ``state`` (those left after
    :func:`xmc_steps.proc.claim_snakemake_folder` belong to an invocation that may be running)."""
    out: set[str] = set()
    for lock in Path(state, "locks").glob("*.lock"):
        try:
            out.update(os.path.abspath(line) for line in lock.read_text(encoding="utf-8").splitlines() if line)
        except OSError:
            continue
    return out


def stale_artifacts(records: dict[str, list[str]], results_dir: str | os.PathLike,
                    locked: Iterable[str] = ()) -> dict[str, str]:
    """``{existing output: the missing file under results_dir it was made from}``, through any number of
    steps, from :func:`metadata_records`.  Files in ``locked`` count as present and are never stale."""
    base = os.path.abspath(results_dir) + os.sep
    locked = set(locked)
    recs = {os.path.abspath(o): [os.path.abspath(i) for i in ins] for o, ins in records.items()}
    missing = {i for ins in recs.values() for i in ins
               if i.startswith(base) and i not in locked and not os.path.lexists(i)}
    cause = {m: m for m in missing}
    stale: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for out, ins in recs.items():
            if out in stale or out in locked or not os.path.lexists(out):
                continue
            gone = next((i for i in ins if i in cause), None)
            if gone is not None:
                stale[out] = cause[gone]
                cause[out] = cause[gone]
                changed = True
    return stale


#: Snakemake's options that run no job (a plan, a report, a listing ...): there :func:`remove_stale` only lists
NO_JOBS = ("dryrun", "touch", "summary", "detailed_summary", "list_rules", "list_target_rules", "filegraph", "d3dag",
           "unlock", "list_input_changes", "list_params_changes", "list_untracked", "delete_all_output",
           "delete_temp_output", "cleanup_shadow", "list_conda_envs", "conda_create_envs_only", "conda_cleanup_envs",
           "print_compilation", "debug_dag")
NO_JOBS_VALUED = ("report", "lint", "dag", "rulegraph", "cleanup_metadata", "archive", "containerize",
                  "generate_unit_tests", "export_cwl")


def runs_jobs(argv: list[str] | None) -> bool:
    """Whether the Snakemake command line ``argv`` (``sys.argv``) runs jobs.  False for a dry run and the other
    commands of :data:`NO_JOBS`, and when ``argv`` is not Snakemake's command line (the API used in-process)."""
    if not argv:
        return False
    program = Path(argv[0])
    if (program.parent.name if program.name == "__main__.py" else program.name) != "snakemake":
        return False
    try:
        from snakemake.cli import get_argument_parser

        args, _ = get_argument_parser().parse_known_args(argv[1:])
    except (SystemExit, Exception):  # noqa: BLE001 - an unparsable line: do not act on a guess
        return False
    return not any(getattr(args, k, False) for k in NO_JOBS) and all(getattr(args, k, None) in (None, False, [])
                                                                    for k in NO_JOBS_VALUED)


def remove_stale(state: str | os.PathLike, results_dir: str | os.PathLike, act: bool) -> list[str]:
    """Remove (``act``) or list the artifacts made from a missing one (:func:`stale_artifacts`); one note per
    missing file for the log."""
    stale = stale_artifacts(metadata_records(state), results_dir, locked_paths(state))
    by_cause: dict[str, list[str]] = {}
    for out, gone in sorted(stale.items()):
        by_cause.setdefault(gone, []).append(out)
    notes = []
    for gone, outs in sorted(by_cause.items()):
        for out in outs if act else ():
            try:
                if os.path.isdir(out) and not os.path.islink(out):
                    shutil.rmtree(out)
                else:
                    os.unlink(out)
            except FileNotFoundError:
                pass
        shown = ", ".join(os.path.relpath(o) for o in outs[:4]) + (f" and {len(outs) - 4} more" if len(outs) > 4 else "")
        notes.append(f"{os.path.relpath(gone)} is missing: {'removed' if act else 'a run would remove'} the "
                     f"{len(outs)} file(s) made from it, so that {'this' if act else 'that'} run rebuilds them ({shown})")
    return notes
