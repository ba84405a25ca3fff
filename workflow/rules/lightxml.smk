# LightXML: one model (encoder + generator + discriminator) trained end to end, its test
# predictions, and the ensemble of several.  One model folder per clustering (and training) seed,
# encoder and negative sampling:
#   results/{dataset}/lightxml/tree-b2-l{leaf}-s{seed}/{enc}-{maxlen}/{sampling}/ (layout.LIGHTXML)
from xmc_steps.lightxml import spec as LXS  # noqa: E402  (its layout)


# this method's path segment: the negative sampling (its Literal type, xmc_steps.params)
wildcard_constraints:
    sampling=xparams.regex(xparams.Sampling),


def lightxml_seed(w):
    """The training seed of the wildcards' member: its clustering seed."""
    return LXS.member_of(S(w), w.tree, w.enc, w.maxlen, w.sampling).seed


rule lightxml_train:
    """LightXML training (Eqs. 1-6): generator, discriminator and encoder together, dynamic negatives."""
    input:
        tokens=lambda w: [f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{s}.npz" for s in ("train", "valid")],
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        tree=R(lay.INDEX, emb="pifa-tfidf") + "/{tree}.npz",
    output:
        model=R(LXS.LIGHTXML) + "/" + lay.WEIGHTS,
        meta=R(LXS.LIGHTXML) + "/lightxml.json",
        curve=R(LXS.LIGHTXML) + "/" + lay.CURVE,
        record=R(LXS.LIGHTXML) + "/" + lay.RECORD,
    log:
        "logs/lightxml_train/{dataset}-{tree}-{enc}-{maxlen}-{sampling}.log",
    params:
        launch=launch(lambda w: S(w)["lightxml"]),
        settings=PASS("lightxml_train", encoder=ENC, max_length=MAXLEN, negatives=lambda w: w.sampling,
                      **{"train.seed": lightxml_seed}),
        hash=H("lightxml_train"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        out=R(LXS.LIGHTXML),
    threads: threads_of
    resources:
        mem_mb=res("lightxml_train", "mem_mb", 16000),
        runtime=res("lightxml_train", "runtime", 1440),
        gpu=gpus(lambda w: S(w)["lightxml"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.lightxml train --tokens-dir {params.tokens_dir:q} --labels-train {input.Y[0]:q} "
        "--labels-valid {input.Y[1]:q} --tree {input.tree:q} --out {params.out:q} "
        "--method lightxml --threads {threads} " + STAGE_ARGS


rule lightxml_predict:
    """Top-k LightXML predictions of the test split."""
    input:
        model=rules.lightxml_train.output.model,
        tokens=lambda w: f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_test.npz",
    output:
        predictions=R(LXS.LIGHTXML) + "/" + lay.PREDICTIONS,
        record=R(LXS.LIGHTXML) + "/" + lay.record("predict"),
    log:
        "logs/lightxml_predict/{dataset}-{tree}-{enc}-{maxlen}-{sampling}.log",
    params:
        settings=PASS("lightxml_predict", encoder=ENC, max_length=MAXLEN),
        hash=H("lightxml_predict"),
        model=folder_of("input", "model"),
        launch=launch(lambda w: S(w)["lightxml"]),
    threads: threads_of
    resources:
        mem_mb=res("lightxml_predict", "mem_mb", 16000),
        runtime=res("lightxml_predict", "runtime", 240),
        gpu=gpus(lambda w: S(w)["lightxml"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.lightxml predict --model {params.model:q} --tokens {input.tokens:q} "
        "--out {output.predictions:q} --method lightxml --threads {threads} " + STAGE_ARGS


rule lightxml_valid_predict:
    """Top-k LightXML predictions of the validation split (the model trains on train alone, unless
    ``train.fit_valid``): what lightxml-ensemble chooses its combination on."""
    input:
        model=rules.lightxml_train.output.model,
        tokens=lambda w: f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_valid.npz",
    output:
        predictions=R(LXS.LIGHTXML) + "/pred_valid.parquet",
        record=R(LXS.LIGHTXML) + "/" + lay.record("pred_valid"),
    log:
        "logs/lightxml_valid_predict/{dataset}-{tree}-{enc}-{maxlen}-{sampling}.log",
    params:
        settings=PASS("lightxml_valid_predict", encoder=ENC, max_length=MAXLEN),
        hash=H("lightxml_valid_predict"),
        model=folder_of("input", "model"),
        launch=launch(lambda w: S(w)["lightxml"]),
    threads: threads_of
    resources:
        mem_mb=res("lightxml_valid_predict", "mem_mb", 16000),
        runtime=res("lightxml_valid_predict", "runtime", 240),
        gpu=gpus(lambda w: S(w)["lightxml"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.lightxml predict --model {params.model:q} --tokens {input.tokens:q} "
        "--out {output.predictions:q} --method lightxml --threads {threads} " + STAGE_ARGS


rule lightxml_ensemble:
    """Ensemble of LightXML models (the paper: three encoders on small label sets, three clusterings on large):
    each member alone or the combination, the best on the validation split (xmc_steps.stages.ensemble), where
    the members did not train on it (``train.fit_valid``: the paper's combination, not measured)."""
    input:
        members=lambda w: [m.dir(RES, w.dataset) + "/" + lay.PREDICTIONS
                           for m in LXS.lightxml_members(S(w), w.variant)],
        valid=lambda w: LXS.valid_predictions(RES, w.dataset, S(w), w.variant),
        Y=R(lay.INGEST) + "/Y_valid.npz",
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        predictions=R(LXS.LIGHTXML_ENSEMBLE) + "/" + lay.PREDICTIONS,
        choice=R(LXS.LIGHTXML_ENSEMBLE) + "/ensemble.json",
        record=R(LXS.LIGHTXML_ENSEMBLE) + "/" + lay.RECORD,
    log:
        "logs/lightxml_ensemble/{dataset}-{variant}.log",
    params:
        settings=PASS("lightxml_ensemble", ensemble=lambda w: S(w)["lightxml"]["ensemble"]["method"]),
        hash=H("lightxml_ensemble"),
        names=lambda w: [m.name for m in LXS.lightxml_members(S(w), w.variant)],
        valid=lambda w, input: (["--valid-predictions", *input.valid, "--valid-labels", input.Y] if input.valid else
                                ["--unmeasured", "the members train on the validation split (lightxml.train.fit_valid)"]),
    threads: 1
    resources:
        mem_mb=res("lightxml_ensemble", "mem_mb", 8000),
        runtime=res("lightxml_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.ensemble --predictions {input.members:q} --names {params.names:q} {params.valid:q} "
        "--choice-out {output.choice:q} --label-table {input.labels:q} --out {output.predictions:q} --method lightxml "
        + STAGE_ARGS
