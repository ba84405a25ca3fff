"""``snakemake --lint``: every lint left is one of the documented false positives (docs/lint.md), so a
new real one (a rule without a log, a hard-coded path prefix, ...) fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

#: the lints that docs/lint.md explains, by title (a regular expression over "* <title>:")
FALSE_POSITIVES = {
    "absolute path": r'Absolute path ".*" in line \d+',
    "path composition": r"Path composition with '\+' in line \d+",
    "mixed rules and functions": r"Mixed rules and functions in same snakefile\.",
    "outside variable": r"Shell command directly uses variable (PY|DATA|rule) from outside of the rule",
    "PYTHONPATH": r"Environment variable PYTHONPATH used but not asserted with envvars directive in line \d+\.",
}


def _lints() -> list[tuple[str, str]]:
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    r = subprocess.run([snakemake, "--lint", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(ROOT)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    text = r.stdout + r.stderr
    out, where = [], ""
    for line in text.splitlines():
        if line.startswith("Lints for "):
            where = line
        m = re.match(r"^    \* (.*):$", line)
        if m:
            out.append((where, m.group(1)))
    assert out or r.returncode == 0, text[-3000:]
    return out


def test_every_lint_is_a_documented_false_positive():
    doc = (ROOT / "docs" / "lint.md").read_text()
    lints = _lints()
    unknown = [(w, t) for w, t in lints if not any(re.fullmatch(p, t) for p in FALSE_POSITIVES.values())]
    assert not unknown, "\n".join(f"{w}: {t}" for w, t in unknown)
    for name in FALSE_POSITIVES:
        assert f"**{name}**" in doc, f"docs/lint.md does not explain '{name}'"
    # what the issue found and is fixed stays fixed
    assert not any("No log directive" in t or "is a prefix of input or output" in t for _, t in lints)
