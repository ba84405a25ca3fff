"""The SLURM profile on a real (one-node) SLURM: `scripts/slurm-local.sh start` sets one up.

The toy xr-linear target and a tiny neural target (ELIAS stage 1, a GPU rule) run with
`--workflow-profile workflow/profiles/slurm`; every non-local job must go through
sbatch with the resources its rule declares (the GPU rules with --gpus), and the
metrics must equal those of a local run.  Skipped where there is no SLURM.
"""

import json
import re
import shutil
import subprocess
import time

import pytest

from conftest import ROOT
from test_workflow import NEURAL_OVERRIDES, RUN_TIMEOUT, _command, _run, _toy

TARGETS = ["results/toy/xr-linear.json", "results/toy/elias-stage1.json"]
OVERRIDES = NEURAL_OVERRIDES     # the neural toy run's settings: its folder is the local run (below)
GPU_RULES = {"matcher", "embed_pretrained", "elias_stage1", "elias_stage2", "elias_predict"}
SLURM_ARGS = [
    "--workflow-profile", str(ROOT / "workflow" / "profiles" / "slurm"),
    "--slurm-init-seconds-before-status-checks", "2",   # toy jobs take seconds:
    "--seconds-between-status-checks", "2",             # poll often (the profile's pace suits
    "--max-status-checks-per-second", "5",              # hour-long jobs; CI time is what counts here)
    "--slurm-keep-successful-logs",
    "--latency-wait", "5",                              # one machine: no file system lag
    "--verbose",                                        # prints each sbatch call
]


def _idle_node() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-t", "idle,mix", "-o", "%n"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _idle_node(), reason="no SLURM here (sinfo missing or no idle node): "
                                                       "run scripts/slurm-local.sh start")]


def _jobs(out: str) -> list[dict]:
    """The jobs of a --verbose SLURM run: rule, declared resources and threads, sbatch call, SLURM id."""
    blocks = {}
    for m in re.finditer(r"^(local)?rule (\w+):\n((?:    .*\n)+)", out, re.M):
        body = m.group(3)
        jobid = re.search(r"^    jobid: (\d+)", body, re.M)
        res = re.search(r"^    resources: (.*)$", body, re.M)
        threads = re.search(r"^    threads: (\d+)", body, re.M)
        resources = dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {}
        blocks[jobid.group(1)] = {"rule": m.group(2), "local": bool(m.group(1)), "resources": resources,
                                  "threads": int(threads.group(1)) if threads else 1}
    # pair each sbatch call with its submission through the SLURM log path (unique per job):
    # "--output <dir>/rule_X/<wildcards>/%j.log" <-> "Job N has been submitted with SLURM jobid J (log: <dir>/.../J.log)"
    calls = {}
    for m in re.finditer(r"^sbatch call: (.*)$", out, re.M):
        o = re.search(r"--output '?(\S+?/)%j\.log", m.group(1))
        calls[o.group(1)] = m.group(1)
    jobs = []
    for m in re.finditer(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+/)\d+\.log\)", out):
        jobs.append(dict(blocks[m.group(1)], sbatch=calls[m.group(3)], slurm_id=m.group(2)))
    return jobs, blocks


class BackgroundRun:
    """The SLURM half of :func:`runs`, started by tests/conftest.py when the session starts: its jobs
    mostly wait (a Snakemake start inside each SLURM job, at least 14 s a level over the chain's eight
    levels on a 2-core machine, about 3 minutes for a few seconds of work), so it overlaps the other
    tests instead of adding its wait at the end.  Output to files (a pipe nobody reads would fill)."""

    def __init__(self, folder):
        self.folder = folder
        cmd, env = _command(folder, *TARGETS, overrides=OVERRIDES, extra=SLURM_ARGS)
        self._out, self._err = (open(folder / f"snakemake-slurm.{k}", "w") for k in ("stdout", "stderr"))
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=folder, stdout=self._out, stderr=self._err, text=True, env=env)

    def result(self, timeout=RUN_TIMEOUT):
        """(output, seconds from start to end), once the run ended; an AssertionError if it failed."""
        rc = self.proc.wait(timeout=timeout)
        self._out.close(), self._err.close()
        out = (self.folder / "snakemake-slurm.stdout").read_text() + (self.folder / "snakemake-slurm.stderr").read_text()
        if rc != 0:
            raise AssertionError(f"snakemake under SLURM failed ({rc}):\n{out[-6000:]}")
        return out, (self.folder / "snakemake-slurm.stderr").stat().st_mtime - self.t0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close(), self._err.close()


