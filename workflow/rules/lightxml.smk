# LightXML: one model (encoder + generator + discriminator) trained end to end, its test
# predictions, and the ensemble of several.  One model folder per clustering (and training) seed,
# encoder and negative sampling:
#   results/{dataset}/lightxml/tree-b2-l{leaf}-s{seed}/{enc}-{maxlen}/{sampling}/ (layout.LIGHTXML)


def lightxml_params(w):
    lx = dict(S(w)["lightxml"])
    for k in ("cluster", "ensemble"):   # the clusters come in as the tree file; members are their own jobs
        lx.pop(k)
    seed = int(w.tree.rsplit("-s", 1)[1])   # a member's clustering seed is its training seed
    return json.dumps({**lx, "encoder": ENC(w), "max_length": int(w.maxlen), "negatives": w.sampling,
                       "train": {**lx["train"], "seed": seed}}, sort_keys=True)


rule lightxml_train:
    """LightXML training (Eqs. 1-6): generator, discriminator and encoder together, dynamic negatives."""
    input:
        tokens=lambda w: [f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{s}.npz" for s in ("train", "valid")],
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        tree=R(lay.INDEX, emb="pifa-tfidf") + "/{tree}.npz",
    output:
        model=R(lay.LIGHTXML) + "/model.safetensors",
        meta=R(lay.LIGHTXML) + "/lightxml.json",
        curve=R(lay.LIGHTXML) + "/curve.png",
        record=R(lay.LIGHTXML) + "/record.json",
    log:
        "logs/lightxml_train/{dataset}-{tree}-{enc}-{maxlen}-{sampling}.log",
    params:
        settings=lightxml_params,
        hash=H("lightxml_train"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        out=R(lay.LIGHTXML),
    threads: threads_of
    resources:
        mem_mb=res("lightxml_train", "mem_mb", 16000),
        runtime=res("lightxml_train", "runtime", 1440),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY} -m xmc_steps.lightxml train --tokens-dir {params.tokens_dir} --labels-train {input.Y[0]} "
        "--labels-valid {input.Y[1]} --tree {input.tree} --out {params.out} "
        "--method lightxml --threads {threads} " + STAGE_ARGS


rule lightxml_predict:
    """Top-k LightXML predictions of the test split."""
    input:
        model=rules.lightxml_train.output.model,
        tokens=lambda w: f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_test.npz",
    output:
        predictions=R(lay.LIGHTXML) + "/predictions_test.parquet",
        record=R(lay.LIGHTXML) + "/predict.record.json",
    log:
        "logs/lightxml_predict/{dataset}-{tree}-{enc}-{maxlen}-{sampling}.log",
    params:
        settings=lambda w: json.dumps({"topk": S(w)["evaluate"]["topk"], "device": S(w)["lightxml"]["device"],
                                       "allow_cpu_fallback": S(w)["lightxml"]["allow_cpu_fallback"],
                                       "amp": S(w)["lightxml"]["amp"]}),
        hash=H("lightxml_predict"),
        model=R(lay.LIGHTXML),
    threads: threads_of
    resources:
        mem_mb=res("lightxml_predict", "mem_mb", 16000),
        runtime=res("lightxml_predict", "runtime", 240),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY} -m xmc_steps.lightxml predict --model {params.model} --tokens {input.tokens} "
        "--out {output.predictions} --method lightxml --threads {threads} " + STAGE_ARGS


rule lightxml_ensemble:
    """Ensemble of LightXML models (the paper: three encoders on small label sets, three clusterings on large)."""
    input:
        members=lambda w: [m.dir(RES, w.dataset) + "/predictions_test.parquet"
                           for m in lay.lightxml_members(S(w), w.variant)],
        labels=R(lay.INGEST) + "/labels.parquet",
    output:
        predictions=R(lay.LIGHTXML_ENSEMBLE) + "/predictions_test.parquet",
        record=R(lay.LIGHTXML_ENSEMBLE) + "/record.json",
    log:
        "logs/lightxml_ensemble/{dataset}-{variant}.log",
    params:
        settings=lambda w: json.dumps({"method": S(w)["lightxml"]["ensemble"]["method"],
                                       "topk": S(w)["evaluate"]["topk"]}),
        hash=H("lightxml_ensemble"),
    threads: 1
    resources:
        mem_mb=res("lightxml_ensemble", "mem_mb", 8000),
        runtime=res("lightxml_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.ensemble --predictions {input.members} --label-table {input.labels} "
        "--out {output.predictions} --method lightxml " + STAGE_ARGS
