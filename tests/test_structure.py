"""The package's shape: stages and library apart, by folder, and the method registry's reach.

* every module with a ``main()`` is a stage and lives in ``xmc_steps/stages/``;
* no stage imports another stage, and no library module imports a stage or the stage harness
  (``xmc_steps.stage``): the harness sits above the library;
* no module but the registry lists the methods (the registry is the one list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "xmc_steps"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path) -> set[str]:
    """The xmc_steps modules ``path`` imports (absolute names; ``from . import x`` counted as ``pkg.x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("xmc_steps"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("xmc_steps"):
                continue
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)   # `from . import io` imports xmc_steps.io
    return out


def _has_main(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


MODULES = _modules()
STAGES = {n for n in MODULES if n.startswith("xmc_steps.stages.")}
#: the console command (pyproject's [project.scripts]): neither library nor a stage, it runs the stages
#: a user runs outside Snakemake (predict, fetch) and the library's serve and params
ENTRY_POINTS = {"xmc_steps.cli", "xmc_steps.schema"}   # the `xmc` command; the schema generator (a developer tool)


def test_every_module_with_a_main_is_a_stage_in_the_stages_folder():
    with_main = {n for n, p in MODULES.items() if _has_main(p)}
    assert with_main, "no stage found"
    assert with_main - STAGES - ENTRY_POINTS == set(), "modules with a main() outside xmc_steps/stages/"
    assert STAGES - with_main == set(), "stage modules without a main()"


def test_no_stage_imports_another_and_the_library_imports_no_stage_nor_the_harness():
    bad = []
    for name, path in MODULES.items():
        got = {m for m in _imports(name, path) if m in MODULES}
        stages = {m for m in got if m in STAGES}
        if name in STAGES and stages:
            bad.append(f"stage {name} imports the stage(s) {sorted(stages)}")
        if name not in STAGES | ENTRY_POINTS and name != "xmc_steps.stages" and (stages or "xmc_steps.stage" in got) \
                and name != "xmc_steps.stage":
            bad.append(f"library module {name} imports {sorted(stages | ({'xmc_steps.stage'} & got))}")
    assert not bad, "\n".join(bad)


def test_the_rule_files_call_stages_only():
    import re

    called = set()
    for f in (ROOT / "workflow" / "rules").glob("*.smk"):
        called.update(re.findall(r"-m (xmc_steps[\w.]*)", f.read_text()))
    called.discard("xmc_steps...")
    assert called and called <= STAGES, sorted(called - STAGES)


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_imports(name):
    import importlib

    importlib.import_module(name)


def _string_constants(path: Path) -> set[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs}


def test_only_the_registry_lists_the_methods():
    """A module that names three or more methods in its code (not its docstrings) is switching on
    them or listing them: that is the registry's job (the specs name their own method only)."""
    from xmc_steps import registry

    names = set(registry.METHODS)
    bad = {}
    for name, path in MODULES.items():
        if name == "xmc_steps.registry" or name.endswith(".spec"):
            continue
        hits = names & _string_constants(path)
        if len(hits) >= 3:
            bad[name] = sorted(hits)
    for f in (ROOT / "workflow" / "rules").glob("*.smk"):
        import re

        hits = {n for n in names if re.search(rf'"{re.escape(n)}"', f.read_text())}
        if len(hits) >= 3:
            bad[f.name] = sorted(hits)
    assert not bad, bad


#: what a stage's ``--help`` must not import: seconds of start-up (torch, transformers, faiss) or most of
#: a second (scikit-learn, which pulls scipy.stats; MLflow; pandas)
HEAVY = ("torch", "transformers", "faiss", "sklearn", "mlflow", "pandas")

_HELP_PROBE = """
import io, os, runpy, sys, contextlib
import numpy, scipy.sparse, pyarrow                    # shared by every stage: loaded once, before the forks
heavy, bad = {heavy!r}, {{}}
for stage in {stages!r}:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                        # a child per stage: the parent's modules, nothing more
        os.close(r)
        out = io.StringIO()
        sys.argv = ["x", "--help"]
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_module("xmc_steps.stages." + stage, run_name="__main__")
        except SystemExit:
            pass
        loaded = [m for m in heavy if m in sys.modules]
        os.write(w, ((" ".join(loaded) or "-") + ("" if "usage:" in out.getvalue() else " no-usage")).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        got = fh.read()
    os.waitpid(pid, 0)
    if got != "-":
        bad[stage] = got
print(bad)
"""


def test_no_stage_s_help_loads_torch_sklearn_or_mlflow():
    """Issue 55: `--help` of the ELIAS stage took 7.6 s and the matcher's and LightXML's 1.8-1.9 s, nearly
    all of it importing torch, transformers and scikit-learn; every stage loads them inside its commands.
    One interpreter, a fork per stage (not a timing: what is imported)."""
    import subprocess
    import sys

    stages = sorted(f.stem for f in (PKG / "stages").glob("*.py") if f.stem != "__init__")
    assert {"elias", "dual_encoder", "matcher", "lightxml", "predict"} <= set(stages)
    code = _HELP_PROBE.format(heavy=HEAVY, stages=stages)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "{}", r.stdout[-2000:]