def start_background_run(tmp_path_factory) -> BackgroundRun | None:
    """A :class:`BackgroundRun` in a fresh toy folder, or None where there is no SLURM."""
    if not _idle_node():
        return None
    slurm = tmp_path_factory.mktemp("slurm")
    _toy(slurm)
    return BackgroundRun(slurm)


@pytest.fixture(scope="module")
def runs(neural_toy_run, slurm_background_run, tmp_path_factory):
    """The targets run locally and on SLURM, in two folders: (local dir, slurm dir, slurm output, seconds).
    The local run is the neural toy run's folder (same settings), which already holds the shared
    stages and the stage-1 ELIAS model: only these targets' own jobs run there.  The SLURM run is the
    one started with the session (tests/conftest.py), or started here when that did not happen."""
    local = neural_toy_run
    _run(local, *TARGETS, overrides=OVERRIDES, env={"XMC_TRACKING": "0"})   # as the neural toy run: no MLflow
    bg = slurm_background_run or start_background_run(tmp_path_factory)
    out, seconds = bg.result()
    return local, bg.folder, out, seconds


def test_every_job_went_through_sbatch_with_its_rules_resources(runs):
    _, slurm, out, seconds = runs
    print(f"SLURM run of {TARGETS}: {seconds:.0f} s from its start (beside other tests)")
    jobs, blocks = _jobs(out)
    submitted = {j["rule"] for j in jobs}
    assert {"ingest", "tfidf", "cluster", "xr_linear_train", "xr_linear_predict", "tokenize",
            "elias_stage1", "elias_predict", "evaluate"} <= submitted, sorted(submitted)
    # every job that is not a localrule was submitted, none ran on the submit host
    assert len(jobs) == sum(not b["local"] for b in blocks.values())
    for j in jobs:
        call, res = j["sbatch"], j["resources"]
        assert call.startswith("sbatch "), call
        assert f"--mem {res['mem_mb']} " in call, (j["rule"], res, call)
        assert f"-t {res['runtime']} " in call, (j["rule"], res, call)
        gpu = j["rule"] in GPU_RULES
        assert (res.get("gpu") == "1") == gpu, (j["rule"], res)
        assert ("--gpus=1" in call) == gpu, (j["rule"], call)
        assert f"--cpus-per-task={j['threads']}" in call, (j["rule"], j["threads"], call)   # GPU rules too
        # the job's SLURM log (kept with --slurm-keep-successful-logs)
        assert list((slurm / ".snakemake" / "slurm_logs" / f"rule_{j['rule']}").rglob(f"{j['slurm_id']}.log")), j
    # what the rules declare, independently of the output parsed above
    ev = next(j for j in jobs if j["rule"] == "evaluate")
    assert "--mem 8000 " in ev["sbatch"] and "-t 30 " in ev["sbatch"]
    st1 = next(j for j in jobs if j["rule"] == "elias_stage1")
    assert "--gpus=1" in st1["sbatch"] and "--mem 16000 " in st1["sbatch"] and "-t 1440 " in st1["sbatch"]


def test_gpu_job_was_granted_a_gpu(runs):
    _, _, out, _ = runs
    jobs, _ = _jobs(out)
    gpu_jobs = [j for j in jobs if j["rule"] in GPU_RULES]
    assert gpu_jobs
    seen = 0
    for j in gpu_jobs:
        r = subprocess.run(["scontrol", "show", "job", j["slurm_id"]], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:            # forgotten by slurmctld already (MinJobAge): the sbatch call is checked above
            continue
        seen += 1
        assert re.search(r"gres[:/]gpu[:=]1", r.stdout), r.stdout
        assert "JobState=COMPLETED" in r.stdout, r.stdout
    if not seen:
        pytest.skip("slurmctld no longer knows the jobs (MinJobAge too short)")


def test_metrics_equal_a_local_run(runs):
    local, slurm, _, _ = runs
    for t in TARGETS:
        a = json.loads((slurm / t).read_text())
        b = json.loads((local / t).read_text())
        assert a["config_hash"] == b["config_hash"], t
        assert set(a["metrics"]) == set(b["metrics"]), t
        for k, v in b["metrics"].items():
            if k.startswith("p_at_"):
                assert a["metrics"][k] == v, (t, k)
            else:
                # xr_linear_train is not bit-reproducible from run to run (also locally):
                # rankers differ in the last digits, propensity-scored metrics by ~1e-5
                assert a["metrics"][k] == pytest.approx(v, rel=1e-3, abs=1e-3), (t, k)
