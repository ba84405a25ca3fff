"""Synthetic data in the shape of a large benchmark, for scale tests on machines without it.

    python -m xmc_steps.stages.synth --shape wiki500k --fraction 0.02 --out data/wiki500k-f002 [--seed 0]

writes the AttentionXML raw-text layout (:mod:`xmc_steps.datasets`): ``train_texts.txt``,
``train_labels.txt``, ``test_texts.txt``, ``test_labels.txt``, ``label_ids.txt`` and
``label_texts.txt``, plus ``synth.json`` (the shape, the seed, the counts written).  The
folder is picked up by name like any dataset (``results/<name>/xr-linear.json``).

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
#: words per document).
SHAPES: dict[str, Shape] = {
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


def write(shape: Shape, fraction: float, out: str | Path, seed: int = 0, progress=None) -> dict:
    """Write the dataset folder; returns what ``synth.json`` holds."""
    if not 0 < fraction <= 1:
        raise StageError(f"--fraction must be in (0, 1], got {fraction}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = Generator(shape, seed)
    ids = [f"L{j}" for j in range(shape.n_labels)]
    counts = {}
    for split, n_full, stream in (("train", shape.n_train, 1), ("test", shape.n_test, 2)):
        n = max(1, int(round(fraction * n_full)))
        tmp_t, tmp_l = out / f".{split}_texts.txt.tmp", out / f".{split}_labels.txt.tmp"
        n_lab = n_words = 0
        with open(tmp_t, "w", encoding="utf-8") as ft, open(tmp_l, "w", encoding="utf-8") as fl:
            done = 0
            for texts, labels in gen.documents(n, stream):
                for t, labs in zip(texts, labels):
                    ft.write(t + "\n")
                    fl.write(" ".join(ids[j] for j in labs) + "\n")
                    n_lab += len(labs)
                    n_words += t.count(" ") + 1
                done += len(texts)
                if progress:
                    progress(split, done, n)
        tmp_t.replace(out / f"{split}_texts.txt")
        tmp_l.replace(out / f"{split}_labels.txt")
        counts[split] = {"documents": n, "labels_per_doc": n_lab / n, "words_per_doc": n_words / n}
    for name, lines in (("label_ids.txt", ids), ("label_texts.txt", (gen.label_text(j) for j in range(shape.n_labels)))):
        tmp = out / f".{name}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        tmp.replace(out / name)
    info = {"format": FORMAT, "shape": asdict(shape), "fraction": fraction, "seed": seed, "written": counts}
    (out / "synth.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info
