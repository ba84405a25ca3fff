# ELIAS (§3): stage 1 (A fixed to the balanced clustering), stage 2 (A learned, initialised
# by Eqs. 9-10), predictions per split, ELIAS++ (§3.5: sparse ranker + calibration) and the
# ensemble over clustering seeds.  One model folder per seed:
#   results/{dataset}/elias/tree-b{B}-l{leaf}-s{seed}/{enc}-{maxlen}/

EL = RES + "/{dataset}/elias/{tree}/{enc}-{maxlen}"


def elias_params(stage):
    def f(w):
        s = S(w)
        el = s["elias"]
        p = {"encoder": ENC(w), "max_length": int(w.maxlen)}
        p.update(el["train"])
        p.update({k: v for k, v in el["index"].items() if v is not None})
        p.update(el[f"stage{stage}"])
        return json.dumps(p, sort_keys=True)

    return f


def elias_tokens(w):
    d = xtg.tokens_dir(RES, w.dataset, w.enc, w.maxlen)
    return [f"{d}/tokens_{s}.npz" for s in SPLITS]


rule elias_stage1:
    """ELIAS stage 1: encoder, W_C and W_L with A fixed to the balanced clustering."""
    input:
        tokens=elias_tokens,
        Y=expand(RES + "/{{dataset}}/ingest/Y_{split}.npz", split=["train", "valid"]),
        tree=RES + "/{dataset}/index/pifa-tfidf/{tree}.npz",
    output:
        model=EL + "/stage1/model.safetensors",
        meta=EL + "/stage1/elias.json",
        clusters=EL + "/stage1/clusters_train.npz",
        record=EL + "/stage1/record.json",
    log:
        "logs/elias_stage1/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        settings=elias_params(1),
        hash=H("elias_stage1"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        out=EL + "/stage1",
    threads: threads_of
    resources:
        mem_mb=res("elias_stage1", "mem_mb", 16000),
        runtime=res("elias_stage1", "runtime", 1440),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY} -m xmc_steps.elias train --stage 1 --tokens-dir {params.tokens_dir} --labels-train {input.Y[0]} "
        "--labels-valid {input.Y[1]} --tree {input.tree} --out {params.out} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --threads {threads} --config-hash {params.hash}"


rule elias_stage2:
    """ELIAS stage 2: A initialised from stage 1 (Eqs. 9-10), everything trained end to end."""
    input:
        tokens=elias_tokens,
        Y=expand(RES + "/{{dataset}}/ingest/Y_{split}.npz", split=["train", "valid"]),
        stage1=rules.elias_stage1.output.model,
        clusters=rules.elias_stage1.output.clusters,
    output:
        model=EL + "/stage2/model.safetensors",
        meta=EL + "/stage2/elias.json",
        record=EL + "/stage2/record.json",
    log:
        "logs/elias_stage2/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        settings=elias_params(2),
        hash=H("elias_stage2"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        init=EL + "/stage1",
        out=EL + "/stage2",
    threads: threads_of
    resources:
        mem_mb=res("elias_stage2", "mem_mb", 16000),
        runtime=res("elias_stage2", "runtime", 1440),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY} -m xmc_steps.elias train --stage 2 --init {params.init} --tokens-dir {params.tokens_dir} "
        "--labels-train {input.Y[0]} --labels-valid {input.Y[1]} --out {params.out} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --threads {threads} --config-hash {params.hash}"


rule elias_predict:
    """Top-k ELIAS predictions, shortlist scores and embeddings of one split."""
    input:
        model=EL + "/stage{stage}/model.safetensors",
        tokens=lambda w: f"{xtg.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{w.split}.npz",
    output:
        predictions=EL + "/stage{stage}/pred_{split}.parquet",
        emb=EL + "/stage{stage}/emb_{split}.npz",
        shortlist=EL + "/stage{stage}/shortlist_{split}.parquet",
        record=EL + "/stage{stage}/pred_{split}.record.json",
    wildcard_constraints:
        stage="1|2",
        split="train|valid|test",
    log:
        "logs/elias_predict/{dataset}-{tree}-{enc}-{maxlen}-stage{stage}-{split}.log",
    params:
        settings=lambda w: json.dumps({"topk": S(w)["evaluate"]["topk"],
                                       "device": S(w)["elias"]["train"]["device"],
                                       "allow_cpu_fallback": S(w)["elias"]["train"]["allow_cpu_fallback"],
                                       **{k: v for k, v in S(w)["elias"]["predict"].items() if v is not None}}),
        hash=H("elias_predict"),
        model=EL + "/stage{stage}",
        phase=lambda w: "predict" if w.split == "test" else "train",  # train/valid predictions feed ELIAS++
    threads: threads_of
    resources:
        mem_mb=res("elias_predict", "mem_mb", 16000),
        runtime=res("elias_predict", "runtime", 240),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY} -m xmc_steps.elias predict --model {params.model} --tokens {input.tokens} "
        "--out {output.predictions} --emb-out {output.emb} --shortlist-out {output.shortlist} "
        "--phase {params.phase} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --threads {threads} --config-hash {params.hash}"


