# Label index: label embeddings (pifa-tfidf, pifa-neural, text-emb) and balanced
# hierarchical cluster trees over them, keyed by what they depend on so every method
# and variant shares them.


rule label_embedding_pifa_tfidf:
    """PIFA label embedding from TF-IDF (X-Transformer §3.2)."""
    input:
        X=expand(R(lay.TFIDF) + "/X_{split}.npz", split=["train", "valid"], allow_missing=True),
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
    output:
        emb=R(lay.INDEX, emb="pifa-tfidf") + "/" + lay.LABEL_EMB,
        record=R(lay.INDEX, emb="pifa-tfidf") + "/" + lay.record(lay.LABEL_EMB),
    log:
        "logs/label_embedding/{dataset}-pifa-tfidf.log",
    params:
        hash=H("label_embedding_pifa_tfidf"),
    threads: 1
    resources:
        mem_mb=res("label_embedding_pifa_tfidf", "mem_mb", 8000),
        runtime=res("label_embedding_pifa_tfidf", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.label_embedding --kind pifa-tfidf --features {input.X:q} --labels {input.Y:q} "
        "--out {output.emb:q} --record {output.record:q} "
        "--log {log:q} --dataset {wildcards.dataset} --rule {rule} --config-hash {params.hash:q}"


rule label_embedding_pifa_neural:
    """PIFA over the pre-trained encoder's instance embeddings (§3.2)."""
    input:
        E=lambda w: expand(R(lay.PRETRAINED) + "/emb_{split}.npz", dataset=w.dataset,
                           enc=w.enc, maxlen=S(w)["xtransformer"]["embed"]["max_length"], split=["train", "valid"], allow_missing=True),
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
    output:
        emb=R(lay.INDEX, emb="pifa-neural__{enc}") + "/" + lay.LABEL_EMB,
        record=R(lay.INDEX, emb="pifa-neural__{enc}") + "/" + lay.record(lay.LABEL_EMB),
    log:
        "logs/label_embedding/{dataset}-pifa-neural__{enc}.log",
    params:
        hash=H("label_embedding_pifa_neural"),
    threads: 1
    resources:
        mem_mb=res("label_embedding_pifa_neural", "mem_mb", 8000),
        runtime=res("label_embedding_pifa_neural", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.label_embedding --kind pifa-neural --features {input.E:q} --labels {input.Y:q} "
        "--out {output.emb:q} --record {output.record:q} "
        "--log {log:q} --dataset {wildcards.dataset} --rule {rule} --config-hash {params.hash:q}"


rule label_embedding_text:
    """Label-text embeddings: the encoder's mean-pooled token states (§3.2)."""
    input:
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        emb=R(lay.INDEX, emb="text-emb__{enc}") + "/" + lay.LABEL_EMB,
        record=R(lay.INDEX, emb="text-emb__{enc}") + "/" + lay.record(lay.LABEL_EMB),
    log:
        "logs/label_embedding/{dataset}-text-emb__{enc}.log",
    params:
        settings=PASS("label_embedding_text", encoder=ENC),
        hash=H("label_embedding_text"),
    threads: threads_of
    resources:
        mem_mb=res("label_embedding_text", "mem_mb", 8000),
        runtime=res("label_embedding_text", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.label_embedding --kind text-emb --label-table {input.labels:q} "
        "--out {output.emb:q} " + STAGE_ARGS


def TREE_SETTINGS(w):
    """The settings of the tree the wildcards name (xmc_steps.registry.tree_settings): the values come from
    the methods' settings; the tree's name is only its key."""
    try:
        return xreg.tree_settings(S(w), w.tree)
    except KeyError as e:
        raise WorkflowError(str(e).strip("'\""))


rule cluster:
    """Balanced hierarchical spherical k-means over the label embeddings."""
    input:
        emb=R(lay.INDEX) + "/" + lay.LABEL_EMB,
    output:
        tree=R(lay.TREE) + ".npz",
        record=lay.record(R(lay.TREE)),
    log:
        "logs/cluster/{dataset}-{emb}-{tree}.log",
    params:
        hash=H("cluster"),
        t=TREE_SETTINGS,
    threads: threads_of
    resources:
        mem_mb=res("cluster", "mem_mb", 8000),
        runtime=res("cluster", "runtime", 120),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.cluster --label-emb {input.emb:q} --out {output.tree:q} "
        "--branching {params.t[branching]:q} --leaf-size {params.t[leaf_size]:q} --min-leaves {params.t[min_leaves]:q} "
        "--seed {params.t[seed]:q} --max-iter {params.t[max_iter]:q} --record {output.record:q} "
        "--log {log:q} --dataset {wildcards.dataset} --rule {rule} --threads {threads} --config-hash {params.hash:q}"
