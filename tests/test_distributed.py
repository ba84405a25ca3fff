"""Data-parallel training (xmc_steps.distributed, the shared trainer under DDP): the global batch's arithmetic,
and 2 processes under torchrun (gloo, the CPU) against 1 process.

Equivalence.  2 processes at per-rank batch B/2 must reach the weights 1 process reaches at batch B after the
same steps (tests/ddp_cases.py: the tiny encoder without dropout, 4 optimisation steps, one thread per process).
Tolerance: |w_2 - w_1| <= TOL = 2e-5 for every weight.  Why that figure: in exact arithmetic the two runs take the
same steps (the ranks' parts are exactly the one process's batch, each rank's mean loss weighted by its share, DDP
averaging the gradients, the dual encoder's labels gathered); in float32 the mean over B and the mean of two means
over B/2 are summed in another order, so a gradient differs in its last bits (relative ~1e-7).  AdamW divides each
coordinate by its own running scale: where a gradient is far above eps (1e-8) the update's relative error stays
~1e-7 of a step (<= lr = 1e-3); where a gradient is as small as eps the update can move by a larger part of a
step.  Measured: 5e-7 (generic), 4e-6 (matcher), 1.2e-6 (dual encoder), 3.5e-8 and 4e-9 (ELIAS stages 1 and 2:
most of their weights move at the encoder's 1e-4), 8e-8 (LightXML), 1.2e-7 (GUDN), 1.8e-7 (GUDN with the feature
loss ``relative`` weighted ``balanced``, both over the global batch), all below TOL = 2 % of one step at the
encoder's rate.  A wrong sharding (every rank on the same half) moves weights by 2e-3 (ELIAS stage 1) to 3e-2,
the dual encoder without the gather by 5e-3, GUDN's ``relative`` measured per rank by 4e-3 (>= 100 x TOL): the
tests check that they are caught (> 50 x TOL).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from xmc_steps import distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_encoder import make_tiny_encoder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).resolve().parent / "ddp_cases.py"
TOL = 2e-5
#: the cases (tests/ddp_cases.py: the label heads' row exchange, then the trainers') and the faulty run each is
#: checked against (None: none)
FAULTS = {"rows": None, "generic": "generic-wrong", "matcher": None, "dual": "dual-nogather", "elias1": "elias1-wrong",
          "elias2": None, "lightxml": "lightxml-wrong", "gudn": None, "gudnrel": "gudnrel-local"}
RIGHT = tuple(FAULTS)


# --------------------------------------------------------------------------- the global batch


def test_per_rank_batch_keeps_the_configured_batch_and_names_the_keys_when_it_does_not_divide():
    assert distributed.per_rank_batch(32, 4, 1) == 32
    assert distributed.per_rank_batch(32, 4, 4) == 8          # 8 x 4 accumulation x 4 ranks = 32 x 4
    assert distributed.per_rank_batch(16, 1, 16) == 1
    with pytest.raises(ValueError) as e:
        distributed.per_rank_batch(30, 2, 4, section="xtransformer.matcher.train")
    msg = str(e.value)
    assert "xtransformer.matcher.train.batch_size = 30" in msg and "xtransformer.matcher.train.grad_accum" in msg
    assert "gpus x nodes" in msg and "multiple of 4" in msg


def test_shard_covers_the_global_batch_once_and_weights_give_its_mean():
    rng = np.random.default_rng(0)
    for world in (1, 2, 3, 8):
        for n in (1, 5, 8, 21):
            idx = rng.permutation(100)[:n]
            parts = [distributed.shard(idx, r, world) for r in range(world)]
            real = np.concatenate([p[:k] for p, k in parts])
            assert np.array_equal(real, idx)                      # consecutive parts, each example once, in order
            assert all(len(p) >= 1 for p, _ in parts)             # every rank runs the step (a stand-in if need be)
            # the ranks' weighted means average to the global mean of any per-example values
            x = rng.normal(size=100)
            got = np.mean([distributed.loss_weight(k, n, world) * (x[p[:k]].mean() if k else 0.0)
                           for p, k in parts])
            assert got == pytest.approx(x[idx].mean(), rel=1e-12)
    assert len(distributed.shard(np.arange(32), 1, 4)[0]) == 8


def test_single_process_is_untouched(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init_from_env("cpu") is False
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    t = torch.arange(6.0).reshape(3, 2)
    assert distributed.gather_rows(t)[0] is t
    assert distributed.shard(np.arange(5))[1] == 5 and distributed.loss_weight(3, 5) == 1.0


def test_collective_timeout_is_named_and_checked(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.collective_timeout().total_seconds() == distributed.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "90")
    assert distributed.collective_timeout().total_seconds() == 90
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=distributed.TIMEOUT_ENV):
        distributed.collective_timeout()


def test_trainer_refuses_a_batch_the_world_does_not_divide(monkeypatch):
    from xmc_steps import trainer

    monkeypatch.setenv("WORLD_SIZE", "3")          # checked before any process group is joined
    model = torch.nn.Linear(2, 1)
    p = trainer.TrainParams(steps=2, batch_size=8, lr=0.1, warmup_steps=0)
    with pytest.raises(ValueError, match="train.batch_size = 8 does not divide over 3 processes"):
        trainer.Trainer(model, trainer.param_groups({"m": (model, 0.1)}), p, None, device="cpu")


# --------------------------------------------------------------------------- 2 processes against 1


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("ddp") / "bert", dropout=0.0)


def torchrun(cases: str, encoder: str, out: Path, ckpt: Path | None = None, env: dict | None = None,
             check: bool = True, nproc: int = 2) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(CASES),
           cases, encoder, str(out)] + ([str(ckpt)] if ckpt else [])
    e = {**os.environ, "OMP_NUM_THREADS": "1", "XMC_TRACKING": "0", **(env or {})}
    e.pop("WORLD_SIZE", None)
    # its own process group: a hung run is ended with its workers (a timeout would otherwise end torchrun alone)
    p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"torchrun hung (300 s):\n{out[-3000:]}\n{err[-6000:]}") from None
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check and r.returncode != 0:
        raise AssertionError(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r


def max_diff(a, b) -> float:
    a = dict(a)
    b = dict(b)
    assert sorted(a) == sorted(b)
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.fixture(scope="module")
def two_processes(encoder, tmp_path_factory):
    """Every case, and the faulty ones, trained by 2 processes in one torchrun launch."""
    out = tmp_path_factory.mktemp("ddp_out")
    # the label heads' rows exchanged sparsely whatever their count (the tiny heads would go dense)
    torchrun(",".join(RIGHT + tuple(f for f in FAULTS.values() if f)), encoder, out,
             env={"XMC_ROW_EXCHANGE": "rows"})
    return {p.stem: dict(np.load(p)) for p in out.glob("*.npz")}


@pytest.mark.parametrize("case", RIGHT)
def test_two_processes_at_half_the_batch_reach_the_weights_of_one(case, encoder, two_processes):
    import ddp_cases

    fault = FAULTS[case]
    one = ddp_cases.run(case, encoder)
    d = max_diff(two_processes[case], one)
    assert d <= TOL, f"{case}: 2 processes at B/2 differ from 1 at B by {d:.3g} > {TOL}"
    if fault:      # the test can fail: a wrong sharding, or no gather of the labels, is far outside the tolerance
        assert max_diff(two_processes[fault], one) > 50 * TOL


def test_the_data_parallel_path_with_one_process_is_the_single_process_path(encoder, tmp_path):
    """``XMC_DDP=1`` under ``torchrun --nproc-per-node 1``: a process group of one, DDP, the shards, the row
    exchange, the dual encoder's gather and every all-reduce run, and the weights are the single-process
    path's bit for bit (gloo here; bench/gpu_ddp.sh runs a target so over NCCL on a GPU)."""
    import ddp_cases

    torchrun("generic,lightxml,dual", encoder, tmp_path, env={distributed.FORCE_ENV: "1"}, nproc=1)
    for case in ("generic", "lightxml", "dual"):
        d = max_diff(np.load(tmp_path / f"{case}.npz"), ddp_cases.run(case, encoder))
        assert d == 0.0, f"{case}: the forced data-parallel path with one process differs by {d:.3g}"


