# Shared helpers: config validation at start-up, effective settings, paths.
import json
import os
import sys
from types import SimpleNamespace

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.0")

sys.path.insert(0, workflow.basedir)
# stage CLIs run as `python -m xmc_steps...` from any working directory
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [workflow.basedir, os.environ.get("PYTHONPATH", "")] if p)
from xmc_steps import config as xcfg  # noqa: E402
from xmc_steps import datasets as xds  # noqa: E402
from xmc_steps import layout as lay  # noqa: E402
from xmc_steps import params as xparams  # noqa: E402
from xmc_steps import proc as xproc  # noqa: E402
from xmc_steps import registry as xreg  # noqa: E402
from xmc_steps import stale as xstale  # noqa: E402

# before Snakemake takes its locks: register this invocation and remove the locks a killed one left
# when no other invocation is running here (xmc_steps/proc.py, "Snakemake's locks"); job processes skip it
if workflow.is_main_process:
    for _note in xproc.claim_snakemake_folder(".snakemake"):
        sys.stderr.write(f"xmc: {_note}\n")
# the stages this process starts stop when it is gone, even if it dies while they start (xmc_steps/proc.py)
xproc.mark_workflow()

try:
    # nested --config values arrive as strings: the schema's types first, then validation
    xcfg.coerce_overrides(config, workflow.config_settings.config)
    xcfg.validate(config, source="config.yaml (with --config overrides)")
except xcfg.ConfigError as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(1)

PY = sys.executable


def launch(section_of):
    """A neural rule's ``params.launch`` (training, predict, embed): the interpreter, or torchrun with ``gpus``
    processes per node on ``nodes`` nodes (``section_of(wildcards)``: the rule's settings section;
    xmc_steps.launch)."""
    from xmc_steps import launch as xlaunch

    return lambda w: xlaunch.command(PY, section_of(w).get("gpus", 1), section_of(w).get("nodes", 1))


def gpus(section_of):
    """A neural rule's ``gpu`` resource: the section's ``gpus`` (one per process on its node)."""
    from xmc_steps import launch as xlaunch

    return lambda w: xlaunch.gpus_of(section_of(w))


def folder_of(kind, key=0):
    """A param that is the folder of one of the rule's files (``kind``: "input" or "output"; ``key``: its name
    or index; a list: its first file): derived from the file, not spelled twice (Snakemake's lint)."""

    def folder(files):
        f = files[key] if isinstance(key, int) else getattr(files, key)
        return os.path.dirname(f if isinstance(f, str) else f[0])

    if kind == "input":
        return lambda wildcards, input: folder(input)
    return lambda wildcards, output: folder(output)

# the stage harness's common flags (xmc_steps.stage.add_common_args), ending every stage's shell line;
# a rule adds --method and --threads where they apply
STAGE_ARGS = ("--params {params.settings:q} --record {output.record:q} --log {log:q} --dataset {wildcards.dataset} "
              "--rule {rule} --config-hash {params.hash:q}")
DATA = config["data_dir"]
RES = config["results_dir"]
# before Snakemake plans: the artifacts made from one that is missing go, so the plan rebuilds the chain
# (xmc_steps/stale.py; a dry run only lists them)
if workflow.is_main_process:
    for _note in xstale.remove_stale(".snakemake", RES, act=xstale.runs_jobs(sys.argv)):
        sys.stderr.write(f"xmc: {_note}\n")
# the methods (xmc_steps.registry, one line each): their names and the `method` wildcard, a name with
# `-<variant>` where the method has variants
METHODS = list(xreg.METHODS)
METHOD_RE = xreg.method_re()


wildcard_constraints:
    dataset=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    method=METHOD_RE,
    enc=r"[A-Za-z0-9][A-Za-z0-9_]*",
    maxlen=r"\d+",
    emb=r"pifa-tfidf|(pifa-neural|text-emb)__[A-Za-z0-9._-]+",
    tree=r"tree-b\d+-l\d+(-c\d+)?-s\d+",
    variant=r"[A-Za-z0-9_.-]+",


def R(pattern, wildcards=None, **values):
    """A layout pattern (xmc_steps.layout, where every artifact path is stated once) under the
    results folder, with the wildcards of ``wildcards`` and ``values`` filled, the others kept."""
    filled = dict(wildcards.items()) if wildcards is not None else {}
    filled.update(values)
    return lay.at(RES, pattern, **filled)


def S(wildcards):
    """Effective settings of the wildcards' dataset (defaults + dataset overrides)."""
    return xcfg.dataset_settings(config, wildcards.dataset)


