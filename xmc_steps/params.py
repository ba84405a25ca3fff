"""Typed parameter objects: a mixin for the dataclasses every stage takes (PECOS style).

``to_dict`` / ``from_dict`` round-trip through JSON; unknown keys are an error naming
them, so a typo in ``config.yaml`` or ``--params`` never passes silently.  ``from_dict``
converts each value to its field's annotated type (:func:`convert`): ``int``, ``float``,
``str``, ``bool``, ``X | None``, ``list[X]``/``tuple[X, ...]`` and nested :class:`Params`
(from a mapping, recursively), so ``"1e-4"`` (a string to YAML 1.1) is a float where a float
is declared and a mistyped value is an error naming the parameter.  A mapping for a field
whose default is a parameter object changes only the keys it names; the others keep that
default (``train: {epochs: 5}`` keeps the matcher's own warm-up and learning rate).

Choices and bounds are declared once, on the fields: a ``Literal[...]`` annotation lists a
setting's choices (:func:`choices`), and :func:`bounded` puts its numeric bounds in the field's
metadata under the JSON Schema keywords (``minimum``, ``exclusiveMinimum``, ``maximum``,
``exclusiveMaximum``).  Every construction checks them (:meth:`Params.check_fields`, before the
class's own ``__post_init__``), with an error naming the parameter ("LightXML parameter dropout
must be in [0, 1), got 1.5"; "... head_init must be one of random, linear, got 'x'"), and the
configuration schema states the same ones (tests/test_settings_source.py keeps the two equal).
"""

from __future__ import annotations

import functools
import json
import re
import types
import typing
from dataclasses import MISSING, Field, asdict, field, fields, is_dataclass
from typing import Any, ClassVar, Literal, Mapping, TypeVar

T = TypeVar("T", bound="Params")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}

# --------------------------------------------------------------------------- choices and bounds

# The choices of the settings that name a part of an artifact path (a wildcard of the rules).  They
# are declared here, in a module without heavy imports, so that workflow/rules/common.smk builds its
# wildcard constraints from them without importing torch; the parameter classes annotate their
# fields with them (xmc_steps.negatives re-exports NegativeKind).
#: the instances each cluster's rankers train on (X-Transformer §3.4): ``{neg}``
NegativeKind = Literal["tfn", "man", "tfn+man"]
#: the X-Transformer rankers' features: ``{rin}``
RankerInput = Literal["tfidf", "tfidf+neural"]
#: the clusters Eq. 2 scores: the matcher's top-b (the paper), with the linear tree's, or the tree's: ``{cand}``
Candidates = Literal["matcher", "union", "linear"]
#: how Eq. 2 combines the matcher's and the rankers' scores: ``{comb}``
Combiner = Literal["product", "ranker", "mean"]
#: LightXML's negative labels: re-drawn from the generator at every step, or drawn once: ``{sampling}``
Sampling = Literal["dynamic", "static"]
#: a B-ary cluster tree's branching factor
Branching = Literal[2, 4, 8, 16, 32, 64, 128, 256]
#: the schema of a setting that names an encoder by its key (config.schema.json's ``$defs/encoder_key``)
ENCODER_KEY = {"$ref": "#/$defs/encoder_key"}
#: the splits a model fits on (``fit_on``)
Split = Literal["train", "valid"]
#: the schema of a ``device`` setting
DEVICE = {"pattern": "^(auto|cpu|cuda(:[0-9]+)?)$"}
#: a list setting of at least one item, each once (``fit_on``, an ensemble's encoders)
UNIQUE_LIST = {"minItems": 1, "uniqueItems": True}
FIT_ON = UNIQUE_LIST