def test_sigterm_on_one_rank_stops_every_rank_at_one_checkpoint_and_the_rerun_resumes(encoder, tmp_path,
                                                                                       two_processes):
    ckpt = tmp_path / "ckpt"
    r = torchrun("generic", encoder, tmp_path / "cut", ckpt, env={"DDP_CASES_SIGTERM_AT": "2"}, check=False)
    assert r.returncode != 0
    assert "another rank received SIGTERM" in r.stderr + r.stdout          # rank 0 heard of rank 1's signal
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003"]     # after the next step: one checkpoint, whole
    assert not (tmp_path / "cut" / "generic.npz").exists()
    torchrun("generic", encoder, tmp_path / "cut", ckpt)
    assert (tmp_path / "cut" / "generic.npz").exists()
    d = max_diff(np.load(tmp_path / "cut" / "generic.npz"), two_processes["generic"])    # the uninterrupted run
    assert d == 0.0, f"the resumed run differs from the uninterrupted one by {d:.3g}"


def test_kill_9_of_one_rank_ends_the_run_and_the_rerun_resumes_from_the_last_checkpoint(encoder, tmp_path,
                                                                                        two_processes):
    """``kill -9`` of rank 1 after step 3 (no handler runs, rank 1 writes nothing): rank 0's next collective fails
    at once (gloo: the peer closed its connection), torchrun reports rank 1's SIGKILL as the root cause, sends
    the other rank SIGTERM and exits non-zero -- seconds, well inside the collective timeout set here (60 s; on
    NCCL, where a dead peer may leave the collective waiting, torchrun's SIGTERM or that timeout ends it).  The
    checkpoints rank 0 wrote (every step; step 3's was not, its step ending in the failed collective) are whole,
    and a rerun resumes from the last, step 2, and ends with the uninterrupted run's weights, bit for bit."""
    import time

    ckpt = tmp_path / "ckpt"
    t0 = time.monotonic()
    r = torchrun("generic", encoder, tmp_path / "cut", ckpt, check=False,
                 env={"DDP_CASES_KILL_AT": "3", "DDP_CASES_CHECKPOINT_EVERY": "1", distributed.TIMEOUT_ENV: "60"})
    took = time.monotonic() - t0
    assert r.returncode != 0
    err = r.stderr + r.stdout
    assert "exitcode  : -9" in err and "Signal 9 (SIGKILL)" in err                  # rank 1's kill, reported
    # rank 0 failed at its next collective, not waiting (gloo: the peer closed or reset the connection); on a loaded
    # machine torchrun's SIGTERM, sent once rank 1's death is seen, may reach rank 0 before that collective does
    assert re.search(r"Connection (closed|reset) by peer|exitcode  : -15 .*\(SIGTERM\)", err), err[-3000:]
    assert took < 60, f"the run took {took:.0f} s after a kill -9 (collective timeout 60 s)"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "cut" / "generic.npz").exists()
    again = torchrun("generic", encoder, tmp_path / "cut", ckpt, env={"DDP_CASES_CHECKPOINT_EVERY": "1"})
    assert all(f"generic: rank {r} resumed from step 2" in again.stderr for r in (0, 1)), again.stderr[-3000:]
    d = max_diff(np.load(tmp_path / "cut" / "generic.npz"), two_processes["generic"])    # the uninterrupted run
    assert d == 0.0, f"the resumed run differs from the uninterrupted one by {d:.3g}"


