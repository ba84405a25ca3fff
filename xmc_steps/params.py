"""Typed parameter objects: a mixin for the dataclasses every stage takes (PECOS style).

``to_dict`` / ``from_dict`` round-trip through JSON; unknown keys are an error naming
them, so a typo in ``config.yaml`` or ``--params`` never passes silently.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, TypeVar

T = TypeVar("T", bound="Params")


class Params:
    """Mixin for parameter dataclasses; ``_what`` names them in error messages."""

    _what = "parameter"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def check_keys(cls, d: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the keys of ``d`` that are not fields."""
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls._what}(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any] | None) -> T:
        d = dict(d or {})
        cls.check_keys(d)
        return cls(**d)

    def pick(self, target: type) -> dict[str, Any]:
        """The fields this object shares with the dataclass ``target`` (e.g. the ranker's)."""
        names = {f.name for f in fields(target)}
        return {k: v for k, v in asdict(self).items() if k in names}  # type: ignore[call-overload]
