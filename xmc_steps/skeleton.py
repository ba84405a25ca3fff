"""Every setting of a method, with its default and its documentation: ``xmc params <method>``.

Generated from the method's parameter tree, its config section shaped like config.yaml's
(:attr:`xmc_steps.methods.MethodSpec.tree`; the keys a stage is given, ``threads``, left out), as PECOS's ``--generate-params-skeleton``: a field's default is the class's, its choices its
``Literal`` annotation (:func:`xmc_steps.params.choices`), its bounds those of
:func:`xmc_steps.params.bounded`, and its documentation the comment beside the field in the class's
source (a comment may continue on the comment-only lines below it).  Nested parameter objects
(``train``, ``solver``) are sections of their own.  :func:`skeleton` returns the tree;
:func:`render_yaml` writes it as the commented YAML of a ``config.yaml`` section.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io as _io
import json
import textwrap
import tokenize
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from . import params as xparams

__all__ = ["field_docs", "skeleton", "method_skeleton", "render_yaml"]


def field_docs(cls: type) -> dict[str, str]:
    """``{field: comment}`` of the comments beside (and continuing below) a dataclass's fields, those its
    dataclass bases declare included (a field the class declares again takes its own comment, if any).  A
    field made from another class's (no source of its own: :func:`dataclasses.make_dataclass`) names it in its
    metadata, ``origin``: ``(class, field)``, and takes that field's comment."""
    out: dict[str, str] = {}
    for c in reversed(cls.__mro__):
        if c is not cls and dataclasses.is_dataclass(c):
            out.update(_own_field_docs(c))
    out.update(_own_field_docs(cls))
    if dataclasses.is_dataclass(cls):
        for f in fields(cls):
            if not out.get(f.name) and "origin" in f.metadata:
                owner, name = f.metadata["origin"]
                if field_docs(owner).get(name):
                    out[f.name] = field_docs(owner)[name]
    return out


def _own_field_docs(cls: type) -> dict[str, str]:
    """``{field: comment}`` of the fields ``cls``'s own source declares."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(src)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    starts = [(n.lineno, n.end_lineno, n.target.id) for n in body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    next_stmt = {n.lineno: (body[i + 1].lineno if i + 1 < len(body) else 10 ** 9) for i, n in enumerate(body)}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(_io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    end = len(src.splitlines()) + 1
    for first, _last, name in starts:
        stop = min(next_stmt[first], end)
        parts = [comments[i] for i in range(first, stop) if i in comments]
        if parts:
            out[name] = " ".join(p for p in parts if p)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _plain(v: Any) -> Any:
    if isinstance(v, xparams.Params) and is_dataclass(v):
        return v.to_dict()
    if isinstance(v, tuple):
        return list(v)
    return v


def skeleton(cls: type, default: Any = None) -> dict[str, Any]:
    """``{field: {"default", "doc", "choices", "bounds"} | {"section": {...}, "doc"}}`` of a parameter
    class; ``default``: an instance whose values replace the class defaults (a nested field's own)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        hints = {}
    docs = field_docs(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.name.startswith("_") or not f.metadata.get("setting", True):
            continue
        value = getattr(default, f.name) if default is not None else _default(f)
        doc = docs.get(f.name, "")
        if is_dataclass(value) and isinstance(value, xparams.Params):
            out[f.name] = {"section": skeleton(type(value), value), "doc": doc}
            continue
        if isinstance(value, dict) and value and all(isinstance(v, xparams.Params) for v in value.values()):
            out[f.name] = {"section": {k: {"section": skeleton(type(v), v), "doc": ""} for k, v in value.items()},
                           "doc": doc}         # named entries (xtransformer.variants): a section each
            continue
        entry: dict[str, Any] = {"default": _plain(value), "doc": doc}
        opts = xparams.choices(hints.get(f.name))
        if opts is not None:
            entry["choices"] = list(opts)
        b = xparams.bounds(f)
        if b:
            entry["bounds"] = xparams.describe_bounds(b)
        out[f.name] = entry
    return out


def method_skeleton(method: str) -> dict[str, dict[str, Any]]:
    """``{config section: skeleton}`` of a method's parameter tree, its whole section shaped like config.yaml's
    (:attr:`xmc_steps.methods.MethodSpec.tree`); a spec without one: ``{dotted section: skeleton}`` of every
    parameter class it names (:attr:`~xmc_steps.methods.MethodSpec.params`)."""
    from . import registry

    spec = registry.get(method)
    refs = [(spec.section, spec.tree)] if spec.tree else [(section, ref) for section, ref, _ in spec.params]
    out: dict[str, dict[str, Any]] = {}
    for section, ref in refs:
        module, _, name = ref.partition(":")
        out[section] = skeleton(getattr(importlib.import_module(module), name))
    return out


def _lines(tree: dict[str, Any], indent: int) -> list[str]:
    pad = "  " * indent
    out: list[str] = []
    for key, e in tree.items():
        if "section" in e:
            out.append(f"{pad}{key}:" + (f"  # {e['doc']}" if e["doc"] else ""))
            out.extend(_lines(e["section"], indent + 1))
            continue
        value = "null" if e["default"] is None else json.dumps(e["default"])
        notes = [e["doc"]] if e["doc"] else []
        if "choices" in e:
            notes.append("one of " + ", ".join(map(str, e["choices"])))
        if "bounds" in e:
            notes.append(e["bounds"])
        out.append(f"{pad}{key}: {value}" + (f"  # {'; '.join(notes)}" if notes else ""))
    return out


def render_yaml(sections: dict[str, dict[str, Any]]) -> str:
    """The sections as commented YAML, each under its dotted place in ``config.yaml``."""
    out: list[str] = []
    for dotted, tree in sections.items():
        parts = dotted.split(".")
        for i, p in enumerate(parts):
            out.append("  " * i + f"{p}:")
        out.extend(_lines(tree, len(parts)))
    return "\n".join(out) + "\n"
