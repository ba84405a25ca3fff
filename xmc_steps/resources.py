"""Memory guards: a stage refuses, before allocating, what would not fit.

A stage that allocates something proportional to N x L (documents x labels: candidate masks,
predictions) or L x C / L x D (labels x clusters or dimensions: heads, label embeddings and their
optimiser state) first calls :func:`check_memory` with an estimate of that allocation; when the
estimate is more than the memory this process can still get, it stops at once with a
:class:`~xmc_steps.stage.StageError` naming the estimate, what is available, and the setting that
changes the size, instead of being killed by the kernel's out-of-memory killer hours later (or
swapping the machine to a halt).

Readings and decisions:

* **Available** = ``psutil.virtual_memory().available`` (free plus reclaimable page cache), and,
  when the process runs in a cgroup with a memory limit (a SLURM job's ``--mem``, a container),
  the limit minus the cgroup's current usage, whichever is smaller (cgroup v2 ``memory.max`` /
  ``memory.current``, or v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``, of the process's
  own cgroup).
* **Estimates** are of what the stage certainly holds at that point, from the input shapes (the
  helpers :func:`dense_bytes`, :func:`csr_bytes` and the per-structure sums in the stages): they
  are meant to be right within a small factor, not to bound the peak.  Where only an upper bound
  is cheap to compute (PIFA's non-zeros) the stage says "up to" and checks that bound.
* **Refuse** when the estimate exceeds ``XMC_MEMORY_FRACTION`` (default 0.9) of the available
  memory: the rest of the process (inputs already loaded, the interpreter, libraries) needs some.
  ``XMC_MEMORY_CHECK=0`` turns the refusals into warnings (the estimate can be wrong; the message
  says so).  Below the threshold the estimate is logged at INFO, so a run's log shows how close it
  came.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np

from .errors import StageError

__all__ = ["available_memory", "check_memory", "dense_bytes", "csr_bytes", "human_bytes", "adam_state_bytes"]


def human_bytes(n: float) -> str:
    """``1.5 GiB`` style."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def dense_bytes(*shape: int, dtype=np.float32) -> int:
    """Bytes of a dense array of ``shape`` and ``dtype``."""
    return int(np.prod([max(0, int(s)) for s in shape], dtype=np.float64) * np.dtype(dtype).itemsize)


def csr_bytes(n_rows: int, nnz: float, value=np.float32, index=np.int32) -> int:
    """Bytes of a CSR matrix: values and column indices per entry, an ``int64`` row pointer."""
    per = np.dtype(value).itemsize + np.dtype(index).itemsize
    return int(float(nnz) * per + (int(n_rows) + 1) * 8)


def adam_state_bytes(n_params: int, dtype=np.float32) -> int:
    """A trained tensor of ``n_params`` with its gradient and Adam's two moments (four copies)."""
    return 4 * dense_bytes(n_params, dtype=dtype)


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Limit minus usage of this process's cgroup, or None where no limit is set (or it is unreadable)."""
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            rel = path.lstrip("/")
            if hier == "0" and controllers == "":                         # cgroup v2
                base = root / rel
                limit, used = _read_int(base / "memory.max"), _read_int(base / "memory.current")
            elif "memory" in controllers.split(","):                     # cgroup v1
                base = root / "memory" / rel
                limit, used = _read_int(base / "memory.limit_in_bytes"), _read_int(base / "memory.usage_in_bytes")
                if limit is not None and limit >= 1 << 60:               # v1's "no limit" is a huge number
                    limit = None
            else:
                continue
            if limit is not None:
                return max(0, limit - (used or 0))
    return None


def available_memory() -> tuple[int, str]:
    """``(bytes, where from)``: what this process can still allocate (see the module docstring)."""
    import psutil

    avail, source = int(psutil.virtual_memory().available), "available on this machine"
    room = _cgroup_room()
    if room is not None and room < avail:
        avail, source = room, "left under this job's cgroup memory limit"
    return avail, source


def _fraction() -> float:
    with contextlib.suppress(ValueError):
        return min(1.0, max(0.05, float(os.environ.get("XMC_MEMORY_FRACTION", "0.9"))))
    return 0.9


def check_memory(what: str, nbytes: float, setting: str, log: logging.Logger | None = None) -> None:
    """Raise :class:`StageError` when ``what`` (an allocation of about ``nbytes``) would not fit in the
    memory available now; ``setting`` names what to change (a config key, a flag).  Logs the estimate
    otherwise.  ``XMC_MEMORY_CHECK=0``: warn instead of raising."""
    avail, source = available_memory()
    need = int(nbytes)
    if need <= _fraction() * avail:
        if log is not None:
            log.info("memory: %s needs about %s (%s %s)", what, human_bytes(need), human_bytes(avail), source)
        return
    msg = (f"{what} needs about {human_bytes(need)}, more than the {human_bytes(avail)} {source} "
           f"(the check allows {_fraction():.0%} of it); change {setting}, or run where more memory is available "
           f"(XMC_MEMORY_CHECK=0 runs anyway, if the estimate is wrong)")
    if os.environ.get("XMC_MEMORY_CHECK", "1") == "0":
        if log is not None:
            log.warning("memory: %s", msg)
        return
    raise StageError(msg)
