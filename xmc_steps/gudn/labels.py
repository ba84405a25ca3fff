"""What GUDN's guide network reads besides the texts: each training text's label sequence, its gold
labels' texts joined into one (label index order, ``label_separator``), tokenized for the encoder."""

from __future__ import annotations

import scipy.sparse as sp

from .. import encoders, neural
from .params import GUDNParams


def label_sequences(Y: sp.spmatrix, label_texts: list[str], separator: str) -> list[str]:
    """Each row's gold label texts joined into one sequence (in label index order)."""
    Y = sp.csr_matrix(Y)
    Y.sort_indices()
    return [separator.join(label_texts[j] for j in Y.indices[Y.indptr[i]:Y.indptr[i + 1]]) for i in range(Y.shape[0])]


def label_tokens(Y: sp.spmatrix, label_texts: list[str], params: GUDNParams) -> tuple[list[str], neural.TokenData]:
    """``(sequences, their token ids)``: :func:`label_sequences` of ``Y``'s rows with ``params.label_separator``,
    tokenized by the backbone's encoder's tokenizer to ``params.label_max_length`` tokens."""
    seqs = label_sequences(Y, label_texts, params.label_separator)
    tok = encoders.load_tokenizer(params.backbone.encoder)
    ids, lengths = encoders.tokenize(seqs, tok, params.label_max_length)
    return seqs, neural.TokenData(ids, lengths)
