# Evaluation: the metrics of xmc_steps/metrics.py, costs of every stage, results/{dataset}/{method}.json.

SHARED_RECORDS = [lay.INGEST + "/record.json", lay.TFIDF + "/record.json"]


def method_predictions(w):
    """The test predictions a target is evaluated on."""
    base, variant = lay.split_method(w.method)
    if base == "xtransformer":
        return lay.xt_predictions(RES, w.dataset, S(w), variant)
    if base == "elias":
        return lay.elias_predictions(RES, w.dataset, S(w), variant)
    if base == "lightxml":
        return lay.lightxml_predictions(RES, w.dataset, S(w), variant)
    if base == "gudn":
        return lay.gudn_predictions(RES, w.dataset, S(w), variant)
    return R(lay.METHOD, w) + "/predictions_test.parquet"


def stage_records(w):
    """Every stage record of a target: its costs go into the results file."""
    base, variant = lay.split_method(w.method)
    out = [R(r, w) for r in SHARED_RECORDS]
    if base == "xtransformer":
        s = S(w)
        enc = {m.enc for m in lay.xt_members(s, variant)}
        out += [f"{lay.tokens_dir(RES, w.dataset, e, s['xtransformer']['matcher']['max_length'])}/record.json" for e in sorted(enc)]
        return out + lay.xt_records(RES, w.dataset, s, variant)
    if base == "elias":
        return out + lay.elias_records(RES, w.dataset, S(w), variant)
    if base == "lightxml":
        return out + lay.lightxml_records(RES, w.dataset, S(w), variant)
    if base == "gudn":
        return out + lay.gudn_records(RES, w.dataset, S(w), variant)
    if base == "xr-linear":
        tree = lay.tree_path(RES, w.dataset, "pifa-tfidf", S(w)["cluster"])
        out += [R(lay.INDEX, w, emb="pifa-tfidf") + "/label_emb.record.json", tree.replace(".npz", ".record.json")]
    return out + [R(lay.METHOD, w) + "/train.record.json", R(lay.METHOD, w) + "/predict.record.json"]


rule effective_config:
    """The effective settings of a target and their hash, for its results file."""
    output:
        R(lay.CONFIG),
    params:
        settings=lambda w: json.dumps(xcfg.method_settings(config, w.dataset, w.method), sort_keys=True),
    localrule: True
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.config --dataset {wildcards.dataset} --method {wildcards.method} "
        "--settings {params.settings:q} --out {output}"


rule evaluate:
    """P@k, nDCG@k, PSP@k, PSnDCG@k, R@k, decile recall; stage costs; schema-validated JSON."""
    input:
        predictions=method_predictions,
        truth=R(lay.INGEST) + "/Y_test.npz",
        train=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        labels=R(lay.INGEST) + "/labels.parquet",
        records=stage_records,
        config=rules.effective_config.output,
        reported=os.path.join(workflow.basedir, "workflow", "reported.json"),
    output:
        # `snakemake --report report.html <targets>`: one category per dataset, a subcategory per method
        result=report(R(lay.METHOD) + ".json", category="{dataset}", subcategory="{method}",
                      labels={"dataset": "{dataset}", "method": "{method}", "file": "metrics (JSON)"}),
        plot=report(R(lay.METHOD) + "_decile_recall.png", category="{dataset}", subcategory="{method}",
                    labels={"dataset": "{dataset}", "method": "{method}", "file": "decile-wise recall@100"}),
        record=R(lay.RECORDS) + "/{method}.evaluate.json",
    log:
        "logs/evaluate/{dataset}-{method}.log",
    params:
        settings=P("evaluate"),
        hash=config_hash,
    threads: 1
    resources:
        mem_mb=res("evaluate", "mem_mb", 8000),
        runtime=res("evaluate", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.evaluate --predictions {input.predictions} --truth {input.truth} "
        "--train-labels {input.train} --labels {input.labels} --stage-records {input.records} "
        "--effective-config {input.config} --reported {input.reported:q} --out {output.result} --plot {output.plot} "
        "--method {wildcards.method} " + STAGE_ARGS
