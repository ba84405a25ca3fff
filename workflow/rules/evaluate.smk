# Evaluation: the metrics of xmc_steps/metrics.py, costs of every stage, results/{dataset}/{method}.json.

SHARED_RECORDS = [lay.INGEST + "/" + lay.RECORD, lay.TFIDF + "/" + lay.RECORD]


def method_predictions(w):
    """The test predictions a target is evaluated on (its method's spec, xmc_steps.registry)."""
    spec = METHOD_SPEC(w.method)
    return spec.predictions(RES, w.dataset, S(w), xreg.split_method(w.method)[1])


def stage_records(w):
    """Every stage record of a target: its costs go into the results file."""
    spec = METHOD_SPEC(w.method)
    return [R(r, w) for r in SHARED_RECORDS] + spec.records(RES, w.dataset, S(w), xreg.split_method(w.method)[1])


rule effective_config:
    """The effective settings of a target and their hash, for its results file."""
    output:
        R(lay.CONFIG),
    log:
        "logs/effective_config/{dataset}-{method}.log",
    params:
        settings=lambda w: json.dumps(xcfg.method_settings(config, w.dataset, w.method), sort_keys=True),
    localrule: True
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.effective_config --dataset {wildcards.dataset} --method {wildcards.method} "
        "--settings {params.settings:q} --out {output:q} 2> {log:q}"


rule evaluate:
    """P@k, nDCG@k, PSP@k, PSnDCG@k, R@k, decile recall; stage costs; schema-validated JSON."""
    input:
        predictions=method_predictions,
        truth=R(lay.INGEST) + "/Y_test.npz",
        train=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        labels=R(lay.INGEST) + "/" + lay.LABELS,
        records=stage_records,
        config=rules.effective_config.output,
        reported=os.path.join(workflow.basedir, "workflow", "reported.json"),
    output:
        # `snakemake --report report.html <targets>`: one category per dataset, a subcategory per method
        result=report(R(lay.METHOD) + ".json", category="{dataset}", subcategory="{method}",
                      labels={"dataset": "{dataset}", "method": "{method}", "file": "metrics (JSON)"}),
        plot=report(R(lay.METHOD) + "_decile_recall.png", category="{dataset}", subcategory="{method}",
                    labels={"dataset": "{dataset}", "method": "{method}", "file": "decile-wise recall@100"}),
        # written by the stage beside the results file (evaluate.metrics_page_path): the metrics as tables
        metrics=report(R(lay.METHOD) + "_metrics.html", category="{dataset}", subcategory="{method}",
                       labels={"dataset": "{dataset}", "method": "{method}", "file": "metrics (tables)"}),
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
        "{PY:q} -m xmc_steps.stages.evaluate --predictions {input.predictions:q} --truth {input.truth:q} "
        "--train-labels {input.train:q} --labels {input.labels:q} --stage-records {input.records:q} "
        "--effective-config {input.config:q} --reported {input.reported:q} --out {output.result:q} --plot {output.plot:q} "
        "--method {wildcards.method} " + STAGE_ARGS


def evaluated_targets(dataset):
    """The results files of a dataset's evaluated targets that exist now (a leaderboard ranks what has
    run; it never asks for a target to be trained)."""
    import glob
    import re

    keep = re.compile(rf"^({METHOD_RE})\.json$")
    out = []
    for p in sorted(glob.glob(R(lay.METHOD, dataset=dataset, method="*") + ".json")):
        if keep.match(os.path.basename(p)):
            try:
                with open(p, encoding="utf-8") as f:
                    if "schema_version" in json.load(f):     # not a validation table (xtransformer-selection)
                        out.append(p)
            except (OSError, ValueError):
                continue
    return out


def seed_results(w):
    """A target's results on each of the dataset's seeds: seed 0 is the dataset's own run, seed k the
    replica <dataset>-seed<k> (xmc_steps.config.replica_of)."""
    return [R(lay.METHOD, w, dataset=w.dataset if k == 0 else f"{w.dataset}-seed{k}") + ".json"
            for k in S(w)["seeds"]]