# --------------------------------------------------------------------------- prediction sharded over ranks


def test_shard_batches_deal_the_one_process_batches_round_the_ranks():
    """Every text in one rank's part, in the batch one process runs it in (the part's own pass forms those
    batches again), the ranks' loads within a batch."""
    from xmc_steps import neural
    from xmc_steps.neural_stage import shard_batches

    rng = np.random.default_rng(0)
    for n, b, world in ((37, 4, 2), (10, 3, 4), (5, 8, 3), (64, 8, 8), (1, 4, 2)):
        lengths = rng.integers(1, 6, n)                       # many ties of length
        one = [list(x) for x in neural.iter_batches(neural.TokenData(np.zeros((n, 6)), lengths), b)]
        parts = [shard_batches(lengths, b, r, world) for r in range(world)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(n))
        for r, part in enumerate(parts):
            own = [list(part[x]) for x in neural.iter_batches(neural.TokenData(np.zeros((len(part), 6)),
                                                                               lengths[part]), b)]
            assert own == one[r::world]
        assert max(map(len, parts)) - min(map(len, parts)) <= b


def test_prediction_and_embedding_sharded_over_2_processes_equal_one_process(encoder, tmp_path):
    """LightXML's predict stage (LightXML's and GUDN's rules) and the embed stage, run by 2 gloo processes under
    torchrun (tests/ddp_predict.py: rank 0's rows gathered in messages of 3 texts), write what one process
    writes, bit for bit: a text meets the same batch (neighbours, padded width) on its rank as in one process
    (xmc_steps.neural_stage.sharded_inference), and the CPU's kernels are deterministic for a shape."""
    import json

    import ddp_predict

    from xmc_steps import io

    ddp_predict.make(str(tmp_path), encoder)
    ddp_predict.run(str(tmp_path), "w1")
    e = {**os.environ, "OMP_NUM_THREADS": "1", "XMC_TRACKING": "0"}
    e.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(CASES.parent / "ddp_predict.py"), str(tmp_path)], cwd=ROOT, env=e, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-6000:]
    one = io.read_predictions(tmp_path / "w1" / "predictions.parquet", ddp_predict.L)
    two = io.read_predictions(tmp_path / "w2" / "predictions.parquet", ddp_predict.L)
    assert one.shape == (ddp_predict.N, ddp_predict.L) and one.nnz >= 3 * ddp_predict.N
    assert np.array_equal(one.indptr, two.indptr) and np.array_equal(one.indices, two.indices)
    assert np.array_equal(one.data, two.data)                                   # max difference 0
    e1, e2 = (io.load_arrays(tmp_path / w / "emb_test.npz")["emb"] for w in ("w1", "w2"))
    assert e1.shape == (ddp_predict.N, 32) and np.array_equal(e1, e2)
    rec = json.loads((tmp_path / "w2" / "predict.json").read_text())
    assert rec["extra"]["processes"] == 2
    assert sorted(p.name for p in (tmp_path / "w2").iterdir()) == sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert "rank1" in r.stderr                                  # rank 1 predicted (its own log lines)


