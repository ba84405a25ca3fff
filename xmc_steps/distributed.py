"""Data-parallel training across processes: PyTorch's own engine (``torchrun``, ``torch.distributed``, DDP).

A neural stage started by ``torchrun --nproc-per-node N`` runs as N processes ("ranks") that each hold the
whole model and train on their own part of every global batch; DDP averages the gradients in the backward
pass.  This module is the small layer the shared trainer and the stages use:

* :func:`init_from_env` joins the process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): backend ``nccl`` on CUDA, ``gloo`` on the CPU, with the
  collective timeout :data:`TIMEOUT_ENV` (``XMC_COLLECTIVE_TIMEOUT_S``, default :data:`DEFAULT_TIMEOUT_S`
  seconds): a rank whose peer died or hangs fails after that long, with the name in the message, instead of
  waiting forever.  Without torchrun's variables (or ``WORLD_SIZE=1``) nothing happens: one process, the
  single-process path unchanged.
* :func:`rank`, :func:`world_size`, :func:`is_main`: rank 0 (the "main" rank) alone writes artifacts,
  checkpoints, logs and MLflow records.
* :func:`per_rank_batch`: the configured ``batch_size`` is the *global* micro-batch, so that
  ``per-rank batch x grad_accum x world size = batch_size x grad_accum`` (the configured batch of an
  optimisation step, what the papers' numbers mean).  A batch that does not divide is an error naming the keys.
* :func:`shard`: a rank's part of a global micro-batch (consecutive slices of the epoch's permutation, which
  every rank draws alike): every example is seen once per epoch, and the ranks' parts together are exactly the
  batch one process would train on.  :func:`loss_weight` turns a rank's mean loss into its share of the global
  mean (DDP averages over ranks), so a short last batch of an epoch weighs as in one process.
* :func:`gather_rows` gathers tensors of varying first dimension across ranks *with* gradients
  (``torch.distributed.nn.functional.all_gather``: the backward pass sums the gradients every rank's loss sends
  to a rank's rows), what the dual encoder's in-batch softmax needs to see every label of the global batch.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

__all__ = ["init_from_env", "active", "rank", "world_size", "local_rank", "is_main", "per_rank_batch", "shard",
           "loss_weight", "gather_rows", "all_reduce_mean", "barrier", "broadcast_object", "all_gather_object",
           "local_device", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "collective_timeout", "gather_to_main"]

_log = logging.getLogger("xmc.distributed")

#: the environment variable that sets the collective timeout, in seconds
TIMEOUT_ENV = "XMC_COLLECTIVE_TIMEOUT_S"
#: the collective timeout without it: long enough for rank 0's validation pass or a checkpoint's write while the
#: other ranks wait at the next collective, short enough that a dead peer ends the job the same hour
DEFAULT_TIMEOUT_S = 1800.0


def collective_timeout() -> datetime.timedelta:
    """The collective timeout (:data:`TIMEOUT_ENV`, else :data:`DEFAULT_TIMEOUT_S`)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        s = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError as e:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds (a number)") from e
    if s <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=s)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


#: ``XMC_DDP=1``: the data-parallel path even with one process (``torchrun --nproc-per-node 1``, a process group
#: of one, DDP and every collective), to check on one GPU that it gives what the single-process path gives
#: (bench/gpu_ddp.sh); unset, one process is the single-process path, untouched
FORCE_ENV = "XMC_DDP"


def forced() -> bool:
    """Whether :data:`FORCE_ENV` asks for the data-parallel path with one process."""
    return os.environ.get(FORCE_ENV, "").strip() == "1"


def wanted() -> bool:
    """Whether this process runs the data-parallel path: torchrun's ``WORLD_SIZE`` > 1, or :func:`forced`."""
    return world_size_from_env() > 1 or forced()


