# Data: build the built-in dataset, ingest any dataset into Parquet/NPZ.

DEBTAGS_FILES = [
    "train_texts.txt", "train_labels.txt", "test_texts.txt", "test_labels.txt",
    "label_ids.txt", "label_texts.txt", "label_map.tsv", "train_ids.txt", "test_ids.txt",
]
SPLITS = ["train", "valid", "test"]


rule prepare:
    """Build the built-in debtags dataset from the Debian package index."""
    output:
        [f"{DATA}/debtags/{n}" for n in DEBTAGS_FILES],
    log:
        "logs/prepare/debtags.log",
    params:
        out=folder_of("output"),
        workdir=R(lay.PREPARE, dataset="debtags") + "/apt",
    threads: 1
    resources:
        mem_mb=res("prepare", "mem_mb", 2000),
        runtime=res("prepare", "runtime", 30),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.prepare_debtags --out {params.out:q} --work-dir {params.workdir:q} "
        "--log {log:q} --dataset debtags --rule {rule}"


rule ingest:
    """Documents and labels to Parquet, label matrices to NPZ, validation split carved."""
    input:
        dataset_inputs,
    output:
        docs=expand(R(lay.INGEST) + "/docs_{split}.parquet", split=SPLITS, allow_missing=True),
        Y=expand(R(lay.INGEST) + "/Y_{split}.npz", split=SPLITS, allow_missing=True),
        labels=R(lay.INGEST) + "/" + lay.LABELS,
        report=R(lay.INGEST) + "/ingest.json",
        record=R(lay.INGEST) + "/" + lay.RECORD,
    log:
        "logs/ingest/{dataset}.log",
    params:
        settings=P("split", "ingest", nest=True),
        hash=H("ingest"),
        path=lambda w: ["--path", S(w)["path"]] if S(w).get("path") else [],
        layout=lambda w: ["--layout", S(w)["layout"]] if S(w).get("layout") else [],
        out=R(lay.INGEST),
    threads: 1
    resources:
        mem_mb=res("ingest", "mem_mb", 4000),
        runtime=res("ingest", "runtime", 60),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.ingest --name {wildcards.dataset} --data-dir {DATA:q} "
        "{params.path:q} {params.layout:q} --out {params.out:q} " + STAGE_ARGS


rule fetch:
    """A PECOS benchmark's tarball: downloaded (resumable), verified against workflow/downloads.tsv, unpacked."""
    output:
        files=[f"{DATA}/xmc-base/{{archive}}/{n}" for n in xds.XMC_BASE_FILES],
        record=f"{DATA}/xmc-base/{{archive}}/download.json",
    log:
        "logs/fetch/{archive}.log",
    params:
        out=f"{DATA}/xmc-base/{{archive}}",
    wildcard_constraints:
        archive="|".join(s.archive for s in xds.CANONICAL.values() if s.archive),
    threads: 1
    resources:
        mem_mb=res("fetch", "mem_mb", 1000),
        runtime=res("fetch", "runtime", 600),
    conda:
        "../../envs/cpu.yaml"
    shell:
        "{PY:q} -m xmc_steps.stages.fetch --archive {wildcards.archive} --out {params.out:q} "
        "--record {output.record:q} --log {log:q} --rule {rule} --no-tracking"
