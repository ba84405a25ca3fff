"""Typed parameter objects: a mixin for the dataclasses every stage takes (PECOS style).

``to_dict`` / ``from_dict`` round-trip through JSON; unknown keys are an error naming
them, so a typo in ``config.yaml`` or ``--params`` never passes silently.  ``from_dict``
converts each value to its field's annotated type (:func:`convert`): ``int``, ``float``,
``str``, ``bool``, ``X | None``, ``list[X]``/``tuple[X, ...]`` and nested :class:`Params`
(from a mapping, recursively), so ``"1e-4"`` (a string to YAML 1.1) is a float where a float
is declared and a mistyped value is an error naming the parameter.  A mapping for a field
whose default is a parameter object changes only the keys it names; the others keep that
default (``train: {epochs: 5}`` keeps the matcher's own warm-up and learning rate).
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, asdict, fields
from typing import Any, ClassVar, Mapping, TypeVar

T = TypeVar("T", bound="Params")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def convert(value: Any, typ: Any, what: str) -> Any:
    """``value`` as the annotated type ``typ``; ``ValueError`` naming ``what`` when it is not one.

    ``None`` passes unchanged (the dataclass's own checks decide whether it is allowed); an
    ``int`` field takes integral numbers only (``600.0`` but not ``0.5``); a ``bool`` takes
    booleans, 0/1 and true/false/yes/no/on/off; other types (``Any``, ``dict``) pass as they are."""
    if value is None:
        return None
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(typ) if a is not type(None)]
        errors = []
        for a in options:
            try:
                return convert(value, a, what)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{what}: {value!r} fits none of {options}")
    if origin in (list, tuple):
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, typing.Iterable):
            raise ValueError(f"{what} must be a list, got {value!r}")
        args = typing.get_args(typ)
        item = args[0] if args else Any
        out = [convert(v, item, f"{what}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if isinstance(typ, type) and issubclass(typ, Params):
        if isinstance(value, typ):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{what} must be a mapping of {typ._what}s, got {value!r}")
        return typ.from_dict(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{what} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(value) if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else _integral(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool):
            raise ValueError(f"{what} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, (list, dict, tuple)):
            raise ValueError(f"{what} must be a string, got {value!r}")
        return str(value)
    return value


def _integral(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    f = float(value)
    if not f.is_integer():
        raise ValueError(value)
    return int(f)


class Params:
    """Mixin for parameter dataclasses; ``_what`` names them in error messages.

    ``_moved`` maps keys of an earlier flat layout to their dotted place in the nested one
    (``{"C": "solver.C"}``): such a key in a mapping is an error naming the new key, and
    :meth:`upgrade` moves them, for reading what an earlier version saved."""

    _what = "parameter"
    _moved: ClassVar[Mapping[str, str]] = {}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def check_keys(cls, d: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the keys of ``d`` that are not fields."""
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        moved = [k for k in unknown if k in cls._moved]
        if moved:
            raise ValueError(f"{cls._what}(s) moved: " + ", ".join(f"{k} is now {cls._moved[k]}" for k in moved))
        if unknown:
            raise ValueError(f"unknown {cls._what}(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")

    @classmethod
    def from_dict(cls: type[T], d: Mapping[str, Any] | None) -> T:
        """An object from a mapping of field values, each converted to its field's type."""
        d = dict(d or {})
        cls.check_keys(d)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):  # type: ignore[arg-type]
            # a nested section names only what it changes: the rest is the field's own default
            if f.name in d and isinstance(d[f.name], Mapping) and f.default_factory is not MISSING:
                base = f.default_factory()
                if isinstance(base, Params):
                    d[f.name] = {**base.to_dict(), **d[f.name]}
        return cls(**{k: convert(v, hints[k], f"{cls._what} {k}") for k, v in d.items()})

    @classmethod
    def upgrade(cls, d: Mapping[str, Any]) -> dict[str, Any]:
        """``d`` with the keys of an earlier flat layout (``_moved``) put in their nested places
        (a value already there wins): for parameters an earlier version saved with a model."""
        d = dict(d)
        for old, new in cls._moved.items():
            if old in d:
                head, _, tail = new.partition(".")
                sub = dict(d.get(head) or {})
                sub.setdefault(tail, d.pop(old))
                d[head] = sub
        return d

    @classmethod
    def from_json(cls: type[T], s: str) -> T:
        return cls.from_dict(json.loads(s))


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"a.b.c": value}`` (values as they are; an empty mapping is a value)."""
    out: dict[str, Any] = {}

    def walk(d: Mapping[str, Any], pre: str) -> None:
        for k, v in d.items():
            if isinstance(v, Mapping) and v:
                walk(v, f"{pre}{k}.")
            else:
                out[f"{pre}{k}"] = v

    walk(params, prefix)
    return out