def active() -> bool:
    """Whether this process is one of several in an initialised process group (or of one, :func:`forced`)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        (torch.distributed.get_world_size() > 1 or forced())


def rank() -> int:
    """This process's rank (0 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def rank_from_env() -> int:
    """torchrun's ``RANK`` (0 when unset): a process's rank before the group is joined (the stage harness's)."""
    return _env_int("RANK", 0)


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without it)."""
    return _env_int("LOCAL_RANK", 0)


def is_main() -> bool:
    """Rank 0: the process that writes (artifacts, checkpoints, logs, MLflow)."""
    return rank() == 0


def init_from_env(device: torch.device | str = "cpu", log: logging.Logger | None = None) -> bool:
    """Join the process group torchrun's environment describes; whether this process is now one of several.

    ``WORLD_SIZE`` unset or 1 (without :data:`FORCE_ENV`): nothing is done (``False``).  Otherwise the group is initialised once
    (``env://``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with ``nccl`` when ``device`` is a
    CUDA device and ``gloo`` otherwise, and the collective timeout (:func:`collective_timeout`).  On CUDA the
    process's device is set first (:func:`local_device`)."""
    log = log or _log
    if not wanted():
        return False
    if torch.distributed.is_initialized():
        return active()
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(local_device(dev))
    timeout = collective_timeout()
    torch.distributed.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    log.info("distributed: rank %d of %d (local rank %d), backend %s, collective timeout %.0f s (%s)%s",
             rank(), world_size(), local_rank(), backend, timeout.total_seconds(), TIMEOUT_ENV,
             f", forced with one process ({FORCE_ENV}=1)" if world_size() == 1 else "")
    return active()


def world_size_from_env() -> int:
    """torchrun's ``WORLD_SIZE`` (1 when unset)."""
    return _env_int("WORLD_SIZE", 1)


def local_device(device: torch.device | str) -> torch.device:
    """The device of this rank: a CUDA device without an index becomes ``cuda:LOCAL_RANK`` when this process
    sees several GPUs (a SLURM job's node), ``cuda:0`` when it sees one (a device claimed for this process by
    :func:`xmc_steps.devices.claim_gpus`); anything else as it is."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda" or dev.index is not None:
        return dev
    n = torch.cuda.device_count()
    return torch.device("cuda", local_rank() if n > 1 else 0)


def destroy() -> None:
    """Leave the process group (if any)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- the global batch


def per_rank_batch(batch_size: int, grad_accum: int, world: int, section: str = "train") -> int:
    """The micro-batch of one rank for the configured (global) ``batch_size``: ``batch_size / world``, so that
    per-rank batch x ``grad_accum`` x ``world`` = ``batch_size`` x ``grad_accum``.  A ``batch_size`` that
    ``world`` does not divide is a ``ValueError`` naming the keys."""
    batch_size, grad_accum, world = int(batch_size), int(grad_accum), int(world)
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if batch_size % world:
        raise ValueError(
            f"{section}.batch_size = {batch_size} does not divide over {world} processes (gpus x nodes): every "
            f"process trains on batch_size / {world} sequences per micro-batch, so that per-process batch x "
            f"{section}.grad_accum ({grad_accum}) x {world} = the configured batch {batch_size * grad_accum}; "
            f"set {section}.batch_size to a multiple of {world} (e.g. {max(world, batch_size - batch_size % world)})")
    return batch_size // world


def shard(idx: np.ndarray, r: int | None = None, world: int | None = None) -> tuple[np.ndarray, int]:
    """Rank ``r``'s part of the global micro-batch ``idx`` and how many of its indices are real.

    The parts are consecutive (``np.array_split``: sizes differ by at most one, the first ranks the larger),
    so that they are ``batch_size / world`` each for a whole batch and together exactly ``idx``.  A rank left
    without an index (a last batch of an epoch shorter than the world) gets ``idx``'s last index as a
    stand-in, with 0 real indices: it runs the step (DDP needs every rank's backward) with loss weight 0."""
    r = rank() if r is None else int(r)
    world = world_size() if world is None else int(world)
    idx = np.asarray(idx)
    if world <= 1:
        return idx, len(idx)
    part = np.array_split(idx, world)[r]
    if len(part) == 0:
        return idx[-1:], 0
    return part, len(part)


def loss_weight(n_local: int, n_global: int, world: int | None = None) -> float:
    """The factor on a rank's mean loss over its ``n_local`` examples so that DDP's average over ``world`` ranks
    is the mean over the ``n_global`` examples of the global batch: ``n_local x world / n_global``."""
    world = world_size() if world is None else int(world)
    if world <= 1:
        return 1.0
    return float(n_local) * world / max(int(n_global), 1)


# --------------------------------------------------------------------------- collectives


def barrier() -> None:
    """Wait for every rank (nothing with one process)."""
    if active():
        torch.distributed.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects)."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, by rank."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


_OBJECT_GROUP: Any = None


