"""Synthetic data in the shape of a large benchmark, for scale tests on machines without it.

    python -m xmc_steps.stages.synth --shape wiki500k --fraction 0.02 --out data/wiki500k-f002 [--seed 0]

writes the AttentionXML raw-text layout (:mod:`xmc_steps.datasets`): ``train_texts.txt``,
``train_labels.txt``, ``test_texts.txt``, ``test_labels.txt``, ``label_ids.txt`` and
``label_texts.txt``, plus ``synth.json`` (the shape, the seed, the counts written); with
``--layout xmc-base``, PECOS's layout instead: ``X.{trn,tst}.txt``, ``Y.{trn,tst}.npz``,
``output-items.txt`` and ``tfidf-attnxml/X.{trn,tst}.npz`` (its own features, a unigram TF-IDF
of its train texts: :data:`OWN_FEATURES`).  The folder is picked up by name like any dataset
(``results/<name>/xr-linear.json``).

What is kept from the real set (:data:`SHAPES`, the statistics published with it,
X-Transformer Table 2 / AttentionXML): **all L labels** whatever the fraction (the label
space is what the scale test is about), the numbers of training and test documents times
``fraction``, the mean number of labels per document and the mean document length.

How the data is made (all from one ``numpy.random.default_rng(seed)``, in chunks of
documents, so memory does not grow with the fraction):

* label frequencies follow a power law, ``p(label of rank r) ∝ r^-label_exponent`` (a
  long tail: at full size the mean is L̄ N / L documents per label, most labels have a
  handful and the head thousands, as in the real sets); label ranks are shuffled so
  label ids carry no frequency order;
* the number of labels of a document is ``1 + Poisson(L̄ - 1)``, the labels drawn from that
  law without repetition;
* a vocabulary of ``vocab`` words ``w<base-36 index>`` with Zipfian frequencies
  (exponent 1.1); each label owns ``topic_words`` words (drawn once, by label id, from
  the vocabulary's less frequent half) and its label text is those words;
* a document's length is log-normal around the shape's mean; a share ``signal`` of its
  words are its labels' topic words (evenly over its labels), the rest background words:
  so the text depends on the labels and the methods can learn, the more so the more
  often a label was seen, as in real data.

A generated set is deterministic for (shape, fraction, seed) and version of this module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .errors import StageError

FORMAT = "xmc-synth-1"


@dataclass(frozen=True)
class Shape:
    name: str
    n_train: int
    n_test: int
    n_labels: int
    labels_per_doc: float
    words_per_doc: float
    vocab: int = 200_000
    label_exponent: float = 1.0
    topic_words: int = 6
    signal: float = 0.3
    source: str = ""


#: Published statistics of the real sets (train/test documents, labels, labels per document,
#: words per document: X-Transformer Table 2's training tokens over its training documents).
SHAPES: dict[str, Shape] = {
    "eurlex4k": Shape("eurlex4k", 15_449, 3_865, 3_956, 5.30, 1240.0, source="Eurlex-4K, X-Transformer Table 2"),
    "wiki10-31k": Shape("wiki10-31k", 14_146, 6_616, 30_938, 18.64, 2090.0, source="Wiki10-31K, X-Transformer Table 2"),
    "amazoncat13k": Shape("amazoncat13k", 1_186_239, 306_782, 13_330, 5.04, 212.0,
                          source="AmazonCat-13K, X-Transformer Table 2"),
    "amazon3m": Shape("amazon3m", 1_717_899, 742_507, 2_812_281, 36.04, 104.0,
                      source="Amazon-3M, AttentionXML Table 1 (not among ../shared/papers)"),
    "wiki500k": Shape("wiki500k", 1_779_881, 769_421, 501_070, 4.75, 800.0,
                      source="Wiki-500K, X-Transformer Table 2 / AttentionXML"),
    "amazon670k": Shape("amazon670k", 490_449, 153_025, 670_091, 5.45, 250.0,
                        source="Amazon-670K, AttentionXML / ELIAS appendix"),
}


def _b36(i: np.ndarray) -> list[str]:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = []
    for v in i.tolist():
        s = ""
        while True:
            v, r = divmod(v, 36)
            s = digits[r] + s
            if v == 0:
                break
        out.append(s)
    return out


def _cdf(n: int, exponent: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    c = np.cumsum(w)
    return c / c[-1]


class Generator:
    """Draws documents of one shape; :meth:`documents` yields ``(text, labels)`` chunks."""

    def __init__(self, shape: Shape, seed: int = 0):
        self.shape, self.seed = shape, int(seed)
        rng = np.random.default_rng([self.seed, 0])
        L, V = shape.n_labels, shape.vocab
        self.label_cdf = _cdf(L, shape.label_exponent)
        self.label_of_rank = rng.permutation(L)                  # rank -> label id
        self.word_cdf = _cdf(V, 1.1)
        self.words = np.array(["w" + s for s in _b36(np.arange(V))], dtype=object)
        # topic words of every label: from the less frequent half of the vocabulary
        self.topics = rng.integers(V // 2, V, size=(L, shape.topic_words))

    def label_text(self, label: int) -> str:
        return " ".join(self.words[self.topics[label]])

    def documents(self, n: int, stream: int, chunk: int = 2048):
        """``n`` documents from random stream ``stream`` (train 1, test 2), in chunks of
        ``(texts, labels)`` lists."""
        s = self.shape
        rng = np.random.default_rng([self.seed, stream])
        mu = np.log(s.words_per_doc) - 0.5 * 0.5 ** 2           # log-normal, sigma 0.5, mean words_per_doc
        for a in range(0, n, chunk):
            m = min(chunk, n - a)
            k = 1 + rng.poisson(max(s.labels_per_doc - 1.0, 0.0), size=m)
            lengths = np.maximum(k, np.round(rng.lognormal(mu, 0.5, size=m)).astype(np.int64))
            texts, labels = [], []
            for i in range(m):
                ranks = np.unique(np.searchsorted(self.label_cdf, rng.random(k[i]), side="right"))
                ranks = np.minimum(ranks, s.n_labels - 1)
                labs = self.label_of_rank[ranks]
                n_sig = max(len(labs), int(round(s.signal * lengths[i])))
                sig = self.topics[labs][np.arange(n_sig) % len(labs), rng.integers(0, s.topic_words, n_sig)]
                bg = np.searchsorted(self.word_cdf, rng.random(lengths[i] - n_sig), side="right")
                ids = np.concatenate([sig, np.minimum(bg, s.vocab - 1)])
                rng.shuffle(ids)
                texts.append(" ".join(self.words[ids]))
                labels.append(labs)
            yield texts, labels


def _write_texts(gen: Generator, n: int, stream: int, path: Path, split: str, progress=None) -> tuple[list, int]:
    """Write ``n`` documents' texts to ``path`` (through a temporary name, renamed when complete);
    returns their label lists and their word count."""
    tmp = path.with_name(f".{path.name}.tmp")
    labels, n_words, done = [], 0, 0
    with open(tmp, "w", encoding="utf-8") as ft:
        for texts, labs in gen.documents(n, stream):
            for t in texts:
                ft.write(t + "\n")
                n_words += t.count(" ") + 1
            labels += labs
            done += len(texts)
            if progress:
                progress(split, done, n)
    tmp.replace(path)
    return labels, n_words


def _write_lines(path: Path, lines) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    tmp.replace(path)


#: the TF-IDF an xmc-base set ships as its own features (tfidf-attnxml/): unigrams, unlike the pipeline's
#: default, so a run can tell the two sources apart
OWN_FEATURES = {"ngram_range": [1, 1], "min_df": 1, "max_features": None, "sublinear_tf": False, "lowercase": True}


def write(shape: Shape, fraction: float, out: str | Path, seed: int = 0, progress=None, layout: str = "raw") -> dict:
    """Write the dataset folder in ``layout`` (``raw``: the AttentionXML files, ``xmc-base``: PECOS's,
    with its own TF-IDF in ``tfidf-attnxml/``); returns what ``synth.json`` holds."""
    from . import io
    from .datasets import XMC_BASE_FEATURES, XMC_BASE_LABEL_TEXTS, XMC_BASE_SPLIT

    if not 0 < fraction <= 1:
        raise StageError(f"--fraction must be in (0, 1], got {fraction}")
    if layout not in ("raw", "xmc-base"):
        raise StageError(f"--layout must be raw or xmc-base, got {layout!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = Generator(shape, seed)
    ids = [f"L{j}" for j in range(shape.n_labels)]
    counts, text_files = {}, {}
    for split, n_full, stream in (("train", shape.n_train, 1), ("test", shape.n_test, 2)):
        n = max(1, int(round(fraction * n_full)))
        if layout == "raw":
            text_files[split] = out / f"{split}_texts.txt"
            labels, n_words = _write_texts(gen, n, stream, text_files[split], split, progress)
            _write_lines(out / f"{split}_labels.txt", (" ".join(ids[j] for j in labs) for labs in labels))
        else:
            text_files[split] = out / f"X.{XMC_BASE_SPLIT[split]}.txt"
            labels, n_words = _write_texts(gen, n, stream, text_files[split], split, progress)
            io.save_csr(out / f"Y.{XMC_BASE_SPLIT[split]}.npz", _label_matrix(labels, shape.n_labels))
        counts[split] = {"documents": n, "labels_per_doc": sum(map(len, labels)) / n, "words_per_doc": n_words / n}
    label_texts = [gen.label_text(j) for j in range(shape.n_labels)]
    if layout == "raw":
        _write_lines(out / "label_ids.txt", ids)
        _write_lines(out / "label_texts.txt", label_texts)
    else:
        _write_lines(out / XMC_BASE_LABEL_TEXTS, label_texts)
        _write_own_features(text_files, out / XMC_BASE_FEATURES, XMC_BASE_SPLIT)
    info = {"format": FORMAT, "layout": layout, "shape": asdict(shape), "fraction": fraction, "seed": seed,
            "written": counts}
    (out / "synth.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def _label_matrix(labels: list, n_labels: int):
    import scipy.sparse as sp

    indptr = np.cumsum([0] + [len(x) for x in labels])
    ind = np.concatenate([np.asarray(x, np.int32) for x in labels]) if labels else np.zeros(0, np.int32)
    return sp.csr_matrix((np.ones(len(ind), np.float32), ind, indptr), shape=(len(labels), n_labels))


def _write_own_features(text_files: dict[str, Path], folder: Path, split_names: dict[str, str]) -> None:
    """The xmc-base set's own features: a TF-IDF (:data:`OWN_FEATURES`) fitted on its train texts."""
    from . import io, tfidf

    def texts(split):
        return text_files[split].read_text(encoding="utf-8").splitlines()

    model = tfidf.fit_streaming([texts("train")], OWN_FEATURES)
    for split, name in split_names.items():
        io.save_csr(folder / f"X.{name}.npz", model.transform_batches([texts(split)]))