def test_the_passes_at_the_end_of_training_are_sharded_and_write_what_one_process_writes(encoder, tmp_path):
    """The training stages' own passes after the last step (the matcher's embeddings of every split, ELIAS stage 1's
    and LightXML's embeddings of the training texts, the dual encoder's label table) are shared by the ranks
    (tests/ddp_finish.py: 2 gloo processes, 2 steps of each trainer at a global batch of 8).

    Within the 2-process run every pass gives rank 0 the rows one pass over all texts gives with the same trained
    weights, bit for bit (the sharding is exact), and each rank embedded half of the texts.  Against one process,
    what is written differs only as the trained weights do (TOL, the training equivalence above): the
    embeddings, the label table and the top-b clusters' scores by <= TOL (measured 4.8e-7, 9e-8, 2.0e-6 and
    ELIAS's 4.3e-6), the clusters chosen, the heads the re-fits keep and the validation figures identical.  The
    re-fit heads themselves are left out: a ridge fit over 24 texts amplifies the training's last-bit differences
    (LightXML's label embeddings by 0.1 of 1808)."""
    import json

    import ddp_finish

    from xmc_steps import io

    ddp_finish.make(str(tmp_path))
    ddp_finish.run(str(tmp_path), encoder, "w1")
    e = {**os.environ, "OMP_NUM_THREADS": "1", "XMC_TRACKING": "0"}
    e.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(CASES.parent / "ddp_finish.py"), str(tmp_path), encoder], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-6000:]
    p0, p1 = (json.loads((tmp_path / "w2" / f"passes_rank{k}.json").read_text()) for k in (0, 1))
    stages = ["matcher"] * 3 + ["elias", "lightxml", "dual_encoder"]
    assert [p["stage"] for p in p0] == stages == [p["stage"] for p in p1]
    for a, b in zip(p0, p1):
        assert a["world"] == b["world"] == 2 and a["exact"] is True, (a, b)
        assert a["mine"] + b["mine"] == a["texts"] and a["mine"] > 0 and b["mine"] > 0, (a, b)

    def both(*path):
        return [tmp_path / w / Path(*path) for w in ("w1", "w2")]

    def close(a, b):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL

    def same_top(a, b):
        assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
        close(a.data, b.data)

    for s in ("train", "valid", "test"):
        close(*(io.load_arrays(f)["emb"] for f in both("matcher", f"emb_{s}.npz")))
        same_top(*(io.load_csr(f) for f in both("matcher", f"clusters_{s}.npz")))
    same_top(*(io.load_csr(f) for f in both("elias", "clusters_train.npz")))
    close(*(io.load_arrays(f)["emb"] for f in both("dual_encoder", "label_emb.npz")))
    g1, g2 = (io.read_json(f) for f in both("matcher", "guard.json"))
    assert g1["head"] == g2["head"] and g1["matcher_recall_at_b"] == g2["matcher_recall_at_b"]
    for st, js, keys in (("elias", "elias.json", ("valid",)), ("lightxml", "lightxml.json", ("valid", "generator"))):
        m1, m2 = (io.read_json(f) for f in both(st, js))
        assert all(m1[k] == m2[k] for k in keys), st
    rec = json.loads((tmp_path / "w2" / "matcher" / "record.json").read_text())
    assert rec["extra"]["processes"] == 2
    for st in ddp_finish.STAGES:
        assert sorted(p.name for p in (tmp_path / "w2" / st).iterdir()) == sorted(
            p.name for p in (tmp_path / "w1" / st).iterdir())


