"""The training loop shared by every neural method (X-Transformer's matcher, ELIAS, ...).

:class:`TrainParams`, :func:`param_groups`, :class:`Trainer`: AdamW with per-group learning
rates (no weight decay on biases and LayerNorm/gain vectors), linear warm-up then linear decay
to 0 at ``steps``, gradient accumulation, gradient clipping, autocast
(:func:`xmc_steps.neural.autocast_context`), per-step callbacks and preemption-safe
checkpoints.

Learning-rate schedule
----------------------
The optimisation step with 0-based index ``t`` (so ``t = 0`` is the first update) uses
``lr * lr_factor(t)`` with ``lr_factor(t) = (t + 1) / warmup`` for ``t < warmup``
(reaching the full rate on the last warm-up step) and ``(steps - t) / (steps - warmup)``
afterwards (the full rate at ``t = warmup``, decaying linearly towards 0, which it
reaches at ``t = steps``).  With ``schedule: constant`` (LightXML's "constant learning rate")
the rate stays at the full rate after the warm-up.  See :func:`lr_factor`.

Weight averaging
----------------
:class:`WeightAverage` keeps the running uniform average of a model's float weights in
buffers (so a checkpoint carries it): stochastic weight averaging (Izmailov et al. 2018), which
ELIAS and LightXML use over the last part of their runs.

Data order
----------
An "epoch" is one pass over a permutation of ``range(n_examples)`` drawn by
``numpy.random.default_rng(seed + epoch)``; micro-batches are consecutive slices of
``batch_size`` indices (the last slice of an epoch may be shorter; the next slice
starts the next epoch).  One optimisation step consumes ``grad_accum`` micro-batches.

Feeding the device
------------------
On CUDA the next ``prefetch`` micro-batches (``Trainer(prefetch=...)``, default 2) are built by
``batch_fn`` in a background thread while the current step runs, and pinned so that their copies to
the device are asynchronous.  On a CPU the default is none: the model's threads have the cores, a
batch costs about 0.1 ms to build, and handing it over between threads cost more than that on a
busy 2-core machine (``bench/bench_neural.py --tiny``: the batch phase 1.0-2.1 ms per step with
``prefetch: 2`` against 0.7-1.1 ms built in the loop).  The prefetched batches' indices are drawn
in order from a look-ahead copy of the epoch cursor: the batches, their order and the weights are
those of a run without prefetching (bit for bit on the CPU), and a checkpoint names the first batch
not yet trained on.  ``batch_fn`` therefore must not read state that the steps change (a stage
that needs such state reads it in its loss).

The loop waits for the device only where numbers must reach the host: at the logging interval
(``log_every``), at checkpoints and after the last step.  The loss, the loss function's logs
(which may be 0-d tensors) and the gradient norm stay on the device in between and are read
back together, once per log line; a non-finite loss is reported then, with its step.  On CUDA
the optimiser is the fused AdamW.  :class:`StepProfiler` splits the steps' time by phase
(``bench/bench_neural.py``).

Several processes (DDP)
-----------------------
Started by ``torchrun`` (``WORLD_SIZE`` > 1) the trainer joins the process group
(:func:`xmc_steps.distributed.init_from_env`: nccl on CUDA, gloo on a CPU, a named collective timeout)
and wraps the model in ``DistributedDataParallel``.  Every rank draws the same epoch permutation; the
micro-batch of ``batch_size`` indices is the *global* one, and each rank trains on its consecutive part
(:func:`xmc_steps.distributed.shard`, ``batch_size / world`` of them: a ``batch_size`` the world does not
divide is an error naming the keys), so every example is seen once per epoch and the ranks together take
the steps one process would.  ``loss_fn`` returns the mean loss over its rank's examples and the trainer
weighs it by the rank's share of the global micro-batch (``n_rank * world / n``, 1 for a whole batch): DDP's
average of the gradients is then the gradient of the global batch's mean loss (``fit(loss_scope="global")``
for a loss that is already its rank's share of a globally normalised one, such as the dual encoder's
in-batch softmax over the gathered labels).  Rank 0 alone writes checkpoints and calls ``on_step`` and
``on_checkpoint``; ``step_end`` runs on every rank (state every rank keeps, such as mined label
embeddings), and what it evaluates is for the caller to do on rank 0
(:func:`xmc_steps.distributed.is_main`).  Every rank resumes from the checkpoint rank 0 picks; a SIGTERM
on any rank stops every rank after the same step (the flag is all-reduced each step on a gloo group),
with one checkpoint, written before any rank exits.  The logged loss is the global mean.  DDP runs without
``find_unused_parameters`` (a traversal of the autograd graph per step): every trainer's loss reaches all of
its trainable parameters at every step, once an encoder's weights that no forward reaches (XLNet's
``mask_emb``) are frozen (:meth:`xmc_steps.neural.TextEncoder.freeze_unreachable`); a trainer whose graph
changes from step to step passes ``unused_parameters=True``.  With one process none of this runs: the loop is
the single-process one.

Checkpoints
-----------
``ckpt_dir/step-XXXXXXXX/`` (8-digit step number) holds

* ``model.safetensors`` — the model's ``state_dict`` (safetensors, fp32 as trained);
* ``trainer.pt`` — a ``torch.save`` dict: ``format``, ``step``, ``epoch``, ``pos``
  (index of the next example in the epoch's permutation), ``optimizer``,
  ``scheduler``, ``scaler`` (GradScaler) state dicts, ``rng`` (torch CPU, CUDA,
  numpy global and Python ``random`` states), ``params`` (the TrainParams dict),
  ``fingerprint`` (a caller-given dict identifying the run) and ``time`` (seconds spent
  training so far), and with several processes ``rng_ranks`` (every rank's ``rng``, by rank).  It loads
  with ``torch.load(..., weights_only=True)``.

A checkpoint is written into ``ckpt_dir/.tmp-step-XXXXXXXX-<pid>/`` and renamed to its
final name once complete, so a ``step-*`` folder is always whole; the newest two are
kept.  Checkpoints are written every ``checkpoint_every`` steps, after the last step,
and when SIGTERM arrives: the handler only sets a flag, the current step finishes,
a checkpoint is saved, a log line says so, and :class:`Preempted` (a ``SystemExit``
with exit status 143 = 128 + SIGTERM) is raised.  A new :class:`Trainer` on the same
``ckpt_dir`` resumes from the newest complete checkpoint: after a SIGTERM or a SIGKILL
the restarted run ends with exactly the same number of optimisation steps as an
uninterrupted one, with the same weights (bit for bit on CPU with a fixed seed and
thread count).  Checkpoints written under other training parameters or another
``fingerprint`` are set aside (deleted, with a warning) rather than resumed.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import threading
import time
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

import numpy as np
import torch
from torch import nn

from . import distributed
from .neural import (TextEncoder, amp_dtype, autocast_context, check_amp, cpu_has_bf16, load_model, needs_grad_scaler,
                     resolve_device, save_model, to_device)
from .layout import WEIGHTS
from .params import Params, bounded
from .clock import started_at as _stage_started_at

CKPT_FORMAT = "xmc-trainer-ckpt-v1"

_default_log = logging.getLogger("xmc.trainer")


# --------------------------------------------------------------------------- training parameters


#: the learning rate after the warm-up: linear decay to 0 at the last step, or constant (:func:`lr_factor`)
Schedule = Literal["linear", "constant"]


@dataclass
class TrainParams(Params):
    """The training recipe every neural stage composes (``matcher.train``, ``elias.stageN.train``).

    Length: ``epochs`` (passes over the training data) or ``steps`` (fixes the count and
    overrides ``epochs``); warm-up: ``warmup`` (a fraction of the steps) or ``warmup_steps``
    (overrides ``warmup``).  :meth:`resolved` turns both into step counts for ``N`` training
    examples; the :class:`Trainer` takes only resolved parameters.  ``lr`` is the learning
    rate of the parameter groups that do not carry their own (``None``: every group must).
    Where the run happens (device, autocast) is the stage's setting, shared with its
    inference, and is given to the :class:`Trainer` beside these.
    """

    epochs: float | None = bounded(None, gt=0)  # passes over the training data:
                                  # steps = ceil(epochs N / (batch_size grad_accum))
    steps: int | None = bounded(None, ge=1)  # total optimisation steps (overrides epochs)
    batch_size: int = bounded(32, ge=1)  # sequences per micro-batch
    grad_accum: int = bounded(1, ge=1)  # micro-batches per optimisation step
    lr: float | None = bounded(5e-5, gt=0)  # learning rate of the groups without their own
    warmup: float | None = bounded(None, ge=0, lt=1)  # warm-up as a fraction of the steps (warmup_steps overrides it)
    warmup_steps: int | None = bounded(None, ge=0)  # warm-up in steps (overrides warmup); neither: no warm-up
    weight_decay: float = bounded(0.01, ge=0)  # AdamW's, of the weights (biases and LayerNorm excepted)
    max_grad_norm: float = 1.0    # <= 0: no clipping
    checkpoint_every: int = 500   # steps; <= 0: only at the end and on SIGTERM
    log_every: int = bounded(10, ge=1)  # steps between the log's loss lines
    seed: int = bounded(0, ge=0)  # the run's seed (the head's start, the batches' order, dropout)
    length_bucket: int = bounded(0, ge=0)  # > 0: batches of similar lengths from windows of this many batches (Trainer)
    schedule: Schedule = "linear"  # after the warm-up: linear (decay to 0 at the last step) | constant (LightXML)
    fit_valid: bool = False       # true: train on train + valid, every training document (the valid ones are then
                                  # also trained on: its curves and guards measure the fit); LightXML and GUDN only

    _what = "training parameter"

    # fields that change the training trajectory (a checkpoint under other values is not resumed)
    TRAJECTORY = ("steps", "batch_size", "grad_accum", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "seed",
                  "length_bucket", "schedule", "fit_valid")

    @property
    def is_resolved(self) -> bool:
        return self.steps is not None and self.warmup_steps is not None

    def resolved(self, n_train: int) -> "TrainParams":
        """A copy with ``steps`` and ``warmup_steps`` fixed for ``n_train`` training examples:
        ``steps = ceil(epochs * n_train / (batch_size * grad_accum))`` unless ``steps`` is set,
        ``warmup_steps = round(warmup * steps)`` unless it is set (capped at ``steps``)."""
        if self.steps is None and self.epochs is None:
            raise ValueError("set epochs or steps (the training length)")
        steps = self.steps
        if steps is None:
            steps = max(1, math.ceil(self.epochs * max(int(n_train), 1) / (self.batch_size * self.grad_accum)))
        warm = self.warmup_steps
        if warm is None:
            warm = int(round((self.warmup or 0.0) * steps))
        return replace(self, steps=int(steps), warmup_steps=int(min(warm, steps)))


SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)


#: the trajectory values of a default recipe (a checkpoint of an earlier version lacks the newer keys)
_TRAJECTORY_DEFAULTS = {"schedule": "linear", "fit_valid": False}


def lr_factor(step: int, warmup: int, total: int, schedule: str = "linear") -> float:
    """Multiplier of the base learning rate for the update with 0-based index ``step``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0 if step < total else 0.0
    if total <= warmup:
        return 1.0 if step < total else 0.0
    return max(0.0, (total - step) / (total - warmup))


