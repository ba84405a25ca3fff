# ELIAS (§3): stage 1 (A fixed to the balanced clustering), stage 2 (A learned, initialised
# by Eqs. 9-10), predictions per split, ELIAS++ (§3.5: sparse ranker + calibration) and the
# ensemble over clustering seeds.  One model folder per seed:
#   results/{dataset}/elias/tree-b{B}-l{leaf}-s{seed}/{enc}-{maxlen}/ (layout.ELIAS)
from xmc_steps.elias import spec as ES  # noqa: E402  (its layout)
from xmc_steps.xtransformer import spec as XTS  # noqa: E402  (its layout)


def elias_tokens(w):
    d = lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)
    return [f"{d}/tokens_{s}.npz" for s in SPLITS]


#: the guard's linear tree (both stages): XR-Linear over the same tree, fit on the train split, and the
#: valid TF-IDF it searches
ELIAS_GUARD_INPUTS = {
    "linear": R(XTS.XT_LINEAR, emb="pifa-tfidf", fit="train") + "/model",
    "X_valid": R(lay.TFIDF) + "/X_valid.npz",
}
GUARD_ARGS = "--linear-model {input.linear:q} --tfidf-valid {input.X_valid:q} "


rule elias_stage1:
    """ELIAS stage 1: encoder, W_C and W_L with A fixed to the balanced clustering."""
    input:
        tokens=elias_tokens,
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        tree=R(lay.INDEX, emb="pifa-tfidf") + "/{tree}.npz",
        **ELIAS_GUARD_INPUTS,
    output:
        model=R(ES.ELIAS_STAGE, stage=1) + "/" + lay.WEIGHTS,
        meta=R(ES.ELIAS_STAGE, stage=1) + "/elias.json",
        clusters=R(ES.ELIAS_STAGE, stage=1) + "/clusters_train.npz",
        record=R(ES.ELIAS_STAGE, stage=1) + "/" + lay.RECORD,
        guard=R(ES.ELIAS_STAGE, stage=1) + "/" + lay.GUARD,
        guard_recall=R(ES.ELIAS_STAGE, stage=1) + "/guard_recall.npz",
        curve=report(R(ES.ELIAS_STAGE, stage=1) + "/" + lay.CURVE, category="{dataset}", subcategory="elias",
                     labels={"dataset": "{dataset}", "model": "{tree} {enc}", "file": "stage 1 valid shortlist recall"}),
    log:
        "logs/elias_stage1/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        launch=launch(lambda w: S(w)["elias"]),
        settings=PASS("elias_stage1", encoder=ENC, max_length=MAXLEN),
        hash=H("elias_stage1"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        out=R(ES.ELIAS_STAGE, stage=1),
    threads: threads_of
    resources:
        mem_mb=res("elias_stage1", "mem_mb", 16000),
        runtime=res("elias_stage1", "runtime", 1440),
        gpu=gpus(lambda w: S(w)["elias"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.elias train --stage 1 --tokens-dir {params.tokens_dir:q} --labels-train {input.Y[0]:q} "
        "--labels-valid {input.Y[1]:q} --tree {input.tree:q} --out {params.out:q} " + GUARD_ARGS +
        "--method elias --threads {threads} " + STAGE_ARGS


rule elias_stage2:
    """ELIAS stage 2: A initialised from stage 1 (Eqs. 9-10), everything trained end to end."""
    input:
        tokens=elias_tokens,
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        stage1=rules.elias_stage1.output.model,
        clusters=rules.elias_stage1.output.clusters,
        stage1_guard=rules.elias_stage1.output.guard_recall,
        **ELIAS_GUARD_INPUTS,
    output:
        model=R(ES.ELIAS_STAGE, stage=2) + "/" + lay.WEIGHTS,
        meta=R(ES.ELIAS_STAGE, stage=2) + "/elias.json",
        record=R(ES.ELIAS_STAGE, stage=2) + "/" + lay.RECORD,
        guard=R(ES.ELIAS_STAGE, stage=2) + "/" + lay.GUARD,
        guard_recall=R(ES.ELIAS_STAGE, stage=2) + "/guard_recall.npz",
        curve=report(R(ES.ELIAS_STAGE, stage=2) + "/" + lay.CURVE, category="{dataset}", subcategory="elias",
                     labels={"dataset": "{dataset}", "model": "{tree} {enc}", "file": "stage 2 valid shortlist recall"}),
    log:
        "logs/elias_stage2/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        launch=launch(lambda w: S(w)["elias"]),
        settings=PASS("elias_stage2", encoder=ENC, max_length=MAXLEN),
        hash=H("elias_stage2"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        init=folder_of("input", "clusters"),
        out=R(ES.ELIAS_STAGE, stage=2),
    threads: threads_of
    resources:
        mem_mb=res("elias_stage2", "mem_mb", 16000),
        runtime=res("elias_stage2", "runtime", 1440),
        gpu=gpus(lambda w: S(w)["elias"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.elias train --stage 2 --init {params.init:q} --tokens-dir {params.tokens_dir:q} "
        "--labels-train {input.Y[0]:q} --labels-valid {input.Y[1]:q} --out {params.out:q} " + GUARD_ARGS +
        "--method elias --threads {threads} " + STAGE_ARGS


rule elias_predict:
    """Top-k ELIAS predictions (k: evaluate.topk, or ELIAS++'s deeper n_candidates), shortlist scores and
    embeddings of one split."""
    input:
        model=R(ES.ELIAS_STAGE) + "/" + lay.WEIGHTS,
        tokens=lambda w: f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{w.split}.npz",
    output:
        predictions=R(ES.ELIAS_STAGE) + "/pred_{split}.parquet",
        emb=R(ES.ELIAS_STAGE) + "/emb_{split}.npz",
        shortlist=R(ES.ELIAS_STAGE) + "/shortlist_{split}.parquet",
        record=R(ES.ELIAS_STAGE) + "/" + lay.record("pred_{split}"),
    wildcard_constraints:
        stage="1|2",
        split="train|valid|test",
    log:
        "logs/elias_predict/{dataset}-{tree}-{enc}-{maxlen}-stage{stage}-{split}.log",
    params:
        settings=PASS("elias_predict"),
        hash=H("elias_predict"),
        model=folder_of("input", "model"),
        phase=lambda w: "predict" if w.split == "test" else "train",  # train/valid predictions feed ELIAS++
        launch=launch(lambda w: S(w)["elias"]),
    threads: threads_of
    resources:
        mem_mb=res("elias_predict", "mem_mb", 16000),
        runtime=res("elias_predict", "runtime", 240),
        gpu=gpus(lambda w: S(w)["elias"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.elias predict --model {params.model:q} --tokens {input.tokens:q} "
        "--out {output.predictions:q} --emb-out {output.emb:q} --shortlist-out {output.shortlist:q} --phase {params.phase:q} "
        "--method elias --threads {threads} " + STAGE_ARGS


rule elias_plus_ranker:
    """ELIAS++ sparse ranker on [embedding ⊕ TF-IDF] over each training point's top-n_candidates."""
    input:
        X=R(lay.TFIDF) + "/X_train.npz",
        Y=R(lay.INGEST) + "/Y_train.npz",
        emb=R(ES.ELIAS_STAGE, stage=2) + "/emb_train.npz",
        cand=R(ES.ELIAS_STAGE, stage=2) + "/pred_train.parquet",
    output:
        model=directory(R(ES.ELIAS_PLUS) + "/ranker"),
        record=R(ES.ELIAS_PLUS) + "/" + lay.record("ranker"),
    log:
        "logs/elias_plus_ranker/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        settings=PASS("elias_plus_ranker"),
        hash=H("elias_plus_ranker"),
    threads: threads_of
    resources:
        mem_mb=res("elias_plus_ranker", "mem_mb", 16000),
        runtime=res("elias_plus_ranker", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus train --tfidf {input.X:q} --emb {input.emb:q} --labels {input.Y:q} "
        "--candidates {input.cand:q} --out {output.model:q} --method elias --threads {threads} " + STAGE_ARGS


rule elias_plus_calibrate:
    """Score calibration: a decision tree on [ranker, ELIAS, label frequency], fit on valid."""
    input:
        model=rules.elias_plus_ranker.output.model,
        X=R(lay.TFIDF) + "/X_valid.npz",
        Y=R(lay.INGEST) + "/Y_valid.npz",
        emb=R(ES.ELIAS_STAGE, stage=2) + "/emb_valid.npz",
        cand=R(ES.ELIAS_STAGE, stage=2) + "/pred_valid.parquet",
    output:
        model=directory(R(ES.ELIAS_PLUS) + "/calibration"),
        valid=R(ES.ELIAS_PLUS) + "/pred_valid.parquet",
        record=R(ES.ELIAS_PLUS) + "/" + lay.record("calibration"),
    log:
        "logs/elias_plus_calibrate/{dataset}-{tree}-{enc}-{maxlen}.log",
    params:
        settings=PASS("elias_plus_calibrate"),
        hash=H("elias_plus_calibrate"),
    threads: 1
    resources:
        mem_mb=res("elias_plus_calibrate", "mem_mb", 8000),
        runtime=res("elias_plus_calibrate", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus calibrate --model {input.model:q} --tfidf {input.X:q} --emb {input.emb:q} "
        "--labels {input.Y:q} --candidates {input.cand:q} --out {output.model:q} --valid-out {output.valid:q} "
        "--method elias " + STAGE_ARGS


rule elias_plus_predict:
    """ELIAS++ scores of the test documents, with or without calibration."""
    input:
        model=rules.elias_plus_ranker.output.model,
        calibration=lambda w: [R(ES.ELIAS_PLUS, w) + "/calibration"] if w.cal == "calibrated" else [],
        X=R(lay.TFIDF) + "/X_test.npz",
        emb=R(ES.ELIAS_STAGE, stage=2) + "/emb_test.npz",
        cand=R(ES.ELIAS_STAGE, stage=2) + "/pred_test.parquet",
    output:
        predictions=R(ES.ELIAS_PLUS) + "/predictions_test_{cal}.parquet",
        record=R(ES.ELIAS_PLUS) + "/" + lay.record("predict_{cal}"),
    wildcard_constraints:
        cal="calibrated|uncalibrated",
    log:
        "logs/elias_plus_predict/{dataset}-{tree}-{enc}-{maxlen}-{cal}.log",
    params:
        settings=PASS("elias_plus_predict"),
        hash=H("elias_plus_predict"),
        cal=lambda w, input: ["--calibration", input.calibration[0]] if input.calibration else [],
    threads: 1
    resources:
        mem_mb=res("elias_plus_predict", "mem_mb", 8000),
        runtime=res("elias_plus_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus predict --model {input.model:q} {params.cal:q} --tfidf {input.X:q} "
        "--emb {input.emb:q} --candidates {input.cand:q} --out {output.predictions:q} --method elias " + STAGE_ARGS


def elias_variant(w):
    return None if w.variant == "main" else w.variant


rule elias_ensemble:
    """Ensemble of ELIAS++ models over different initial clusterings (the paper's 3x): each seed alone or the
    combination, the best on the validation split (each seed's ELIAS++ scored there out of fold by its
    calibrate stage; xmc_steps.stages.ensemble)."""
    input:
        members=lambda w: [ES.elias_dir(RES, w.dataset, S(w), seed) + "/plus/predictions_test_calibrated.parquet"
                           for seed in ES.elias_seeds(S(w), elias_variant(w))],
        valid=lambda w: [ES.elias_dir(RES, w.dataset, S(w), seed) + "/plus/pred_valid.parquet"
                         for seed in ES.elias_seeds(S(w), elias_variant(w))],
        Y=R(lay.INGEST) + "/Y_valid.npz",
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        predictions=R(ES.ELIAS_ENSEMBLE) + "/" + lay.PREDICTIONS,
        choice=R(ES.ELIAS_ENSEMBLE) + "/ensemble.json",
        record=R(ES.ELIAS_ENSEMBLE) + "/" + lay.RECORD,
    log:
        "logs/elias_ensemble/{dataset}-{variant}.log",
    params:
        settings=PASS("elias_ensemble"),
        hash=H("elias_ensemble"),
        names=lambda w: [f"seed {seed}" for seed in ES.elias_seeds(S(w), elias_variant(w))],
    threads: 1
    resources:
        mem_mb=res("elias_ensemble", "mem_mb", 8000),
        runtime=res("elias_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.ensemble --predictions {input.members:q} --names {params.names:q} "
        "--valid-predictions {input.valid:q} --valid-labels {input.Y:q} --choice-out {output.choice:q} "
        "--label-table {input.labels:q} --out {output.predictions:q} --method elias " + STAGE_ARGS
