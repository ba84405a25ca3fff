# X-Transformer: the neural matcher (§3.3) per (indexing, tree, encoder), its rankers
# (§3.4) per (ranker input, negatives), Eq. 2 prediction, and ensembles (Table 5 rows 7-9).

XT = RES + "/{dataset}/xtransformer/{emb}/{tree}/{enc}"


def xt_tokens(split_list, maxlen_key="matcher"):
    def f(w):
        xt = S(w)["xtransformer"]
        d = xtg.tokens_dir(RES, w.dataset, xtg.unslug(w.enc), xt[maxlen_key]["max_length"])
        return [f"{d}/tokens_{s}.npz" for s in split_list]

    return f


def matcher_params(w):
    s = S(w)
    p = dict(s["xtransformer"]["matcher"], encoder=xtg.unslug(w.enc), threads=s["threads"])
    return json.dumps(p, sort_keys=True)


rule matcher:
    """Fine-tune the encoder + a linear head over the K clusters, squared hinge (Eq. 3)."""
    input:
        tokens=xt_tokens(SPLITS),
        Y=expand(RES + "/{{dataset}}/ingest/Y_{split}.npz", split=["train", "valid"]),
        tree=RES + "/{dataset}/index/{emb}/{tree}.npz",
    output:
        model=XT + "/matcher/model.safetensors",
        meta=XT + "/matcher/matcher.json",
        emb=expand(XT + "/matcher/emb_{split}.npz", split=SPLITS, allow_missing=True),
        clusters=expand(XT + "/matcher/clusters_{split}.npz", split=SPLITS, allow_missing=True),
        record=XT + "/matcher/record.json",
    log:
        "logs/matcher/{dataset}-{emb}-{tree}-{enc}.log",
    params:
        settings=matcher_params,
        hash=H("split", "ingest", "tfidf", "cluster", "xtransformer.matcher"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        out=XT + "/matcher",
    threads: threads_of
    resources:
        # per-dataset overrides: resources.matcher.mem_mb / .runtime in config.yaml
        mem_mb=lambda w: S(w).get("resources", {}).get("matcher", {}).get("mem_mb", 16000),
        runtime=lambda w: S(w).get("resources", {}).get("matcher", {}).get("runtime", 720),
        gpu=1,
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{PY} -m xmc_steps.matcher --tokens-dir {params.tokens_dir} --labels-train {input.Y[0]} "
        "--labels-valid {input.Y[1]} --cluster-assign {input.tree} --out {params.out} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method xtransformer --rule matcher --config-hash {params.hash}"


def xt_ranker_params(w, predict=False):
    s = S(w)
    xt = s["xtransformer"]
    p = {k: v for k, v in xt["ranker"].items()}
    p.update(ranker_input=w.rin, negatives=w.neg, topb=xt["matcher"]["topb"], topk=s["evaluate"]["topk"])
    if predict:
        p = {k: p[k] for k in ("topb", "topk", "combiner", "transform")}
    else:
        p["threads"] = s["threads"]
    return json.dumps(p, sort_keys=True)


def xt_fit(kind):
    def f(w):
        s = S(w)
        splits = s["xtransformer"]["fit_on"]
        if kind == "X":
            return [f"{RES}/{w.dataset}/features/tfidf/X_{x}.npz" for x in splits]
        if kind == "Y":
            return [f"{RES}/{w.dataset}/ingest/Y_{x}.npz" for x in splits]
        base = f"{RES}/{w.dataset}/xtransformer/{w.emb}/{w.tree}/{w.enc}/matcher"
        return [f"{base}/{kind}_{x}.npz" for x in splits]

    return f


rule xtransformer_ranker:
    """Linear rankers on TF-IDF (⊕ neural) with TFN / MAN / TFN+MAN negatives (§3.4)."""
    input:
        X=xt_fit("X"),
        Y=xt_fit("Y"),
        emb=xt_fit("emb"),
        clusters=xt_fit("clusters"),
        tree=RES + "/{dataset}/index/{emb}/{tree}.npz",
    output:
        model=directory(XT + "/ranker-{rin}-{neg}/model"),
        record=XT + "/ranker-{rin}-{neg}/train.record.json",
    log:
        "logs/xtransformer_ranker/{dataset}-{emb}-{tree}-{enc}-{rin}-{neg}.log",
    params:
        settings=xt_ranker_params,
        hash=H("split", "ingest", "tfidf", "cluster", "xtransformer.matcher", "xtransformer.ranker", "xtransformer.fit_on"),
        emb=lambda w, input: f"--emb {' '.join(input.emb)}" if w.rin == "tfidf+neural" else "",
    threads: threads_of
    resources:
        mem_mb=16000,
        runtime=240,
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.xtransformer train --tfidf {input.X} {params.emb} --labels {input.Y} "
        "--clusters {input.clusters} --tree {input.tree} --out {output.model} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method xtransformer --rule xtransformer_ranker "
        "--config-hash {params.hash}"


rule xtransformer_predict:
    """Eq. 2: matcher's top-b clusters, ranker scores inside them, combined."""
    input:
        model=rules.xtransformer_ranker.output.model,
        X=RES + "/{dataset}/features/tfidf/X_test.npz",
        emb=XT + "/matcher/emb_test.npz",
        clusters=XT + "/matcher/clusters_test.npz",
    output:
        predictions=XT + "/ranker-{rin}-{neg}/predictions_test.parquet",
        record=XT + "/ranker-{rin}-{neg}/predict.record.json",
    log:
        "logs/xtransformer_predict/{dataset}-{emb}-{tree}-{enc}-{rin}-{neg}.log",
    params:
        settings=lambda w: xt_ranker_params(w, predict=True),
        hash=H("split", "ingest", "tfidf", "cluster", "xtransformer.matcher", "xtransformer.ranker", "xtransformer.fit_on"),
        emb=lambda w, input: f"--emb {input.emb}" if w.rin == "tfidf+neural" else "",
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.xtransformer predict --model {input.model} --tfidf {input.X} {params.emb} "
        "--clusters {input.clusters} --out {output.predictions} "
        "--params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method xtransformer --rule xtransformer_predict "
        "--config-hash {params.hash}"


def xt_variant(w):
    return None if w.variant == "main" else w.variant


rule xtransformer_ensemble:
    """Ensemble over indexings and encoders (Table 5 rows 7-9)."""
    input:
        members=lambda w: [f"{m.ranker_dir(RES, w.dataset)}/predictions_test.parquet"
                           for m in xtg.xt_members(S(w), xt_variant(w))],
        labels=RES + "/{dataset}/ingest/labels.parquet",
    output:
        predictions=RES + "/{dataset}/xtransformer/ensemble-{variant}/predictions_test.parquet",
        record=RES + "/{dataset}/xtransformer/ensemble-{variant}/record.json",
    log:
        "logs/xtransformer_ensemble/{dataset}-{variant}.log",
    params:
        settings=lambda w: json.dumps({"method": xtg.xt_spec(S(w), xt_variant(w))["ensemble"],
                                       "topk": S(w)["evaluate"]["topk"]}),
        hash=H("split", "ingest", "tfidf", "cluster", "xtransformer"),
    threads: 1
    resources:
        mem_mb=8000,
        runtime=30,
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY} -m xmc_steps.ensemble --predictions {input.members} --label-table {input.labels} "
        "--out {output.predictions} --params {params.settings:q} --record {output.record} "
        "--log {log:q} --dataset {wildcards.dataset} --method xtransformer --rule xtransformer_ensemble "
        "--config-hash {params.hash}"