class LinearWarmupDecay:
    """Picklable ``LambdaLR`` multiplier: :func:`lr_factor` with fixed ``warmup``/``total``."""

    def __init__(self, warmup: int, total: int, schedule: str = "linear"):
        self.warmup, self.total, self.schedule = int(warmup), int(total), schedule

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup, self.total, self.schedule)


def _is_no_decay(name: str, p: torch.Tensor) -> bool:
    n = name.lower()
    return p.ndim <= 1 or n.endswith("bias") or "layernorm" in n or "layer_norm" in n or n.endswith("norm.weight")


def param_groups(named_params_by_group: Mapping[str, tuple[Any, float]], weight_decay: float = 0.01) -> list[dict[str, Any]]:
    """AdamW parameter groups: two per named group (decay / no decay), each with its own lr.

    ``named_params_by_group`` maps a group name (``"encoder"``, ``"classifier"``, ...)
    to ``(what, lr)`` where ``what`` is an ``nn.Module``, an iterable of ``(name,
    parameter)`` pairs or an iterable of parameters.  Biases, LayerNorm weights and any
    other 1-d parameter (gains, scales) get ``weight_decay = 0``; everything else gets
    ``weight_decay``.  Parameters with ``requires_grad=False`` are skipped; a parameter
    listed in two groups is an error.  Each returned group carries ``name`` (e.g.
    ``"encoder"`` / ``"encoder.no_decay"``) and ``group`` (the name given).
    """
    seen: set[int] = set()
    groups: list[dict[str, Any]] = []
    for gname, (what, lr) in named_params_by_group.items():
        if isinstance(what, nn.Module):
            items = list(what.named_parameters())
        else:
            items = []
            for j, x in enumerate(what):
                items.append(x if isinstance(x, tuple) else (f"param{j}", x))
        decay, no_decay = [], []
        for n, p in items:
            if not p.requires_grad:
                continue
            if id(p) in seen:
                raise ValueError(f"parameter '{n}' of group '{gname}' is already in another group")
            seen.add(id(p))
            (no_decay if _is_no_decay(n, p) else decay).append(p)
        if decay:
            groups.append({"params": decay, "lr": float(lr), "weight_decay": float(weight_decay), "name": gname, "group": gname})
        if no_decay:
            groups.append({"params": no_decay, "lr": float(lr), "weight_decay": 0.0, "name": f"{gname}.no_decay", "group": gname})
    if not groups:
        raise ValueError("param_groups: no trainable parameters")
    return groups


