# Dual encoder (NGAME, DEXML): one encoder for the texts and the label texts, trained with DEXML's
# decoupled softmax over each batch's labels and mined negatives, batches of close texts (NGAME);
# predictions are the nearest labels (faiss, xmc_steps.ann).  One model folder per encoder and length:
#   results/{dataset}/dual-encoder/{enc}-{maxlen}/ (xmc_steps/dual_encoder/spec.py)
# Variants: dual-encoder-ranker (NGAME's per-label classifiers over the shortlist: the ELIAS++ sparse ranker
# stage on TF-IDF + the embedding, then NGAME's score fusion chosen on validation) and dual-encoder-ensemble
# (with xr-linear, its weight chosen on validation).
from xmc_steps.dual_encoder import spec as DES  # noqa: E402  (its layout)
from xmc_steps.xtransformer import spec as XTS  # noqa: E402  (the guard's linear tree)


def dual_encoder_linear(w):
    """The guard's linear tree: XR-Linear over the shared PIFA-TF-IDF tree, fit on the train split."""
    return DES.linear_tree(RES, w.dataset, S(w)) + "/model"


rule dual_encoder_train:
    """Texts and label texts through one encoder (DEXML's loss, NGAME's batches, labels re-encoded for mining)."""
    input:
        tokens=lambda w: [f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{s}.npz" for s in ("train", "valid")],
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        labels=R(lay.INGEST) + "/" + lay.LABELS,
        linear=dual_encoder_linear,
        X=R(lay.TFIDF) + "/X_valid.npz",
    output:
        model=R(DES.DUAL_ENCODER) + "/" + lay.WEIGHTS,
        meta=R(DES.DUAL_ENCODER) + "/dual_encoder.json",
        label_emb=R(DES.DUAL_ENCODER) + "/" + lay.LABEL_EMB,
        index=R(DES.DUAL_ENCODER) + "/label_index.faiss",
        guard=R(DES.DUAL_ENCODER) + "/" + lay.GUARD,
        curve=report(R(DES.DUAL_ENCODER) + "/" + lay.CURVE, category="{dataset}", subcategory="dual-encoder",
                     labels={"dataset": "{dataset}", "method": "dual-encoder", "file": "validation curve"}),
        record=R(DES.DUAL_ENCODER) + "/" + lay.RECORD,
    log:
        "logs/dual_encoder_train/{dataset}-{enc}-{maxlen}.log",
    params:
        launch=launch(lambda w: S(w)["dual_encoder"]),
        settings=PASS("dual_encoder_train", encoder=ENC, max_length=MAXLEN),
        hash=H("dual_encoder_train"),
        tokens_dir=lambda w: lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen),
        out=R(DES.DUAL_ENCODER),
    threads: threads_of
    resources:
        mem_mb=res("dual_encoder_train", "mem_mb", 16000),
        runtime=res("dual_encoder_train", "runtime", 720),
        gpu=gpus(lambda w: S(w)["dual_encoder"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        # one malloc arena: the batches' changing shapes fragment the default arenas (debtags: 7.5 GB peak, ~2 GB with one)
        "MALLOC_ARENA_MAX=1 {params.launch} -m xmc_steps.stages.dual_encoder train --tokens-dir {params.tokens_dir:q} --labels-train {input.Y[0]:q} "
        "--labels-valid {input.Y[1]:q} --label-table {input.labels:q} --linear-model {input.linear:q} "
        "--tfidf-valid {input.X:q} --out {params.out:q} --method dual-encoder --threads {threads} " + STAGE_ARGS


rule dual_encoder_predict:
    """The nearest labels of every text of a split, its shortlist and its embeddings (the ranker reads them)."""
    input:
        model=rules.dual_encoder_train.output.model,
        tokens=lambda w: f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{w.split}.npz",
    output:
        predictions=R(DES.DUAL_ENCODER) + "/pred_{split}.parquet",
        emb=R(DES.DUAL_ENCODER) + "/emb_{split}.npz",
        record=R(DES.DUAL_ENCODER) + "/" + lay.record("pred_{split}"),
    wildcard_constraints:
        split="train|valid|test",
    log:
        "logs/dual_encoder_predict/{dataset}-{enc}-{maxlen}-{split}.log",
    params:
        settings=PASS("dual_encoder_predict", encoder=ENC, max_length=MAXLEN),
        hash=H("dual_encoder_predict"),
        model=folder_of("input", "model"),
        phase=lambda w: "predict" if w.split == "test" else "train",  # train/valid predictions feed the ranker
        launch=launch(lambda w: S(w)["dual_encoder"]),
    threads: threads_of
    resources:
        mem_mb=res("dual_encoder_predict", "mem_mb", 16000),
        runtime=res("dual_encoder_predict", "runtime", 240),
        gpu=gpus(lambda w: S(w)["dual_encoder"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.dual_encoder predict --model {params.model:q} --tokens {input.tokens:q} "
        "--out {output.predictions:q} --emb-out {output.emb:q} --phase {params.phase:q} --method dual-encoder "
        "--threads {threads} " + STAGE_ARGS


rule dual_encoder_ranker:
    """NGAME's second module: a classifier per label on [embedding ⊕ TF-IDF] over the dual encoder's shortlist."""
    input:
        X=R(lay.TFIDF) + "/X_train.npz",
        Y=R(lay.INGEST) + "/Y_train.npz",
        emb=R(DES.DUAL_ENCODER) + "/emb_train.npz",
        cand=R(DES.DUAL_ENCODER) + "/pred_train.parquet",
    output:
        model=directory(R(DES.DUAL_ENCODER_RANKER) + "/model"),
        record=R(DES.DUAL_ENCODER_RANKER) + "/" + lay.record("train"),
    log:
        "logs/dual_encoder_ranker/{dataset}-{enc}-{maxlen}.log",
    params:
        settings=PASS("dual_encoder_ranker"),
        hash=H("dual_encoder_ranker"),
    threads: threads_of
    resources:
        mem_mb=res("dual_encoder_ranker", "mem_mb", 16000),
        runtime=res("dual_encoder_ranker", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus train --tfidf {input.X:q} --emb {input.emb:q} --labels {input.Y:q} "
        "--candidates {input.cand:q} --out {output.model:q} --method dual-encoder --threads {threads} " + STAGE_ARGS


rule dual_encoder_ranker_fuse:
    """NGAME's score fusion, fitted and chosen on the validation split: the classifiers' scores, the shortlist's
    and each label's frequency through a tree, beta and depth chosen there, beside the shortlist alone, the
    product and the classifiers alone (xmc_steps.elias_plus.select)."""
    input:
        model=rules.dual_encoder_ranker.output.model,
        X=R(lay.TFIDF) + "/X_valid.npz",
        Y=R(lay.INGEST) + "/Y_valid.npz",
        emb=R(DES.DUAL_ENCODER) + "/emb_valid.npz",
        cand=R(DES.DUAL_ENCODER) + "/pred_valid.parquet",
    output:
        model=directory(R(DES.DUAL_ENCODER_RANKER) + "/fusion"),
        record=R(DES.DUAL_ENCODER_RANKER) + "/" + lay.record("fusion"),
    log:
        "logs/dual_encoder_ranker_fuse/{dataset}-{enc}-{maxlen}.log",
    params:
        settings=PASS("dual_encoder_ranker_fuse"),
        hash=H("dual_encoder_ranker_fuse"),
    threads: 1
    resources:
        mem_mb=res("dual_encoder_ranker_fuse", "mem_mb", 8000),
        runtime=res("dual_encoder_ranker_fuse", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus calibrate --model {input.model:q} --tfidf {input.X:q} --emb {input.emb:q} "
        "--labels {input.Y:q} --candidates {input.cand:q} --out {output.model:q} --method dual-encoder " + STAGE_ARGS


rule dual_encoder_ranker_predict:
    """The test documents' shortlist re-ranked by the combination the validation split chose."""
    input:
        model=rules.dual_encoder_ranker.output.model,
        fusion=rules.dual_encoder_ranker_fuse.output.model,
        X=R(lay.TFIDF) + "/X_test.npz",
        emb=R(DES.DUAL_ENCODER) + "/emb_test.npz",
        cand=R(DES.DUAL_ENCODER) + "/pred_test.parquet",
    output:
        predictions=R(DES.DUAL_ENCODER_RANKER) + "/" + lay.PREDICTIONS,
        record=R(DES.DUAL_ENCODER_RANKER) + "/" + lay.record("predict"),
    log:
        "logs/dual_encoder_ranker_predict/{dataset}-{enc}-{maxlen}.log",
    params:
        settings=PASS("dual_encoder_ranker_predict"),
        hash=H("dual_encoder_ranker_predict"),
    threads: 1
    resources:
        mem_mb=res("dual_encoder_ranker_predict", "mem_mb", 8000),
        runtime=res("dual_encoder_ranker_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus predict --model {input.model:q} --calibration {input.fusion:q} "
        "--tfidf {input.X:q} --emb {input.emb:q} --candidates {input.cand:q} --out {output.predictions:q} "
        "--method dual-encoder " + STAGE_ARGS


rule linear_tree_valid_predict:
    """XR-Linear fit on the train split (the guard's linear tree: xr-linear's settings and tree) on the
    validation split: xr-linear's stand-in where an ensemble chooses on validation (xr-linear itself fits on
    train + valid, so its own validation predictions have seen their labels)."""
    input:
        model=R(XTS.XT_LINEAR) + "/model",
        X=R(lay.TFIDF) + "/X_valid.npz",
    output:
        predictions=R(XTS.XT_LINEAR) + "/pred_valid.parquet",
        record=R(XTS.XT_LINEAR) + "/" + lay.record("pred_valid"),
    wildcard_constraints:
        fit="train",
    log:
        "logs/linear_tree_valid_predict/{dataset}-{emb}-{tree}-{fit}.log",
    params:
        settings=PASS("linear_tree_valid_predict"),
        hash=H("linear_tree_valid_predict"),
    threads: threads_of
    resources:
        mem_mb=res("linear_tree_valid_predict", "mem_mb", 8000),
        runtime=res("linear_tree_valid_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xr_linear predict --model {input.model:q} --features {input.X:q} "
        "--out {output.predictions:q} --method xr-linear " + STAGE_ARGS


rule dual_encoder_ensemble:
    """The dual encoder's test predictions with xr-linear's: each alone or averaged (weights 0.25-0.75), the
    best on the validation split (xr-linear there: its fit on the train split)."""
    input:
        members=lambda w: [DES.predictions(RES, w.dataset, S(w), None),
                           lay.at(RES, XRS.XR_LINEAR, dataset=w.dataset) + "/" + lay.PREDICTIONS],
        valid=lambda w: [DES.model_dir(RES, w.dataset, S(w)) + "/pred_valid.parquet",
                         DES.linear_tree(RES, w.dataset, S(w)) + "/pred_valid.parquet"],
        Y=R(lay.INGEST) + "/Y_valid.npz",
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        predictions=R(DES.DUAL_ENCODER_ENSEMBLE) + "/" + lay.PREDICTIONS,
        choice=R(DES.DUAL_ENCODER_ENSEMBLE) + "/ensemble.json",
        record=R(DES.DUAL_ENCODER_ENSEMBLE) + "/" + lay.RECORD,
    log:
        "logs/dual_encoder_ensemble/{dataset}-{variant}.log",
    params:
        settings=PASS("dual_encoder_ensemble"),
        hash=H("dual_encoder_ensemble"),
    threads: 1
    resources:
        mem_mb=res("dual_encoder_ensemble", "mem_mb", 8000),
        runtime=res("dual_encoder_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.ensemble --predictions {input.members:q} --names dual-encoder xr-linear "
        "--valid-predictions {input.valid:q} --valid-labels {input.Y:q} --choice-out {output.choice:q} "
        "--label-table {input.labels:q} --out {output.predictions:q} --method dual-encoder " + STAGE_ARGS
