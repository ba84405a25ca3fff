# X-Transformer: the neural matcher (§3.3) per (indexing, tree, encoder), its rankers
# (§3.4) per (ranker input, negatives), Eq. 2 prediction, and ensembles (Table 5 rows 7-9).
# XR-Linear over the matcher's tree, fit on the splits `fit` ("train" or "train+valid"), in
# layout.XT_LINEAR: the guard's linear baseline and the second candidate source of Eq. 2
# (xmc_steps/xtransformer/).
from xmc_steps.xtransformer import spec as XTS  # noqa: E402  (its layout)


# this method's path segments: the settings' choices they name (their Literal types, xmc_steps.params)
wildcard_constraints:
    rin=xparams.regex(xparams.RankerInput),
    neg=xparams.regex(xparams.NegativeKind),
    cand=xparams.regex(xparams.Candidates),
    comb=xparams.regex(xparams.Combiner),
    fit=r"train|train\+valid|valid\+train",


def xt_fit_name(s):
    """The `fit` wildcard of the X-Transformer rankers' training splits (config fit_on)."""
    return "+".join(s["xtransformer"]["fit_on"])


def xt_tokens(split_list, maxlen_key="matcher"):
    def f(w):
        xt = S(w)["xtransformer"]
        d = lay.tokens_dir(RES, w.dataset, w.enc, xt[maxlen_key]["max_length"])
        return [f"{d}/tokens_{s}.npz" for s in split_list]

    return f


