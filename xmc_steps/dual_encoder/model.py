"""The dual encoder: one :class:`~xmc_steps.neural.TextEncoder` for the texts and the label texts, unit-norm
embeddings, the label texts' tokens, prediction through the nearest-label search, and saving and loading
(docs/methods/dual-encoder.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import ann, encoders, io, layout, neural
from ..neural_stage import load_trained, save_trained
from ..search import padded_to_csr
from .params import DualEncoderParams

FORMAT = "xmc-dual-encoder-v1"
#: the model's description beside its weights (format, encoder, pooling, dim, L, widths, parameters, ...)
JSON = "dual_encoder.json"
#: the trained label embeddings (``emb``: L x d float32, unit rows) ...
LABEL_EMB = layout.LABEL_EMB
#: ... and the search index over them that prediction loads (:mod:`xmc_steps.ann`, built by the training stage)
LABEL_INDEX = "label_index.faiss"


class DualEncoder(nn.Module):
    """``forward(input_ids, attention_mask) -> (B, dim)`` unit-norm float32 embeddings of texts or label
    texts alike (one encoder, one pooling)."""

    def __init__(self, encoder: neural.TextEncoder):
        super().__init__()
        self.encoder = encoder
        self.dim = int(encoder.dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.encoder(input_ids, attention_mask).float(), dim=-1)

    def describe(self) -> dict[str, Any]:
        return {"dim": self.dim, "pooling": self.encoder.pooling, "last_k": self.encoder.last_k}


def build_model(params: DualEncoderParams, pretrained: bool = True) -> DualEncoder:
    """The dual encoder of ``params`` (the pre-trained encoder's weights unless ``pretrained=False``)."""
    neural.seed_everything(params.train.seed)
    return DualEncoder(neural.TextEncoder(params.encoder, pooling=params.pooling, pretrained=pretrained))


def label_tokens(texts: Sequence[str], encoder: str, max_length: int) -> neural.TokenData:
    """The label texts tokenized by ``encoder``'s tokenizer to ``max_length`` tokens (one row per label)."""
    tok = encoders.load_tokenizer(encoder)
    ids, lengths = encoders.tokenize([str(t) for t in texts], tok, int(max_length))
    return neural.TokenData(ids, lengths)


def encode(model: DualEncoder, tokens: neural.TokenData, batch_size: int = 128, device: torch.device | str = "auto",
           amp: str = "auto", progress: Callable[..., Any] | None = None) -> np.ndarray:
    """Unit-norm embeddings (``N x dim`` float32) of every row of ``tokens``, in eval mode."""
    return neural.embed(model, tokens, batch_size, device, amp, progress=progress)


def unit_rows(emb: np.ndarray) -> np.ndarray:
    """``emb`` as float32 with rows of unit L2 norm (a zero row stays zero)."""
    emb = np.asarray(emb, dtype=np.float32)
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    return np.ascontiguousarray(emb / np.where(norms > 0, norms, 1.0), dtype=np.float32)


def build_label_index(label_emb: np.ndarray, search: str = "auto", exact_max: int = ann.EXACT_MAX, seed: int = 0,
                      threads: int | None = None) -> ann.Index:
    """The nearest-label index over ``label_emb`` (``L x d``, re-normalised to unit rows;
    :func:`xmc_steps.ann.build_index`).  Built on one thread (an HNSW graph is then a function of its inputs
    and ``seed``: :mod:`xmc_steps.ann`, "Threads and determinism"); it searches with ``threads`` (default:
    torch's intra-op threads, which the stages set)."""
    index = ann.build_index(unit_rows(label_emb), search, int(exact_max), threads=1, seed=int(seed))
    index.threads = max(1, int(threads or torch.get_num_threads()))
    return index


def search_labels(index: ann.Index, n_labels: int, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cosines N x k', label ids N x k')``, ``k' = min(k, n_labels)``: each query's nearest labels in
    ``index`` (over ``n_labels`` labels), nearest first (:func:`xmc_steps.ann.search`)."""
    k = max(1, min(int(k), int(n_labels)))
    s, i = ann.search(index, np.ascontiguousarray(queries, dtype=np.float32), k)
    return np.asarray(s, dtype=np.float32), np.asarray(i, dtype=np.int64)


def scores_of(cos: np.ndarray, ids: np.ndarray, n_labels: int) -> Any:
    """The prediction table's scores: ``(1 + cos) / 2`` in ``[0, 1]`` (the order is the cosines'), CSR N x L."""
    val = np.clip((1.0 + np.nan_to_num(cos, neginf=-1.0)) / 2.0, 0.0, 1.0).astype(np.float32)
    return padded_to_csr(np.where(ids >= 0, ids, -1), val, int(n_labels))


@torch.no_grad()
def predict(model: DualEncoder, tokens: neural.TokenData, label_emb: np.ndarray | None = None, topk: int = 100,
            batch_size: int = 128, device: torch.device | str = "auto", amp: str = "auto", search: str = "auto",
            exact_max: int = ann.EXACT_MAX, progress: Callable[..., Any] | None = neural._default_log.info,
            with_emb: bool = False, index: ann.Index | None = None) -> dict[str, Any]:
    """The ``topk`` labels nearest each text (``scores``: CSR N x L, :func:`scores_of`), the seconds of the
    pass (the texts' encoder pass, the index build when no ``index`` is given, the search) and, with
    ``with_emb``, the texts' embeddings (``emb``).  The labels are ``index``'s, or ``label_emb``'s (an
    index built over them with ``search`` / ``exact_max``)."""
    t0 = time.perf_counter()
    if index is None:
        if label_emb is None:
            raise ValueError("predict needs the label embeddings or an index over them")
        index = build_label_index(label_emb, search, exact_max)
    emb = encode(model, tokens, batch_size, device, amp, progress)
    cos, ids = search_labels(index, index.n_labels, emb, topk)
    out = {"scores": scores_of(cos, ids, index.n_labels), "seconds": time.perf_counter() - t0}
    if with_emb:
        out["emb"] = emb
    return out


def save_dual_encoder(st, out: str | os.PathLike, model: DualEncoder, label_emb: np.ndarray,
                      meta: dict[str, Any], index: ann.Index | None = None) -> None:
    """``out/model.safetensors`` and ``out/dual_encoder.json`` (:func:`xmc_steps.neural_stage.save_trained`:
    the stage's outputs ``model`` and ``dual_encoder_json``), the label embeddings ``out/label_emb.npz``
    (output ``label_emb``) and, when given, the search index over them ``out/label_index.faiss`` (output
    ``label_index``); ``meta`` gets the format, the encoder's path, the pooling and the sizes."""
    out = Path(out)
    name = meta.get("encoder", model.encoder.name)
    meta = {"format": FORMAT, "encoder": name, "encoder_path": str(encoders.resolve(name)), **model.describe(),
            "L": int(label_emb.shape[0]), **meta}
    save_trained(st, out, model, JSON, meta, FORMAT)
    io.save_arrays(out / LABEL_EMB, emb=np.asarray(label_emb, dtype=np.float32))
    st.output("label_emb", out / LABEL_EMB)
    if index is not None:
        ann.save_index(index, out / LABEL_INDEX)
        st.output("label_index", out / LABEL_INDEX)


def load_dual_encoder(folder: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[DualEncoder, np.ndarray]:
    """``(model, label embeddings)`` as :func:`save_dual_encoder` wrote them."""
    folder = Path(folder)
    model = load_trained(folder, JSON, FORMAT, lambda enc, meta: DualEncoder(enc), device)
    label_emb = io.load_arrays(folder / LABEL_EMB)["emb"].astype(np.float32)
    if label_emb.shape[1] != model.dim:
        raise ValueError(f"{folder / LABEL_EMB}: embeddings of width {label_emb.shape[1]}, the model's is {model.dim}")
    return model, label_emb


def load_label_index(folder: str | os.PathLike, label_emb: np.ndarray, search: str = "auto",
                     exact_max: int = ann.EXACT_MAX, threads: int | None = None) -> ann.Index:
    """The saved search index of a trained model (``label_index.faiss``), searching with ``threads``; built
    over ``label_emb`` (``search`` / ``exact_max``) when the folder has none or it does not match them."""
    path = Path(folder) / LABEL_INDEX
    threads = max(1, int(threads or torch.get_num_threads()))
    if path.is_file():
        index = ann.load_index(path, threads)
        if index.n_labels == label_emb.shape[0] and index.dim == label_emb.shape[1]:
            return index
    return build_label_index(label_emb, search, exact_max, threads=threads)
