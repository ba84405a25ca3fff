"""The installable package: ranges in pyproject.toml that admit requirements.txt's pins, the ``xmc``
command and its subcommands, every stage's ``--help`` pointing at ``xmc params``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import ROOT
from xmc_steps import cli, registry, skeleton

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEST_TOOLS = {"pytest", "pytest-timeout", "hypothesis"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def _pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            out[_norm(r.name)] = str(next(iter(r.specifier)).version)
    return out


def test_every_pin_lies_in_its_range_and_test_tools_are_an_extra():
    project = PYPROJECT["project"]
    deps = {_norm(Requirement(d).name): Requirement(d) for d in project["dependencies"]}
    extras = {_norm(Requirement(d).name): Requirement(d) for ds in project["optional-dependencies"].values() for d in ds}
    pins = _pins()
    assert set(deps) | set(extras) == set(pins), set(pins) ^ (set(deps) | set(extras))
    assert not TEST_TOOLS & set(deps) and TEST_TOOLS <= {_norm(Requirement(d).name)
                                                          for d in project["optional-dependencies"]["test"]}
    for name, req in {**deps, **extras}.items():
        assert req.specifier.contains(pins[name]), f"{name}: {req.specifier} does not admit the pin {pins[name]}"
        assert not any(s.operator == "==" for s in req.specifier), f"{name}: a range, not a pin"
    assert pins["torch"] == "2.13.0" and deps["torch"].specifier.contains("2.13.0")
    assert "dynamic" not in project or "dependencies" not in project["dynamic"]
    assert project["scripts"] == {"xmc": "xmc_steps.cli:main"}


def _xmc(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmc_steps.cli", *args], cwd=ROOT, input=stdin, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_xmc_lists_its_subcommands():
    r = _xmc("--help")
    assert r.returncode == 0
    for name in cli.SUBCOMMANDS:
        assert name in r.stdout.decode()
    assert _xmc("predict", "--help").stdout.decode().count("--model") >= 1
    assert b"--archive" in _xmc("fetch", "--help").stdout


@pytest.mark.parametrize("method", list(registry.METHODS))
def test_params_lists_every_setting_with_its_default(method, capsys):
    assert cli.main(["params", method]) == 0
    out = capsys.readouterr().out
    for section, tree in skeleton.method_skeleton(method).items():
        assert f"{section.split('.')[-1]}:" in out
        for key, entry in tree.items():
            assert f"{key}:" in out, (method, key)
    assert cli.main(["params", method, "--json"]) == 0
    json.loads(capsys.readouterr().out)


def test_params_carry_the_comments_and_bounds_of_the_classes(capsys):
    assert cli.main(["params", "xr-linear"]) == 0
    out = capsys.readouterr().out
    assert "  beam: 10  # beam width of the tree search: the predictions and the MAN negatives; >= 1" in out
    assert "    C: 1.0  # inverse regularisation strength; > 0" in out          # the nested solver section
    assert "one of tfn, man, tfn+man" in out
    assert cli.main(["params", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_every_stage_help_points_at_xmc_params():
    from xmc_steps.stage import add_common_args
    import argparse

    text = add_common_args(argparse.ArgumentParser()).format_help()
    assert "xmc params <method>" in text
    stages = sorted(p.stem for p in (ROOT / "xmc_steps" / "stages").glob("*.py") if p.stem != "__init__")
    for stem in stages:          # each stage with settings takes --params through add_common_args
        src = (ROOT / "xmc_steps" / "stages" / f"{stem}.py").read_text()
        assert "add_common_args" in src or '"--params"' not in src, stem


def test_the_wheel_holds_the_package_and_the_console_command(tmp_path):
    """``pip install`` of the checkout (no dependencies, no build isolation: offline, seconds) installs
    the ``xmc`` command, which runs."""
    import shutil

    src, target = tmp_path / "src", tmp_path / "site"       # a copy: the build leaves build/ and egg-info beside it
    shutil.copytree(ROOT / "xmc_steps", src / "xmc_steps", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(target), str(src)], capture_output=True, text=True,
                       env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (target / "xmc_steps" / "cli.py").is_file() and (target / "bin" / "xmc").is_file()
    out = subprocess.run([sys.executable, str(target / "bin" / "xmc"), "params", "parabel"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    assert out.returncode == 0 and "n_trees: 3" in out.stdout, out.stderr[-2000:]


def test_params_prints_the_section_tree_as_config_yaml_reads(capsys):
    """ELIAS's settings are its section's tree (index, predict, stage1, stage2 as config.yaml nests them), not the
    flat parameters a training stage derives from it (eps, topk: no key of the section)."""
    assert cli.main(["params", "elias"]) == 0
    out = capsys.readouterr().out
    for key in ("\n  index:\n    alpha: 10.0", "\n  stage1:\n    train:", "\n  stage2:\n", "\n  predict:\n",
                "\n  plus:  # ELIAS++", "\n  seeds: [0]"):
        assert key in out, key
    assert "\n  eps:" not in out and "\n  topk:" not in out and "threads:" not in out