#: the bound keywords of a field's metadata (JSON Schema's, so the schema states them the same way)
BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def choices(typ: Any) -> tuple | None:
    """The choices of a ``Literal[...]`` type (also of ``Literal[...] | None``), else ``None``."""
    if typing.get_origin(typ) is Literal:
        return typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        arms = [choices(a) for a in typing.get_args(typ) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return None


def regex(options: Any) -> str:
    """A regular expression matching exactly one of ``options`` (a ``Literal`` type or a sequence):
    the wildcard constraint of a setting that names a part of a path."""
    opts = choices(options)
    return "|".join(re.escape(str(o)) for o in (opts if opts is not None else options))


def is_choice(value: Any, options: tuple) -> bool:
    """``value`` is one of ``options`` (of the same type: ``True`` is not the choice ``1``)."""
    return any(value == o and type(value) is type(o) for o in options)


def check_choice(value: Any, options: Any, what: str) -> None:
    """``ValueError`` "<what> must be one of <options>, got <value>" unless ``value`` is one of
    ``options`` (a ``Literal`` type or a tuple)."""
    opts = choices(options)
    opts = tuple(options) if opts is None else opts
    if not is_choice(value, opts):
        raise ValueError(f"{what} must be one of {', '.join(map(str, opts))}, got {value!r}")


def bounded(default: Any = MISSING, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, default_factory: Any = MISSING, schema: Mapping[str, Any] | None = None,
            setting: bool = True, null: bool = True) -> Any:
    """A dataclass field whose value (unless ``None``) must be ``>= ge``, ``> gt``, ``<= le``, ``< lt``:
    ``dropout: float = bounded(0.1, ge=0, lt=1)``.  The bounds are the field's metadata under the
    JSON Schema keywords (:data:`BOUNDS`); :meth:`Params.check_fields` checks them.  ``schema``: further
    JSON Schema keywords of the setting (``{"minItems": 1}``; a ``$ref`` replaces the type's schema);
    ``setting=False``: a value the stage is given (``threads``), no key of the config section
    (:mod:`xmc_steps.schema`); ``null=False``: an optional field whose key, when the config gives it, holds a
    value (a variant's changes: left out, the main target's)."""
    meta: dict[str, Any] = {k: v for k, v in zip(BOUNDS, (ge, gt, le, lt)) if v is not None}
    if schema:
        meta["schema"] = dict(schema)
    if not setting:
        meta["setting"] = False
    if not null:
        meta["null"] = False
    return field(default=default, default_factory=default_factory, metadata=meta)


def given(default: Any = None) -> Any:
    """A field the rule or the stage fills in (the thread count, an encoder's name), no config setting."""
    return bounded(default, setting=False)


def bounds(f: Field) -> dict[str, float]:
    """The bounds a field declares (:func:`bounded`), by JSON Schema keyword."""
    return {k: f.metadata[k] for k in BOUNDS if k in f.metadata}


def describe_bounds(b: Mapping[str, float]) -> str:
    """``>= 1``, ``> 0``, ``in [0, 1)``: what a value within the bounds ``b`` is."""
    lo = ("[", b["minimum"]) if "minimum" in b else ("(", b["exclusiveMinimum"]) if "exclusiveMinimum" in b else None
    hi = ("]", b["maximum"]) if "maximum" in b else (")", b["exclusiveMaximum"]) if "exclusiveMaximum" in b else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}"
    return f"{'<=' if hi[0] == ']' else '<'} {hi[1]}" if hi else "any number"


def within(value: Any, b: Mapping[str, float]) -> bool:
    """``value`` lies within the bounds ``b``."""
    return not (("minimum" in b and value < b["minimum"])
                or ("exclusiveMinimum" in b and value <= b["exclusiveMinimum"])
                or ("maximum" in b and value > b["maximum"])
                or ("exclusiveMaximum" in b and value >= b["exclusiveMaximum"]))



def convert(value: Any, typ: Any, what: str) -> Any:
    """``value`` as the annotated type ``typ``; ``ValueError`` naming ``what`` when it is not one.

    ``None`` passes unchanged (the dataclass's own checks decide whether it is allowed); an
    ``int`` field takes integral numbers only (``600.0`` but not ``0.5``); a ``bool`` takes
    booleans, 0/1 and true/false/yes/no/on/off; a ``Literal[...]`` one of its choices ("<what>
    must be one of ..."); other types (``Any``, ``dict``) pass as they are."""
    if value is None:
        return None
    origin = typing.get_origin(typ)
    if origin is Literal:
        options = typing.get_args(typ)
        for o in options:
            if is_choice(value, (o,)):
                return o
            if not isinstance(o, str):      # a number given as a string (YAML, a command line)
                try:
                    if is_choice(convert(value, type(o), what), (o,)):
                        return o
                except ValueError:
                    pass
        check_choice(value, options, what)
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
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{what} must be a mapping, got {value!r}")
        item = typing.get_args(typ)[1] if typing.get_args(typ) else Any
        return {k: convert(v, item, f"{what}.{k}") for k, v in value.items()}
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

    def __post_init__(self) -> None:
        self.check_fields()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``__post_init__`` runs after :meth:`check_fields`, so the declared
        choices and bounds hold whenever its checks run, however the object was made."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None or getattr(own, "_checks_fields", False):
            return

        @functools.wraps(own)
        def __post_init__(self: "Params", *args: Any, **kw: Any) -> None:
            self.check_fields()
            own(self, *args, **kw)

        __post_init__._checks_fields = True  # type: ignore[attr-defined]
        cls.__post_init__ = __post_init__  # type: ignore[method-assign]

    def check_fields(self) -> None:
        """``ValueError`` naming the first field whose value is not one of its ``Literal`` choices
        or lies outside its bounds (:func:`bounded`); ``None`` passes (an optional field's type
        says whether it may be ``None``)."""
        for name, opts, b in _declared(type(self)):
            value = getattr(self, name)
            if value is None:
                continue
            if opts is not None:
                check_choice(value, opts, f"{self._what} {name}")
            if b and not isinstance(value, bool) and isinstance(value, (int, float)) and not within(value, b):
                raise ValueError(f"{self._what} {name} must be {describe_bounds(b)}, got {value}")

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


@functools.cache
def _declared(cls: type) -> tuple[tuple[str, tuple | None, dict[str, float]], ...]:
    """``(field name, Literal choices or None, bounds)`` of the fields of ``cls`` that declare either."""
    if not is_dataclass(cls):
        return ()
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):      # annotations naming what the module cannot see (a class made in a function)
        hints = {}
    out = []
    for f in fields(cls):
        opts, b = choices(hints.get(f.name)), bounds(f)
        if opts is not None or b:
            out.append((f.name, opts, b))
    return tuple(out)


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
