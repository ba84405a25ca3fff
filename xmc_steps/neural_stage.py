"""What every neural training stage does around its own model (X-Transformer's matcher, ELIAS,
and the methods to come), written once: reading the token splits, threads and device, the
training metrics of the stage record, the saved model with its description, peak GPU memory,
removing the checkpoints once every output is written, and loading the saved model back.

A stage's training run reads::

    tokens = load_tokens(args.tokens_dir, ("train", "valid"))
    with training_device(st, params) as device:         # threads, device, peak GPU memory
        trainer = ...                                    # the method's own loop on trainer.Trainer
        record_training(st, trainer)
        ...
        save_trained(st, out, model, "elias.json", meta, FORMAT)
    remove_checkpoints(out / "checkpoints")
    ...
    model = load_trained(out, "elias.json", FORMAT, build)     # later, for prediction
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from . import io, layout, neural
from .errors import StageError


def load_tokens(tokens_dir: str | os.PathLike, splits: Iterable[str]) -> dict[str, neural.TokenData]:
    """``tokens_{split}.npz`` of each split (:mod:`xmc_steps.stages.tokenize`); a file that cannot be read is a
    :class:`StageError` naming it."""
    out = {}
    for s in splits:
        path = Path(tokens_dir) / f"tokens_{s}.npz"
        try:
            out[s] = neural.TokenData.load(path)
        except (OSError, ValueError) as e:
            raise StageError(f"{path}: {e}") from e
    return out


def train_split_only(train: Any, method: str, why: str = "") -> None:
    """A stage that trains on the train split alone refuses ``train.fit_valid`` (LightXML's and GUDN's
    training take it) with a :class:`StageError` saying so, and why."""
    if getattr(train, "fit_valid", False):
        raise StageError(f"train.fit_valid: {method} trains on the train split only{why}; set it false "
                         "(split.valid_size carves fewer validation documents)")


@contextlib.contextmanager
def training_device(st, params: Any) -> Iterator[torch.device]:
    """Set ``params.threads`` (torch intra-op threads, when given), resolve ``params.device`` (already
    checked by :func:`xmc_steps.devices.require_device`) and, on CUDA, record the stage's peak GPU
    memory as ``peak_gpu_mem_mb`` when the block completes.  Under ``torchrun`` (several processes) the
    device is the rank's own and the process group is joined here (:mod:`xmc_steps.distributed`)."""
    if getattr(params, "threads", None):
        torch.set_num_threads(int(params.threads))
    device = neural.resolve_device(params.device)
    from . import distributed

    want = int(getattr(params, "gpus", 1) or 1) * int(getattr(params, "nodes", 1) or 1)
    if want != distributed.world_size_from_env():
        st.log.warning("the settings ask for %d process(es) (gpus x nodes) and this stage runs as %d: the rule "
                       "starts it under torchrun when gpus x nodes > 1 (xmc_steps.launch)", want,
                       distributed.world_size_from_env())
    if distributed.wanted():
        # under torchrun: this rank's device, and the process group joined before any model is built
        device = distributed.local_device(device)
        distributed.init_from_env(device, st.log)
        st.extra["processes"] = distributed.world_size()
    st.extra["device"] = device_label(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield device
    if device.type == "cuda":
        st.metric("peak_gpu_mem_mb", torch.cuda.max_memory_allocated(device) / 2**20)


def device_label(device: torch.device) -> str:
    """A stage record's ``extra.device``: ``cpu``, or ``cuda:<the card's name>`` (what evaluate reports)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def record_training(st, trainer) -> None:
    """The training figures of a finished :class:`xmc_steps.trainer.Trainer` run, as stage metrics, and
    the precision its steps ran in (``extra.precision``: ``fp32``, ``bfloat16`` or ``float16``)."""
    st.extra["precision"] = str(neural.amp_dtype(trainer.device, trainer.amp) or "fp32").replace("torch.", "")
    st.metric("train_steps", trainer.step)
    st.metric("resumed_from_step", trainer.resumed_from or 0)
    st.metric("train_seq_per_s", trainer.throughput)
    st.metric("train_time_s", trainer.train_time)
    # a resumed run: the earlier processes' stage time (evaluate adds it to this record's wall_s)
    st.metric("resumed_wall_s", trainer.wall_before)


def save_trained(st, out: Path, model: nn.Module, json_name: str, meta: Mapping[str, Any], fmt: str) -> None:
    """``out/model.safetensors`` and ``out/<json_name>`` (the model's description), both atomic, as
    the stage's outputs ``model`` and ``<json stem>_json``; ``model_bytes`` as a metric."""
    out = Path(out)
    neural.save_model(model, out / layout.WEIGHTS, metadata={"format": fmt})
    io.write_json(out / json_name, dict(meta))
    st.output("model", out / layout.WEIGHTS)
    st.output(f"{Path(json_name).stem}_json", out / json_name)
    st.extra["model_paths"] = [str(out / layout.WEIGHTS), str(out / json_name)]
    st.metric("model_bytes", (out / layout.WEIGHTS).stat().st_size)


def load_trained(folder: str | os.PathLike, json_name: str, fmt: str,
                 build: Callable[[neural.TextEncoder, dict[str, Any]], nn.Module],
                 device: str | torch.device = "cpu") -> nn.Module:
    """The model :func:`save_trained` wrote to ``folder``: its description (checked to be of format
    ``fmt``), the encoder it names (architecture only), ``build(encoder, description)`` for the rest,
    then the weights, on ``device``."""
    folder = Path(folder)
    meta = io.read_json(folder / json_name)
    if meta.get("format") != fmt:
        raise ValueError(f"{folder}/{json_name}: unknown format {meta.get('format')!r}")
    enc = neural.TextEncoder(meta["encoder"], pooling=meta["pooling"], last_k=meta["last_k"], pretrained=False)
    model = build(enc, meta)
    neural.load_model(model, folder / layout.WEIGHTS)
    return model.to(neural.resolve_device(device))


def stage_params(st, cls: type | Callable[[Any], Any], rule: str, section: str, on: Callable[[Any], Any] = lambda p: p
                 ) -> Any:
    """A neural stage's typed parameters, ``cls.from_dict(st.params)`` (``cls(st.params)`` for a function; a bad
    value is a StageError naming it), with the device checked at once (:func:`xmc_steps.devices.require_device`: a GPU rule
    without a GPU fails before any work).  ``on(params)`` is the object that carries ``device`` and
    ``allow_cpu_fallback`` (GUDN's backbone); ``section`` the config section named in messages."""
    from .devices import require_device

    try:
        params = cls.from_dict(st.params) if hasattr(cls, "from_dict") else cls(st.params)
    except (TypeError, ValueError) as e:
        raise StageError(str(e)) from e
    run = on(params)
    run.device = str(require_device(run.device, run.allow_cpu_fallback, config_key=f"{section}.allow_cpu_fallback",
                                    rule=getattr(st.args, "rule", None) or rule, log=st.log))
    return params


def valid_subset(valid: tuple[neural.TokenData, Any] | None, max_docs: int, seed: int
                 ) -> tuple[neural.TokenData | None, Any]:
    """The validation texts and labels a training loop evaluates on: all of them, or a fixed random
    subset of ``max_docs`` (drawn with ``seed``); ``(None, None)`` without validation data."""
    import numpy as np
    import scipy.sparse as sp

    if valid is None:
        return None, None
    vt, vY = valid
    vY = sp.csr_matrix(vY)
    if len(vt) > max_docs:
        sub = np.sort(np.random.default_rng(seed).choice(len(vt), max_docs, replace=False))
        vt, vY = neural.TokenData(vt.input_ids[sub], vt.lengths[sub]), vY[sub]
    return vt, vY


def prediction_inputs(st, params: Any, model_dir: str | os.PathLike, json_name: str, tokens_path: str | os.PathLike
                      ) -> tuple[dict[str, Any], neural.TokenData, torch.device]:
    """What a neural predict stage reads first: threads (``params.threads``), the trained model's
    description ``json_name``, the token ids (of the width the model was trained on) and the
    device (``params.device``, already checked); a file that cannot be read is a StageError."""
    if getattr(params, "threads", None):
        torch.set_num_threads(int(params.threads))
    try:
        meta = io.read_json(Path(model_dir) / json_name)
        tokens = neural.TokenData.load(tokens_path)
    except (OSError, ValueError) as e:
        raise StageError(str(e)) from e
    if tokens.max_length != meta["max_length"]:
        raise StageError(f"tokens have width {tokens.max_length} but the model was trained with {meta['max_length']}")
    device = inference_device(st, params.device)
    return meta, tokens, device


def inference_device(st, device: Any) -> torch.device:
    """The device of a predict or embed stage (``device``, already checked), recorded as ``extra.device``.
    Under ``torchrun`` (several processes) it is the rank's own and the process group is joined here, for
    :func:`sharded_inference`; ``extra.processes`` records the world."""
    from . import distributed

    device = neural.resolve_device(device)
    if distributed.wanted():
        device = distributed.local_device(device)
        distributed.init_from_env(device, st.log)
        st.extra["processes"] = distributed.world_size()
    st.extra["device"] = device_label(device)
    return device


#: documents per message when the ranks' results are gathered on rank 0 (bounds a message: 20,000 texts of
#: top-100 scores and 768-d embeddings are about 85 MB)
GATHER_ROWS = 20_000


def shard_batches(lengths: np.ndarray, batch_size: int, r: int, world: int) -> np.ndarray:
    """The documents rank ``r`` of ``world`` predicts: the batches ``r, r + world, r + 2 world, ...`` of the
    one-process pass (:func:`xmc_steps.neural.iter_batches` over documents of these ``lengths``:
    ``batch_size`` at a time, longest first), in that order.  Every document is in exactly one rank's part,
    in the same batch (the same neighbours, the same padded width) as one process runs it, and the part's
    own pass (``iter_batches`` again: its lengths are already in order and its batches whole but the
    last) forms those batches; dealing the batches round the ranks gives each a share of the long ones."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    b = max(int(batch_size), 1)
    n_batches = -(-len(order) // b)
    mine = np.arange(int(r), n_batches, int(world))
    if not len(mine):
        return order[:0]
    return np.concatenate([order[k * b:(k + 1) * b] for k in mine])


def sharded_inference(tokens: neural.TokenData, batch_size: int,
                      run: Callable[[neural.TokenData], dict[str, Any]],
                      rows: tuple[str, ...] = ("scores", "shortlist", "emb")) -> dict[str, Any] | None:
    """A neural predict or embed pass over ``tokens``, split over the ranks under ``torchrun``: every
    predict and embed stage's one path (ELIAS, LightXML and GUDN, the dual encoder, the pre-trained
    embeddings).

    ``run(part)`` is the one-process pass over a :class:`~xmc_steps.neural.TokenData` (the method's own
    ``predict``), batching ``batch_size`` texts at a time; it returns a dict whose ``rows`` entries hold one
    row per text (a scipy sparse matrix or a numpy array; ``None`` when not asked for) and ``seconds``.
    With one process this is ``run(tokens)``.  With several, each rank runs ``run`` on its batches
    (:func:`shard_batches`), sends its rows to rank 0 (:func:`xmc_steps.distributed.gather_to_main`, at
    most :data:`GATHER_ROWS` texts a message), and rank 0 puts them back in the documents' order: its
    ``run`` result with the ``rows`` entries of all documents and ``seconds`` the slowest rank's.  The
    other ranks get ``None`` (rank 0 alone writes).  Since a text meets the same batch as in one process,
    the rows are the one-process rows: bit for bit where the kernels are deterministic for a shape (the
    CPU), to the device's rounding elsewhere (tests/test_distributed.py)."""
    import scipy.sparse as sp

    from . import distributed

    world = distributed.world_size()
    if world <= 1:
        return run(tokens)
    rank = distributed.rank()
    n = len(tokens)
    if n == 0:                                    # no text: rank 0's empty pass, nothing to gather
        return run(tokens) if rank == 0 else None
    parts = [shard_batches(tokens.lengths, batch_size, r, world) for r in range(world)]
    idx = parts[rank]
    res = run(neural.TokenData(tokens.input_ids[idx], tokens.lengths[idx])) if len(idx) else None
    keys = [k for k in rows if res is not None and res.get(k) is not None]
    keys = distributed.broadcast_object(keys)     # rank 0's: a rank without texts sends empty pieces
    seconds = distributed.gather_to_main(float(res["seconds"]) if res is not None else 0.0)
    step = GATHER_ROWS
    rounds = -(-max(len(p) for p in parts) // step)
    got: dict[str, list[Any]] = {k: [] for k in keys}
    for q in range(rounds):
        lo, hi = q * step, min((q + 1) * step, len(idx))
        piece = {k: (res[k][lo:hi] if res is not None and lo < hi else None) for k in keys}
        pieces = distributed.gather_to_main(piece)
        if pieces is not None:
            for pc in pieces:
                for k in keys:
                    if pc[k] is not None:
                        got[k].append(pc[k])
    if rank != 0:
        return None
    # the pieces arrived rank by rank within a round, and the rounds in order: put them back by rank
    per_rank: dict[str, list[list[Any]]] = {k: [[] for _ in range(world)] for k in keys}
    for k in keys:
        it = iter(got[k])
        for q in range(rounds):
            for r in range(world):
                if q * step < len(parts[r]):
                    per_rank[k][r].append(next(it))
    perm = np.concatenate(parts)
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n, dtype=np.int64)
    out = dict(res)
    for k in keys:
        flat = [x for r in range(world) for x in per_rank[k][r]]
        if sp.issparse(flat[0]):
            out[k] = sp.vstack(flat, format="csr")[inv]
        else:
            out[k] = np.concatenate(flat, 0)[inv]
    out["seconds"] = max(seconds)
    return out


def sharded_embed(encoder: nn.Module, tokens: neural.TokenData, batch_size: int, device: torch.device | str,
                  amp: str = "auto", progress: Callable[..., Any] | None = None) -> tuple[np.ndarray | None, float]:
    """``(emb, seconds)``: :func:`xmc_steps.neural.embed` of every text of ``tokens`` by ``encoder`` (a text
    encoder, or the dual encoder's unit-norm model), split over the ranks by :func:`sharded_inference`:
    the training stages' passes at the end of training (the matcher's embeddings of every split, ELIAS's
    and LightXML's fine-tuned embeddings of the training texts, the dual encoder's label table).  Every
    rank must call it (with the same weights: after a DDP run they are); rank 0 gets the embeddings of all
    texts, in their order (the one-process rows, bit for bit on the CPU), the other ranks ``None``.
    ``seconds`` is the slowest rank's pass (rank 0; 0 elsewhere)."""
    import time

    def run(part: neural.TokenData) -> dict[str, Any]:
        t0 = time.perf_counter()
        e = neural.embed(encoder, part, batch_size, device, amp, progress=progress)
        return {"emb": e, "seconds": time.perf_counter() - t0}

    r = sharded_inference(tokens, batch_size, run, rows=("emb",))
    return (None, 0.0) if r is None else (r["emb"], float(r["seconds"]))


def curve_logger(st, ckpt_dir: str | os.PathLike, keys: tuple[str, ...]):
    """``(curve, on_step)``: the validation curve kept beside the checkpoints (``curve.json``, so a resumed
    run continues it; :class:`xmc_steps.curves.CurveLog`) and the trainer's step callback, which logs every
    step (:meth:`st.step_logger`) and adds the step's ``keys`` to the curve."""
    from .curves import CurveLog

    curve = CurveLog(Path(ckpt_dir) / "curve.json")
    log_step = st.step_logger({"loss": "train_loss"})

    def on_step(step: int, logs: dict[str, float]) -> None:
        log_step(step, logs)
        curve.add(step, logs, keys)

    return curve, on_step


def remove_checkpoints(ckpt_dir: str | os.PathLike) -> None:
    """Drop a finished run's checkpoints (call it once every output is written: a failure before
    that leaves them for the rerun to resume from)."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)