def _object_group() -> Any:
    """The group object collectives go through: the default group when it is gloo, else a gloo group made once
    (NCCL would stage every pickled object on the GPU; prediction results go to rank 0's host memory)."""
    global _OBJECT_GROUP
    if torch.distributed.get_backend() == "gloo":
        return None
    if _OBJECT_GROUP is None:
        _OBJECT_GROUP = torch.distributed.new_group(backend="gloo")
    return _OBJECT_GROUP


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` (picklable), by rank, on rank 0; ``None`` on the other ranks (``[obj]`` with one
    process).  Through gloo, whatever the default backend (:func:`_object_group`)."""
    if not active():
        return [obj]
    out: list[Any] | None = [None] * world_size() if is_main() else None
    torch.distributed.gather_object(obj, out, dst=0, group=_object_group())
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of ``t`` over the ranks (a new tensor; ``t`` with one process)."""
    if not active():
        return t
    out = t.detach().clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
    return out / world_size()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over the ranks, without gradient (a new tensor; ``t`` with one process)."""
    if not active():
        return t
    out = t.detach().clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
    return out


def all_reduce_any(mask: torch.Tensor) -> torch.Tensor:
    """The element-wise OR of a boolean ``mask`` over the ranks (``mask`` itself with one process)."""
    if not active():
        return mask
    m = mask.to(torch.uint8)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
    return m.bool()


def gather_rows(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same trailing shape, any number of rows), by rank, with gradients: the backward pass
    sends each rank's rows the sum of the gradients all ranks' losses put on them
    (``torch.distributed.nn.functional.all_gather``).  Rows are padded to the largest count for the collective
    and cut back.  With one process: ``[t]``."""
    if not active():
        return [t]
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size())]
    torch.distributed.all_gather(sizes, n)
    sizes_l = [int(s.item()) for s in sizes]
    m = max(sizes_l)
    if t.shape[0] < m:
        t = torch.cat([t, t.new_zeros((m - t.shape[0],) + tuple(t.shape[1:]))], 0)
    gathered = _all_gather_autograd(t.contiguous())
    return [gathered[j * m:j * m + k] for j, k in enumerate(sizes_l)]


def _all_gather_autograd(t: torch.Tensor) -> torch.Tensor:
    """The ranks' ``t`` (equal shapes) concatenated along dim 0, differentiable: the backward pass gives each
    rank the sum over ranks of the gradients on its rows (a reduce-scatter).  torch's functional collective
    (``torch.distributed._functional_collectives.all_gather_single``; ``torch.distributed.nn.functional.all_gather``,
    which it deprecates, in the torch versions without it)."""
    try:
        from torch.distributed._functional_collectives import all_gather_single
    except ImportError:                                    # torch before the functional collectives' autograd
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(t), 0)
    return all_gather_single(t, 0, torch.distributed.group.WORLD)


def touched_rows(grad: torch.Tensor) -> torch.Tensor:
    """The rows of a 2-d gradient with a nonzero entry (int64, ascending)."""
    return torch.nonzero(grad.reshape(grad.shape[0], -1).ne(0).any(1)).reshape(-1)


class RowExchange:
    """The gradient of a large row-indexed parameter (a label head: ELIAS's ``W_L``, LightXML's label embeddings)
    averaged over the ranks through the rows a step touched, instead of DDP's dense all-reduce.

    A step of a 500k-label head touches the rows of its shortlists (ELIAS: the batch's K = 2000 labels per text),
    not L: each rank sends its touched rows (ids and values) to the others (two all-gathers, the rows padded to
    the largest count) and adds the ranks' rows into its gradient, then divides by the world: the mean of the
    ranks' dense gradients, as DDP's all-reduce gives it, for a payload that grows with the rows touched.  When
    the touched rows are so many that the gather would send more than half of a dense ring all-reduce's bytes
    (``(W - 1) x max rows x (8 + row bytes)`` against ``2 (W - 1) / W x L x row bytes``; :attr:`SPARSE_AT`)
    the step all-reduces densely instead (``XMC_ROW_EXCHANGE``: ``rows`` or ``dense`` forces one).  The rows
    are those a model declares (:meth:`touch`), else the gradient's nonzero rows (a pass over ``L x d``).  ``stats`` keeps the last exchange's figures (rows, bytes sent by
    this rank, dense or not) for ``bench/bench_label_head.py``."""

    #: sparse when its bytes are at most this share of a dense all-reduce's: the gathered rows' scatter costs more
    #: time per byte than the all-reduce (bench/bench_label_head.py at 20,000 labels: 0.8 of the bytes, slower)
    SPARSE_AT = 0.5

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self._rows: dict[int, list[torch.Tensor]] = {}
        # XMC_ROW_EXCHANGE: auto (by the bytes) | rows (always the rows) | dense (always the all-reduce)
        self.mode = os.environ.get("XMC_ROW_EXCHANGE", "auto").strip() or "auto"
        if self.mode not in ("auto", "rows", "dense"):
            raise ValueError(f"XMC_ROW_EXCHANGE={self.mode!r}: expected auto, rows or dense")

    def touch(self, p: torch.nn.Parameter, rows: torch.Tensor) -> None:
        """Declare rows of ``p`` this step's gradient may reach (ids; repeats and ``-1`` padding allowed): the
        exchange then sends those instead of scanning the ``L x d`` gradient for nonzero rows.  Every row with a
        gradient must be declared (the model's: ELIAS's shortlists)."""
        if active():
            self._rows.setdefault(id(p), []).append(rows.detach().reshape(-1))

    def __call__(self, p: torch.nn.Parameter) -> None:
        """Average ``p.grad`` over the ranks (``None`` on every rank: left so)."""
        if not active():
            return
        g = p.grad
        declared = self._rows.pop(id(p), None)
        if g is None:
            rows = torch.zeros(0, dtype=torch.int64, device=p.device)
        elif declared:
            rows = torch.unique(torch.cat(declared).to(g.device))
            rows = rows[rows >= 0]
        else:
            rows = touched_rows(g)
        n = torch.tensor([rows.numel() if g is not None else -1], dtype=torch.int64, device=p.device)
        counts = [torch.zeros_like(n) for _ in range(world_size())]
        torch.distributed.all_gather(counts, n)
        counts_l = [int(c.item()) for c in counts]
        if all(c < 0 for c in counts_l):
            self.stats = {"rows": 0, "bytes": 8 * world_size(), "dense": False}
            return
        if g is None:
            g = p.grad = torch.zeros_like(p)
        w = world_size()
        m = max(max(counts_l), 0)
        row_bytes = g[0].numel() * g.element_size()
        dense_bytes = 2 * (w - 1) / w * g.numel() * g.element_size()      # a ring all-reduce's, per rank
        sparse_bytes = (w - 1) * m * (8 + row_bytes)
        if self.mode == "dense" or (self.mode == "auto" and sparse_bytes > self.SPARSE_AT * dense_bytes):
            torch.distributed.all_reduce(g, op=torch.distributed.ReduceOp.SUM)
            g.div_(w)
            self.stats = {"rows": rows.numel(), "dense": True, "bytes": 8 * w + int(dense_bytes)}
            return
        ids = torch.full((m,), -1, dtype=torch.int64, device=g.device)
        ids[:rows.numel()] = rows
        vals = g.new_zeros((m,) + tuple(g.shape[1:]))
        vals[:rows.numel()] = g.index_select(0, rows)
        all_ids = [torch.empty_like(ids) for _ in range(w)]
        all_vals = [torch.empty_like(vals) for _ in range(w)]
        torch.distributed.all_gather(all_ids, ids)
        torch.distributed.all_gather(all_vals, vals)
        # the touched rows alone are rewritten (no pass over the L rows): emptied, the ranks' rows added in rank
        # order (every rank sums alike), the union divided by the world
        g.index_fill_(0, rows, 0)
        parts = [all_ids[r][:max(counts_l[r], 0)] for r in range(w)]
        for r in range(w):
            g.index_add_(0, parts[r], all_vals[r][:parts[r].numel()])
        union = torch.unique(torch.cat(parts))
        g.index_copy_(0, union, g.index_select(0, union).div_(w))
        self.stats = {"rows": rows.numel(), "dense": False,
                      "bytes": 8 * w + (w - 1) * m * (8 + row_bytes)}


def gather_ids(ids: np.ndarray) -> list[np.ndarray]:
    """Every rank's integer array (any length), by rank (no gradient; objects through the process group)."""
    return [np.asarray(a) for a in all_gather_object(np.asarray(ids))]


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block before the others (a cache it fills, a folder it cleans); with one process, a no-op."""
    if not active():
        yield
        return
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


def gather_union(ids: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of the ranks' id sets with one embedding row each, gradients kept: ``ids`` (``n``, int64,
    unique) and ``emb`` (``n x d``) on every rank give the sorted union of the ranks' ids and, for each, the
    row of its first rank (by rank) that has it (:func:`gather_rows`; with one process ``ids`` sorted, with
    ``emb``'s rows in that order).  The dual encoder's label pool over the global batch: each rank encodes
    its texts' labels, and every text is scored against every label of the global batch."""
    parts_e = gather_rows(emb)
    parts_i = gather_rows(ids.to(torch.int64))
    uniq, first = unique_union([p.cpu().numpy() for p in parts_i])
    cat = torch.cat(parts_e, 0)
    sel = torch.from_numpy(first).to(cat.device)
    return torch.from_numpy(uniq).to(ids.device), cat.index_select(0, sel)


def unique_union(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The sorted union of the ranks' id arrays ``parts`` and, for each union id, its position in their
    concatenation (its first occurrence): the rows of the gathered tensors to keep."""
    cat = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)
    uniq, first = np.unique(cat, return_index=True)
    return uniq, first
