# XMC experiment pipeline.  Thin on purpose: configuration, schema validation and the
# rule files; every rule only wires files to a stage CLI in xmc_steps/.
#
#   snakemake --cores all demo                       # the built-in debtags dataset
#   snakemake --cores 8 results/<dataset>/<method>.json

configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/features.smk"
include: "workflow/rules/index.smk"
# each registered method's rule file (xmc_steps.registry), in registration order
for _rules in xreg.rule_files():
    include: f"workflow/rules/{_rules}"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/predict.smk"


def demo_inputs(wildcards):
    """Both linear baselines on debtags, evaluated; its token ids for the configured `tokenize`
    encoder and length (the input every neural method shares); and Debtags suggested for the
    Debian packages that have none (`suggestions`)."""
    tok = xcfg.dataset_settings(config, "debtags")["tokenize"]
    return [f"{RES}/debtags/xr-linear.json", f"{RES}/debtags/parabel.json",
            lay.tokens_dir(RES, "debtags", tok["encoder"], tok["max_length"]) + "/tokens_test.npz",
            lay.at(RES, lay.SUGGESTIONS, dataset="debtags") + ".parquet"]


rule demo:
    """The main job on the built-in dataset: both linear baselines, evaluated, and their suggestions."""
    input:
        demo_inputs,
    default_target: True