rule xtransformer_linear_train:
    """XR-Linear (the xr_linear settings) over the matcher's cluster tree, fit on `fit`."""
    input:
        X=lambda w: [R(lay.TFIDF, w) + f"/X_{s}.npz" for s in XTS.fit_splits(S(w), w.fit)],
        Y=lambda w: [R(lay.INGEST, w) + f"/Y_{s}.npz" for s in XTS.fit_splits(S(w), w.fit)],
        tree=R(lay.TREE) + ".npz",
    output:
        model=directory(R(XTS.XT_LINEAR) + "/model"),
        record=R(XTS.XT_LINEAR) + "/" + lay.record("train"),
    log:
        "logs/xtransformer_linear_train/{dataset}-{emb}-{tree}-{fit}.log",
    params:
        settings=PASS("xtransformer_linear_train"),
        hash=H("xtransformer_linear_train"),
    threads: threads_of
    resources:
        mem_mb=res("xtransformer_linear_train", "mem_mb", 8000),
        runtime=res("xtransformer_linear_train", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xr_linear train --features {input.X:q} --labels {input.Y:q} --tree {input.tree:q} "
        "--out {output.model:q} --method xtransformer --threads {threads} " + STAGE_ARGS


rule xtransformer_linear_clusters:
    """The linear tree's beam: top-b finest clusters of every document (a matcher's output); the
    train-split tree keeps 2b, from which the matcher's guard cuts its equal-budget baseline.  The stage
    derives both, and whether its test clusters are online, from what the rule passes (the matcher's topb and
    scorer, fit_on, the tree's fit: xmc_steps.stages.xr_linear.clusters_settings)."""
    input:
        # the xr-linear target's model when it is the same model (same tree and splits): fit once
        model=lambda w: XTS.linear_model_dir(RES, w.dataset, S(w), w.emb, w.tree, w.fit),
        X=expand(R(lay.TFIDF) + "/X_{split}.npz", split=SPLITS, allow_missing=True),
    output:
        clusters=expand(R(XTS.XT_LINEAR) + "/clusters_{split}.npz", split=SPLITS, allow_missing=True),
        record=R(XTS.XT_LINEAR) + "/" + lay.record("clusters"),
    log:
        "logs/xtransformer_linear_clusters/{dataset}-{emb}-{tree}-{fit}.log",
    params:
        settings=PASS("xtransformer_linear_clusters", fit=lambda w: w.fit),
        hash=H("xtransformer_linear_clusters"),
    threads: 1
    resources:
        mem_mb=res("xtransformer_linear_clusters", "mem_mb", 8000),
        runtime=res("xtransformer_linear_clusters", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xr_linear clusters --model {input.model:q} --features {input.X:q} --out {output.clusters:q} "
        "--method xtransformer " + STAGE_ARGS


rule matcher:
    """Fine-tune the encoder + a linear head over the K clusters, squared hinge (Eq. 3); score the
    clusters with the head or head + the linear tree (scorer); fail when no better than the
    trivial baselines (the guard)."""
    input:
        tokens=xt_tokens(SPLITS),
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        tree=R(lay.TREE) + ".npz",
        linear=expand(R(XTS.XT_LINEAR, fit="train") + "/clusters_{split}.npz", split=SPLITS, allow_missing=True),
    output:
        model=R(XTS.XT_MATCHER) + "/" + lay.WEIGHTS,
        meta=R(XTS.XT_MATCHER) + "/matcher.json",
        guard=R(XTS.XT_MATCHER) + "/" + lay.GUARD,
        curve=report(R(XTS.XT_MATCHER) + "/" + lay.CURVE, category="{dataset}", subcategory="xtransformer matcher",
                     labels={"dataset": "{dataset}", "matcher": "{emb} {tree} {enc}", "file": "valid cluster recall"}),
        emb=expand(R(XTS.XT_MATCHER) + "/emb_{split}.npz", split=SPLITS, allow_missing=True),
        clusters=expand(R(XTS.XT_MATCHER) + "/clusters_{split}.npz", split=SPLITS, allow_missing=True),
        record=R(XTS.XT_MATCHER) + "/" + lay.RECORD,
    log:
        "logs/matcher/{dataset}-{emb}-{tree}-{enc}.log",
    params:
        launch=launch(lambda w: S(w)["xtransformer"]["matcher"]),
        settings=PASS("matcher", encoder=ENC),
        hash=H("matcher"),
        tokens_dir=lambda w, input: os.path.dirname(input.tokens[0]),
        out=R(XTS.XT_MATCHER),
    threads: threads_of
    resources:
        mem_mb=res("matcher", "mem_mb", 16000),
        runtime=res("matcher", "runtime", 720),
        gpu=gpus(lambda w: S(w)["xtransformer"]["matcher"]),
    conda:
        "../../envs/gpu.yaml"
    shell:
        "{params.launch} -m xmc_steps.stages.matcher --tokens-dir {params.tokens_dir:q} --labels-train {input.Y[0]:q} "
        "--labels-valid {input.Y[1]:q} --cluster-assign {input.tree:q} --linear-clusters {input.linear:q} --out {params.out:q} "
        "--method xtransformer --threads {threads} " + STAGE_ARGS


def xt_fit(kind):
    def f(w):
        s = S(w)
        splits = s["xtransformer"]["fit_on"]
        if kind == "X":
            return [R(lay.TFIDF, w) + f"/X_{x}.npz" for x in splits]
        if kind == "Y":
            return [R(lay.INGEST, w) + f"/Y_{x}.npz" for x in splits]
        if kind == "linear":
            return [R(XTS.XT_LINEAR, w, fit=xt_fit_name(s)) + f"/clusters_{x}.npz" for x in splits]
        return [R(XTS.XT_MATCHER, w) + f"/{kind}_{x}.npz" for x in splits]

    return f


rule xtransformer_ranker:
    """Linear rankers on TF-IDF (⊕ neural) with TFN / MAN / TFN+MAN negatives (§3.4)."""
    input:
        X=xt_fit("X"),
        Y=xt_fit("Y"),
        emb=xt_fit("emb"),
        clusters=xt_fit("clusters"),
        linear=xt_fit("linear"),
        tree=R(lay.TREE) + ".npz",
        guard=R(XTS.XT_MATCHER) + "/" + lay.GUARD,   # candidates matcher: the matcher must beat the baselines alone
    output:
        model=directory(R(XTS.XT_RANKER) + "/model"),
        record=R(XTS.XT_RANKER) + "/" + lay.record("train"),
    log:
        "logs/xtransformer_ranker/{dataset}-{emb}-{tree}-{enc}-{rin}-{neg}-{cand}.log",
    params:
        settings=PASS("xtransformer_ranker", ranker_input=lambda w: w.rin, negatives=lambda w: w.neg,
                      candidates=lambda w: w.cand),
        hash=H("xtransformer_ranker"),
        emb=lambda w, input: ["--emb", *input.emb] if w.rin == "tfidf+neural" else [],
    threads: threads_of
    resources:
        mem_mb=res("xtransformer_ranker", "mem_mb", 16000),
        runtime=res("xtransformer_ranker", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xtransformer train --tfidf {input.X:q} {params.emb:q} --labels {input.Y:q} "
        "--clusters {input.clusters:q} --linear {input.linear:q} --tree {input.tree:q} --guard {input.guard:q} "
        "--out {output.model:q} --method xtransformer --threads {threads} " + STAGE_ARGS


rule xtransformer_predict:
    """Eq. 2: matcher's top-b clusters, ranker scores inside them, combined."""
    input:
        model=rules.xtransformer_ranker.output.model,
        matcher=R(XTS.XT_MATCHER) + "/" + lay.WEIGHTS,
        X=R(lay.TFIDF) + "/X_test.npz",
        emb=R(XTS.XT_MATCHER) + "/emb_test.npz",
        clusters=R(XTS.XT_MATCHER) + "/clusters_test.npz",
        linear=lambda w: R(XTS.XT_LINEAR, w, fit=xt_fit_name(S(w))) + "/clusters_test.npz",
    output:
        predictions=R(XTS.XT_PREDICT) + "/" + lay.PREDICTIONS,
        record=R(XTS.XT_PREDICT) + "/" + lay.record("predict"),
    log:
        "logs/xtransformer_predict/{dataset}-{emb}-{tree}-{enc}-{rin}-{neg}-{cand}-{comb}.log",
    params:
        settings=PASS("xtransformer_predict", candidates=lambda w: w.cand, combiner=lambda w: w.comb),
        hash=H("xtransformer_predict"),
    threads: 1
    resources:
        mem_mb=res("xtransformer_predict", "mem_mb", 8000),
        runtime=res("xtransformer_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xtransformer predict --model {input.model:q} --matcher-model {input.matcher:q} "
        "--tfidf {input.X:q} --emb {input.emb:q} --clusters {input.clusters:q} --linear {input.linear:q} --out {output.predictions:q} "
        "--method xtransformer " + STAGE_ARGS


rule xtransformer_valid_ranker:
    """The member's rankers fit on the train split alone (xtransformer_ranker's settings; its own fit adds
    valid): they score the validation split an ensemble chooses on."""
    input:
        X=R(lay.TFIDF) + "/X_train.npz",
        Y=R(lay.INGEST) + "/Y_train.npz",
        emb=R(XTS.XT_MATCHER) + "/emb_train.npz",
        clusters=R(XTS.XT_MATCHER) + "/clusters_train.npz",
        linear=R(XTS.XT_LINEAR, fit="train") + "/clusters_train.npz",
        tree=R(lay.TREE) + ".npz",
        guard=R(XTS.XT_MATCHER) + "/" + lay.GUARD,
    output:
        model=directory(R(XTS.XT_RANKER_VALID) + "/model"),
        record=R(XTS.XT_RANKER_VALID) + "/" + lay.record("train"),
    log:
        "logs/xtransformer_valid_ranker/{dataset}-{emb}-{tree}-{enc}-{rin}-{neg}-{cand}.log",
    params:
        settings=PASS("xtransformer_valid_ranker", ranker_input=lambda w: w.rin, negatives=lambda w: w.neg,
                      candidates=lambda w: w.cand),
        hash=H("xtransformer_valid_ranker"),
        emb=lambda w, input: ["--emb", input.emb] if w.rin == "tfidf+neural" else [],
    threads: threads_of
    resources:
        mem_mb=res("xtransformer_valid_ranker", "mem_mb", 16000),
        runtime=res("xtransformer_valid_ranker", "runtime", 240),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xtransformer train --tfidf {input.X:q} {params.emb:q} --labels {input.Y:q} "
        "--clusters {input.clusters:q} --linear {input.linear:q} --tree {input.tree:q} --guard {input.guard:q} "
        "--out {output.model:q} --method xtransformer --threads {threads} " + STAGE_ARGS


def xt_valid_model(w):
    """The rankers that score the member's validation split (XTMember.valid_ranker_dir)."""
    return XTS.XTMember(w.emb, w.tree, w.enc, w.rin, w.neg, w.cand, w.comb).valid_ranker_dir(RES, w.dataset, S(w)) + "/model"


rule xtransformer_valid_predict:
    """Eq. 2 on the validation split, with rankers and a linear tree that did not fit on it."""
    input:
        model=xt_valid_model,
        matcher=R(XTS.XT_MATCHER) + "/" + lay.WEIGHTS,
        X=R(lay.TFIDF) + "/X_valid.npz",
        emb=R(XTS.XT_MATCHER) + "/emb_valid.npz",
        clusters=R(XTS.XT_MATCHER) + "/clusters_valid.npz",
        linear=R(XTS.XT_LINEAR, fit="train") + "/clusters_valid.npz",
    output:
        predictions=R(XTS.XT_PREDICT) + "/pred_valid.parquet",
        record=R(XTS.XT_PREDICT) + "/" + lay.record("pred_valid"),
    log:
        "logs/xtransformer_valid_predict/{dataset}-{emb}-{tree}-{enc}-{rin}-{neg}-{cand}-{comb}.log",
    params:
        settings=PASS("xtransformer_valid_predict", candidates=lambda w: w.cand, combiner=lambda w: w.comb),
        hash=H("xtransformer_valid_predict"),
    threads: 1
    resources:
        mem_mb=res("xtransformer_valid_predict", "mem_mb", 8000),
        runtime=res("xtransformer_valid_predict", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xtransformer predict --model {input.model:q} --matcher-model {input.matcher:q} "
        "--tfidf {input.X:q} --emb {input.emb:q} --clusters {input.clusters:q} --linear {input.linear:q} --out {output.predictions:q} "
        "--method xtransformer " + STAGE_ARGS


rule xtransformer_select:
    """The validation table the prediction defaults are chosen from: rankers fit on train, every
    candidate set (matcher, linear tree, union) x combiner (Eq. 2's sigma) scored on valid."""
    input:
        X=expand(R(lay.TFIDF) + "/X_{split}.npz", split=["train", "valid"], allow_missing=True),
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=["train", "valid"], allow_missing=True),
        emb=lambda w: [f"{xt_select_member(w).matcher_dir(RES, w.dataset)}/emb_{s}.npz" for s in ("train", "valid")],
        clusters=lambda w: [f"{xt_select_member(w).matcher_dir(RES, w.dataset)}/clusters_{s}.npz" for s in ("train", "valid")],
        linear=lambda w: [f"{xt_select_member(w).linear_dir(RES, w.dataset, 'train')}/clusters_{s}.npz"
                          for s in ("train", "valid")],
        matcher=lambda w: f"{xt_select_member(w).matcher_dir(RES, w.dataset)}/{lay.WEIGHTS}",
        tree=lambda w: R(lay.TREE, w, emb=xt_select_member(w).emb, tree=xt_select_member(w).tree) + ".npz",
    output:
        csv=R(XTS.XT_SELECTION) + ".csv",
        md=report(R(XTS.XT_SELECTION) + ".md", category="{dataset}", subcategory="xtransformer",
                  labels={"dataset": "{dataset}", "file": "validation table (candidates x combiner)"}),
        json=R(XTS.XT_SELECTION) + ".json",
        record=R(lay.RECORDS) + "/xtransformer-selection.json",
    log:
        "logs/xtransformer_select/{dataset}.log",
    params:
        settings=PASS("xtransformer_select", ranker_input=lambda w: xt_select_member(w).ranker_input,
                      negatives=lambda w: xt_select_member(w).negatives, candidates=lambda w: "union"),
        hash=H("xtransformer_select"),
    threads: threads_of
    resources:
        mem_mb=res("xtransformer_select", "mem_mb", 16000),
        runtime=res("xtransformer_select", "runtime", 480),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.xtransformer select --tfidf {input.X:q} --emb {input.emb:q} --labels {input.Y:q} "
        "--clusters {input.clusters:q} --linear {input.linear:q} --matcher-model {input.matcher:q} --tree {input.tree:q} "
        "--out-csv {output.csv:q} --out-md {output.md:q} --out-json {output.json:q} "
        "--method xtransformer --threads {threads} " + STAGE_ARGS


def xt_select_member(w):
    """The member the validation table is computed for: the full method's first indexing x encoder."""
    return XTS.xt_members(S(w), None)[0]


def xt_variant(w):
    return None if w.variant == "main" else w.variant


rule xtransformer_ensemble:
    """Ensemble over indexings and encoders (Table 5 rows 7-9): each member alone or the combination, the best
    on the validation split (each member's rankers fit on train there; xmc_steps.stages.ensemble)."""
    input:
        members=lambda w: [f"{m.predict_dir(RES, w.dataset)}/{lay.PREDICTIONS}"
                           for m in XTS.xt_members(S(w), xt_variant(w))],
        valid=lambda w: [f"{m.predict_dir(RES, w.dataset)}/pred_valid.parquet"
                         for m in XTS.xt_members(S(w), xt_variant(w))],
        Y=R(lay.INGEST) + "/Y_valid.npz",
        labels=R(lay.INGEST) + "/" + lay.LABELS,
    output:
        predictions=R(XTS.XT_ENSEMBLE) + "/" + lay.PREDICTIONS,
        choice=R(XTS.XT_ENSEMBLE) + "/ensemble.json",
        record=R(XTS.XT_ENSEMBLE) + "/" + lay.RECORD,
    log:
        "logs/xtransformer_ensemble/{dataset}-{variant}.log",
    params:
        settings=PASS("xtransformer_ensemble", ensemble=lambda w: XTS.xt_spec(S(w), xt_variant(w))["ensemble"]),
        hash=H("xtransformer_ensemble"),
        names=lambda w: [m.name for m in XTS.xt_members(S(w), xt_variant(w))],
    threads: 1
    resources:
        mem_mb=res("xtransformer_ensemble", "mem_mb", 8000),
        runtime=res("xtransformer_ensemble", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.ensemble --predictions {input.members:q} --names {params.names:q} "
        "--valid-predictions {input.valid:q} --valid-labels {input.Y:q} --choice-out {output.choice:q} "
        "--label-table {input.labels:q} --out {output.predictions:q} --method xtransformer " + STAGE_ARGS