def plus_params(w):
    s = S(w)
    return json.dumps(dict(s["elias"]["plus"], topk=s["evaluate"]["topk"]), sort_keys=True)


rule elias_plus_ranker:
    """ELIAS++ sparse ranker on [embedding ⊕ TF-IDF] over each training point's top-100."""
    input:
        X=RES + "/{dataset}/features/tfidf/X_train.npz",
        Y=RES + "/{dataset}/ingest/Y_train.npz",
        emb=EL + "/stage2/emb_train.npz",
        cand=EL + "/stage2/pred_train.parquet",
    output:
        model=directory(EL + "/plus/ranker"),
        record=EL + "/plus/ranker.record.json",
    log:
        "logs/elias_plus_ranker/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        settings=plus_params,
        hash=H("elias_plus_ranker"),
    threads: threads_of
    resources:
        mem_mb=res("elias_plus_ranker", "mem_mb", 16000),
        runtime=res("elias_plus_ranker", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.elias_plus train --tfidf {input.X} --emb {input.emb} --labels {input.Y} "
        "--candidates {input.cand} --out {output.model} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --threads {threads} --config-hash {params.hash}"


rule elias_plus_calibrate:
    """Score calibration: a decision tree on [ranker, ELIAS, label frequency], fit on valid."""
    input:
        model=rules.elias_plus_ranker.output.model,
        X=RES + "/{dataset}/features/tfidf/X_valid.npz",
        Y=RES + "/{dataset}/ingest/Y_valid.npz",
        emb=EL + "/stage2/emb_valid.npz",
        cand=EL + "/stage2/pred_valid.parquet",
    output:
        model=directory(EL + "/plus/calibration"),
        record=EL + "/plus/calibration.record.json",
    log:
        "logs/elias_plus_calibrate/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        settings=plus_params,
        hash=H("elias_plus_calibrate"),
    threads: 1
    resources:
        mem_mb=res("elias_plus_calibrate", "mem_mb", 8000),
        runtime=res("elias_plus_calibrate", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.elias_plus calibrate --model {input.model} --tfidf {input.X} --emb {input.emb} "
        "--labels {input.Y} --candidates {input.cand} --out {output.model} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --config-hash {params.hash}"


rule elias_plus_predict:
    """ELIAS++ scores of the test documents, with or without calibration."""
    input:
        model=rules.elias_plus_ranker.output.model,
        calibration=lambda w: [f"{RES}/{w.dataset}/elias/{w.tree}/{w.enc}-{w.maxlen}/plus/calibration"] if w.cal == "calibrated" else [],
        X=RES + "/{dataset}/features/tfidf/X_test.npz",
        emb=EL + "/stage2/emb_test.npz",
        cand=EL + "/stage2/pred_test.parquet",
    output:
        predictions=EL + "/plus/predictions_test_{cal}.parquet",
        record=EL + "/plus/predict_{cal}.record.json",
    wildcard_constraints:
        cal="calibrated|uncalibrated",
    log:
        "logs/elias_plus_predict/{dataset}-{tree}-{enc}-{maxlen}-{cal}.log",
    params:
        settings=lambda w: json.dumps({"topk": S(w)["evaluate"]["topk"], "uncalibrated": S(w)["elias"]["plus"]["uncalibrated"]}),
        hash=H("elias_plus_predict"),
        cal=lambda w, input: f"--calibration {input.calibration[0]}" if input.calibration else "",
    threads: 1
    resources:
        mem_mb=res("elias_plus_predict", "mem_mb", 8000),
        runtime=res("elias_plus_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.elias_plus predict --model {input.model} {params.cal} --tfidf {input.X} "
        "--emb {input.emb} --candidates {input.cand} --out {output.predictions} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --config-hash {params.hash}"


def elias_variant(w):
    return None if w.variant == "main" else w.variant


rule elias_ensemble:
    """Ensemble of ELIAS++ models over different initial clusterings (the paper's 3x)."""
    input:
        members=lambda w: [f"{xtg.elias_dir(RES, w.dataset, S(w), seed)}/plus/predictions_test_calibrated.parquet"
                           for seed in xtg.elias_seeds(S(w), elias_variant(w))],
        labels=RES + "/{dataset}/ingest/labels.parquet",
    output:
        predictions=RES + "/{dataset}/elias/ensemble-{variant}/predictions_test.parquet",
        record=RES + "/{dataset}/elias/ensemble-{variant}/record.json",
    log:
        "logs/elias_ensemble/{dataset}-{variant}.log",
    params:
        settings=lambda w: json.dumps({"method": S(w)["elias"]["ensemble"], "topk": S(w)["evaluate"]["topk"]}),
        hash=H("elias_ensemble"),
    threads: 1
    resources:
        mem_mb=res("elias_ensemble", "mem_mb", 8000),
        runtime=res("elias_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.ensemble --predictions {input.members} --label-table {input.labels} "
        "--out {output.predictions} --params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method elias --rule {rule} --config-hash {params.hash}"
