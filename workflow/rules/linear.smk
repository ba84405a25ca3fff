# Linear rankers: XR-Linear (tree of one-vs-all rankers, TFN/MAN negatives, beam search)
# and the Parabel baseline (omikuji), both on the shared TF-IDF features.
from xmc_steps.xr_linear import spec as XRS  # noqa: E402  (its layout)
from xmc_steps.parabel import spec as PBS  # noqa: E402  (its layout)


def fit_files(kind, section):
    """The feature (``X``) or label (``Y``) files of the splits a method fits on."""

    def f(wildcards):
        folder = R(lay.TFIDF if kind == "X" else lay.INGEST, wildcards)
        return [f"{folder}/{kind}_{s}.npz" for s in S(wildcards)[section]["fit_on"]]

    return f


rule xr_linear_train:
    """Level-wise one-vs-all rankers over the cluster tree (X-Transformer §3.4)."""
    input:
        X=fit_files("X", "xr_linear"),
        Y=fit_files("Y", "xr_linear"),
        tree=lambda w: lay.tree_path(RES, w.dataset, "pifa-tfidf", S(w)["cluster"]),
    output:
        model=directory(R(XRS.XR_LINEAR) + "/model"),
        record=R(XRS.XR_LINEAR) + "/" + lay.record("train"),
    log:
        "logs/xr_linear_train/{dataset}.log",
    params:
        settings=PASS("xr_linear_train"),
        hash=H("xr_linear_train"),
    threads: threads_of
    resources:
        mem_mb=res("xr_linear_train", "mem_mb", 8000),
        runtime=res("xr_linear_train", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xr_linear train --features {input.X:q} --labels {input.Y:q} --tree {input.tree:q} "
        "--out {output.model:q} --method xr-linear --threads {threads} " + STAGE_ARGS


rule xr_linear_predict:
    """Beam search down the tree; top-k labels per test document."""
    input:
        model=rules.xr_linear_train.output.model,
        X=R(lay.TFIDF) + "/X_test.npz",
    output:
        predictions=R(XRS.XR_LINEAR) + "/" + lay.PREDICTIONS,
        record=R(XRS.XR_LINEAR) + "/" + lay.record("predict"),
    log:
        "logs/xr_linear_predict/{dataset}.log",
    params:
        settings=PASS("xr_linear_predict"),
        hash=H("xr_linear_predict"),
    threads: threads_of
    resources:
        mem_mb=res("xr_linear_predict", "mem_mb", 8000),
        runtime=res("xr_linear_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xr_linear predict --model {input.model:q} --features {input.X:q} --out {output.predictions:q} "
        "--method xr-linear " + STAGE_ARGS


rule parabel_train:
    """omikuji with its Parabel settings (3 trees, balanced 2-means, hinge rankers)."""
    input:
        X=fit_files("X", "parabel"),
        Y=fit_files("Y", "parabel"),
    output:
        model=directory(R(PBS.PARABEL) + "/model"),
        record=R(PBS.PARABEL) + "/" + lay.record("train"),
    log:
        "logs/parabel_train/{dataset}.log",
    params:
        settings=PASS("parabel_train"),
        hash=H("parabel_train"),
    threads: threads_of
    resources:
        mem_mb=res("parabel_train", "mem_mb", 8000),
        runtime=res("parabel_train", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.parabel train --features {input.X:q} --labels {input.Y:q} --out {output.model:q} "
        "--method parabel --threads {threads} " + STAGE_ARGS


rule parabel_predict:
    """omikuji beam search; top-k labels per test document."""
    input:
        model=rules.parabel_train.output.model,
        X=R(lay.TFIDF) + "/X_test.npz",
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        predictions=R(PBS.PARABEL) + "/" + lay.PREDICTIONS,
        record=R(PBS.PARABEL) + "/" + lay.record("predict"),
    log:
        "logs/parabel_predict/{dataset}.log",
    params:
        settings=PASS("parabel_predict"),
        hash=H("parabel_predict"),
    threads: threads_of
    resources:
        mem_mb=res("parabel_predict", "mem_mb", 8000),
        runtime=res("parabel_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.parabel predict --model {input.model:q} --features {input.X:q} --label-table {input.labels:q} "
        "--out {output.predictions:q} --method parabel --threads {threads} " + STAGE_ARGS
