"""Prediction parameters saved with a trained model, as PECOS saves its ``pred_params``: a method's
``PredictParams`` (a :class:`SavedPredictParams`) is written into the model's description (its
``<method>.json``'s ``predict``) by the training run, read back by the method's one prediction path
(``xmc_steps.<method>.serve.predict``, the predict stage's and serving's) and overridden there by the
caller's values (the predict rule's settings; serving's)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, TypeVar

from .params import Params

T = TypeVar("T", bound="SavedPredictParams")


class SavedPredictParams(Params):
    """The base of a method's ``PredictParams`` dataclass."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls: type[T], params: Any, **values: Any) -> T:
        """The prediction parameters of a training run's ``params`` (its attributes of the same names),
        ``values`` replacing some."""
        return cls(**{**{k: getattr(params, k) for k in cls.keys() if k not in values}, **values})

    @classmethod
    def effective(cls: type[T], meta: Mapping[str, Any], overrides: Mapping[str, Any] | Params | None = None,
                  **fallback: Any) -> T:
        """The parameters saved in a model's description ``meta`` (``meta["predict"]``; a model saved before
        they were: its training parameters', ``meta["params"]``, with ``fallback``) with ``overrides``'
        values that are not ``None``."""
        saved = meta.get("predict")
        if saved is None:
            trained = meta.get("params") or {}
            saved = {**{k: trained[k] for k in cls.keys() if k in trained}, **fallback}
        if isinstance(overrides, Params):
            overrides = overrides.to_dict()
        return cls.from_dict({**saved, **{k: v for k, v in (overrides or {}).items() if v is not None}})
