"""The documentation holds together: README.md stays a front page, and every relative link in it and in
docs/**/*.md points at a file that exists (and, for a link into a Markdown file, at a heading there)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

#: pages the README links to that another branch writes; a missing one is not an error until it lands
#: (once it exists its links are checked like every other page's)
PENDING = {"docs/datasets.md"}

#: ``[text](target)``, not an image; the target up to the first space or ``)``
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks, indented code blocks and inline code spans."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("*", "-", "|")):
            continue
        out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        s = _slug(line.lstrip("#"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_every_relative_link_resolves():
    bad = []
    for page in _pages():
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):         # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no {rel})")
                continue
            if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {rel})")
    assert not bad, "\n".join(bad)


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move the detail into docs/"
    text = "\n".join(lines)
    # the two set-up commands, verbatim (CI runs the second)
    assert "    python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/snakemake --cores all demo" \
        in lines
    assert "    python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/python -m pytest -q" in lines
    assert text.count("python3 -m venv .venv") == 2
    for method in ("xr-linear", "parabel", "xtransformer", "elias", "lightxml", "gudn", "dual-encoder"):
        assert f"results/{{dataset}}/{method}.json" in text, method


def test_every_method_has_a_page():
    from xmc_steps import registry

    for name in registry.METHODS:
        page = "linear" if name in ("xr-linear", "parabel") else name
        assert (ROOT / "docs" / "methods" / f"{page}.md").is_file(), name


def test_the_markdown_links_are_found():
    """The link scan itself: a link in prose is found, one in code is not."""
    text = "see [a](a.md#x) and `[b](b.md)`\n\n    [c](c.md)\n```\n[d](d.md)\n```\n* [e](e.md)"
    assert LINK.findall(_prose(text)) == ["a.md#x", "e.md"]
    assert _slug(" ELIAS++: the sparse ranker (`xmc_steps/elias_plus.py`)") == \
        "elias-the-sparse-ranker-xmc_stepselias_pluspy"