# --------------------------------------------------------------------------- the stage harness under torchrun


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_writes_its_log_record_and_run_on_rank_0_alone(rank, tmp_path, monkeypatch):
    """Under torchrun every rank runs the stage; rank 0 alone writes the log file and the record (and logs to
    MLflow), and a failing rank other than 0 removes nothing (rank 0's outputs)."""
    import argparse

    from xmc_steps.stage import add_common_args, stage_run

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    args = add_common_args(argparse.ArgumentParser()).parse_args(
        ["--log", str(tmp_path / "x.log"), "--record", str(tmp_path / "record.json"), "--no-tracking"])
    with stage_run("x", args) as st:
        st.log.info("trained")
    assert (tmp_path / "record.json").exists() == (rank == 0)
    assert (tmp_path / "x.log").exists() == (rank == 0)
    kept = tmp_path / "out.bin"
    kept.write_bytes(b"rank 0's")
    with pytest.raises(RuntimeError):
        with stage_run("x", args, outputs=[str(kept)]):
            raise RuntimeError("a rank fails")
    assert kept.exists() == (rank > 0)


# --------------------------------------------------------------------------- the rules' launcher


def test_the_launcher_is_the_interpreter_for_one_gpu_and_torchrun_for_several(monkeypatch):
    import shlex

    from xmc_steps import launch

    monkeypatch.delenv("XMC_DDP", raising=False)
    py = "/opt/my env/$(touch x)/python"
    assert launch.command(py) == shlex.quote(py)
    one_node = launch.command(py, gpus=4)
    assert shlex.split(one_node) == [py, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                                     "-m", "xmc_steps.launch", "--"]
    two = launch.command(py, gpus=8, nodes=2)
    words = shlex.split(two.replace('"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"', "HEAD")
                        .replace('"$SLURM_JOB_ID"', "JOB"))
    assert words[:5] == ["srun", "--nodes", "2", "--ntasks-per-node", "1"]
    assert words[words.index(py):] == [py, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--nnodes", "2",
                                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "HEAD:29500", "--rdzv-id", "JOB",
                                       "-m", "xmc_steps.launch", "--"]
    assert launch.processes({"gpus": 8, "nodes": 2}) == 16 and launch.gpus_of({}) == 1
    monkeypatch.setenv("XMC_DDP", "1")    # the data-parallel path with one process: torchrun even for one GPU
    assert shlex.split(launch.command(py))[:6] == [py, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                                   "--standalone"]
    with pytest.raises(ValueError):
        launch.command(py, gpus=0)


