"""Tokenize stage: documents -> token ids (NPZ) for any Hugging Face tokenizer.

Output per split: ``tokens_{split}.npz`` with ``input_ids`` (int32, N x max_length,
padded with the tokenizer's pad id) and ``lengths`` (int32, tokens before padding, so
the attention mask is ``arange(max_length) < lengths[:, None]``).  Truncation keeps
the first ``max_length`` tokens ([CLS] ... [SEP]).  A ``max_length`` above the
encoder's position limit is an error before anything is tokenized.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np

from . import encoders, io
from .stage import StageError, add_common_args, cli_main, stage_run

SPLITS = ("train", "valid", "test")
BATCH = 2048   # documents per tokenizer call, read from Parquet batch by batch


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
    limit = encoders.max_positions(encoder)
    if limit is not None and max_length > limit:
        raise StageError(f"tokenize.max_length = {max_length} exceeds the {limit} positions of encoder '{encoder}'")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.tokenize", description=__doc__.splitlines()[0])
    p.add_argument("--ingest", required=True, help="the ingest stage's output folder")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    src, out = Path(args.ingest), Path(args.out)
    names = [f"tokens_{s}.npz" for s in SPLITS]
    with stage_run("tokenize", args, outputs=[str(out / n) for n in names]) as st:
        encoder, max_length = st.params["encoder"], int(st.params["max_length"])
        check_max_length(encoder, max_length)
        tok = encoders.load_tokenizer(encoder)
        for s in SPLITS:
            path = src / f"docs_{s}.parquet"
            n, _ = io.column_bytes(path, "text")
            t0 = time.perf_counter()
            ids, lengths = tokenize(io.iter_column(path, "text", BATCH), tok, max_length, n=n,
                                    progress=lambda d, n, s=s: st.log.info("%s: %d/%d documents", s, d, n))
            if s == "test":
                st.online_cost(time.perf_counter() - t0, n)
            io.save_arrays(out / f"tokens_{s}.npz", input_ids=ids, lengths=lengths)
            st.metric(f"truncated_fraction_{s}", float((lengths >= max_length).mean()) if len(lengths) else 0.0)
            st.output(f"tokens_{s}", out / f"tokens_{s}.npz")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
