"""Issue 54: a configured string is never interpreted by a shell.  The toy's xr-linear target runs with its
project folder, its data folder and its dataset ``path`` full of what a shell would act on (quotes, ``$()``,
backticks, spaces, non-ASCII): it must work, and run nothing.  (tests/test_rules.py checks that every
such placeholder of every shell line is quoted.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_workflow import _run, _toy

#: a folder name a shell would act on three ways if it reached one unquoted
WEIRD = "bob's \"set\" $(touch INJECTED-1) `touch INJECTED-2` ü"


@pytest.mark.slow
def test_paths_with_shell_characters_work_and_run_nothing(tmp_path):
    root = tmp_path / WEIRD
    root.mkdir()
    made = _toy(root)                                   # root/data/toy
    own = root / f"{WEIRD} data" / "toy's own"
    own.parent.mkdir()
    shutil.move(made, own)
    shutil.rmtree(root / "data")
    _run(root, "results/toy/xr-linear.json", overrides={
        "data_dir": str(root / f"{WEIRD} data"),
        "datasets": {"toy": {"path": str(own), "cluster": {"leaf_size": 2, "branching": 2}, "threads": 1}}})
    res = json.loads((root / "results" / "toy" / "xr-linear.json").read_text())
    assert res["metrics"]["p_at_1"] > 50.0
    injected = [str(p) for p in tmp_path.rglob("INJECTED-*")] + [str(p) for p in Path.cwd().glob("INJECTED-*")]
    assert not injected, injected
