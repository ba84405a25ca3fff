# GUDN: the LightXML network trained with the guide network on each text's label texts, then its
# test predictions (LightXML's predict: the guide is training-only).  One model folder per
# guide setting:  results/{dataset}/gudn/{tree}/{enc}-{maxlen}/{guides}/ (layout.GUDN)
import re

from xmc_steps.gudn import spec as GDS  # noqa: E402  (its layout)


# this method's path segment: a guide setting (the keys of gudn.spec.GUIDES)
wildcard_constraints:
    guides="|".join(re.escape(g) for g in GDS.GUIDES),


def GUIDE(key):
    """The wildcards' guide setting's value of ``key`` (the folder names a row of gudn.spec.GUIDES), else the section's."""
    return lambda w: GDS.GUIDES[w.guides].get(key, S(w)["gudn"][key])


def label_texts_file(w):
    """The label text file the dataset would have (named in GUDN's error when it has none)."""
    s = S(w)
    if data_name(w) == "debtags" and not s.get("path"):
        return f"{DATA}/debtags/label_texts.txt"
    try:
        files = xds.locate(data_name(w), DATA, s.get("path"), s.get("layout"))
    except xds.StageError:
        fetched = xds.fetch_folder(data_name(w), DATA)
        return f"{fetched}/{xds.XMC_BASE_LABEL_TEXTS}" if fetched else f"{DATA}/{data_name(w)}/label_texts.txt"
    return str(files.label_texts or f"{files.folder}/label_texts.txt")


rule gudn_train:
    """GUDN training (Eqs. 2-6): the backbone's classification loss plus the feature and link guides."""
    input:
        tokens=lambda w: [f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_{s}.npz" for s in ("train", "valid")],
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        labels=R(lay.INGEST) + "/" + lay.LABELS,
        ingest=R(lay.INGEST) + "/" + lay.RECORD,
        tree=R(lay.INDEX, emb="pifa-tfidf") + "/{tree}.npz",
    output:
        model=R(GDS.GUDN) + "/" + lay.WEIGHTS,
        meta=R(GDS.GUDN) + "/lightxml.json",
        curve=R(GDS.GUDN) + "/" + lay.CURVE,
        record=R(GDS.GUDN) + "/" + lay.RECORD,
    log:
        "logs/gudn_train/{dataset}-{tree}-{enc}-{maxlen}-{guides}.log",
    params:
        launch=launch(lambda w: S(w)["gudn"]["backbone"]),
        settings=PASS("gudn_train", feature_guide=GUIDE("feature_guide"), link_guide=GUIDE("link_guide"),
                      **{"backbone.encoder": ENC, "backbone.max_length": MAXLEN}),
        hash=H("gudn_train"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        label_texts=label_texts_file,
        out=R(GDS.GUDN),
    threads: threads_of
    resources:
        mem_mb=res("gudn_train", "mem_mb", 16000),
        runtime=res("gudn_train", "runtime", 1440),
        gpu=gpus(lambda w: S(w)["gudn"]["backbone"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.gudn train --tokens-dir {params.tokens_dir:q} --labels-train {input.Y[0]:q} "
        "--labels-valid {input.Y[1]:q} --label-table {input.labels:q} --ingest-record {input.ingest:q} "
        "--label-texts-file {params.label_texts:q} --tree {input.tree:q} --out {params.out:q} "
        "--method gudn --threads {threads} " + STAGE_ARGS


rule gudn_predict:
    """Top-k GUDN predictions of the test split, from the text alone."""
    input:
        model=rules.gudn_train.output.model,
        tokens=lambda w: f"{lay.tokens_dir(RES, w.dataset, w.enc, w.maxlen)}/tokens_test.npz",
    output:
        predictions=R(GDS.GUDN) + "/" + lay.PREDICTIONS,
        record=R(GDS.GUDN) + "/" + lay.record("predict"),
    log:
        "logs/gudn_predict/{dataset}-{tree}-{enc}-{maxlen}-{guides}.log",
    params:
        settings=PASS("gudn_predict", encoder=ENC, max_length=MAXLEN),
        hash=H("gudn_predict"),
        model=folder_of("input", "model"),
        launch=launch(lambda w: S(w)["gudn"]["backbone"]),
    threads: threads_of
    resources:
        mem_mb=res("gudn_predict", "mem_mb", 16000),
        runtime=res("gudn_predict", "runtime", 240),
        gpu=gpus(lambda w: S(w)["gudn"]["backbone"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.lightxml predict --model {params.model:q} --tokens {input.tokens:q} "
        "--out {output.predictions:q} --method gudn --threads {threads} " + STAGE_ARGS
