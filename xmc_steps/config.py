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
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from . import registry
from .errors import StageError
from .methods import BASE_SETTINGS as _BASE
from .methods import TREE_SETTINGS as _TREE
from .methods import Only
from .registry import split_method

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "config.schema.json"

#: The settings each rule depends on (dotted keys of a dataset's effective settings; ``{enc}``
#: is the rule's encoder-key wildcard).  Their hash (:func:`rule_settings`, ``H(rule)`` in the
#: rules) tags the stage's MLflow run and is a Snakemake param, so a change of exactly these
#: settings reruns the stage and nothing else does.  The one table of what each rule reads: the
#: shared stages' here, each method's rules' in its spec (:attr:`xmc_steps.methods.MethodSpec.rule_settings`).
#: A rule's settings by dotted key; ``(key, names)`` is that section without the keys ``names``.
RULE_SETTINGS: dict[str, list[str | tuple[str, tuple[str, ...]]]] = {
    "ingest": _BASE,
    "tfidf": _BASE + ["tfidf"],
    "tokenize": _BASE + ["encoders.{enc}"],
    "embed_pretrained": _BASE + ["encoders.{enc}", "xtransformer.embed"],
    "label_embedding_pifa_tfidf": _BASE + ["tfidf"],
    "label_embedding_pifa_neural": _BASE + ["encoders.{enc}"],
    "label_embedding_text": _BASE + ["encoders.{enc}", "xtransformer.embed"],
    "cluster": _TREE,
}
def expand(entries: list) -> list:
    """``entries`` with each :class:`~xmc_steps.methods.Only` as its dotted keys (the form a hash lists)."""
    return [k for e in entries for k in (e.keys if isinstance(e, Only) else [e])]


def covered(entry: str | tuple[str, tuple[str, ...]] | Only, entries: list) -> bool:
    """``entry`` (a dotted key, ``(key, names left out)`` or an :class:`~xmc_steps.methods.Only`) lies within
    one of ``entries``."""
    if isinstance(entry, Only):
        return all(covered(k, entries) for k in entry.keys)
    key, drop = (entry, ()) if isinstance(entry, str) else entry
    for e in entries:
        k, d = (e, ()) if isinstance(e, str) else e
        if k == key and set(d) <= set(drop):
            return True
        if key.startswith(k + ".") and key[len(k) + 1:].split(".")[0] not in d:
            return True
    return False


#: The settings each rule passes its stage, unchanged (``params.settings``: :func:`rule_payload`), by dotted key:
#: the methods' rules' from their specs' ``passes``.  Each is also in the rule's :data:`RULE_SETTINGS` entry, so
#: what a rule passes is always part of its hash.
RULE_PASSES: dict[str, list[str | tuple[str, tuple[str, ...]] | Only]] = {}
for _spec in registry.METHODS.values():
    for _rule in [*_spec.rule_settings, *(r for r in _spec.passes if r not in _spec.rule_settings)]:
        if _rule in RULE_SETTINGS:
            raise ValueError(f"rule '{_rule}' of method '{_spec.name}' is already in config.RULE_SETTINGS")
        _own = list(_spec.rule_settings.get(_rule, []))
        RULE_SETTINGS[_rule] = _own + [k for k in expand(_spec.passes.get(_rule, [])) if not covered(k, _own)]
    RULE_PASSES.update({r: list(keys) for r, keys in _spec.passes.items()})
#: the shared rules': the token width and the encoder come from their wildcards (``PASS(rule, encoder=ENC, ...)``)
RULE_PASSES.update({"tokenize": [], "embed_pretrained": [Only("xtransformer.embed", ("batch_size", "allow_cpu_fallback"))],
                    "label_embedding_text": [Only("xtransformer.embed", ("max_length",))]})


#: The form of an encoder key (the schema's ``$defs/encoder_key``): it names the encoder in paths.
ENCODER_KEY = "^[A-Za-z0-9][A-Za-z0-9_]*$"

