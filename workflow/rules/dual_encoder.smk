# Dual encoder (NGAME, DEXML): one encoder for the texts and the label texts, trained with DEXML's
# decoupled softmax over each batch's labels and mined negatives, batches of close texts (NGAME);
# predictions are the nearest labels (faiss, xmc_steps.ann).  One model folder per encoder and length:
#   results/{dataset}/dual-encoder/{enc}-{maxlen}/ (xmc_steps/dual_encoder/spec.py)
# Variants: dual-encoder-ranker (NGAME's per-label classifiers over the shortlist: the ELIAS++ sparse ranker
# stage on TF-IDF + the embedding) and dual-encoder-ensemble (averaged with xr-linear).
from xmc_steps.dual_encoder import spec as DES  # noqa: E402  (its layout)
from xmc_steps.xtransformer import spec as XTS  # noqa: E402  (the guard's linear tree)


def dual_encoder_params(w):
    de = {k: v for k, v in S(w)["dual_encoder"].items() if k not in ("ranker", "ensemble", "encoder", "max_length")}
    return json.dumps({**de, "encoder": ENC(w), "max_length": int(w.maxlen)}, sort_keys=True)


def dual_encoder_linear(w):
    """The guard's linear tree: XR-Linear over the shared PIFA-TF-IDF tree, fit on the train split."""
    return lay.at(RES, XTS.XT_LINEAR, dataset=w.dataset, emb="pifa-tfidf", tree=lay.tree_name(S(w)["cluster"]),
                  fit="train") + "/model"


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
        settings=dual_encoder_params,
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
        settings=lambda w: json.dumps({"topk": S(w)["evaluate"]["topk"], **{k: S(w)["dual_encoder"][k] for k in (
            "search", "exact_max_labels", "eval_batch_size", "amp", "device", "allow_cpu_fallback")}}),
        hash=H("dual_encoder_predict"),
        model=folder_of("input", "model"),
        phase=lambda w: "predict" if w.split == "test" else "train",  # train/valid predictions feed the ranker
    threads: threads_of
    resources:
        mem_mb=res("dual_encoder_predict", "mem_mb", 16000),
        runtime=res("dual_encoder_predict", "runtime", 240),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.dual_encoder predict --model {params.model:q} --tokens {input.tokens:q} "
        "--out {output.predictions:q} --emb-out {output.emb:q} --phase {params.phase:q} --method dual-encoder "
        "--threads {threads} " + STAGE_ARGS


def dual_encoder_ranker_params(w):
    s = S(w)
    return json.dumps(dict(s["dual_encoder"]["ranker"], topk=s["evaluate"]["topk"]), sort_keys=True)


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
        settings=dual_encoder_ranker_params,
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


rule dual_encoder_ranker_predict:
    """The classifiers' scores over the dual encoder's shortlist of each test document (uncalibrated)."""
    input:
        model=rules.dual_encoder_ranker.output.model,
        X=R(lay.TFIDF) + "/X_test.npz",
        emb=R(DES.DUAL_ENCODER) + "/emb_test.npz",
        cand=R(DES.DUAL_ENCODER) + "/pred_test.parquet",
    output:
        predictions=R(DES.DUAL_ENCODER_RANKER) + "/" + lay.PREDICTIONS,
        record=R(DES.DUAL_ENCODER_RANKER) + "/" + lay.record("predict"),
    log:
        "logs/dual_encoder_ranker_predict/{dataset}-{enc}-{maxlen}.log",
    params:
        settings=lambda w: json.dumps({"topk": S(w)["evaluate"]["topk"],
                                       "uncalibrated": S(w)["dual_encoder"]["ranker"]["uncalibrated"]}),
        hash=H("dual_encoder_ranker_predict"),
    threads: 1
    resources:
        mem_mb=res("dual_encoder_ranker_predict", "mem_mb", 8000),
        runtime=res("dual_encoder_ranker_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.elias_plus predict --model {input.model:q} --tfidf {input.X:q} --emb {input.emb:q} "
        "--candidates {input.cand:q} --out {output.predictions:q} --method dual-encoder " + STAGE_ARGS


rule dual_encoder_ensemble:
    """The dual encoder's test predictions averaged with xr-linear's (the papers' ensembles with a linear model)."""
    input:
        members=lambda w: [DES.predictions(RES, w.dataset, S(w), None),
                           lay.at(RES, XRS.XR_LINEAR, dataset=w.dataset) + "/" + lay.PREDICTIONS],
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        predictions=R(DES.DUAL_ENCODER_ENSEMBLE) + "/" + lay.PREDICTIONS,
        record=R(DES.DUAL_ENCODER_ENSEMBLE) + "/" + lay.RECORD,
    log:
        "logs/dual_encoder_ensemble/{dataset}-{variant}.log",
    params:
        settings=lambda w: json.dumps({"method": S(w)["dual_encoder"]["ensemble"], "topk": S(w)["evaluate"]["topk"]}),
        hash=H("dual_encoder_ensemble"),
    threads: 1
    resources:
        mem_mb=res("dual_encoder_ensemble", "mem_mb", 8000),
        runtime=res("dual_encoder_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.ensemble --predictions {input.members:q} --label-table {input.labels:q} "
        "--out {output.predictions:q} --method dual-encoder " + STAGE_ARGS
