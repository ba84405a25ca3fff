"""Loading, validating and resolving the pipeline configuration.

``config.yaml`` is validated against ``workflow/schemas/config.schema.json``; every
error names the offending key by its dotted path (``defaults.tfidf.min_df``) and the
file.  The effective settings of a dataset are ``defaults`` deep-merged with
``datasets.<name>``.  :func:`config_hash` hashes the part of the effective settings a
method depends on, so a results file can say exactly which configuration produced it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import yaml

from .stage import StageError

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "config.schema.json"

#: The settings sections each method depends on (for the config hash).
METHOD_SECTIONS: dict[str, list[str]] = {
    "xr-linear": ["split", "ingest", "tfidf", "cluster", "xr_linear", "evaluate"],
    "parabel": ["split", "ingest", "tfidf", "parabel", "evaluate"],
    "xtransformer": ["split", "ingest", "tfidf", "cluster", "xr_linear", "xtransformer", "evaluate"],
    "elias": ["split", "ingest", "tfidf", "cluster", "elias", "evaluate"],
}


#: Settings an earlier version took elsewhere (paths within a settings block): an old config
#: gets an error naming the new key rather than only "unknown key".
MOVED_KEYS: dict[str, str] = {
    f"{section}.{key}": f"{section}.solver.{key}"
    for section in ("xr_linear", "xtransformer.ranker", "elias.plus")
    for key in ("C", "threshold", "tol", "max_iter")
}


def _moved(full: str) -> str | None:
    """The new place of ``full`` (``defaults.xr_linear.C`` or ``datasets.<name>.xr_linear.C``)."""
    parts = full.split(".")
    n = 1 if parts[0] == "defaults" else 2 if parts[0] == "datasets" else None
    if n is None:
        return None
    new = MOVED_KEYS.get(".".join(parts[n:]))
    return ".".join(parts[:n] + [new]) if new else None


class ConfigError(StageError):
    """The configuration is invalid; the message names the file and key."""


def _key_path(error) -> str:
    parts = [str(p) for p in error.absolute_path]
    return ".".join(parts) if parts else "<top level>"


def _ref_properties(schema: Mapping[str, Any], ref: str) -> dict[str, Any]:
    """The ``properties`` of a local ``#/$defs/...`` reference."""
    node: Any = schema
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node.get("properties", {})


def validate(config: Mapping[str, Any], source: str = "config.yaml", schema_path: Path = SCHEMA_PATH) -> None:
    """Validate ``config``; raise :class:`ConfigError` naming every bad key."""
    import jsonschema

    schema = json.loads(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    messages = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        where = _key_path(err)
        if err.validator in ("additionalProperties", "unevaluatedProperties"):
            allowed = set(err.schema.get("properties", {}))
            if "$ref" in err.schema:      # a settings block: the shared definition's keys too
                allowed |= set(_ref_properties(schema, err.schema["$ref"]))
            allowed = sorted(allowed)
            extra = sorted(set(err.instance) - set(allowed)) if isinstance(err.instance, dict) else []
            for key in extra:
                full = f"{where}.{key}" if where != "<top level>" else key
                new = _moved(full)
                if new:
                    messages.append(f"key '{full}' has moved: write it as '{new}'")
                else:
                    messages.append(f"unknown key '{full}' (allowed here: {', '.join(allowed)})")
        elif err.validator == "required":
            messages.append(f"{where}: {err.message}")
        else:
            messages.append(f"key '{where}': {err.message}")
    if messages:
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(messages))


def load(path: str | Path = "config.yaml", overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read, merge command-line ``overrides`` into, and validate a config file."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: configuration file not found") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if overrides:
        config = deep_merge(config, overrides)
    validate(config, source=str(path))
    return config


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` with ``over`` merged in recursively (``over`` wins)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def dataset_settings(config: Mapping[str, Any], dataset: str) -> dict[str, Any]:
    """Effective settings of ``dataset``: defaults deep-merged with its own section."""
    own = (config.get("datasets") or {}).get(dataset) or {}
    return deep_merge(config["defaults"], own)


def method_settings(config: Mapping[str, Any], dataset: str, method: str) -> dict[str, Any]:
    """The sections of the effective settings that ``method`` depends on."""
    s = dataset_settings(config, dataset)
    base = next((b for b in ("xtransformer", "elias") if method.startswith(b)), method)
    sections = METHOD_SECTIONS.get(base, sorted(s))
    return {k: s[k] for k in sections if k in s} | {"threads": s.get("threads")}


def config_hash(settings: Mapping[str, Any]) -> str:
    """Short SHA-256 of the canonical JSON of ``settings``."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    """``python -m xmc_steps.config --dataset D --method M --settings JSON --out F``:
    write the effective settings of a target and their hash (a snapshot for results)."""
    import argparse

    from . import io

    p = argparse.ArgumentParser(prog="python -m xmc_steps.config", description=main.__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--method", required=True)
    p.add_argument("--settings", required=True, help="effective settings (JSON)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    settings = json.loads(args.settings)
    io.write_json(args.out, {"dataset": args.dataset, "method": args.method,
                             "config_hash": config_hash(settings), "settings": settings})


if __name__ == "__main__":
    main()
