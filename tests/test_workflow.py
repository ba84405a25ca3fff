"""The Snakemake DAG end to end: a tiny synthetic dataset, both linear targets."""

import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, write_raw_dataset

SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def _toy(tmp_path: Path) -> Path:
    import random

    rng = random.Random(0)
    words = {lab: [f"{lab}w{i}" for i in range(6)] for lab in "abcdefgh"}
    rows = []
    for _ in range(300):
        labs = rng.sample(sorted(words), rng.choice([1, 2, 3]))
        text = " ".join(rng.choice(words[l]) for l in labs for _ in range(4)) + " common filler"
        rows.append((text, labs))
    # label texts in the toy's words (GUDN's guide reads them)
    return write_raw_dataset(tmp_path / "data" / "toy", rows[:240], rows[240:], label_ids=sorted(words),
                             label_texts=[f"{lab}w0 {lab}w1" for lab in sorted(words)])


def _command(tmp_path, *targets, extra=(), overrides=None, env=None) -> tuple[list[str], dict[str, str]]:
    """The snakemake command line and environment that :func:`_run` runs in ``tmp_path`` (the project's
    config plus an override file, written here); no flag beyond what the README's command needs to
    find the Snakefile, the folder and the configs."""
    import yaml

    # one thread per job: snakemake --cores 2 then runs two of the toy's small jobs at once
    over = {"data_dir": str(tmp_path / "data"), "results_dir": "results",
            "datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1}}}
    for k, v in (overrides or {}).items():
        over[k] = v
    (tmp_path / "override.yaml").write_text(yaml.safe_dump(over))
    cmd = SNAKEMAKE + [*targets, "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--cores", "2",
                       "--configfile", str(ROOT / "config.yaml"), str(tmp_path / "override.yaml"), *extra]
    e = {**os.environ, "XMC_TRACKING": "1", **(env or {})}
    e.pop("MLFLOW_TRACKING_URI", None)
    return cmd, e


#: seconds before a Snakemake run counts as hung: CI's own cap (90 minutes), far beyond the neural toy run's 6
#: minutes on a quiet 2-core machine (it passed 25 minutes beside a training job: a slow machine must not trip it)
RUN_TIMEOUT = 5400


def _run(tmp_path, *targets, extra=(), overrides=None, check=True, env=None):
    """Run snakemake in ``tmp_path`` with the project's config plus an override file."""
    cmd, e = _command(tmp_path, *targets, extra=extra, overrides=overrides, env=env)
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=e, timeout=RUN_TIMEOUT)
    if check and r.returncode != 0:
        raise AssertionError(f"snakemake failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r


@pytest.mark.slow
def test_linear_targets_end_to_end(toy_linear_run):
    tmp_path = toy_linear_run
    for method in ("xr-linear", "parabel"):
        res = json.loads((tmp_path / "results" / "toy" / f"{method}.json").read_text())
        assert res["method"] == method and res["dataset"] == "toy"
        assert res["metrics"]["p_at_1"] > 50.0            # the toy task is easy
        assert (tmp_path / "results" / "toy" / f"{method}_decile_recall.png").stat().st_size > 1000
    for rule in ("ingest", "tfidf", "label_embedding", "cluster", "xr_linear_train", "evaluate"):
        assert list((tmp_path / "logs" / rule).glob("*.log")), rule
    # MLflow: one experiment, a parent per target carrying the test metrics, every stage job a child
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("toy")
    runs = client.search_runs([exp.experiment_id])
    parents = {r.data.tags["xmc.method"]: r for r in runs if r.data.tags.get("xmc.run_type") == "target"}
    assert set(parents) == {"xr-linear", "parabel", "shared"}
    assert parents["xr-linear"].data.metrics["p_at_1"] == pytest.approx(
        json.loads((tmp_path / "results" / "toy" / "xr-linear.json").read_text())["metrics"]["p_at_1"])
    children = {r.data.tags["mlflow.runName"]: r.data.tags["mlflow.parentRunId"] for r in runs
                if r.data.tags.get("xmc.run_type") == "stage"}
    assert children["xr_linear_train"] == parents["xr-linear"].info.run_id
    assert children["tfidf"] == parents["shared"].info.run_id          # logged once, shared
    assert parents["parabel"].data.tags["xmc.uses.tfidf"]                # and referenced
    # a second run has nothing to do: every stage is cached
    r = _run(tmp_path, "results/toy/xr-linear.json", extra=["-n"])
    assert "Nothing to be done" in r.stdout + r.stderr


#: artifacts that are not results: run records and logs (timings, hosts), each run's own paths and
#: thread counts (the ingest report, the settings snapshots), the tracking store, the toy targets' results files and
#: their metrics pages (timings)
_NOT_RESULTS = re.compile(r"record\.json$|/records/|/config/|ingest\.json$|mlflow|mlartifacts|\.png$|/toy/[^/]+\.json$|/toy/[^/]+_metrics\.html$")
#: omikuji (parabel) draws its 2-means starts from an unseeded thread-local RNG and has no seed
#: parameter: its trees differ from run to run (docs/running.md, "Determinism")
_NONDETERMINISTIC = re.compile(r"/parabel/")


def _artifact_digests(root: Path) -> dict[str, str]:
    import hashlib

    out = {}
    for p in sorted((root / "results").rglob("*")):
        rel = "/" + str(p.relative_to(root))
        if p.is_file() and not _NOT_RESULTS.search(rel) and not _NONDETERMINISTIC.search(rel):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.slow
def test_linear_stages_give_the_same_bytes_for_any_thread_count(toy_linear_run, tmp_path):
    """The toy's xr-linear target again, from scratch with two threads per job (the shared run used
    one): every artifact (TF-IDF, label embeddings, tree, rankers, predictions) byte for byte the
    same, and so every metric."""
    _toy(tmp_path)
    _run(tmp_path, "results/toy/xr-linear.json", env={"XMC_TRACKING": "0"},     # the bytes, not the tracking
         overrides={"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 2}}})
    ours, theirs = _artifact_digests(tmp_path), _artifact_digests(toy_linear_run)
    assert len(ours) >= 15, sorted(ours)
    assert any(k.endswith("/xr-linear/model/W_1.npz") for k in ours) and any("predictions_test" in k for k in ours)
    differ = sorted(k for k in ours if ours[k] != theirs.get(k))
    assert not differ, differ
    m1 = json.loads((tmp_path / "results/toy/xr-linear.json").read_text())["metrics"]
    m2 = json.loads((toy_linear_run / "results/toy/xr-linear.json").read_text())["metrics"]
    assert m1 == m2


def test_threads_and_rule_names_come_from_snakemake(tmp_path):
    """`--cores 1` runs every stage on one thread whatever the config's `threads` says, and each
    stage is told its own rule name."""
    _toy(tmp_path)
    r = _run(tmp_path, "results/toy/xr-linear.json", "results/toy/parabel.json", extra=["-n", "-p", "--cores", "1"],
             overrides={"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 2}}})
    shells = {}
    for line in (r.stdout + r.stderr).splitlines():
        if " -m xmc_steps." in line and "--rule " in line:
            shells[line.split("--rule ", 1)[1].split()[0]] = line
    assert {"tfidf", "cluster", "xr_linear_train", "parabel_train", "parabel_predict"} <= set(shells), sorted(shells)
    for rule in ("cluster", "xr_linear_train", "parabel_train", "parabel_predict"):
        assert "--threads 1 " in shells[rule], shells[rule]
    assert all('"threads"' not in s for s in shells.values())      # never a setting in --params
    assert "--threads" not in shells["xr_linear_predict"]            # a single-threaded stage


def test_demo_tokens_follow_the_tokenize_settings(tmp_path):
    r = _run(tmp_path, "demo", extra=["-n"], overrides={"defaults": {"tokenize": {"max_length": 32}}})
    assert "results/debtags/features/tokens/minilm-32/tokens_test.npz" in r.stdout + r.stderr


def test_a_local_encoder_folder_is_a_value_and_paths_carry_its_key(tmp_path):
    """``encoders: {local: /models/my--bert}``: the rules plan paths with the key and hand the
    folder to the stage in its parameters (it once had to survive a path wildcard)."""
    _toy(tmp_path)
    folder = "/models/my--bert"
    over = {"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1,
                                 "encoders": {"local": folder}, "elias": {"encoder": "local", "max_length": 16}}}}
    r = _run(tmp_path, "results/toy/elias-stage1.json", extra=["-n", "-p"], overrides=over)
    out = r.stdout + r.stderr
    assert "results/toy/features/tokens/local-16/tokens_train.npz" in out
    assert "results/toy/elias/tree-b16-l100-c64-s0/local-16/stage1" in out
    assert f'"encoder": "{folder}"' in out and "my--bert-16" not in out


def test_elias_predictions_hold_elias_plus_deeper_candidates(tmp_path):
    """``elias.plus.n_candidates`` above ``evaluate.topk``: stage 2's prediction files, which feed ELIAS++,
    are written that deep (the ranker once got ``evaluate.topk`` candidates whatever it asked for)."""
    _toy(tmp_path)
    over = {"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1,
                                 "elias": {"max_length": 16, "plus": {"n_candidates": 150}}}}}
    r = _run(tmp_path, "results/toy/elias.json", extra=["-n", "-p"], overrides=over)
    rules = (r.stdout + r.stderr).split("\nrule ")[1:]
    blocks = [b for b in rules if b.startswith("elias_predict:")]
    # the rule passes evaluate.topk and elias.plus.n_candidates; the stage predicts the deeper of the two
    from xmc_steps.elias.serve import PredictSettings

    depths = [PredictSettings.from_dict(json.loads(re.search(r"--params '(\{.*?\})'", b).group(1))).overrides()["topk"]
              for b in blocks]
    assert len(blocks) >= 3 and all(d == 150 for d in depths), blocks
    plus = [b for b in rules if b.startswith("elias_plus_predict:")]     # ELIAS++'s own answer: evaluate.topk
    assert plus and all('"topk": 100' in b for b in plus), plus


def test_bad_config_key_stops_at_start(tmp_path):
    _toy(tmp_path)
    r = _run(tmp_path, "results/toy/xr-linear.json", overrides={"defaults": {"tfidf": {"ngrams": 3}}}, check=False)
    assert r.returncode != 0
    assert "unknown key" in r.stderr and "ngrams" in r.stderr


def test_unknown_dataset_lists_known_names(tmp_path):
    _toy(tmp_path)
    r = _run(tmp_path, "results/nosuch/xr-linear.json", check=False)
    assert r.returncode != 0
    assert "unknown dataset 'nosuch'" in r.stderr + r.stdout and "wiki500k" in r.stderr + r.stdout


def test_wiki500k_plan_with_upstream_layout(tmp_path):
    """A user who unpacks Wiki-500K under data/wiki500k/ gets a complete plan."""
    d = tmp_path / "data" / "wiki500k"
    write_raw_dataset(d, [("x", ["1"])], [("y", ["1"])])
    # any rule's resources can be raised for one dataset
    over = {"datasets": {"wiki500k": {"resources": {"tfidf": {"mem_mb": 123456}, "xr_linear_train": {"runtime": 4321}}}}}
    r = _run(tmp_path, "results/wiki500k/xr-linear.json", "results/wiki500k/parabel.json", extra=["-n"],
             overrides=over)
    out = r.stdout + r.stderr
    for rule in ("ingest", "tfidf", "label_embedding", "cluster", "xr_linear_train", "xr_linear_predict",
                 "parabel_train", "parabel_predict", "evaluate"):
        assert rule in out, rule
    blocks = {b.split(":", 1)[0].strip(): b for b in out.split("\nrule ")[1:]}
    assert "mem_mb=123456" in blocks["tfidf"] and "runtime=4321" in blocks["xr_linear_train"]
    assert "mem_mb=8000" in blocks["parabel_train"]          # the rule's own value where none is given


def test_wiki500k_elias_paper_plan_has_gpu_training_rules(tmp_path):
    """`snakemake -n results/wiki500k/elias.json` with the paper config is a complete plan."""
    import yaml

    write_raw_dataset(tmp_path / "data" / "wiki500k", [("x", ["1"])], [("y", ["1"])])
    paper = yaml.safe_load((ROOT / "config.paper.yaml").read_text())
    r = _run(tmp_path, "results/wiki500k/elias.json", "results/wiki500k/xtransformer.json",
             extra=["-n", "--cores", "8"], overrides=paper)
    out = r.stdout + r.stderr
    jobs = [blk for blk in out.split("\nrule ")[1:]]
    by_rule = {}
    for blk in jobs:
        name = blk.split(":", 1)[0].strip()
        by_rule.setdefault(name, []).append(blk)
    for rule in ("ingest", "tfidf", "tokenize", "label_embedding_pifa_tfidf", "cluster", "elias_stage1",
                 "elias_stage2", "elias_predict", "elias_plus_ranker", "elias_plus_calibrate", "elias_plus_predict",
                 "elias_ensemble", "matcher", "xtransformer_ranker", "xtransformer_predict", "xtransformer_ensemble",
                 "embed_pretrained", "label_embedding_pifa_neural", "label_embedding_text", "evaluate"):
        assert rule in by_rule, rule
    assert len(by_rule["elias_stage1"]) == 3 and len(by_rule["elias_stage2"]) == 3     # 3 clustering seeds
    assert len(by_rule["matcher"]) == 9                                                 # 3 indexings x 3 encoders
    # the ensembles choose on validation: each X-Transformer member's rankers fit on train score it (the members'
    # own fit on train + valid), each ELIAS++ seed is scored there out of fold by its calibrate stage
    assert len(by_rule["xtransformer_valid_ranker"]) == 9 and len(by_rule["xtransformer_valid_predict"]) == 9
    assert all("/valid/model" in blk and "X_train.npz" in blk for blk in by_rule["xtransformer_valid_ranker"])
    assert all("--valid-predictions" in blk for rule in ("elias_ensemble", "xtransformer_ensemble")
               for blk in by_rule[rule])
    assert all("--valid-out" in blk for blk in by_rule["elias_plus_calibrate"])
    for rule in ("elias_stage1", "elias_stage2", "elias_predict", "matcher", "embed_pretrained"):
        assert all("gpu=1" in blk for blk in by_rule[rule]), rule
    assert "tree-b16-l123-s2" in out and "bert_base-128" in out and "/xlnet_large/matcher" in out
    # the job sizes config.paper.yaml gives the full set reach every job of their rule
    sizes = paper["datasets"]["wiki500k"]["resources"]
    for rule in ("tfidf", "cluster", "elias_stage2", "matcher", "xtransformer_ranker"):
        assert all(f"mem_mb={sizes[rule]['mem_mb']}" in blk for blk in by_rule[rule]), rule


def test_wiki500k_lightxml_paper_plan_has_gpu_training_rules(tmp_path):
    """`snakemake -n results/wiki500k/lightxml.json` with the paper config: the clusters of Table 1
    (balanced 2-means down to 60 labels), BERT-base at 128 tokens, GPU rules sized for the full set."""
    import yaml

    write_raw_dataset(tmp_path / "data" / "wiki500k", [("x", ["1"])], [("y", ["1"])])
    paper = yaml.safe_load((ROOT / "config.paper.yaml").read_text())
    r = _run(tmp_path, "results/wiki500k/lightxml.json", "results/wiki500k/lightxml-ensemble.json",
             "results/wiki500k/lightxml-static.json", extra=["-n", "-p", "--cores", "8"], overrides=paper)
    out = r.stdout + r.stderr
    by_rule = {}
    for blk in out.split("\nrule ")[1:]:
        by_rule.setdefault(blk.split(":", 1)[0].strip(), []).append(blk)
    for rule in ("ingest", "tfidf", "tokenize", "label_embedding_pifa_tfidf", "cluster", "lightxml_train",
                 "lightxml_predict", "lightxml_ensemble", "evaluate"):
        assert rule in by_rule, rule
    # the single model is the ensemble's first member; three clusterings (Table 4 / §Experiment settings) + static
    assert len(by_rule["lightxml_train"]) == 4
    trains = sorted(blk.split("--out ", 1)[1].split()[0].rsplit("/lightxml/", 1)[1] for blk in by_rule["lightxml_train"])
    assert trains == ["tree-b2-l60-s0/bert_base-128/dynamic", "tree-b2-l60-s0/bert_base-128/static",
                      "tree-b2-l60-s1/bert_base-128/dynamic", "tree-b2-l60-s2/bert_base-128/dynamic"]
    assert all("gpu=1" in blk for rule in ("lightxml_train", "lightxml_predict") for blk in by_rule[rule])
    # the paper's members train on train + valid (train.fit_valid): the ensemble is not chosen on validation, and
    # its record says why
    assert "lightxml_valid_predict" not in by_rule
    assert "--unmeasured" in by_rule["lightxml_ensemble"][0] and "--valid-predictions" not in by_rule["lightxml_ensemble"][0]
    train = next(b for b in by_rule["lightxml_train"] if "tree-b2-l60-s0/bert_base-128/dynamic" in b)
    assert "index/pifa-tfidf/tree-b2-l60-s0.npz" in train and "lightxml/tree-b2-l60-s0/bert_base-128" in train
    params = json.loads(train.split("--params '", 1)[1].split("'", 1)[0])
    assert params["encoder"] == "bert-base-uncased" and params["hidden"] == 500 and params["topb"] == 32
    assert params["train"]["epochs"] == 10 and params["train"]["batch_size"] == 32
    assert params["train"]["schedule"] == "constant" and params["allow_cpu_fallback"] is False
    assert params["negatives"] == "dynamic" and params["train"]["seed"] == 0 and "ensemble" not in params
    # the paper's random generator and label embeddings, not config.yaml's least-squares starts
    assert params["head_init"] == "random" and params["discriminator_init"] == "random"
    sizes = paper["datasets"]["wiki500k"]["resources"]
    assert f"mem_mb={sizes['lightxml_train']['mem_mb']}" in train


def test_wiki500k_gudn_paper_plan_trains_on_lightxmls_clusters(tmp_path):
    """GUDN's paper settings on Wiki-500K: LightXML's clusters and BERT, 512 tokens, 20 epochs of batch 8."""
    import yaml

    write_raw_dataset(tmp_path / "data" / "wiki500k", [("x", ["1"])], [("y", ["1"])])
    paper = yaml.safe_load((ROOT / "config.paper.yaml").read_text())
    r = _run(tmp_path, "results/wiki500k/gudn.json", "results/wiki500k/gudn-no-feature-guide.json",
             extra=["-n", "-p", "--cores", "8"], overrides=paper)
    out = r.stdout + r.stderr
    trains = [b for b in out.split("\nrule ")[1:] if b.startswith("gudn_train")]
    assert len(trains) == 2 and all("gpu=1" in b and "index/pifa-tfidf/tree-b2-l60-s0.npz" in b for b in trains)
    full = next(b for b in trains if "bert_base-512/full" in b)
    params = json.loads(full.split("--params '", 1)[1].split("'", 1)[0])
    b = params["backbone"]
    assert (b["last_k"], b["max_length"], b["hidden"], b["topb"]) == (10, 512, 500, 32)
    assert (b["train"]["epochs"], b["train"]["batch_size"]) == (20, 8) and params["feature_guide"] is True
    ablation = next(b for b in trains if "bert_base-512/no-feature-guide" in b)
    assert '"feature_guide": false' in ablation and "--label-texts-file" in ablation

NEURAL_TINY = {
    "xtransformer": {
        "cluster": {"branching": 2, "leaf_size": 2},
        "embed": {"max_length": 16, "batch_size": 64},
        # 4 steps learn little: allow_weak lets the plumbing run (the guard has its own test)
        "matcher": {"max_length": 16, "topb": 2, "eval_every": 0, "allow_weak": True,
                    "train": {"steps": 4, "batch_size": 8, "warmup_steps": 1, "checkpoint_every": 2}},
        "variants": {"tfidf-tfn": {"ranker_input": "tfidf", "negatives": "tfn"},
                     "ens": {"indexing": ["pifa-tfidf", "pifa-neural"]}},
    },
    "elias": {
        "max_length": 16,
        # 8 clusters of one label (the default floor, min_clusters 64, stops at one label per cluster);
        # 3 steps learn little: allow_weak lets the plumbing run (the guard has its own test)
        "cluster": {"branching": 2, "leaf_size": 2},
        "index": {"b": 2, "K": 8},
        "allow_weak": True,
        "stage1": {"train": {"steps": 3, "batch_size": 8, "warmup_steps": 1}},
        "stage2": {"train": {"steps": 3, "batch_size": 8, "warmup_steps": 1}},
        "train": {"checkpoint_every": 2},
        "eval_every": 0,
        "ensemble_seeds": [0, 1],
    },
    # the clustered mode (4 clusters of 2 labels, candidates from the top 3) rather than the flat
    # one the toy's 8 labels would get (tests/test_lightxml.py runs both through the CLI)
    "lightxml": {
        "max_length": 16, "flat_max_labels": 4, "cluster": {"leaf_size": 2}, "topb": 3, "hidden": 32,
        "dropout": 0.1, "eval_every": 0, "swa_start": 1.0,
        # the paper's start and one fast rate: the generator's least-squares start (config.yaml) ends this clustered
        # toy at test P@1 48-53 after 135 steps (tests/test_lightxml.py covers both least-squares starts).  Two
        # epochs of 27 batches: test P@1 91.7 (seed 0), the floor of 80 below with room
        "head_init": "random", "discriminator_init": "random", "lr_generator": None,
        "train": {"epochs": 2, "batch_size": 8, "lr": 3.0e-4, "checkpoint_every": 50},
        # lightxml-ensemble: the single model (seed 0) and one more clustering
        "ensemble": {"encoders": ["minilm"], "seeds": [0, 1], "method": "average"},
    },
}


NEURAL_TARGETS = ["results/toy/xtransformer.json", "results/toy/xtransformer-tfidf-tfn.json",
                  "results/toy/xtransformer-paper-candidates.json", "results/toy/elias.json",
                  "results/toy/elias-ensemble.json", "results/toy/lightxml.json",
                  "results/toy/lightxml-ensemble.json", "results/toy/gudn.json",
                  "results/toy/dual-encoder.json", "results/toy/dual-encoder-ranker.json",
                  "results/toy/dual-encoder-ensemble.json"]


# GUDN: three epochs (test P@1 98.3; two gave 85.0 and 86.7, too near the floor of 80 for a slower machine's numbers)
NEURAL_TINY["gudn"] = {"backbone": {"train": {**NEURAL_TINY["lightxml"]["train"], "epochs": 3}}}

#: the environment of a run in (a copy of) the neural toy run's folder, which goes without MLflow tracking
#: (tests/conftest.py's neural_toy_run)
UNTRACKED = {"XMC_TRACKING": "0"}

#: the settings of the neural toy runs (tests/conftest.py's neural_toy_run, and the SLURM test's)
# the dual encoder: two epochs of 15 batches of 16 (NGAME's clusters of 2, one label mined per text)
NEURAL_TINY["dual_encoder"] = {"max_length": 16, "label_max_length": 8, "eval_every": 0, "allow_weak": True,
                               "train": {"epochs": 2.0, "batch_size": 16, "checkpoint_every": 10}}

NEURAL_OVERRIDES = {"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1, **NEURAL_TINY}}}


@pytest.mark.slow
def test_neural_targets_end_to_end_with_minilm(neural_toy_run):
    """X-Transformer (two Table 5 variants, the paper's candidates, the validation table) and ELIAS++
    (alone and ensembled over two clustering seeds) and LightXML (clustered mode) through the DAG:
    MiniLM, 16 tokens, a few steps.

    One thread per job lets two tiny jobs run at once.  Covered elsewhere, so not run here: the
    elias-stage1 target (tests/test_slurm.py runs it locally and under SLURM) and the plan of an
    X-Transformer ensemble over indexings (test_wiki500k_elias_paper_plan_has_gpu_training_rules);
    both ensembles run the same ``xmc_steps.stages.ensemble`` stage, which elias-ensemble runs here.
    """
    tmp_path, targets = neural_toy_run, NEURAL_TARGETS
    for t in targets:
        res = json.loads((tmp_path / t).read_text())
        # the toy's labels are written in its words: a method that learned nothing (chance is
        # about 25) or lost the true labels from its candidates falls far below this floor
        assert res["metrics"]["p_at_1"] >= 80.0, (t, res["metrics"])
        assert res["model_size_bytes"] > 0 and res["device"] == "cpu"
    full = json.loads((tmp_path / "results/toy/elias.json").read_text())
    rules = {s["rule"] for s in full["stages"]}
    assert {"elias_stage1", "elias_stage2", "elias_plus_ranker", "elias_plus_calibrate", "elias_plus_predict"} <= rules
    lx = json.loads((tmp_path / "results/toy/lightxml.json").read_text())
    assert {"lightxml_train", "lightxml_predict"} <= {s["rule"] for s in lx["stages"]}
    assert next((tmp_path / "results/toy/lightxml").glob("tree-b2-l2-s0/minilm-16/dynamic/curve.png")).stat().st_size > 0
    gu = json.loads((tmp_path / "results/toy/gudn.json").read_text())
    assert {"gudn_train", "gudn_predict"} <= {s["rule"] for s in gu["stages"]}
    ens = json.loads((tmp_path / "results/toy/elias-ensemble.json").read_text())
    assert sum(s["rule"] == "elias_stage2" for s in ens["stages"]) == 2          # one model per clustering seed
    assert any(s["rule"] == "elias_ensemble" for s in ens["stages"])
    # every ensemble chose on validation, among each member alone and the combination (the members' validation
    # tables: ELIAS++'s out of fold from its calibrate stage, LightXML's from its model fit on train)
    for t, rule in (("elias-ensemble", "elias_ensemble"), ("lightxml-ensemble", "lightxml_ensemble"),
                    ("dual-encoder-ensemble", "dual_encoder_ensemble")):
        res = json.loads((tmp_path / f"results/toy/{t}.json").read_text())
        check = next(c for c in res["second_stages"] if c["rule"] == rule)
        assert check.get("measured", True) and {"input", "chosen"} <= set(check["valid"]), (t, check)
        assert {"lightxml-ensemble": "lightxml_valid_predict", "elias-ensemble": "elias_plus_calibrate"}.get(
            t, "dual_encoder_predict") in {s["rule"] for s in res["stages"]}, t
    # the variants and the validation table share one matcher: trained once
    assert len(list((tmp_path / "logs" / "matcher").glob("*.log"))) == 1
    # the validation table: every candidate set x combiner, rankers fit on train
    sel = json.loads((tmp_path / "results/toy/xtransformer-selection.json").read_text())
    assert {(r["candidates"], r["combiner"]) for r in sel["rows"]} == {
        (c, m) for c in ("matcher", "union", "linear") for m in ("ranker", "product", "mean")}
    assert sel["best"] in sel["rows"] and "| union | ranker" in (tmp_path / "results/toy/xtransformer-selection.md").read_text()
    union = next(r for r in sel["rows"] if r["candidates"] == "union")
    matcher_only = next(r for r in sel["rows"] if r["candidates"] == "matcher")
    assert union["label_recall_of_candidates"] >= matcher_only["label_recall_of_candidates"]
    # the matcher's guard numbers and curve are written next to it
    guard = json.loads(next((tmp_path / "results/toy/xtransformer").glob("pifa-tfidf/*/*/matcher/guard.json")).read_text())
    # the toy's 4 clusters at b = 2: its 4-step matcher, re-fit by least squares, reached 0.875 against the most frequent
    # clusters' 0.5 (the tree 0.917: it passes through allow_weak); a matcher that learned nothing stays near 0.5
    assert {"most_frequent", "linear_tree"} <= set(guard["baselines"]) and guard["matcher_recall_at_b"] >= max(
        0.75, guard["baselines"]["most_frequent"] + 0.2), guard
    # the paper's candidates (matcher top-b only) are their own rankers and predictions
    full = json.loads((tmp_path / "results/toy/xtransformer.json").read_text())
    # latency from raw text: tokens, TF-IDF, the matcher's encoder pass, the linear beam, the rankers
    parts = full["predict_latency_parts_ms_per_doc"]
    for piece in ("features/tokens/", "features/tfidf/", "/matcher/", "/clusters.record.json", "/predict.record.json"):
        assert any(piece in k for k in parts), (piece, parts)
    assert full["predict_latency_ms_per_doc"] == pytest.approx(sum(parts.values()), rel=1e-6)
    # one linear tree serves prediction (the rankers' fit, train+valid); the guard's (train) is not counted
    assert [k for k in parts if k.endswith("/clusters.record.json")] == [
        next(k for k in parts if "/linear-train+valid/" in k)], parts
    paper = json.loads((tmp_path / "results/toy/xtransformer-paper-candidates.json").read_text())
    assert any("ranker-tfidf+neural-tfn+man-matcher" in str(s) for s in paper["stages"])
    assert not any("ranker-tfidf+neural-tfn+man-matcher" in str(s) for s in full["stages"])


@pytest.mark.slow
def test_matcher_guard_stops_a_matcher_that_learned_nothing(neural_toy_run, tmp_path):
    """A matcher that cannot learn (a learning rate of 1e-12, a random head) fails its stage with
    the numbers and the config keys to change; no matcher output is left, the checkpoint is.

    Runs in a copy of the neural run's folder (Snakemake's records included), so only the
    matcher job runs again: its parameters changed, everything upstream is up to date."""
    tmp_path = tmp_path / "run"
    shutil.copytree(neural_toy_run, tmp_path, symlinks=True)
    shutil.rmtree(tmp_path / "logs" / "matcher")
    for ck in (tmp_path / "results" / "toy" / "xtransformer").glob("*/*/*/matcher/checkpoints"):
        shutil.rmtree(ck)                       # the neural run's checkpoints are not this matcher's
    (tmp_path / "results" / "toy" / "xtransformer.json").unlink()
    tiny = {k: v for k, v in NEURAL_TINY.items() if k == "xtransformer"}
    tiny = json.loads(json.dumps(tiny))
    tiny["xtransformer"]["matcher"].update(allow_weak=False, lr_head=1e-12, head_init="random")
    tiny["xtransformer"]["matcher"]["train"].update(lr=1e-12, steps=2)
    # the same data folder as the neural run: a different path to the inputs would rerun everything
    over = {"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1, **tiny}},
            "data_dir": str(neural_toy_run / "data")}
    started = time.time()
    r = _run(tmp_path, "results/toy/xtransformer.json", overrides=over, check=False, env=UNTRACKED)
    assert r.returncode != 0
    log = "".join(p.read_text() for p in (tmp_path / "logs" / "matcher").glob("*.log"))
    assert "the matcher learned too little" in log and "xtransformer.matcher.allow_weak" in log
    assert "linear_tree" in log and "most_frequent" in log
    mdir = next((tmp_path / "results" / "toy" / "xtransformer").glob("*/*/*/matcher"))
    assert not (mdir / "model.safetensors").exists() and not (mdir / "guard.json").exists()
    assert list((mdir / "checkpoints").glob("step-*"))
    assert not (tmp_path / "results" / "toy" / "xtransformer.json").exists()
    ran = [p.parent.name for p in (tmp_path / "logs").glob("*/*.log") if p.stat().st_mtime > started]
    assert "matcher" in ran and not set(ran) & {"ingest", "tfidf", "tokenize", "label_embedding", "cluster",
                                                "xtransformer_linear_train", "xtransformer_linear_clusters"}, ran
    # allow_weak lets the same matcher job go on, from the kept checkpoint (no training again);
    # the stages after it are the neural DAG test's
    tiny["xtransformer"]["matcher"]["allow_weak"] = True
    over["datasets"]["toy"].update(tiny)
    _run(tmp_path, str((mdir / "guard.json").relative_to(tmp_path)), overrides=over, env=UNTRACKED)
    log = "".join(p.read_text() for p in (tmp_path / "logs" / "matcher").glob("*.log"))
    assert "training already complete" in log and "continuing: xtransformer.matcher.allow_weak is true" in log
    guard = json.loads((mdir / "guard.json").read_text())
    assert guard["passed"] is False and guard["allow_weak"] is True


@pytest.mark.slow
def test_elias_guard_stops_a_stage_that_learned_nothing(neural_toy_run, tmp_path):
    """An ELIAS stage 1 that cannot learn (learning rates of 1e-12, the paper's random start, no re-fit) fails with
    the numbers and the config keys to change; its checkpoint stays, and allow_weak then goes on from
    it without training again.  Runs in a copy of the neural run's folder, so only ELIAS reruns."""
    tmp_path = tmp_path / "run"
    shutil.copytree(neural_toy_run, tmp_path, symlinks=True)
    tiny = json.loads(json.dumps({k: v for k, v in NEURAL_TINY.items() if k == "elias"}))
    tiny["elias"].update(allow_weak=False, head_init="random", head_refit=False, seeds=[0])
    tiny["elias"]["stage1"].update(lr_encoder=1e-12, lr_clf=1e-12)
    over = {"datasets": {"toy": {"cluster": {"leaf_size": 2, "branching": 2}, "threads": 1, **tiny}},
            "data_dir": str(neural_toy_run / "data")}
    started = time.time()
    r = _run(tmp_path, "results/toy/elias-stage1.json", overrides=over, check=False, env=UNTRACKED)
    assert r.returncode != 0
    log = "".join(p.read_text() for p in (tmp_path / "logs" / "elias_stage1").glob("*.log")
                  if p.stat().st_mtime > started)
    assert "ELIAS stage 1 learned too little" in log and "elias.allow_weak" in log
    assert "linear_tree" in log and "most_frequent" in log
    s1 = next((tmp_path / "results" / "toy" / "elias").glob("tree-*-s0/minilm-16/stage1"))
    assert not (s1 / "model.safetensors").exists() and not (s1 / "guard.json").exists()
    assert list((s1 / "checkpoints").glob("step-*"))
    ran = [p.parent.name for p in (tmp_path / "logs").glob("*/*.log") if p.stat().st_mtime > started]
    assert "elias_stage1" in ran and not set(ran) & {"ingest", "tfidf", "tokenize", "cluster",
                                                     "xtransformer_linear_train"}, ran
    tiny["elias"]["allow_weak"] = True
    over["datasets"]["toy"].update(tiny)
    _run(tmp_path, str((s1 / "guard.json").relative_to(tmp_path)), overrides=over, env=UNTRACKED)
    log = "".join(p.read_text() for p in (tmp_path / "logs" / "elias_stage1").glob("*.log"))
    assert "training already complete" in log and "continuing: elias.allow_weak is true" in log
    guard = json.loads((s1 / "guard.json").read_text())
    assert guard["passed"] is False and guard["allow_weak"] is True and (s1 / "curve.png").stat().st_size > 0


def test_nested_command_line_overrides_take_the_schemas_types(tmp_path):
    """Issue 54.4: the README's `--config 'datasets={...}'` with a number: Snakemake hands '10' on as a string;
    the plan converts it by the schema and the stage receives the integer (a word that is no integer stops
    the plan naming the key, in one line)."""
    _toy(tmp_path)
    over = 'datasets={"toy": {"xr_linear": {"beam": 7}, "cluster": {"leaf_size": 2, "branching": 2}}}'
    r = _run(tmp_path, "results/toy/xr-linear.json", extra=("-n", "-p", "--config", over))
    assert '"beam": 7' in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    bad = 'datasets={"toy": {"xr_linear": {"beam": "seven"}}}'
    r = _run(tmp_path, "results/toy/xr-linear.json", extra=("-n", "--config", bad), check=False)
    assert r.returncode != 0 and "datasets.toy.xr_linear.beam': 'seven' is not of type 'integer'" in r.stderr
    assert "Traceback" not in r.stderr
