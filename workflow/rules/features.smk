# Features: TF-IDF (fitted on train only) and transformer token ids.


rule tfidf:
    """Word n-gram TF-IDF, sublinear tf, L2-normalised; vocabulary and idf saved."""
    input:
        rules.ingest.output.docs,
        record=RES + "/{dataset}/ingest/record.json",
    output:
        X=expand(RES + "/{{dataset}}/features/tfidf/X_{split}.npz", split=SPLITS),
        vocab=RES + "/{dataset}/features/tfidf/vocab.parquet",
        record=RES + "/{dataset}/features/tfidf/record.json",
    log:
        "logs/tfidf/{dataset}.log",
    params:
        settings=P("tfidf"),
        hash=config_hash,
        ingest=RES + "/{dataset}/ingest",
        out=RES + "/{dataset}/features/tfidf",
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{PY} -m xmc_steps.tfidf --ingest {params.ingest} --out {params.out} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --rule tfidf --config-hash {params.hash}"


rule tokenize:
    """Token ids of every split for the configured Hugging Face tokenizer."""
    input:
        rules.ingest.output.docs,
    output:
        tokens=expand(RES + "/{{dataset}}/features/tokens/tokens_{split}.npz", split=SPLITS),
        record=RES + "/{dataset}/features/tokens/record.json",
    log:
        "logs/tokenize/{dataset}.log",
    params:
        settings=P("tokenize"),
        hash=config_hash,
        ingest=RES + "/{dataset}/ingest",
        out=RES + "/{dataset}/features/tokens",
    threads: 1
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{PY} -m xmc_steps.tokenize --ingest {params.ingest} --out {params.out} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --rule tokenize --config-hash {params.hash}"