#: Settings an earlier version took elsewhere (paths within a settings block): an old config
#: gets an error naming the new key rather than only "unknown key".
MOVED_KEYS: dict[str, str] = {
    **{f"{section}.{key}": f"{section}.solver.{key}"
       for section in ("xr_linear", "xtransformer.ranker", "elias.plus")
       for key in ("C", "threshold", "tol", "max_iter")},
    # the neural training recipe is a nested `train` section (xmc_steps.trainer.TrainParams)
    **{f"xtransformer.matcher.{key}": f"xtransformer.matcher.train.{key}"
       for key in ("epochs", "steps", "batch_size", "grad_accum", "lr", "warmup", "warmup_steps", "weight_decay",
                   "max_grad_norm", "length_bucket", "checkpoint_every", "log_every", "seed")},
    **{f"elias.{stage}.{key}": f"elias.{stage}.train.{key}"
       for stage in ("stage1", "stage2")
       for key in ("epochs", "steps", "batch_size", "grad_accum", "warmup_steps", "weight_decay")},
    **{f"elias.train.{key}": f"elias.{key}" for key in ("eval_every", "amp", "device", "allow_cpu_fallback", "pooling")},
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


def _resolve(schema: Mapping[str, Any], node: Any) -> list[Mapping[str, Any]]:
    """``node`` and every schema it stands for through ``$ref`` (local), ``allOf``, ``anyOf`` and ``oneOf``."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, Mapping):
            continue
        out.append(n)
        if "$ref" in n:
            ref: Any = schema
            for part in n["$ref"].lstrip("#/").split("/"):
                ref = ref[part]
            todo.append(ref)
        for k in ("allOf", "anyOf", "oneOf"):
            todo.extend(n.get(k) or [])
    return out


def _children(schema: Mapping[str, Any], nodes: list[Mapping[str, Any]], key: str) -> list[Any]:
    """The schemas an object's value at ``key`` must meet (properties, patternProperties, additionalProperties)."""
    out = []
    for n in nodes:
        if key in (n.get("properties") or {}):
            out.append(n["properties"][key])
            continue
        matched = [s for p, s in (n.get("patternProperties") or {}).items() if re.search(p, key)]
        out += matched
        if not matched and isinstance(n.get("additionalProperties"), Mapping):
            out.append(n["additionalProperties"])
    return out


_NULLS = {"null", "~", "none", ""}


def _as_type(value: str, nodes: list[Mapping[str, Any]]) -> Any:
    """A command-line string as the JSON type the schemas ``nodes`` declare (unchanged if a string is allowed,
    or if it converts to none of them: validation then names it)."""
    types, enums = set(), []
    for n in nodes:
        t = n.get("type")
        types |= set(t if isinstance(t, list) else [t] if t else [])
        for v in [*(n.get("enum") or []), *([n["const"]] if "const" in n else [])]:
            enums.append(v)
            types.add("string" if isinstance(v, str) else "null" if v is None else
                      "boolean" if isinstance(v, bool) else "number")
    if "string" in types or not types:
        return value
    s = value.strip()
    candidates = []
    if "null" in types and s.lower() in _NULLS:
        candidates.append(None)
    if "boolean" in types and s.lower() in ("true", "false", "yes", "no", "on", "off"):
        candidates.append(s.lower() in ("true", "yes", "on"))
    if types & {"integer", "number"} and re.fullmatch(r"[+-]?\d+", s):
        candidates.append(int(s))
    if "number" in types:
        try:
            candidates.append(float(s))
        except ValueError:
            pass
    for c in candidates:
        if not enums or any(c == e and type(c) is type(e) for e in enums):
            return c
    return value


def load_schema(schema_path: Path = SCHEMA_PATH) -> dict[str, Any]:
    """The configuration schema: the committed, generated file (:mod:`xmc_steps.schema`), or, where a registered
    method's section is not in it yet (a method just added), the schema generated anew from the registry."""
    schema = json.loads(Path(schema_path).read_text())
    sections = schema.get("$defs", {}).get("settings", {}).get("properties", {})
    if Path(schema_path) == SCHEMA_PATH and any(s.tree and s.section not in sections for s in registry.METHODS.values()):
        from .schema import build

        schema = build()
    return schema


def coerce_overrides(config: dict[str, Any], overrides: Mapping[str, Any], schema_path: Path = SCHEMA_PATH) -> None:
    """Give the values of ``config`` that ``overrides`` (Snakemake's ``--config``) set the types the schema
    declares there, in place.  Snakemake reads a nested ``--config 'datasets={"x": {"beam": 10}}'`` with
    YAML's BaseLoader, which leaves every scalar a string ('10'); a top-level ``key=10`` it converts itself.
    A string that fits none of the declared types is left for :func:`validate` to name."""
    schema = load_schema(schema_path)

    def walk(value: Any, mask: Any, nodes: list[Mapping[str, Any]]) -> Any:
        if isinstance(value, str):
            return _as_type(value, nodes)
        if isinstance(value, dict) and isinstance(mask, Mapping):
            for k in list(value):
                if k in mask:
                    value[k] = walk(value[k], mask[k], [r for c in _children(schema, nodes, k) for r in _resolve(schema, c)])
        elif isinstance(value, list):
            items = [r for n in nodes if isinstance(n.get("items"), Mapping) for r in _resolve(schema, n["items"])]
            return [walk(v, v, items) for v in value]
        return value

    walk(config, overrides, _resolve(schema, schema))


def validate(config: Mapping[str, Any], source: str = "config.yaml", schema_path: Path = SCHEMA_PATH) -> None:
    """Validate ``config``; raise :class:`ConfigError` naming every bad key."""
    import jsonschema

    schema = load_schema(schema_path)
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
        elif err.validator == "pattern" and err.schema.get("pattern") == ENCODER_KEY:
            messages.append(f"key '{where}': {err.instance!r} is an encoder name, not a key: encoders are named by "
                            f"a key of `encoders` now (add `encoders: {{<key>: {err.instance}}}` and write the key here)")
        elif err.validator == "required":
            messages.append(f"{where}: {err.message}")
        else:
            messages.append(f"key '{where}': {err.message}")
    if not messages:
        messages = encoder_key_errors(config)
    if messages:
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(messages))


