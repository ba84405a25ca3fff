"""When the stage this process is running began, for library code that counts from it (a resumed
trainer adds the wall time of the processes before it to this one's: :class:`xmc_steps.trainer.Trainer`).

The stage harness (:func:`xmc_steps.stage.stage_run`) registers each stage's start here and removes
it at the end; library code reads :func:`started_at` without importing the harness.
"""

from __future__ import annotations

_STARTS: list[float] = []   # ``time.perf_counter()`` of the running stage(s), innermost last


def stage_began(t0: float) -> None:
    """A stage began at ``t0`` (``time.perf_counter()``)."""
    _STARTS.append(t0)


def stage_ended(t0: float) -> None:
    """The stage that began at ``t0`` ended."""
    _STARTS.remove(t0)


def started_at() -> float | None:
    """``time.perf_counter()`` when the running stage began (``None`` outside a stage)."""
    return _STARTS[-1] if _STARTS else None
