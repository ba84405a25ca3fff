"""Which device a GPU rule runs on, and a clear error when it gets none.

The GPU rules (``matcher``, ``embed_pretrained``, ``elias_stage1``, ``elias_stage2``,
``elias_predict``) ask the scheduler for a GPU (``gpu=1``).  When a job of theirs
starts and torch sees no CUDA device -- a CPU-only torch build, a SLURM job without
``--gpus``, an empty ``CUDA_VISIBLE_DEVICES`` -- silently training on the CPU would
turn a minutes-long job into a days-long one.  :func:`require_device` therefore fails
with a :class:`~xmc_steps.stage.StageError` that says what was visible and how to
allow the CPU, unless the configuration allows the CPU fallback
(``allow_cpu_fallback: true``, which the 2-core default configuration needs).

Settings (the rule's ``device`` key):

* ``auto``  -- ``cuda`` when available; else ``cpu`` if the fallback is allowed, else
  an error;
* ``cuda`` / ``cuda:N`` -- that GPU (``N`` must be below the visible device count); with
  no CUDA at all, ``cpu`` if the fallback is allowed, else an error;
* ``cpu``   -- the CPU, always (an explicit choice, never an error).

**One GPU job per device.**  Snakemake's ``gpu`` resource is only a counter (``--resources gpu=8``): it
sets no ``CUDA_VISIBLE_DEVICES``, so two GPU jobs it runs at once on one machine would both land on
device 0.  Before torch touches CUDA, :func:`require_device` therefore claims a device for the job
(:func:`claim_gpus`): an exclusive ``flock`` on a lock file per device under a machine-wide folder
(``XMC_GPU_LOCK_DIR``, default ``<tmp>/xmc-gpu-locks``), held until the process ends (the kernel drops
it on any exit, ``kill -9`` included), then ``CUDA_VISIBLE_DEVICES`` narrowed to the claimed device.  The
devices are those ``CUDA_VISIBLE_DEVICES`` lists, else those ``nvidia-smi -L`` lists; each is locked by
its UUID where ``nvidia-smi`` tells it (so two jobs with different device lists still meet).  When every
device is taken the job waits, saying so.  Inside a SLURM job (``SLURM_JOB_ID``) the scheduler already
gave the job its own devices: nothing is claimed.  ``XMC_GPU_CLAIM=0`` turns it off.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .errors import StageError

__all__ = ["require_device", "describe_visible_devices", "visible_gpus", "claim_gpus"]

_log = logging.getLogger("xmc.devices")


def describe_visible_devices() -> str:
    """One line about what this process can see: CUDA_VISIBLE_DEVICES, torch build, GPUs."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    cvd_s = "unset" if cvd is None else (repr(cvd) if cvd.strip() else "'' (empty: no GPU visible)")
    build = getattr(torch.version, "cuda", None)
    build_s = f"CUDA {build} build" if build else "CPU-only build (no CUDA support compiled in)"
    parts = [f"CUDA_VISIBLE_DEVICES={cvd_s}", f"torch {torch.__version__}, {build_s}"]
    slurm_job = os.environ.get("SLURM_JOB_ID")
    if slurm_job:
        gpus = os.environ.get("SLURM_JOB_GPUS") or os.environ.get("SLURM_GPUS_ON_NODE") or "none"
        parts.append(f"SLURM job {slurm_job} with GPUs {gpus}")
    return "; ".join(parts)


def _nvidia_smi_gpus() -> list[tuple[str, str]]:
    """``(index, UUID)`` of every GPU ``nvidia-smi -L`` lists; empty without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():           # "GPU 0: NVIDIA H200 (UUID: GPU-8f...)"
        if line.startswith("GPU ") and "UUID:" in line:
            gpus.append((line[4:].split(":", 1)[0].strip(), line.rsplit("UUID:", 1)[1].strip(" )")))
    return gpus


def visible_gpus() -> list[tuple[str, str]]:
    """``(name, lock key)`` of each GPU this process may use: ``CUDA_VISIBLE_DEVICES``'s entries (an index or
    a UUID), else every GPU ``nvidia-smi`` lists.  The key is the device's UUID where nvidia-smi tells it."""
    smi = _nvidia_smi_gpus()
    by_index = dict(smi)
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return [(i, u) for i, u in smi]
    names = [d.strip() for d in cvd.split(",") if d.strip()]
    return [(n, by_index.get(n, n)) for n in names]


_CLAIMED: list = []     # the open lock files of the claimed devices: held for the process's life


