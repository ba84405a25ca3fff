# Features: TF-IDF (fitted on train only) and transformer token ids.


rule tfidf:
    """Word n-gram TF-IDF, sublinear tf, L2-normalised; vocabulary and idf saved."""
    input:
        rules.ingest.output.docs,
        record=R(lay.INGEST) + "/" + lay.RECORD,
    output:
        X=expand(R(lay.TFIDF) + "/X_{split}.npz", split=SPLITS, allow_missing=True),
        vocab=R(lay.TFIDF) + "/vocab.parquet",
        record=R(lay.TFIDF) + "/" + lay.RECORD,
    log:
        "logs/tfidf/{dataset}.log",
    params:
        settings=P("tfidf"),
        hash=H("tfidf"),
        ingest=folder_of("input"),
        out=R(lay.TFIDF),
    threads: 1
    resources:
        mem_mb=res("tfidf", "mem_mb", 8000),
        runtime=res("tfidf", "runtime", 120),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.tfidf --ingest {params.ingest:q} --out {params.out:q} " + STAGE_ARGS


rule tokenize:
    """Token ids of every split for one Hugging Face tokenizer and maximum length."""
    input:
        rules.ingest.output.docs,
    output:
        tokens=expand(R(lay.TOKENS) + "/tokens_{split}.npz", split=SPLITS, allow_missing=True),
        record=R(lay.TOKENS) + "/" + lay.RECORD,
    log:
        "logs/tokenize/{dataset}-{enc}-{maxlen}.log",
    params:
        settings=PASS("tokenize", encoder=ENC, max_length=MAXLEN),
        hash=H("tokenize"),
        ingest=folder_of("input"),
        out=R(lay.TOKENS),
    threads: 1
    resources:
        mem_mb=res("tokenize", "mem_mb", 8000),
        runtime=res("tokenize", "runtime", 120),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.tokenize --ingest {params.ingest:q} --out {params.out:q} " + STAGE_ARGS


rule embed_pretrained:
    """Instance embeddings from the pre-trained encoder (the input of pifa-neural)."""
    input:
        tokens=expand(R(lay.TOKENS) + "/tokens_{split}.npz", split=["train", "valid"], allow_missing=True),
    output:
        emb=expand(R(lay.PRETRAINED) + "/emb_{split}.npz", split=["train", "valid"], allow_missing=True),
        record=R(lay.PRETRAINED) + "/" + lay.RECORD,
    log:
        "logs/embed_pretrained/{dataset}-{enc}-{maxlen}.log",
    params:
        settings=PASS("embed_pretrained", encoder=ENC),
        hash=H("embed_pretrained"),
        out=R(lay.PRETRAINED),
        launch=launch(lambda w: S(w)["xtransformer"]["embed"]),
    threads: threads_of
    resources:
        mem_mb=res("embed_pretrained", "mem_mb", 8000),
        runtime=res("embed_pretrained", "runtime", 240),
        gpu=gpus(lambda w: S(w)["xtransformer"]["embed"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.embed --tokens {input.tokens:q} --out-dir {params.out:q} " + STAGE_ARGS