# --------------------------------------------------------------------------- through Snakemake


@pytest.mark.slow
def test_a_target_with_gpus_2_trains_under_torchrun_on_the_cpu(neural_toy_run, tmp_path):
    """LightXML's toy target with ``lightxml.gpus: 2``: the rules start its training and its prediction under
    torchrun (2 gloo processes on the CPU), rank 0 writes the records, the model and the predictions, the target
    is evaluated.  Runs in a copy of the
    neural toy run (tests/conftest.py), so that only LightXML's jobs run again (their settings changed)."""
    import copy
    import json
    import shutil
    import time

    import test_workflow as tw

    run = tmp_path / "run"
    shutil.copytree(neural_toy_run, run, symlinks=True)
    shutil.rmtree(run / "logs" / "lightxml_train", ignore_errors=True)
    over = copy.deepcopy(tw.NEURAL_OVERRIDES)
    over["data_dir"] = str(neural_toy_run / "data")      # the same inputs: nothing upstream runs again
    over["datasets"]["toy"]["lightxml"].update(gpus=2, train={**over["datasets"]["toy"]["lightxml"]["train"],
                                                               "epochs": 1})
    started = time.time()
    tw._run(run, "results/toy/lightxml.json", overrides=over, env={"XMC_TRACKING": "0"})   # as the folder it copies
    log = "".join(p.read_text() for p in (run / "logs" / "lightxml_train").glob("*.log"))
    assert "distributed: rank 0 of 2" in log and "data parallel: rank 0 of 2" in log
    assert "rank1" not in log                              # the other rank logs to stderr, not the log file
    ran = {p.parent.name for p in (run / "logs").glob("*/*.log") if p.stat().st_mtime > started}
    assert "lightxml_train" in ran and not ran & {"ingest", "tokenize", "cluster"}, ran
    # the target's model (the toy run's lightxml-ensemble also holds a second clustering's, not run again)
    records = [json.loads(p.read_text()) for p in (run / "results" / "toy" / "lightxml").glob("tree-*-s0/**/*record.json")]
    train = [r for r in records if r["rule"] == "lightxml_train"]
    assert len(train) == 1 and train[0]["extra"]["processes"] == 2
    predict = [r for r in records if r["rule"] == "lightxml_predict"]       # its predict rule: 2 processes too
    assert len(predict) == 1 and predict[0]["extra"]["processes"] == 2
    res = json.loads((run / "results" / "toy" / "lightxml.json").read_text())
    assert res["metrics"]["p_at_1"] > 0


def test_an_encoder_freezes_the_weights_no_forward_reaches(encoder):
    """DDP runs without find_unused_parameters: an encoder's weights that no forward of ours reaches (XLNet's
    mask_emb; here one added to the tiny BERT) are found and frozen, the others left as they are."""
    from xmc_steps import neural

    enc = neural.TextEncoder(encoder)
    enc.model.register_parameter("mask_emb", torch.nn.Parameter(torch.zeros(1, 1, enc.hidden)))
    enc.train()
    assert enc.freeze_unreachable() == ["model.mask_emb"]
    assert not enc.model.mask_emb.requires_grad and enc.training
    assert all(p.requires_grad for n, p in enc.named_parameters() if n != "model.mask_emb")
    assert enc.freeze_unreachable() == []