def res(rule, key, default):
    """A rule's resource ``key`` (mem_mb | runtime): ``resources.<rule>.<key>`` of the wildcards'
    dataset (config.yaml defaults or datasets.<name>), else ``default``."""
    def get(w):
        if not hasattr(w, "dataset"):
            return config.get("defaults", {}).get("resources", {}).get(rule, {}).get(key, default)
        return S(w).get("resources", {}).get(rule, {}).get(key, default)
    return get


def P(*sections, nest=False, keep=None, drop=()):
    """A params function: the JSON of the given settings sections, merged into one
    object (or kept under their names with ``nest=True``); ``keep``/``drop`` select
    keys of the merged object.  (A stage's thread count is not a setting: rules pass
    Snakemake's ``--threads {threads}``, so ``--cores 1`` runs every stage on one thread.)"""

    def f(wildcards):
        s = S(wildcards)
        out = {}
        for sec in sections:
            if nest or not isinstance(s[sec], dict):
                out[sec] = s[sec]
            else:
                out.update(s[sec])
        out = {k: v for k, v in out.items() if (keep is None or k in keep) and k not in drop}
        return json.dumps(out, sort_keys=True)

    return f


def PASS(rule, **given):
    """A params function: the settings ``rule`` passes its stage (its spec's ``passes``: each section
    unchanged), the JSON of config.rule_payload; they are part of the rule's hash, ``H(rule)``.  ``given``:
    keys whose value the rule takes from its wildcards, as it takes a path (``encoder=ENC``: the encoder the
    section's key stands for; ``max_length=MAXLEN``: the token files' width); a dotted key sets a key of a
    passed subsection (``**{"train.seed": ...}``)."""

    def f(wildcards):
        out = xcfg.rule_payload(S(wildcards), rule, dict(wildcards.items()))
        for key, value in given.items():
            *parents, name = key.split(".")
            node = out
            for p in parents:
                node = node.get(p) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                raise WorkflowError(f"rule {rule}: '{key}' is in no section it passes")
            node[name] = value(wildcards)
        return json.dumps(out, sort_keys=True)

    return f


def MAXLEN(wildcards):
    """The token files' width of the wildcards' ``maxlen``."""
    return int(wildcards.maxlen)


def threads_of(wildcards):
    """The threads a multi-threaded rule asks for: the dataset's ``threads`` setting (Snakemake
    caps it at ``--cores`` and passes what it grants as ``--threads {threads}``)."""
    return S(wildcards)["threads"]


def config_hash(wildcards):
    """Hash of the settings a target (a method wildcard) depends on."""
    return xcfg.config_hash(xcfg.method_settings(config, wildcards.dataset, getattr(wildcards, "method", "")))


def H(rule):
    """A params function: the hash of the settings ``rule`` depends on (config.RULE_SETTINGS,
    the one table of them).  It tags the stage's MLflow run and is a Snakemake param, so a
    change of exactly these settings reruns the stage, and nothing else does."""

    def f(wildcards):
        return xcfg.config_hash(xcfg.rule_settings(S(wildcards), rule, dict(wildcards.items())))

    return f


def METHOD_SPEC(method):
    """The registered spec of a target name (xmc_steps.registry); an unknown method stops the DAG naming the known."""
    try:
        return xreg.get(method)
    except KeyError as e:
        raise WorkflowError(str(e).strip("'\""))


def ENC(wildcards):
    """The encoder (name or folder) of the wildcards' encoder key."""
    return xcfg.encoder_name(S(wildcards), wildcards.enc)


def data_name(wildcards):
    """The dataset whose files a dataset reads: itself, or the base of a seed replica."""
    return S(wildcards).get("replica_of") or wildcards.dataset


def stop(message):
    """End the run with ``message`` as one line on stderr (no traceback): what an input function
    does when the DAG cannot be built, as the config check above does at start-up."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(1)


def dataset_inputs(wildcards):
    """The upstream files of a dataset (the built-in debtags is made by `prepare`, a PECOS benchmark
    not yet here by `fetch`)."""
    s = S(wildcards)
    if data_name(wildcards) == "debtags" and not s.get("path"):
        return [f"{DATA}/debtags/{n}" for n in DEBTAGS_FILES]
    try:
        return [str(p) for p in xds.dataset_inputs(data_name(wildcards), DATA, s.get("path"), s.get("layout"))]
    except xds.StageError as e:
        stop(e)
