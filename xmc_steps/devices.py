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
"""

from __future__ import annotations

import logging
import os

import torch

from .errors import StageError

__all__ = ["require_device", "describe_visible_devices"]

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
