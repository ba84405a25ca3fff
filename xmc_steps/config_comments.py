"""config.yaml's comments in ``defaults:``, generated from the parameter trees: ``python -m xmc_steps.schema --write``.

The keys, values, order and indentation are config.yaml's own (a rule passes its raw section, so a new key would
change its params); only the comments of the ``defaults:`` block are rewritten, by these rules:

* a key that is a setting of a tree (:func:`xmc_steps.schema.generated_sections`; the settings that are no section:
  :data:`xmc_steps.schema.TOP_LEVEL`) gets its declaration's one-line doc (the comment beside its field,
  :func:`xmc_steps.skeleton.field_docs`) as its trailing comment; a nested section (``train``, ``solver``, written
  as a block or a flow mapping) gets its field's doc, or, without one, the first sentence of its class's docstring
  less a leading ``section.name``: that names it.  A setting of string choices (``Literal``) whose doc does not
  name every choice gets ``; one of ...`` appended;
* a top-level section: its class's docstring (first paragraph, less that leading name) as comment-only lines under
  its key; other comment-only lines before a setting are dropped;
* an entry of a map (``xtransformer.variants.<name>``, ``encoders.<key>``) is no declaration: its line and its
  comment lines are kept as written;
* the text: RST markup as plain backticks, Python's ``None``/``True``/``False`` as YAML's ``null``/``true``/``false``,
  wrapped at :data:`WIDTH` columns; the ``#`` of a top-level section's comments in the column most of its
  comments use (:data:`COLUMN` where none), two spaces after a longer value; continuation lines put their ``#``
  under the first's.

Everything outside ``defaults:`` (the header, ``data_dir``, ``results_dir``, ``datasets:``) is written by hand.
Why a default is what it is (measurements, the papers' values) lives in the methods' pages (docs/methods/*.md,
"Defaults and why") and docs/configuration.md.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import textwrap
import typing
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PATH = ROOT / "config.yaml"
#: the widest a generated line gets
WIDTH = 120
#: the comments' column of a section that has none yet
COLUMN = 38

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_][A-Za-z0-9_.+-]*|\"[^\"]*\"|'[^']*'):(?=\s|$)(?P<rest>.*)$")


@dataclass
class Node:
    """Where a key of ``defaults`` stands among the declarations."""

    kind: str                   # "section" (a parameter class), "map" (named entries), "leaf", "entry" (kept)
    doc: str | None = None      # its one-line doc (None for a kept entry)
    cls: type | None = None     # section: its class; map: its values' class (or None)


def _strip_markup(text: str) -> str:
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0)
                  else m.group(1), text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"\bNone\b", "null", text)
    text = re.sub(r"\bTrue\b", "true", text)
    return re.sub(r"\bFalse\b", "false", text)


def class_doc(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring, on one line (a dataclass's generated signature is none)."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def _section_doc(cls: type, sentence: bool = True) -> str:
    """A section's doc from its class: its docstring (the first sentence: ``sentence``) less a leading
    ````a.b````: naming it."""
    doc = re.sub(r"^``[A-Za-z0-9_.]+``:\s*", "", class_doc(cls))
    return re.split(r"\.\s+(?=[A-Z])", doc, maxsplit=1)[0].rstrip(".") if sentence else doc


def _with_choices(doc: str, typ: Any) -> str:
    from .params import choices

    opts = choices(typ)
    if not opts or len(opts) < 2 or not all(isinstance(c, str) for c in opts):
        return doc
    named = all(re.search(rf"(?<![\w+-]){re.escape(str(c))}(?![\w+-])", doc) for c in opts)
    return doc if named else f"{doc}; one of {', '.join(map(str, opts))}"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def child(parent: Node, key: str, where: str) -> Node:
    """The node of ``key`` under ``parent`` (``where``: its dotted place, for the errors)."""
    from .params import Params
    from .skeleton import field_docs

    if parent.kind == "map":
        return Node("entry", cls=parent.cls)
    if parent.kind == "entry":
        if parent.cls is None:
            return Node("entry")
        parent = Node("section", cls=parent.cls)
    if parent.kind != "section":
        return Node("entry")               # a key inside a setting's own mapping (a stage's `train`): kept
    cls = parent.cls
    fs = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("setting", True)}
    if key not in fs:
        raise KeyError(f"config.yaml's defaults.{where} is no setting of {cls.__module__}.{cls.__name__}")
    f = fs[key]
    hint = typing.get_type_hints(cls)[key]
    doc = field_docs(cls).get(key, "")
    value = _default(f)
    if isinstance(value, Params) and is_dataclass(value):
        doc = doc or _section_doc(type(value))
        kind, sub = "section", type(value)
    elif typing.get_origin(hint) is dict:
        arg = typing.get_args(hint)[1]
        kind, sub = ("map", arg if isinstance(arg, type) and is_dataclass(arg) else None)
        if sub is None and typing.get_args(hint)[0] is str and arg is Any:
            kind = "leaf"                   # a free mapping of settings (elias.stageN.train): one setting
    else:
        kind, sub = "leaf", None
        doc = _with_choices(doc, hint) if doc else doc
    if not doc:
        raise ValueError(f"defaults.{where} ({cls.__name__}.{key}) has no one-line doc: write it beside the field")
    return Node(kind, doc, sub)


def top_nodes() -> dict[str, Node]:
    """The top-level keys of ``defaults`` the declarations cover: each section and each setting that is none."""
    from . import schema

    top = Node("section", None, schema.load_class(schema.TOP_LEVEL))
    out = {f.name: child(top, f.name, f.name) for f in dataclasses.fields(top.cls) if f.metadata.get("setting", True)}
    return {**out, **{name: Node("section", None, schema.load_class(ref))
                      for name, ref in schema.generated_sections().items()}}


def _split_comment(rest: str) -> tuple[str, str | None, int]:
    """``rest`` of a key line -> (value text, comment text or None, the comment's offset in ``rest``)."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1] in " \t"):
            return rest[:i].rstrip(), rest[i:], i
    return rest.rstrip(), None, -1


def _comment(text: str, col: int) -> list[str]:
    """The comment lines of ``text`` whose ``#`` stands at ``col`` (the first line's prefix is the caller's)."""
    width = max(WIDTH - col - 2, 40)
    return textwrap.wrap(_strip_markup(text), width=width, break_long_words=False, break_on_hyphens=False)


@dataclass
class _Line:
    text: str
    kind: str                   # "blank", "comment", "key"
    indent: int = 0
    key: str = ""
    value: str = ""             # the line up to the end of its value (no comment)
    comment_col: int = -1


def _parse(lines: list[str]) -> list[_Line]:
    out = []
    for text in lines:
        stripped = text.strip()
        if not stripped:
            out.append(_Line(text, "blank"))
        elif stripped.startswith("#"):
            out.append(_Line(text, "comment", len(text) - len(text.lstrip()), comment_col=text.index("#")))
        else:
            m = _KEY.match(text)
            if not m:
                raise ValueError(f"config.yaml: a line of defaults the generator does not read: {text!r}")
            value, comment, at = _split_comment(m.group("rest"))
            head = text[: m.start("rest")]
            col = len(head) + at if comment is not None else -1
            out.append(_Line(text, "key", len(m.group("indent")), m.group("key"), (head + value).rstrip(), col))
    return out


def _columns(block: list[_Line]) -> dict[int, int]:
    """``{index of a top-level section's line: the column of its comments}``."""
    out: dict[int, int] = {}
    start = None
    for i, ln in enumerate(block + [_Line("", "key", 2)]):
        if ln.kind == "key" and ln.indent == 2:
            if start is not None:
                cols = collections.Counter(x.comment_col for x in block[start:i] if x.kind == "key" and x.comment_col > 0)
                col = max(cols.items(), key=lambda kv: (kv[1], -kv[0]))[0] if cols else COLUMN
                out.update({j: col for j in range(start, i)})
            start = i
    return out


def _pad(value: str, col: int) -> tuple[str, int]:
    if len(value) + 2 <= col:
        return value.ljust(col), col
    return value + "  ", len(value) + 2


def rewrite(text: str) -> str:
    """config.yaml's text with the comments of its ``defaults:`` block generated."""
    lines = text.split("\n")
    try:
        start = lines.index("defaults:") + 1
    except ValueError:
        raise ValueError("config.yaml has no top-level `defaults:` line") from None
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    block = _parse(lines[start:end])
    cols = _columns(block)
    tops = top_nodes()
    out: list[str] = []
    stack: list[tuple[int, Node, str]] = []       # (indent, node, dotted)
    prev_col, prev_kept = -1, False               # the key line above: its comment's column, whether it is kept
    pending: list[str] = []                       # comment-only lines waiting for the key they stand before
    for i, ln in enumerate(block):
        if ln.kind == "blank":
            out.extend(pending)
            pending = []
            out.append(ln.text)
            prev_col = -1
            continue
        if ln.kind == "comment":
            if prev_col >= 0 and ln.comment_col == prev_col:
                if prev_kept:                     # a kept line's continuation (a generated one's is dropped)
                    out.append(ln.text)
            else:
                prev_col = -1
                pending.append(ln.text)
            continue
        while stack and stack[-1][0] >= ln.indent:
            stack.pop()
        dotted = f"{stack[-1][2]}.{ln.key}" if stack else ln.key
        if not stack:
            node = tops.get(ln.key, Node("entry"))
        else:
            node = child(stack[-1][1], ln.key, dotted)
        stack.append((ln.indent, node, dotted))
        if node.kind == "entry" or (node.kind != "section" and node.doc is None):
            out.extend(pending)
            pending = []
            out.append(ln.text)
            prev_col, prev_kept = ln.comment_col, True
            continue
        pending = []
        prev_col, prev_kept = -1, False
        col = cols.get(i, COLUMN)
        if not stack[:-1] and node.kind == "section":     # a top-level section: its class's doc under its key
            out.append(ln.value)
            pad = " " * (ln.indent + 2)
            out.extend(f"{pad}# {t}" for t in textwrap.wrap(_strip_markup(_section_doc(node.cls, False)),
                                                             width=WIDTH - len(pad) - 2, break_long_words=False,
                                                             break_on_hyphens=False))
            continue
        head, at = _pad(ln.value, col)
        prev_col = at
        body = _comment(node.doc or "", at)
        out.append(f"{head}# {body[0]}" if body else ln.value)
        out.extend(" " * at + f"# {t}" for t in body[1:])
    out.extend(pending)
    return "\n".join(lines[:start] + out + lines[end:])


def check(path: Path = CONFIG_PATH) -> bool:
    """Whether ``path``'s comments are the generated ones."""
    text = Path(path).read_text()
    return rewrite(text) == text


def write(path: Path = CONFIG_PATH) -> None:
    """Rewrite ``path``'s ``defaults:`` comments (its values unchanged: checked)."""
    import yaml

    text = Path(path).read_text()
    new = rewrite(text)
    if yaml.safe_load(new) != yaml.safe_load(text):
        raise AssertionError("the generated comments changed config.yaml's values")
    if new != text:
        Path(path).write_text(new)

