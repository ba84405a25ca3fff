# Label index: label embeddings and the balanced hierarchical cluster tree.


rule label_embedding:
    """PIFA label embedding from TF-IDF (X-Transformer §3.2)."""
    input:
        X=RES + "/{dataset}/features/tfidf/X_train.npz",
        Xv=RES + "/{dataset}/features/tfidf/X_valid.npz",
        Y=RES + "/{dataset}/ingest/Y_train.npz",
        Yv=RES + "/{dataset}/ingest/Y_valid.npz",
    output:
        emb=RES + "/{dataset}/index/pifa-tfidf/label_emb.npz",
        record=RES + "/{dataset}/index/pifa-tfidf/label_emb.record.json",
    log:
        "logs/label_embedding/{dataset}.log",
    params:
        settings=P("cluster"),
        hash=config_hash,
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
    shell:
        "{PY} -m xmc_steps.label_embedding --kind pifa-tfidf --features {input.X} {input.Xv} "
        "--labels {input.Y} {input.Yv} --out {output.emb} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --rule label_embedding --config-hash {params.hash}"


rule cluster:
    """Balanced hierarchical spherical k-means over the label embeddings."""
    input:
        emb=rules.label_embedding.output.emb,
    output:
        tree=RES + "/{dataset}/index/pifa-tfidf/tree.npz",
        record=RES + "/{dataset}/index/pifa-tfidf/tree.record.json",
    log:
        "logs/cluster/{dataset}.log",
    params:
        settings=P(),
        hash=config_hash,
        c=lambda w: S(w)["cluster"],
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{PY} -m xmc_steps.cluster --label-emb {input.emb} --out {output.tree} "
        "--branching {params.c[branching]} --leaf-size {params.c[leaf_size]} "
        "--seed {params.c[seed]} --max-iter {params.c[max_iter]} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --rule cluster --config-hash {params.hash}"