def claim_gpus(n: int = 1, log: logging.Logger | None = None, poll: float = 1.0) -> list[str] | None:
    """Claim ``n`` of the :func:`visible_gpus` for this process (see the module docstring) and narrow
    ``CUDA_VISIBLE_DEVICES`` to them; their names, or None when nothing is claimed (off, a SLURM job,
    no GPU visible, already claimed).  Waits while fewer than ``n`` are free."""
    log = log or _log
    if os.environ.get("XMC_GPU_CLAIM", "1") == "0" or os.environ.get("SLURM_JOB_ID") or _CLAIMED:
        return None
    gpus = visible_gpus()
    if not gpus:
        return None
    if n > len(gpus):
        raise StageError(f"{n} GPU(s) asked for, {len(gpus)} visible ({describe_visible_devices()})")
    folder = Path(os.environ.get("XMC_GPU_LOCK_DIR") or Path(tempfile.gettempdir()) / "xmc-gpu-locks")
    if not folder.exists():
        folder.mkdir(parents=True, exist_ok=True)
        try:
            folder.chmod(0o1777)          # one folder for every user of the machine
        except OSError:
            pass
    said = False
    while True:
        held = []
        for name, key in gpus:
            path = folder / ("gpu-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in key) + ".lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            held.append((name, fd))
            if len(held) == n:
                break
        if len(held) == n:
            _CLAIMED.extend(fd for _, fd in held)
            names = [name for name, _ in held]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names)
            log.info("GPU(s) %s claimed for this job (CUDA_VISIBLE_DEVICES=%s; locks in %s)",
                     ", ".join(names), ",".join(names), folder)
            return names
        for _, fd in held:
            os.close(fd)
        if not said:
            log.warning("all %d visible GPU(s) are taken by other jobs; waiting for one (locks in %s)", len(gpus), folder)
            said = True
        time.sleep(poll)


def _no_gpu_error(device_setting: str, config_key: str, rule: str | None, reason: str) -> StageError:
    who = f"rule '{rule}'" if rule else "this rule"
    return StageError(
        f"{who} needs a GPU (device: {device_setting!r}) but {reason} "
        f"[{describe_visible_devices()}]. "
        f"Run it where a GPU is visible (on SLURM the rule asks for one with its gpu resource; "
        f"check CUDA_VISIBLE_DEVICES and that torch is a CUDA build), "
        f"or set `{config_key}: true` in the config to run it on the CPU (slow), "
        f"or set its device to 'cpu'."
    )


def require_device(device_setting: str, allow_cpu_fallback: bool, *,
                   config_key: str = "allow_cpu_fallback", rule: str | None = None,
                   log: logging.Logger | None = None) -> torch.device:
    """The torch device a GPU rule runs on; a :class:`StageError` when it needs a GPU and has none.

    ``device_setting``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (see the module
    docstring).  ``allow_cpu_fallback``: run on the CPU when no GPU is visible instead
    of failing.  ``config_key`` is the key the error message tells the user to set
    (e.g. ``elias.train.allow_cpu_fallback``) and ``rule`` the rule named in it.
    A fallback to the CPU is logged as a warning on ``log``.
    """
    log = log or _log
    setting = (str(device_setting).strip().lower() if device_setting is not None else "") or "auto"
    if setting != "cpu" and not torch.cuda.is_initialized():
        if setting.startswith("cuda:"):
            log.info("device %s: a fixed device, not claimed (CUDA_VISIBLE_DEVICES as it is)", setting)
        else:
            claim_gpus(1, log=log)
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if allow_cpu_fallback:
            log.warning("no CUDA device visible (%s); %s=true: running on the CPU",
                        describe_visible_devices(), config_key)
            return torch.device("cpu")
        raise _no_gpu_error(device_setting, config_key, rule, "torch sees no CUDA device")
    try:
        dev = torch.device(setting)
    except (RuntimeError, ValueError) as e:
        raise StageError(f"unknown device {device_setting!r} (expected auto, cpu, cuda or cuda:N): {e}") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise StageError(f"unsupported device {device_setting!r} (expected auto, cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        if allow_cpu_fallback:
            log.warning("device %r requested but no CUDA device is visible (%s); %s=true: running on the CPU",
                        device_setting, describe_visible_devices(), config_key)
            return torch.device("cpu")
        raise _no_gpu_error(device_setting, config_key, rule, "torch sees no CUDA device")
    if dev.index is not None:
        n = torch.cuda.device_count()
        if dev.index >= n:
            # a wrong index is a configuration error, not a missing GPU: no fallback
            raise StageError(
                f"device {device_setting!r} requested but only {n} CUDA device(s) are visible "
                f"[{describe_visible_devices()}]"
            )
    return dev
