"""xmc_steps.stale: the artifacts made from a missing one, from Snakemake's own records (issue 54)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

from xmc_steps import stale


def _record(state: Path, output: str, inputs: list[str], max_len: int = 255) -> None:
    """A record as Snakemake's file persistence writes it (long names split into '@' folders)."""
    b64 = base64.urlsafe_b64encode(output.encode()).decode()
    parts = [b64[i:i + max_len - 1] for i in range(0, len(b64), max_len - 1)]
    path = state / "metadata" / Path(*(["@" + p for p in parts[:-1]] + [parts[-1]]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rule": "r", "input": inputs}))


def _chain(tmp_path: Path, monkeypatch) -> Path:
    """data/a -> results/b -> results/c (a folder) -> results/d; results/e from data/a alone."""
    monkeypatch.chdir(tmp_path)
    state = tmp_path / ".snakemake"
    for p in ("data/a", "results/b", "results/d", "results/e"):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
        Path(p).write_text(p)
    Path("results/c").mkdir()
    (Path("results/c") / "W.npz").write_text("w")
    _record(state, "results/b", ["data/a"])
    _record(state, "results/c", ["results/b"])
    _record(state, "results/d", ["results/c", "data/a"])
    _record(state, "results/e", ["data/a"])
    return state


def test_the_records_are_read_back_long_names_included(tmp_path):
    state = tmp_path / ".snakemake"
    long = "results/" + "x" * 400 + "/model"
    _record(state, long, ["results/in"], max_len=100)
    _record(state, "results/b", ["data/a"])
    (state / "metadata" / "not-base64!").write_text("{}")
    assert stale.metadata_records(state) == {long: ["results/in"], "results/b": ["data/a"]}


def test_what_was_made_from_a_missing_artifact_is_stale_through_every_step(tmp_path, monkeypatch):
    state = _chain(tmp_path, monkeypatch)
    assert stale.stale_artifacts(stale.metadata_records(state), "results") == {}
    os.unlink("results/b")
    got = stale.stale_artifacts(stale.metadata_records(state), "results")
    assert got == {os.path.abspath("results/c"): os.path.abspath("results/b"),
                   os.path.abspath("results/d"): os.path.abspath("results/b")}


def test_missing_data_outside_the_results_is_not_acted_on(tmp_path, monkeypatch):
    state = _chain(tmp_path, monkeypatch)
    os.unlink("data/a")
    assert stale.stale_artifacts(stale.metadata_records(state), "results") == {}


def test_a_locked_file_is_neither_missing_nor_stale(tmp_path, monkeypatch):
    state = _chain(tmp_path, monkeypatch)
    os.unlink("results/b")
    (state / "locks").mkdir()
    (state / "locks" / "0.output.lock").write_text("results/b\n")
    assert stale.stale_artifacts(stale.metadata_records(state), "results", stale.locked_paths(state)) == {}


def test_remove_stale_removes_files_and_folders_and_a_plan_only_lists(tmp_path, monkeypatch):
    state = _chain(tmp_path, monkeypatch)
    os.unlink("results/b")
    notes = stale.remove_stale(state, "results", act=False)
    assert Path("results/c").is_dir() and Path("results/d").exists()
    assert len(notes) == 1 and "results/b is missing: a run would remove the 2 file(s)" in notes[0]
    notes = stale.remove_stale(state, "results", act=True)
    assert not Path("results/c").exists() and not Path("results/d").exists() and Path("results/e").exists()
    assert "removed the 2 file(s)" in notes[0]
    assert stale.remove_stale(state, "results", act=True) == []


def test_only_a_snakemake_command_line_that_runs_jobs_acts():
    sm = str(Path(sys.executable).parent / "snakemake")
    main = str(Path(subprocess.__file__).parent / "site-packages" / "snakemake" / "__main__.py")
    assert stale.runs_jobs([sm, "--cores", "2", "results/x.json"])
    assert stale.runs_jobs([main, "results/x.json", "--forcerun", "tfidf"])
    for flags in (["-n"], ["-np"], ["--dry-run"], ["--touch"], ["--summary"], ["--report", "r.html"], ["--lint"],
                  ["--dag"], ["--unlock"], ["--list-rules"]):
        assert not stale.runs_jobs([sm, "results/x.json", *flags]), flags
    assert not stale.runs_jobs(["/usr/bin/pytest", "-q"]) and not stale.runs_jobs([])
