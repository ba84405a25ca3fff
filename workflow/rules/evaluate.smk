# Evaluation: metrics of DESIGN.md, costs of every stage, results/{dataset}/{method}.json.

SHARED_RECORDS = ["ingest/record.json", "features/tfidf/record.json"]
METHOD_RECORDS = {
    "xr-linear": [
        "index/pifa-tfidf/label_emb.record.json", "index/pifa-tfidf/tree.record.json",
        "xr-linear/train.record.json", "xr-linear/predict.record.json",
    ],
    "parabel": ["parabel/train.record.json", "parabel/predict.record.json"],
}


def stage_records(wildcards):
    return [f"{RES}/{wildcards.dataset}/{r}" for r in SHARED_RECORDS + METHOD_RECORDS[wildcards.method]]


rule effective_config:
    """The effective settings of a target and their hash, for its results file."""
    output:
        RES + "/{dataset}/{method}/effective_config.json",
    params:
        settings=lambda w: json.dumps(xcfg.method_settings(config, w.dataset, w.method), sort_keys=True),
    localrule: True
    shell:
        "{PY} -m xmc_steps.config --dataset {wildcards.dataset} --method {wildcards.method} "
        "--settings {params.settings:q} --out {output}"


rule evaluate:
    """P@k, nDCG@k, PSP@k, PSnDCG@k, R@k, decile recall; stage costs; schema-validated JSON."""
    input:
        predictions=RES + "/{dataset}/{method}/predictions_test.parquet",
        truth=RES + "/{dataset}/ingest/Y_test.npz",
        train=expand(RES + "/{{dataset}}/ingest/Y_{split}.npz", split=["train", "valid"]),
        labels=RES + "/{dataset}/ingest/labels.parquet",
        records=stage_records,
        config=rules.effective_config.output,
    output:
        result=RES + "/{dataset}/{method}.json",
        plot=RES + "/{dataset}/{method}_decile_recall.png",
        record=RES + "/{dataset}/{method}/evaluate.record.json",
    log:
        "logs/evaluate/{dataset}-{method}.log",
    params:
        settings=P("evaluate"),
        hash=config_hash,
    threads: 1
    resources:
        mem_mb=8000,
        runtime=30,
    shell:
        "{PY} -m xmc_steps.evaluate --predictions {input.predictions} --truth {input.truth} "
        "--train-labels {input.train} --labels {input.labels} --stage-records {input.records} "
        "--effective-config {input.config} --out {output.result} --plot {output.plot} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method {wildcards.method} --rule evaluate "
        "--config-hash {params.hash}"