class WeightAverage(nn.Module):
    """Running uniform average of a model's trainable float weights, in buffers (so checkpointed
    with the module that holds it): :meth:`update` after a step adds the current weights,
    :meth:`copy_to` writes the average into the model (a no-op before the first update)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        params = dict(model.named_parameters())
        self.names = [n for n, p in params.items() if p.is_floating_point()]
        for n in self.names:
            self.register_buffer("avg__" + n.replace(".", "__"), params[n].detach().float().clone())
        self.register_buffer("n", torch.zeros((), dtype=torch.long))
        self._count: int | None = 0   # ``n`` on the host (no device read per update); None: read it again

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._count = None

    def count(self) -> int:
        """Snapshots averaged so far (``n``)."""
        if self._count is None:
            self._count = int(self.n)
        return self._count

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        k = self.count() + 1
        for n in self.names:
            avg = getattr(self, "avg__" + n.replace(".", "__"))
            if k == 1:
                avg.copy_(params[n])
            else:
                avg.add_(params[n].detach().float() - avg, alpha=1.0 / k)
        self.n.fill_(k)
        self._count = k

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        if self.count() == 0:
            return
        params = dict(model.named_parameters())
        for n in self.names:
            params[n].copy_(getattr(self, "avg__" + n.replace(".", "__")))


# --------------------------------------------------------------------------- checkpoints


def digest(*arrays: np.ndarray) -> str:
    """A fingerprint of arrays (dtype, shape and bytes): what a checkpoint was trained on (a run's ``fingerprint``)."""
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir``, oldest first, as ``(step, folder)``."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
            if (p / WEIGHTS).is_file() and (p / "trainer.pt").is_file():
                out.append((int(p.name[5:]), p))
    return sorted(out)


class Preempted(SystemExit):
    """Raised after the checkpoint that follows a SIGTERM; exit status 143 (128 + 15)."""

    def __init__(self, step: int, path: str | os.PathLike):
        super().__init__(143)
        self.step, self.path = step, str(path)

    def __str__(self) -> str:
        return f"preempted by SIGTERM at step {self.step}; checkpoint saved to {self.path}; rerun to resume"


def _rng_state() -> dict[str, Any]:
    st = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": [st[0], torch.from_numpy(np.asarray(st[1], dtype=np.int64)), int(st[2]), int(st[3]), float(st[4])],
        "python": random.getstate(),
    }