def encoder_refs(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(dotted key, encoder key)`` of every place a settings block names an encoder (the registry's)."""
    return registry.encoder_refs(settings)


def encoder_key_errors(config: Mapping[str, Any]) -> list[str]:
    """Each encoder reference that is not a key of its dataset's ``encoders`` map, named (a
    dataset that only inherits a bad reference from ``defaults`` is not named again)."""
    out = []
    failed = set()
    blocks = [("defaults", config.get("defaults") or {})]
    blocks += [(f"datasets.{name}", dataset_settings(config, name)) for name in sorted(config.get("datasets") or {})]
    for prefix, settings in blocks:
        keys = settings.get("encoders") or {}
        for where, key in encoder_refs(settings):
            if key in keys or (where, key) in failed:
                continue
            failed.add((where, key))
            out.append(f"key '{prefix}.{where}': '{key}' is not a key of encoders "
                       f"(known: {', '.join(sorted(keys)) or 'none'})")
    return out


def encoder_name(settings: Mapping[str, Any], key: str) -> str:
    """The encoder (packaged name, local folder or hub name) an encoder key stands for."""
    try:
        return settings["encoders"][key]
    except KeyError:
        raise ConfigError(f"'{key}' is not a key of encoders (known: {', '.join(sorted(settings.get('encoders', {})))})") from None


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


#: a seed replica of a dataset: ``<dataset>-seed<k>`` (:func:`replica_of`)
_REPLICA = re.compile(r"^(?P<base>.+)-seed(?P<seed>\d+)$")


def replica_of(config: Mapping[str, Any], dataset: str) -> tuple[str, int] | None:
    """``(base, k)`` when ``dataset`` is the seed-``k`` replica ``<base>-seed<k>`` of a dataset whose
    ``seeds`` list holds ``k`` (and no dataset of that name is configured), else None.

    A replica is the base dataset (its data, its settings) with every ``seed`` setting except the
    split's (so the validation and test documents stay the same) set to ``k``, and ELIAS's clustering
    ``seeds`` to ``[k]``: cluster trees, solver and training seeds.  Its targets, under
    ``results/<base>-seed<k>/``, give the spread a leaderboard reports as mean +- std over ``seeds``
    (seed 0 is the base dataset's own run, with its seeds as configured)."""
    m = _REPLICA.match(dataset)
    if not m or dataset in (config.get("datasets") or {}):
        return None
    base, k = m.group("base"), int(m.group("seed"))
    if k == 0 or k not in (dataset_settings(config, base).get("seeds") or []):
        return None
    return base, k


def _reseed(node: Any, k: int, path: str = "") -> Any:
    """``node`` with every ``seed`` but the split's set to ``k``; a training recipe (``train``) or a
    rankers' ``solver`` section gets ``seed: k`` even where config.yaml leaves it to the default."""
    if isinstance(node, Mapping):
        out = {}
        for key, v in node.items():
            here = f"{path}.{key}" if path else key
            if key == "seed" and isinstance(v, int) and here != "split.seed":
                out[key] = k
            elif here == "elias.seeds":
                out[key] = [k]
            elif key in ("train", "solver") and isinstance(v, Mapping):
                out[key] = {**_reseed(v, k, here), "seed": k}
            else:
                out[key] = _reseed(v, k, here)
        return out
    return node


def dataset_settings(config: Mapping[str, Any], dataset: str) -> dict[str, Any]:
    """Effective settings of ``dataset``: defaults deep-merged with its own section; ``gudn.backbone`` is
    the ``lightxml`` section with ``gudn.backbone``'s changes merged in.  A seed replica
    (:func:`replica_of`) has its base's settings reseeded, ``replica_of`` naming the base, ``path``
    the base's data folder (unless the base sets one) and the base's propensity constants."""
    rep = replica_of(config, dataset)
    if rep is not None:
        from .metrics import propensity_constants

        base, k = rep
        s = _reseed(dataset_settings(config, base), k)
        A, B = propensity_constants(base)
        prop = s["evaluate"].get("propensity") or {}
        s["evaluate"] = {**s["evaluate"], "propensity": {"A": A if prop.get("A") is None else prop["A"],
                                                         "B": B if prop.get("B") is None else prop["B"]}}
        s["replica_of"] = base
        if not s.get("path"):   # the base's files (the ingest rule reads --path)
            from .datasets import candidate_folders, fetch_folder

            data_dir = config.get("data_dir", "data")
            folders = candidate_folders(base, data_dir)
            s["path"] = str(next((f for f in folders if f.is_dir()), fetch_folder(base, data_dir) or folders[0]))
        return s
    own = (config.get("datasets") or {}).get(dataset) or {}
    s = deep_merge(config["defaults"], own)
    if "gudn" in s and "lightxml" in s:   # GUDN's network is LightXML's: its backbone is that section + changes
        s["gudn"] = {**s["gudn"], "backbone": deep_merge(s["lightxml"], s["gudn"].get("backbone") or {})}
    return s


def method_settings(config: Mapping[str, Any], dataset: str, method: str) -> dict[str, Any]:
    """The sections of the effective settings that ``method`` depends on."""
    s = dataset_settings(config, dataset)
    base, _ = split_method(method)
    sections = registry.METHODS[base].sections if base in registry.METHODS else sorted(s)
    return {k: s[k] for k in sections if k in s} | {"threads": s.get("threads")}


def rule_settings(settings: Mapping[str, Any], rule: str, wildcards: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings ``rule`` depends on (:data:`RULE_SETTINGS`), by dotted key."""
    if rule not in RULE_SETTINGS:
        raise KeyError(f"rule '{rule}' is not in config.RULE_SETTINGS")
    return dict(_lookup(settings, entry, wildcards) for entry in RULE_SETTINGS[rule])


def _lookup(settings: Mapping[str, Any], entry: str | tuple[str, tuple[str, ...]],
            wildcards: Mapping[str, str] | None) -> tuple[str, Any]:
    """``(dotted key, value)`` of a table entry: a dotted key, or ``(key, names left out)``."""
    key, leave_out = (entry, ()) if isinstance(entry, str) else entry
    key = key.format(**(wildcards or {}))
    v: Any = settings
    for part in key.split("."):
        v = v[part]
    return key, (_without(v, leave_out) if leave_out else v)


def _without(section: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``section`` without the keys ``names`` (dotted: a key of a subsection)."""
    out = dict(section)
    for name in names:
        head, _, rest = name.partition(".")
        if rest and isinstance(out.get(head), Mapping):
            out[head] = _without(out[head], (rest,))
        elif not rest:
            out.pop(head, None)
    return out


def rule_payload(settings: Mapping[str, Any], rule: str, wildcards: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What ``rule`` passes its stage (:data:`RULE_PASSES`): each passed section's keys unchanged, merged into
    one object (a dotted key that is no section passes as ``{its last name: value}``; an ``Only`` entry as the
    named keys of its section).  A key two entries
    both give is an error: the payload reshapes nothing."""
    if rule not in RULE_PASSES:
        raise KeyError(f"rule '{rule}' passes no settings (config.RULE_PASSES)")
    out: dict[str, Any] = {}
    for entry in RULE_PASSES[rule]:
        if isinstance(entry, Only):
            _, section = _lookup(settings, entry.key, wildcards)
            part = {name: copy.deepcopy(section[name]) for name in entry.names}
        else:
            key, value = _lookup(settings, entry, wildcards)
            part = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else {key.rpartition(".")[2]: value}
        clash = sorted(set(part) & set(out))
        if clash:
            raise ValueError(f"rule '{rule}' passes {', '.join(clash)} twice (config.RULE_PASSES)")
        out.update(part)
    return out


def config_hash(settings: Mapping[str, Any]) -> str:
    """Short SHA-256 of the canonical JSON of ``settings``."""
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
