# Trained targets asked about new text (xmc_steps.stages.predict): suggestions for a dataset's unlabelled texts.


rule debtags_untagged:
    """The Debian packages without Debtags (about as many as the tagged ones), in the dataset's text recipe."""
    input:
        ids=[f"{DATA}/debtags/train_ids.txt", f"{DATA}/debtags/test_ids.txt"],
    output:
        texts=R(lay.UNTAGGED, dataset="debtags") + "/texts.txt",
        ids=R(lay.UNTAGGED, dataset="debtags") + "/ids.txt",
    log:
        "logs/debtags_untagged/debtags.log",
    params:
        out=folder_of("output", "texts"),
        workdir=R(lay.PREPARE, dataset="debtags") + "/apt",
    threads: 1
    resources:
        mem_mb=res("debtags_untagged", "mem_mb", 2000),
        runtime=res("debtags_untagged", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.prepare_debtags --untagged {params.out:q} --work-dir {params.workdir:q} "
        "--exclude-ids {input.ids:q} --log {log:q} --dataset debtags --rule {rule}"


def unlabelled_texts(w):
    """debtags: its untagged packages; any other dataset: data/<dataset>/unlabelled_texts.txt (one per line)."""
    if w.dataset == "debtags":
        return {"texts": R(lay.UNTAGGED, w) + "/texts.txt", "ids": R(lay.UNTAGGED, w) + "/ids.txt"}
    return {"texts": f"{DATA}/{w.dataset}/unlabelled_texts.txt"}


rule suggestions:
    """The configured target's top labels (suggestions.method, suggestions.top_k) for every unlabelled text."""
    input:
        unpack(unlabelled_texts),
        target=lambda w: R(lay.METHOD, w, method=S(w)["suggestions"]["method"]) + ".json",
    output:
        R(lay.SUGGESTIONS) + ".parquet",
    log:
        "logs/suggestions/{dataset}.log",
    params:
        model=lambda w: R(lay.METHOD, w, method=S(w)["suggestions"]["method"]),
        top_k=lambda w: S(w)["suggestions"]["top_k"],
        ids=lambda w, input: ["--ids", input.ids] if "ids" in input.keys() else [],
    threads: 1
    resources:
        mem_mb=res("suggestions", "mem_mb", 8000),
        runtime=res("suggestions", "runtime", 120),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.predict --model {params.model:q} --top-k {params.top_k:q} --input {input.texts:q} {params.ids:q} "
        "--out {output:q} --skip-empty 2> {log:q}"