def _set_rng_state(s: Mapping[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), int(n[2]), int(n[3]), float(n[4])))
    py = s["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


# --------------------------------------------------------------------------- step-time profiling


class StepProfiler:
    """Where the time of :meth:`Trainer.fit`'s steps goes (``bench/bench_neural.py``).

    The loop calls :meth:`begin`, :meth:`lap` at its phase boundaries (``"batch"``: the next batch
    in hand and on its way to the device; ``"forward_backward"``; ``"optimizer"``: freeing the
    gradients, unscaling, the ``grads_ready`` hook, clipping, the optimiser and scheduler steps;
    ``"rest"``: the logs, the hooks, checkpoints) and :meth:`end` after each step.  Code inside the
    loss may call :meth:`lap` too (the benchmark times the negatives/shortlist so).  With
    ``detailed=False`` the laps are not taken: only the wall time of the steps after the first
    ``warmup`` is kept (one device synchronisation at its start; it ends after the last step, where
    the loop itself waits for the device), so the run is timed as it runs in production.
    ``detailed=True`` synchronises the device at every lap (CUDA): the split is exact, the total a
    little slower.  ``between``, if given, runs after each timed step, outside the steps' time (the
    benchmark's bare step, so that both are sampled over the same seconds of a shared CPU).  Attach
    one with :func:`profiling` (the next :class:`Trainer` built takes it) or set ``Trainer.profiler``."""

    def __init__(self, device: torch.device | str | None = None, detailed: bool = True, warmup: int = 2,
                 between: Callable[[], Any] | None = None):
        self.device = torch.device(device) if device is not None else None
        self.detailed, self.warmup = bool(detailed), int(warmup)
        self.between = between         # run after each timed step, outside its time (a paired reference)
        self.phases: dict[str, float] = {}
        self.steps = 0                 # steps ended (all)
        self.timed_steps = 0           # steps in the timed window
        self.timed_s = 0.0             # their wall time
        self.durations: list[float] = []  # each timed step's seconds (detailed mode: the device waited for)
        self.per_step: list[dict[str, float]] = []   # each timed step's seconds by phase (detailed mode)
        self._cur: dict[str, float] = {}
        self._t = 0.0
        self._b = 0.0
        self._t0: float | None = None

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def active(self) -> bool:
        return self.steps >= self.warmup

    def begin(self) -> None:
        if self.steps == self.warmup:
            self._sync()
            self._t0 = time.perf_counter()
        if self.detailed:
            self._sync()
            self._t = self._b = time.perf_counter()

    def lap(self, phase: str) -> None:
        if not self.detailed:
            return
        self._sync()
        t = time.perf_counter()
        if self.active:
            self.phases[phase] = self.phases.get(phase, 0.0) + t - self._t
            self._cur[phase] = self._cur.get(phase, 0.0) + t - self._t
        self._t = t

    def end(self) -> None:
        self.lap("rest")
        if self.detailed and self.active:
            self.durations.append(self._t - self._b)
            self.per_step.append(self._cur)
        self._cur = {}
        self.steps += 1
        if self._t0 is not None:
            self.timed_steps = self.steps - self.warmup
            self.timed_s = time.perf_counter() - self._t0
        if self.between is not None and self.steps > self.warmup:
            t = time.perf_counter()
            self.between()
            if self._t0 is not None:     # not the trainer's time
                self._t0 += time.perf_counter() - t

    def step_ms(self, median: bool = False) -> float:
        """Mean milliseconds per step over the timed window (``median``: the median step, detailed mode;
        robust to a shared CPU's interruptions)."""
        if median and self.durations:
            return 1000.0 * float(np.median(self.durations))
        return 1000.0 * self.timed_s / max(self.timed_steps, 1)

    def split_ms(self, typical: bool = False) -> dict[str, float]:
        """Mean milliseconds per step in each phase (detailed mode); ``typical``: over the steps that
        took at most 1.25 times the median step (a shared CPU's interrupted steps left out, so that the
        phases add up to about the median step)."""
        if typical and self.per_step:
            cap = 1.25 * float(np.median(self.durations))
            keep = [d for d, t in zip(self.per_step, self.durations) if t <= cap]
            return {k: 1000.0 * sum(d.get(k, 0.0) for d in keep) / len(keep) for k in self.phases}
        n = max(self.timed_steps, 1)
        return {k: 1000.0 * v / n for k, v in self.phases.items()}


_next_profiler: StepProfiler | None = None


@contextlib.contextmanager
def profiling(profiler: StepProfiler) -> Iterator[StepProfiler]:
    """Within the block, every :class:`Trainer` built gets ``profiler`` (the benchmark's way in to the
    trainers that the stages build inside their training functions)."""
    global _next_profiler
    prev, _next_profiler = _next_profiler, profiler
    try:
        yield profiler
    finally:
        _next_profiler = prev


class _Prefetcher:
    """Builds the next micro-batches in a background thread while the current step runs.

    The indices are drawn in the loop's thread, in order, from a look-ahead copy of the epoch
    cursor (the trainer's ``epoch``/``pos`` move only when a batch is taken, so a checkpoint names
    the next batch not yet trained on, prefetched or not); ``batch_fn`` runs in the worker, then
    the batch's tensors are pinned (CUDA) so the copy to the device is asynchronous.  ``depth``
    batches are kept in flight; none beyond the run's last step is built."""

    def __init__(self, trainer: "Trainer", batch_fn: Callable[[np.ndarray], Any], n: int, remaining: int,
                 depth: int, pin: bool):
        from concurrent.futures import ThreadPoolExecutor

        self.trainer, self.batch_fn, self.n, self.remaining = trainer, batch_fn, n, int(remaining)
        self.depth, self.pin = max(0, int(depth)), pin
        self.cursor = (trainer.epoch, trainer.pos)
        self.queue: collections.deque = collections.deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="xmc-batches") if self.depth > 0 else None
        self._fill()

    def _build(self, idx: np.ndarray) -> Any:
        b = self.batch_fn(idx)
        return pin_memory(b) if self.pin else b

    def _fill(self) -> None:
        while self.pool is not None and len(self.queue) < self.depth and self.remaining > 0:
            idx, self.cursor = self.trainer._indices_at(self.cursor, self.n)
            self.queue.append((self.pool.submit(self._build, idx), idx, self.cursor))
            self.remaining -= 1

    def next(self) -> tuple[np.ndarray, Any]:
        """The next micro-batch ``(indices, batch)``; advances the trainer's cursor past it."""
        if self.pool is None:
            idx = self.trainer._next_indices(self.n)
            return idx, self.batch_fn(idx)
        if not self.queue:            # more batches than planned (cannot happen in fit): build it here
            self.remaining += 1
            self._fill()
        fut, idx, cursor = self.queue.popleft()
        self.trainer.epoch, self.trainer.pos = cursor
        self._fill()
        return idx, fut.result()

    def close(self) -> None:
        if self.pool is not None:
            for fut, _, _ in self.queue:
                fut.cancel()
            self.queue.clear()
            self.pool.shutdown(wait=True)


def pin_memory(obj: Any) -> Any:
    """``obj`` with its CPU tensors (inside tuples, lists and dicts) in page-locked memory."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(pin_memory(x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(pin_memory(x) for x in obj)
    if isinstance(obj, dict):
        return {k: pin_memory(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- trainer


def bucket_by_length(order: np.ndarray, lengths: np.ndarray, batch_size: int, window: int,
                     rng: np.random.Generator) -> np.ndarray:
    """A permutation whose consecutive ``batch_size`` blocks hold sequences of similar length.

    ``order`` (a random permutation) is cut into windows of ``window * batch_size``; each
    window is sorted by length and cut into batches, and the batches of a window are
    shuffled.  Every example still appears once per epoch and the windows keep the
    epoch's random order, but a batch is padded to a length near its members' (short-text
    data trains about twice as fast on a CPU, where padding costs compute).
    """
    out = []
    size = window * batch_size
    for a in range(0, len(order), size):
        chunk = order[a:a + size]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches = [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        short = batches.pop() if len(batches[-1]) < batch_size else None   # keeps the others aligned
        for j in rng.permutation(len(batches)):
            out.append(batches[j])
        if short is not None:
            out.append(short)
    return np.concatenate(out) if out else order


def _seed_rank(seed: int, rank: int) -> None:
    """Seed this rank's generators (torch, numpy's global, Python's) apart from rank 0's: its own dropout masks."""
    s = int(seed) * 1_000_003 + 7919 * int(rank)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


class _LossModule(nn.Module):
    """What DDP wraps: its ``forward`` is the step's loss function on the model, so that every use of the
    model inside the loss (methods other than ``forward`` included) runs inside DDP's forward and its
    gradients are averaged in the backward pass."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, loss_fn, batch):
        return loss_fn(self.model, batch)


