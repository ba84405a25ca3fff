"""Every rule is complete: log, threads, memory, runtime, a conda environment; GPU rules ask for a GPU."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_RULES = {"embed_pretrained", "matcher", "elias_stage1", "elias_stage2", "elias_predict", "lightxml_train", "lightxml_predict", "gudn_train", "gudn_predict"}


def _rules():
    for f in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        parts = re.split(r"(?m)^rule (\w+):\n", f.read_text())
        for name, body in zip(parts[1::2], parts[2::2]):
            yield f.name, name, body


def test_every_job_rule_declares_its_resources():
    seen = set()
    for fname, name, body in _rules():
        seen.add(name)
        if "shell:" not in body:
            continue
        where = f"{fname}: rule {name}"
        assert "conda:" in body, where
        assert "localrule: True" in body or all(k in body for k in ("log:", "threads:", "mem_mb=", "runtime=")), where
        gpu = "gpu=1" in body or "gpu=gpus(" in body       # one GPU, or the section's gpus (torchrun's processes)
        assert gpu == ("envs/gpu.yaml" in body), where      # a GPU rule runs in the GPU env
        assert name not in GPU_RULES or gpu, where
        # a rule that starts its stage with {params.launch} (torchrun for gpus > 1) asks for those GPUs
        assert ("{params.launch}" in body) == ("gpu=gpus(" in body), where
    assert GPU_RULES <= seen


def test_every_rules_resources_can_be_set_per_dataset():
    """mem_mb and runtime of every rule go through res("<the rule>", ...), and the schema accepts
    resources.<rule> for exactly those rules."""
    import json

    with_res = set()
    for fname, name, body in _rules():
        for key in ("mem_mb", "runtime"):
            for m in re.finditer(rf"^\s+{key}=(.*)$", body, re.M):
                assert m.group(1).startswith(f'res("{name}", "{key}", '), f"{fname}: rule {name}: {m.group(0).strip()}"
                with_res.add(name)
    schema = json.loads((ROOT / "workflow" / "schemas" / "config.schema.json").read_text())
    enum = schema["$defs"]["settings"]["properties"]["resources"]["propertyNames"]["enum"]
    assert set(enum) == with_res


def test_logs_follow_rule_and_wildcards():
    for fname, name, body in _rules():
        m = re.search(r'log:\n\s+"logs/(\w+)/', body)
        if m:
            assert m.group(1) in (name, name.rsplit("_", 1)[0], "label_embedding"), f"{fname}: rule {name}"


#: the placeholders of a shell line that may carry a configured string (every artifact path lies under the
#: configured results_dir, a dataset's path under data_dir or its own `path`; PY is the interpreter's path)
_CONFIGURED = re.compile(r"\{(PY|DATA|RES|log|input|output|params)(\.\w+)?(\[[^\]]*\])?(:[^}]*)?\}")


def _shell_lines(text: str):
    """The string literals of every ``shell:`` block and of the module-level ``*_ARGS`` pieces of a rule file."""
    for m in re.finditer(r"(?m)^\s+shell:\n((?:\s{8}.*\n?)+)", text):
        yield from re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1))
    for m in re.finditer(r"(?m)^[A-Z_]+_ARGS = (\((?:[^()]|\n)*\)|\".*\")", text):
        yield from re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1))


def test_every_configured_string_reaches_the_shell_quoted():
    """Issue 54: a path or JSON from the config is shell-quoted (Snakemake's ``:q``) wherever a shell line
    uses it, so a quote, ``$()`` or a backtick in it is a character, not a command."""
    files = sorted((ROOT / "workflow" / "rules").glob("*.smk")) + sorted((ROOT / "tests" / "toy_method").rglob("*.smk"))
    seen = 0
    for f in files:
        for line in _shell_lines(f.read_text()):
            for m in _CONFIGURED.finditer(line):
                if m.group(0) == "{params.launch}":     # shell words: xmc_steps.launch.command quotes the interpreter
                    continue                            # (tests/test_distributed.py), the rest are integers
                seen += 1
                assert (m.group(4) or "").endswith("q"), f"{f.name}: {m.group(0)} is not quoted (add :q) in {line!r}"
    assert seen > 100, seen
