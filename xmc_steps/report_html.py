"""HTML pages for ``snakemake --report``, which renders images and HTML inline and offers other files
(Markdown, JSON, CSV) only as downloads.

* :func:`markdown_to_html`: the leaderboard's Markdown (headings, paragraphs, bullet lists and pipe
  tables: what :func:`xmc_steps.leaderboard.markdown` writes) as one self-contained page
  (``leaderboard.html`` beside ``leaderboard.md``, a report item of rule ``leaderboard``);
* :func:`metrics_page`: a target's results as tables (P, nDCG, PSP, PSnDCG at 1, 3, 5; recall at 10, 20,
  100; the decile-wise recall@100; the costs; the papers' figures beside ours where they exist):
  ``<method>_metrics.html`` beside ``<method>.json``, a report item of rule ``evaluate``.

Both write no script and load nothing: the report stays one offline file.
"""

from __future__ import annotations

import html
import re
from typing import Any, Mapping

__all__ = ["markdown_to_html", "metrics_page", "page"]

STYLE = ("body{font-family:sans-serif;font-size:14px;margin:1em}table{border-collapse:collapse;margin:.5em 0 1em}"
         "th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}th:first-child,td:first-child{text-align:left}"
         "th{background:#f3f3f3}caption{text-align:left;font-weight:bold;padding:4px 0}")


def page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def _inline(text: str) -> str:
    """Escaped text with Markdown's ``code``, **bold** and [links](url) (the url escaped, never a script)."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)

    def link(m: re.Match) -> str:
        url = m.group(2)
        if url.lower().startswith(("javascript:", "data:")):
            return m.group(1)
        return f'<a href="{html.escape(url)}">{m.group(1)}</a>'

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, out)


def _cells(line: str) -> list[str]:
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|") and not s.endswith("\\|"):
        s = s[:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", s)]


def _table(lines: list[str]) -> str:
    head = _cells(lines[0])
    rows = [_cells(x) for x in lines[2:]] if len(lines) > 1 and re.fullmatch(r"[\s|:\-]+", lines[1]) else \
        [_cells(x) for x in lines[1:]]
    out = ["<table>", "<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows]
    return "\n".join(out + ["</table>"])


def markdown_to_html(md: str, title: str = "") -> str:
    """A page of the Markdown ``md``: ``#`` headings, pipe tables, ``*``/``-`` lists, paragraphs."""
    blocks: list[str] = []
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        if line.lstrip().startswith("|"):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            blocks.append(_table(lines[i:j]))
            i = j
            continue
        m = re.match(r"^(#{1,6})\s+(.*)$", line)
        if m:
            n = len(m.group(1))
            blocks.append(f"<h{n}>{_inline(m.group(2))}</h{n}>")
            i += 1
            continue
        if re.match(r"^\s*[*-]\s+", line):
            items = []
            while i < len(lines) and re.match(r"^\s*[*-]\s+", lines[i]):
                items.append(re.sub(r"^\s*[*-]\s+", "", lines[i]))
                i += 1
                while i < len(lines) and lines[i].startswith("  ") and lines[i].strip() and \
                        not re.match(r"^\s*[*-]\s+", lines[i]):
                    items[-1] += " " + lines[i].strip()
                    i += 1
            blocks.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in items) + "</ul>")
            continue
        para = []
        while i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith(("|", "#")) and \
                not re.match(r"^\s*[*-]\s+", lines[i]):
            para.append(lines[i].strip())
            i += 1
        blocks.append(f"<p>{_inline(' '.join(para))}</p>")
    return page(title or "leaderboard", "\n".join(blocks))


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return html.escape(str(v))
    return f"{v:.{digits}f}"


def _grid(caption: str, rows: list[tuple[str, list[Any]]], cols: list[str]) -> str:
    out = [f"<table><caption>{html.escape(caption)}</caption>",
           "<tr><th></th>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"]
    out += ["<tr><td>" + html.escape(name) + "</td>" + "".join(f"<td>{_f(v)}</td>" for v in vals) + "</tr>"
            for name, vals in rows]
    return "\n".join(out + ["</table>"])


def _reported(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """The papers' figures for the target (``reported``: ``{p_at_1: ..., "source": ...}``), or none."""
    rep = result.get("reported")
    return rep if isinstance(rep, Mapping) else {}


def metrics_page(result: Mapping[str, Any]) -> str:
    """A target's results file as tables (the report's item for the target)."""
    m = result.get("metrics") or {}
    paper = _reported(result)
    title = f"{result.get('dataset', '')} / {result.get('method', '')}"
    ks = [1, 3, 5]
    body = [f"<h2>{html.escape(title)}</h2>",
            f"<p>{result.get('n_train_docs', '?')} training and {result.get('n_test_docs', '?')} test documents, "
            f"{result.get('n_labels', '?')} labels; metrics in percent on the test split.  PSP and PSnDCG weigh each "
            "true label by its inverse propensity (Jain et al., KDD 2016): rare labels count more.</p>"]
    rows = [(name, [m.get(f"{key}_at_{k}") for k in ks]) for name, key in
            (("P", "p"), ("nDCG", "ndcg"), ("PSP", "psp"), ("PSnDCG", "psndcg"))]
    if paper:
        rows += [(f"{name} ({paper.get('source') or 'paper'})", [paper.get(f"{key}_at_{k}") for k in ks]) for name, key in
                 (("P", "p"), ("nDCG", "ndcg"), ("PSP", "psp"))
                 if any(paper.get(f"{key}_at_{k}") is not None for k in ks)]
    body.append(_grid("ranking at k", rows, [f"@{k}" for k in ks]))
    rk = [10, 20, 100]
    body.append(_grid("recall at k", [("R", [m.get(f"recall_at_{k}") for k in rk])], [f"@{k}" for k in rk]))
    deciles = m.get("decile_recall_at_100")
    if isinstance(deciles, list) and deciles:
        body.append(_grid("recall@100 by label-frequency decile (d01: the rarest labels)",
                          [("R@100", deciles)], [f"d{i:02d}" for i in range(1, len(deciles) + 1)]))
    size = result.get("model_size_bytes")
    costs = [("training (s)", result.get("total_train_time_s")),
             ("prediction (ms/document, end to end)", result.get("predict_latency_ms_per_doc")),
             ("model size (MB)", size / 1e6 if isinstance(size, (int, float)) else None),
             ("device", result.get("device"))]
    body.append("<table><caption>costs</caption>" + "".join(
        f"<tr><td>{html.escape(k)}</td><td>{_f(v, 3)}</td></tr>" for k, v in costs) + "</table>")
    return page(title, "\n".join(body))