class Trainer:
    """The training loop shared by the neural methods (see the module docstring).

    ``groups`` are AdamW parameter groups (from :func:`param_groups`; a group without
    ``lr`` uses ``params.lr``).  ``params`` must be resolved (:meth:`TrainParams.resolved`);
    ``device`` and ``amp`` say where and in which precision the steps run.  ``on_step(step, logs)`` is called every
    ``log_every`` steps (and after the last) with ``loss`` (mean over the step's
    micro-batches), the loss function's own floats (averaged likewise), ``lr_<group>``,
    ``grad_norm`` (before clipping) and ``seq_per_s``; ``on_checkpoint(step, folder)``
    after each checkpoint.  The model is moved to the device at construction, and the
    newest complete checkpoint in ``ckpt_dir`` (if any, and if it was written under the
    same trajectory parameters and ``fingerprint``) is loaded then.
    """

    def __init__(self, model: nn.Module, groups: list[dict[str, Any]], params: TrainParams,
                 ckpt_dir: str | os.PathLike | None, log: logging.Logger | None = None,
                 on_step: Callable[[int, dict[str, float]], Any] | None = None,
                 on_checkpoint: Callable[[int, Path], Any] | None = None,
                 fingerprint: Mapping[str, Any] | None = None, keep: int = 2,
                 lengths: np.ndarray | None = None, device: str | torch.device = "auto", amp: str = "auto",
                 prefetch: int | None = None, row_sparse: tuple[nn.Parameter, ...] | list = (),
                 unused_parameters: bool = False):
        if not params.is_resolved:
            raise ValueError("the Trainer takes resolved training parameters (TrainParams.resolved(n_train))")
        check_amp(amp)
        self.model, self.params = model, params
        # the per-rank micro-batch: a configured batch_size the world does not divide is an error naming the keys
        self.rank_batch = distributed.per_rank_batch(params.batch_size, params.grad_accum,
                                                     distributed.world_size_from_env())
        self.lengths = None if lengths is None else np.asarray(lengths)
        if params.length_bucket > 0 and self.lengths is None:
            # a setting the loop would otherwise ignore without a word (ELIAS, LightXML and the dual
            # encoder accepted train.length_bucket and trained on random batches until they passed lengths)
            raise ValueError(f"train.length_bucket = {params.length_bucket} needs the sequences' lengths "
                             "(Trainer(lengths=...)); this trainer was given none")
        self.log = log or _default_log
        self.on_step, self.on_checkpoint = on_step, on_checkpoint
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
        self.fingerprint = json.loads(json.dumps(dict(fingerprint or {}), default=str))
        self.keep = max(1, int(keep))
        self.device = resolve_device(device)
        self.world = 1
        self._ddp: nn.Module | None = None
        self._flag_group = None
        if distributed.wanted():
            self.device = distributed.local_device(self.device)
            distributed.init_from_env(self.device, self.log)
            self.world = distributed.world_size()
        # the data-parallel path: several processes (or one, distributed.FORCE_ENV)
        self.dist = distributed.active()
        self.rank = distributed.rank()
        self.is_main = self.rank == 0
        self.amp = amp
        self.model.to(self.device)
        for j, g in enumerate(groups):
            if "lr" not in g and params.lr is None:
                raise ValueError(f"parameter group {g.get('name', j)!r} has no lr and the training parameters set none")
            g.setdefault("lr", params.lr)
            g.setdefault("name", f"group{j}")
        self.group_names = [g.get("group", g["name"]) for g in groups]
        # CUDA: the fused AdamW (one kernel for every parameter; a GradScaler's checks stay on the device)
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(groups, lr=groups[0]["lr"], weight_decay=params.weight_decay, **fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LinearWarmupDecay(params.warmup_steps, params.steps, params.schedule))
        self.scaler = torch.amp.GradScaler("cuda", enabled=needs_grad_scaler(self.device, self.amp))
        self.step = 0            # optimisation steps done
        self.epoch = 0           # current epoch
        self.pos = 0             # next position in the epoch's permutation
        self.train_time = 0.0    # seconds in optimisation steps (over resumes)
        # wall time of the stage processes before this one, up to the checkpoint resumed from; this
        # process's counts from its stage's start (xmc_steps.clock.started_at) or from here
        self.wall_before = 0.0
        self._clock0 = _stage_started_at() or time.perf_counter()
        self.sequences = 0       # sequences processed in this process
        self.run_time = 0.0      # seconds in optimisation steps in this process
        self.steps_this_run = 0  # optimisation steps done in this process
        self.resumed_from: int | None = None
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}   # the current epoch's and the next's
        self._stop = False
        self._last_ckpt_step = -1
        # with several processes: the real examples of this rank's part of the current micro-batch (0: a stand-in)
        self.rank_examples = 0
        # ... and its share of it, n_real * world / n (distributed.loss_weight): a "global" loss's weight
        self.batch_share = 1.0
        # micro-batches built ahead in a background thread (0: none); None: 2 on CUDA, none on a CPU
        self.prefetch = max(0, int(prefetch)) if prefetch is not None else (2 if self.device.type == "cuda" else 0)
        self.profiler: StepProfiler | None = _next_profiler
        self.row_sparse: list[nn.Parameter] = []
        self.row_exchange = distributed.RowExchange()
        if self.dist:
            # a CPU group for the small per-step agreements (the SIGTERM flag, the checkpoints' RNG states):
            # no wait for the device
            self._flag_group = (torch.distributed.new_group(backend="gloo")
                                if torch.distributed.get_backend() != "gloo" else None)
        self._resume()
        if self.dist:
            if self.resumed_from is None and self.rank > 0:
                # independent dropout masks (and other draws) on every rank; rank 0 draws as one process would
                _seed_rank(self.params.seed, self.rank)
            # the label heads: their gradients averaged through the rows a step touched, not by DDP's dense
            # all-reduce (distributed.RowExchange)
            self.row_sparse = list(row_sparse)
            ids = {id(q) for q in self.row_sparse}
            ignore = [f"model.{n}" for n, q in self.model.named_parameters() if id(q) in ids]
            if len(ignore) != len(self.row_sparse):
                raise ValueError("row_sparse: every parameter must be one of the model's")
            # DDP without find_unused_parameters (no traversal of the autograd graph per step): every trainer's
            # loss reaches each of its trainable parameters at every step (the equivalence tests,
            # tests/test_distributed.py, run them so) except an encoder's weights that no forward of ours reaches
            # (XLNet's mask_emb, used by its two-stream pre-training alone): found once and frozen, which is what
            # AdamW does to a parameter without a gradient anyway.  A trainer with a step-dependent graph passes
            # unused_parameters=True.
            for enc in [m for m in self.model.modules() if isinstance(m, TextEncoder)]:
                for name in enc.freeze_unreachable():
                    self.log.info("data parallel: %s.%s is reached by no forward pass of ours: frozen", enc.name, name)
            wrapped = _LossModule(self.model)
            if ignore:
                torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapped, ignore)
            self._ddp = torch.nn.parallel.DistributedDataParallel(
                wrapped, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=bool(unused_parameters), forward_sync_buffers=False)
            self.log.info("data parallel: rank %d of %d, %d sequences per rank and micro-batch (global batch %d x "
                          "%d accumulation)", self.rank, self.world, self.rank_batch, self.params.batch_size,
                          self.params.grad_accum)

    @property
    def wall_s(self) -> float:
        """The stage's wall time so far over every process that trained this run (the earlier
        ones' up to the checkpoint this one resumed from)."""
        return self.wall_before + time.perf_counter() - self._clock0

    # -- data order
    def _order(self, epoch: int, n: int) -> np.ndarray:
        order = self._order_cache.get((epoch, n))
        if order is None:
            rng = np.random.default_rng(self.params.seed + epoch)
            order = rng.permutation(n)
            w = self.params.length_bucket
            if w > 0 and self.lengths is not None and len(self.lengths) == n:
                order = bucket_by_length(order, self.lengths, self.params.batch_size, w, rng)
            self._order_cache = {k: v for k, v in self._order_cache.items() if k[0] >= epoch - 1}
            self._order_cache[(epoch, n)] = order
        return order

    def _indices_at(self, cursor: tuple[int, int], n: int) -> tuple[np.ndarray, tuple[int, int]]:
        """The micro-batch at ``cursor = (epoch, pos)`` and the cursor after it."""
        epoch, pos = cursor
        idx = self._order(epoch, n)[pos:pos + self.params.batch_size]
        pos += len(idx)
        if pos >= n:
            epoch, pos = epoch + 1, 0
        return idx, (epoch, pos)

    def _next_indices(self, n: int) -> np.ndarray:
        idx, (self.epoch, self.pos) = self._indices_at((self.epoch, self.pos), n)
        return idx

    # -- checkpoints
    def _trajectory(self) -> dict[str, Any]:
        d = self.params.to_dict()
        return {k: d[k] for k in TrainParams.TRAJECTORY}

    def _resume(self) -> None:
        if self.ckpt_dir is None:
            return
        if self.dist:
            # rank 0 cleans the folder and picks the checkpoint; every rank loads that one
            path = self._pick_checkpoint() if self.is_main else None
            path = distributed.broadcast_object(None if path is None else str(path))
            if path is not None:
                state = torch.load(Path(path) / "trainer.pt", map_location="cpu", weights_only=True)
                self._load_checkpoint(Path(path), state)
            return
        path = self._pick_checkpoint()
        if path is not None:
            self._load_checkpoint(path, self._picked_state)

    def _pick_checkpoint(self) -> Path | None:
        """The newest readable checkpoint written by this run's configuration (its state in
        ``_picked_state``), or None; the leftovers of killed saves, and checkpoints of another
        configuration, are removed."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        for p in self.ckpt_dir.glob(".tmp-step-*"):  # leftovers of a killed save
            shutil.rmtree(p, ignore_errors=True)
        ckpts = list_checkpoints(self.ckpt_dir)
        while ckpts:
            step, path = ckpts[-1]
            try:
                state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is skipped
                self.log.warning("checkpoint %s is unreadable (%s); trying an older one", path, e)
                ckpts.pop()
                continue
            # a key an earlier version did not write had its default then (schedule: linear)
            saved = {k: state.get("params", {}).get(k, _TRAJECTORY_DEFAULTS.get(k)) for k in TrainParams.TRAJECTORY}
            if state.get("format") != CKPT_FORMAT or saved != self._trajectory() or state.get("fingerprint", {}) != self.fingerprint:
                self.log.warning("checkpoints in %s were written by a different run configuration "
                                 "(params %s, fingerprint %s); removing them and starting from scratch",
                                 self.ckpt_dir, saved, state.get("fingerprint"))
                for _, p in list_checkpoints(self.ckpt_dir):
                    shutil.rmtree(p, ignore_errors=True)
                return None
            self._picked_state = state
            return path
        return None

    def _load_checkpoint(self, path: Path, state: Mapping[str, Any]) -> None:
        load_model(self.model, path / WEIGHTS)
        self.model.to(self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.lr_lambdas = [LinearWarmupDecay(self.params.warmup_steps, self.params.steps, self.params.schedule)
                                     for _ in self.optimizer.param_groups]
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.pos = int(state["step"]), int(state["epoch"]), int(state["pos"])
        self.train_time = float(state.get("time", 0.0))
        # checkpoints written before "wall" was kept: the optimisation time is the lower bound known
        self.wall_before = float(state.get("wall", self.train_time))
        ranks = state.get("rng_ranks") or []
        if self.dist and len(ranks) == self.world:
            _set_rng_state(ranks[self.rank])
        else:
            _set_rng_state(state["rng"])
            if self.rank > 0:        # written by another number of processes: this rank's own draws
                _seed_rank(self.params.seed + self.step, self.rank)
        self.resumed_from = self._last_ckpt_step = self.step
        self.log.info("resumed from checkpoint %s: step %d/%d, epoch %d, position %d",
                      path, self.step, self.params.steps, self.epoch, self.pos)

    def save_checkpoint(self) -> Path:
        """Write ``ckpt_dir/step-XXXXXXXX/`` atomically and keep the newest ``keep``."""
        if self.ckpt_dir is None:
            raise ValueError("this trainer has no checkpoint folder")
        name = f"step-{self.step:08d}"
        final = self.ckpt_dir / name
        if self.dist:
            # every rank's RNG states to rank 0, which alone writes; no rank goes on (or exits) before it is written
            ranks = self._gather_object(_rng_state())
            if self.is_main:
                try:
                    self._write_checkpoint(final, name, {"rng_ranks": ranks})
                finally:
                    distributed.barrier()
            else:
                distributed.barrier()
            self._last_ckpt_step = self.step
            return final
        return self._write_checkpoint(final, name, {})

    def _gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self._flag_group)
        return out

    def _write_checkpoint(self, final: Path, name: str, extra: Mapping[str, Any]) -> Path:
        tmp = self.ckpt_dir / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            save_model(self.model, tmp / WEIGHTS)
            state = {
                "format": CKPT_FORMAT,
                "step": self.step, "epoch": self.epoch, "pos": self.pos,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                "rng": _rng_state(),
                "params": self.params.to_dict(),
                "fingerprint": self.fingerprint,
                "time": self.train_time,
                "wall": self.wall_s,
                **extra,
            }
            torch.save(state, tmp / "trainer.pt")
            for f in tmp.iterdir():  # data on disk before the rename makes it visible
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in list_checkpoints(self.ckpt_dir)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        self._last_ckpt_step = self.step
        self.log.info("checkpoint: step %d -> %s", self.step, final)
        if self.on_checkpoint:
            self.on_checkpoint(self.step, final)
        return final

    def save_model(self, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write the model's weights as safetensors, atomically (rank 0 alone, with several processes)."""
        if self.is_main:
            save_model(self.model, path, metadata)

    # -- SIGTERM
    def _on_sigterm(self, signum, frame) -> None:  # noqa: ARG002
        self._stop = True
        self.log.warning("SIGTERM received: finishing step %d, then checkpoint and exit", self.step + 1)

    @contextlib.contextmanager
    def _sigterm_handler(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            self.log.warning("not in the main thread: SIGTERM will not trigger a checkpoint")
            yield
            return
        prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, prev)

    # -- loop
    def fit(self, loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, Mapping[str, float]]], n_examples: int,
            batch_fn: Callable[[np.ndarray], Any],
            step_end: Callable[[int], Mapping[str, float] | None] | None = None,
            grads_ready: Callable[[int], None] | None = None, loss_scope: str = "mean") -> "Trainer":
        """Train until ``params.steps`` optimisation steps are done (resuming if possible).

        ``batch_fn(indices)`` builds a batch (any object; tensors inside tuples, lists
        and dicts are moved to the device), on CUDA ahead of its step in a background thread
        (see "Feeding the device"); ``loss_fn(model, batch)`` returns ``(loss, logs)``, the logs'
        values floats or 0-d tensors (read at the logging interval: no sync per step).
        ``grads_ready(step)``, if given, runs once the step's gradients are
        complete and unscaled, before clipping and the optimiser step (``step`` is the
        number the step will have); it may edit or remove (``grad = None``: the optimiser
        skips the parameter) gradients.  ``step_end(step)``, if given, runs after every step
        before any checkpoint (evaluation hooks); the floats it returns go to ``on_step`` at once.

        With several processes (module docstring, "Several processes") ``batch_fn`` gets the rank's part of
        the global micro-batch, ``loss_fn`` runs inside DDP's forward and returns ``loss_scope``: ``"mean"``,
        the mean over the rank's examples (the trainer weighs it by the rank's share), or ``"global"``, the
        rank's share of the global batch's loss already (the ranks' average is that loss; the trainer then
        only zeroes a stand-in rank's, :func:`xmc_steps.distributed.shard`).  ``loss_fn`` returns the same
        log keys on every rank.
        """
        if loss_scope not in ("mean", "global"):
            raise ValueError(f"loss_scope must be 'mean' or 'global', got {loss_scope!r}")
        p = self.params
        if n_examples < 1:
            raise ValueError("no training examples")
        params = [q for g in self.optimizer.param_groups for q in g["params"]]
        if self.step >= p.steps:
            self.log.info("training already complete (%d/%d steps)", self.step, p.steps)
            return self
        autocast = amp_dtype(self.device, self.amp)
        self.log.info("training: %d steps from step %d, batch %d x %d accumulation, %d examples, "
                      "device %s, autocast %s", p.steps, self.step, p.batch_size, p.grad_accum, n_examples,
                      self.device, autocast or "off (fp32)")
        if self.device.type == "cpu" and autocast is not None and not cpu_has_bf16():
            self.log.warning("amp %s on a CPU without native bf16 instructions (avx512_bf16/amx_bf16): emulated, "
                             "slower than fp32 (amp: auto runs fp32 on such a CPU)", self.amp)
        self.model.train()
        prof = self.profiler
        cuda = self.device.type == "cuda"
        acc: dict[str, list] = {}   # per step: tensors stay on the device until a log line needs them
        acc_n = 0
        win_t, win_seq = 0.0, 0
        dist = self.dist
        if dist:
            def rank_batch_fn(idx: np.ndarray, _fn=batch_fn):     # this rank's part of the global micro-batch
                return _fn(distributed.shard(idx, self.rank, self.world)[0])
            batch_fn = rank_batch_fn
            if n_examples < self.world:
                self.log.warning("%d training examples for %d processes: some ranks train on stand-ins with loss "
                                 "weight 0", n_examples, self.world)
        feed = _Prefetcher(self, batch_fn, n_examples, (p.steps - self.step) * p.grad_accum, self.prefetch, pin=cuda)
        with self._sigterm_handler(), contextlib.closing(feed):
            while self.step < p.steps:
                t0 = time.perf_counter()
                if prof is not None:
                    prof.begin()
                self.optimizer.zero_grad(set_to_none=True)
                if prof is not None:
                    prof.lap("optimizer")    # freeing the gradients is the optimiser's part
                step_logs: dict[str, Any] = {}
                loss_sum = torch.zeros((), device=self.device)  # summed on the device: no sync per micro-batch
                n_seq = 0
                for micro in range(p.grad_accum):
                    idx, batch = feed.next()
                    batch = to_device(batch, self.device)
                    if prof is not None:
                        prof.lap("batch")
                    if not dist:
                        with autocast_context(self.device, self.amp):
                            loss, logs = loss_fn(self.model, batch)
                        self.scaler.scale(loss.float() / p.grad_accum).backward()
                    else:
                        # the gradients are averaged over the ranks in the last micro-batch's backward pass
                        n_real = distributed.shard(idx, self.rank, self.world)[1]
                        self.rank_examples = n_real
                        self.batch_share = distributed.loss_weight(n_real, len(idx), self.world)
                        w = self.batch_share if loss_scope == "mean" else float(n_real > 0)
                        sync = micro == p.grad_accum - 1
                        with (contextlib.nullcontext() if sync else self._ddp.no_sync()):
                            with autocast_context(self.device, self.amp):
                                loss, logs = self._ddp(loss_fn, batch)
                            loss = loss.float() * w
                            self.scaler.scale(loss / p.grad_accum).backward()
                    if prof is not None:
                        prof.lap("forward_backward")
                    loss_sum += loss.detach().float()
                    for k, v in (logs or {}).items():
                        v = v.detach().float() if isinstance(v, torch.Tensor) else float(v)
                        step_logs[k] = step_logs.get(k, 0.0) + v / p.grad_accum
                    n_seq += len(idx)
                step_logs = {"loss": loss_sum / p.grad_accum, **step_logs}
                for q in self.row_sparse:      # the label heads' gradients: the rows touched (DDP ignores them)
                    self.row_exchange(q)
                self.scaler.unscale_(self.optimizer)
                # the stop after this step: SIGTERM seen (by any rank, with several processes: agreed before the
                # step's end, so that every rank checkpoints and exits after the same step)
                stopping = self._agree_on_stop() if dist else self._stop
                if grads_ready is not None:
                    grads_ready(self.step + 1)
                if p.max_grad_norm and p.max_grad_norm > 0:
                    gn = torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm)
                else:
                    gn = torch.nn.utils.clip_grad_norm_(params, float("inf"))
                step_logs["grad_norm"] = gn.detach()
                lrs = {f"lr_{n}": g["lr"] for n, g in zip(self.group_names, self.optimizer.param_groups)}
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.step += 1
                self.steps_this_run += 1
                if prof is not None:
                    prof.lap("optimizer")
                last = self.step >= p.steps
                log_now = self.step % p.log_every == 0 or last
                ckpt_now = self.ckpt_dir is not None and (
                    stopping or last or (p.checkpoint_every > 0 and self.step % p.checkpoint_every == 0))
                if cuda and (log_now or ckpt_now or stopping):
                    # the only wait for the device: where a log line or a checkpoint needs the numbers
                    torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t0
                self.train_time += dt
                self.run_time += dt
                self.sequences += n_seq
                win_t += dt
                win_seq += n_seq
                for k, v in step_logs.items():
                    acc.setdefault(k, []).append(v)
                acc_n += 1
                extra = dict(step_end(self.step) or {}) if step_end else {}
                if log_now:
                    logs, losses = self._reduce_logs(acc, acc_n)
                    for j, v in enumerate(losses):
                        if not math.isfinite(v):
                            self.log.warning("non-finite loss at step %d", self.step - acc_n + 1 + j)
                    logs.update(lrs)
                    logs["seq_per_s"] = win_seq / max(win_t, 1e-9)
                    logs.update(extra)
                    eta = (p.steps - self.step) * win_t / max(acc_n, 1)
                    self.log.info("step %d/%d epoch %d loss %.5f %s %.1f seq/s eta %.0f s", self.step, p.steps,
                                  self.epoch, logs["loss"],
                                  " ".join(f"{k} {v:.3g}" for k, v in logs.items() if k not in ("loss", "seq_per_s")),
                                  logs["seq_per_s"], eta)
                    if self.on_step and self.is_main:
                        self.on_step(self.step, logs)
                    acc, acc_n, win_t, win_seq = {}, 0, 0.0, 0
                elif extra and self.on_step and self.is_main:
                    self.on_step(self.step, extra)
                if not dist:
                    stopping = self._stop         # one process: a SIGTERM during the hooks stops after this step
                if self.ckpt_dir is not None and (
                        stopping or last or (p.checkpoint_every > 0 and self.step % p.checkpoint_every == 0)):
                    path = self.save_checkpoint()
                    if stopping:
                        exc = Preempted(self.step, path)
                        self.log.warning("%s", exc)
                        raise exc
                elif stopping:
                    exc = Preempted(self.step, "(no checkpoint folder)")
                    self.log.warning("%s", exc)
                    raise exc
                if prof is not None:
                    prof.end()
        return self

    def _agree_on_stop(self) -> bool:
        """Whether every rank stops after this step: any rank got SIGTERM before it (one all-reduce of a flag,
        on the CPU).  A signal that arrives after the all-reduce counts at the next step."""
        flag = torch.tensor([1 if self._stop else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._flag_group)
        stop = bool(int(flag.item()))
        if stop and not self._stop:
            self._stop = True
            self.log.warning("another rank received SIGTERM: finishing step %d, then checkpoint and exit", self.step + 1)
        return stop

    def _reduce_logs(self, acc: Mapping[str, list], n: int) -> tuple[dict[str, float], list[float]]:
        """The window's means of the per-step logs (``sum / n``, a key missing at a step counting 0) and
        its per-step losses, with one transfer from the device for all the tensors among them."""
        where = [(k, j) for k, vs in acc.items() for j, v in enumerate(vs) if isinstance(v, torch.Tensor)]
        vals = {k: list(vs) for k, vs in acc.items()}
        if where:
            got = torch.stack([acc[k][j].reshape(()).double().to(self.device) for k, j in where])
            if self.dist:     # the ranks' mean: the global batch's loss (each rank's weighted by its share)
                got = distributed.all_reduce_mean(got)
            got = got.cpu().tolist()
            for (k, j), v in zip(where, got):
                vals[k][j] = v
        return {k: sum(vs) / n for k, vs in vals.items()}, vals.get("loss", [])

    @property
    def throughput(self) -> float:
        """Training sequences per second over this process's optimisation steps."""
        return self.sequences / self.run_time if self.run_time > 0 else 0.0