rule seed_summary:
    """A target over the dataset's `seeds`: every main metric's mean and standard deviation."""
    input:
        seed_results,
    output:
        R(lay.SEEDS) + ".json",
    log:
        "logs/seed_summary/{dataset}-{method}.log",
    localrule: True
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.leaderboard --summarise --seeds {input:q} --out {output:q} --log {log:q} --no-tracking"


def seed_summaries(dataset):
    """The seed summaries of a dataset that exist now (the leaderboard shows what has run)."""
    import glob

    return sorted(glob.glob(R(lay.SEEDS, dataset=dataset, method="*") + ".json"))


rule leaderboard:
    """Every evaluated target of a dataset side by side, with the papers' figures and the plots."""
    input:
        # the results are not inputs: a leaderboard ranks what has run and never asks for a method to
        # be (re)trained; `params.results` (their paths and times) reruns it when one changes or appears
        reported=os.path.join(workflow.basedir, "workflow", "reported.json"),
        # the papers' settings (config.yaml + config.paper.yaml): a paper figure beside a run of other settings is marked
        paper_config=[os.path.join(workflow.basedir, f) for f in ("config.yaml", "config.paper.yaml")],
    output:
        md=report(R(lay.LEADERBOARD) + ".md", category="{dataset}", subcategory="leaderboard",
                  labels={"dataset": "{dataset}", "method": "leaderboard", "file": "table (Markdown)"}),
        csv=R(lay.LEADERBOARD) + ".csv",
        # the table rendered (the stage writes it beside --out)
        html=report(R(lay.LEADERBOARD) + ".html", category="{dataset}", subcategory="leaderboard",
                    labels={"dataset": "{dataset}", "method": "leaderboard", "file": "table"}),
        bars=report(R(lay.LEADERBOARD) + ".png", category="{dataset}", subcategory="leaderboard",
                    labels={"dataset": "{dataset}", "method": "leaderboard", "file": "P@k"}),
        recall=report(R(lay.LEADERBOARD) + "_recall.png", category="{dataset}", subcategory="leaderboard",
                      labels={"dataset": "{dataset}", "method": "leaderboard", "file": "recall@k"}),
        deciles=report(R(lay.LEADERBOARD) + "_deciles.png", category="{dataset}", subcategory="leaderboard",
                       labels={"dataset": "{dataset}", "method": "leaderboard", "file": "decile-wise recall@100"}),
        record=R(lay.RECORDS) + "/leaderboard.json",
    log:
        "logs/leaderboard/{dataset}.log",
    params:
        results=lambda w: [(p, os.path.getmtime(p)) for p in evaluated_targets(w.dataset) + seed_summaries(w.dataset)],
        files=lambda w: evaluated_targets(w.dataset),
        seeds=lambda w: ["--seeds"] + seed_summaries(w.dataset) if seed_summaries(w.dataset) else [],
        settings=lambda w: "{}",
        hash=lambda w: "none",   # it depends on no setting
    localrule: True
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.leaderboard --results {params.files:q} {params.seeds:q} --reported {input.reported:q} "
        "--paper-config {input.paper_config:q} --out {output.md:q} "
        + STAGE_ARGS


rule leaderboard_all:
    """The cross-dataset leaderboard: the main columns of every dataset that has evaluated targets."""
    input:
        tables=lambda w: [R(lay.LEADERBOARD, dataset=os.path.basename(os.path.dirname(d))) + ".csv"
                          for d in sorted(glob_datasets())],
    output:
        md=report(R(lay.LEADERBOARD_ALL) + ".md", category="all datasets", labels={"file": "leaderboard"}),
    log:
        "logs/leaderboard/all.log",
    localrule: True
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.leaderboard --tables {input.tables:q} --out {output.md:q} --log {log:q} --no-tracking"


def glob_datasets():
    """Result folders (results/<dataset>/) holding at least one evaluated target."""
    import glob

    return [d + "/" for d in glob.glob(os.path.join(RES, "*")) if os.path.isdir(d) and evaluated_targets(os.path.basename(d))]
