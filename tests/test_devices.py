"""xmc_steps.devices.require_device: a GPU rule without a GPU fails unless the CPU is allowed."""

import logging

import pytest
import torch

from xmc_steps.devices import require_device
from xmc_steps.errors import StageError


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_picks_cuda_when_available(two_gpus):
    assert require_device("auto", allow_cpu_fallback=False) == torch.device("cuda")
    assert require_device("auto", allow_cpu_fallback=True) == torch.device("cuda")
    assert require_device("", allow_cpu_fallback=False) == torch.device("cuda")      # empty = auto


def test_auto_without_gpu_fails_naming_the_key_and_cuda_visible_devices(no_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(StageError) as e:
        require_device("auto", allow_cpu_fallback=False)
    msg = str(e.value)
    assert "allow_cpu_fallback" in msg and "CUDA_VISIBLE_DEVICES" in msg
    assert "needs a GPU" in msg


def test_error_names_the_rule_and_its_config_key(no_gpu, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(StageError) as e:
        require_device("auto", False, config_key="elias.allow_cpu_fallback", rule="elias_stage1")
    msg = str(e.value)
    assert "elias.allow_cpu_fallback: true" in msg and "'elias_stage1'" in msg
    assert "CUDA_VISIBLE_DEVICES=unset" in msg


def test_error_mentions_the_slurm_job(no_gpu, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(StageError, match=r"SLURM job 42") as e:
        require_device("auto", False)
    assert "CUDA_VISIBLE_DEVICES='0'" in str(e.value)


def test_auto_without_gpu_falls_back_when_allowed(no_gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="xmc.devices"):
        assert require_device("auto", allow_cpu_fallback=True) == torch.device("cpu")
    assert "running on the CPU" in caplog.text


def test_explicit_cuda_without_gpu(no_gpu):
    with pytest.raises(StageError, match="allow_cpu_fallback"):
        require_device("cuda", allow_cpu_fallback=False)
    with pytest.raises(StageError, match="allow_cpu_fallback"):
        require_device("cuda:1", allow_cpu_fallback=False)
    assert require_device("cuda", allow_cpu_fallback=True) == torch.device("cpu")


def test_explicit_cuda_with_gpus(two_gpus):
    assert require_device("cuda", False) == torch.device("cuda")
    assert require_device("CUDA:1", False) == torch.device("cuda", 1)
    with pytest.raises(StageError, match="only 2 CUDA device"):
        require_device("cuda:2", allow_cpu_fallback=True)        # a wrong index is never a fallback


def test_cpu_is_always_allowed(no_gpu, two_gpus):
    assert require_device("cpu", allow_cpu_fallback=False) == torch.device("cpu")


def test_unknown_device_is_an_error(two_gpus):
    with pytest.raises(StageError, match="unknown device"):
        require_device("tpu0", allow_cpu_fallback=True)
    with pytest.raises(StageError, match="unsupported device"):
        require_device("meta", allow_cpu_fallback=True)


# --------------------------------------------------------------------------- one GPU job per device

CLAIMER = """
import logging, sys, time
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from xmc_steps import devices
names = devices.claim_gpus(1)
import os
print(os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
while not os.path.exists({release!r}):
    time.sleep(0.05)
"""


def _claimer(tmp_path, cvd, release, env_extra=None):
    import os
    import subprocess
    import sys
    from conftest import ROOT

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=cvd, XMC_GPU_CLAIM="1", XMC_GPU_LOCK_DIR=str(tmp_path / "locks"),
               **(env_extra or {}))
    env.pop("SLURM_JOB_ID", None)
    code = CLAIMER.format(root=str(ROOT), release=str(release))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_gpu_jobs_at_once_never_share_a_device_and_a_third_waits(tmp_path):
    """Issue 52.5 with a fake device list: Snakemake's gpu=N is a counter and sets no CUDA_VISIBLE_DEVICES;
    each job claims a free device before torch sees CUDA.  Two jobs on a 2-GPU list see one device each,
    different ones; a third waits, saying so, until a device is given back (its holder ended), and then
    sees that one."""
    import select

    release = {k: tmp_path / k for k in "abc"}
    jobs = {}
    try:
        jobs["a"] = _claimer(tmp_path, "0,1", release["a"])
        seen_a = jobs["a"].stdout.readline().strip()
        jobs["b"] = _claimer(tmp_path, "0,1", release["b"])
        seen_b = jobs["b"].stdout.readline().strip()
        assert {seen_a, seen_b} == {"0", "1"}, (seen_a, seen_b)
        jobs["c"] = _claimer(tmp_path, "0,1", release["c"])
        while "waiting" not in (line := jobs["c"].stderr.readline()):
            assert line, "the third job neither waited nor claimed"
        assert not select.select([jobs["c"].stdout], [], [], 0.5)[0], "the third job claimed a taken device"
        release["a"].write_text("")
        jobs["a"].wait(600)
        assert jobs["c"].stdout.readline().strip() == seen_a
    finally:
        for k, p in jobs.items():
            release[k].write_text("")
            p.wait(600)


def test_a_slurm_job_and_a_fixed_device_claim_nothing(tmp_path, monkeypatch):
    from xmc_steps import devices

    monkeypatch.setenv("XMC_GPU_CLAIM", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert devices.claim_gpus(1) is None
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.claim_gpus(1) is None                       # no device visible: nothing to claim
