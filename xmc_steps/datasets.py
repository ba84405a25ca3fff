"""Dataset registry: canonical names, upstream folder/file names, layout detection.

Two input layouts are understood:

* ``raw`` — the AttentionXML raw-text layout that Eurlex-4K, Wiki10-31K,
  AmazonCat-13K, Wiki-500K and Amazon-670K ship in: ``{split}_texts.txt`` (one document
  per line; AttentionXML's ``{split}_raw_texts.txt`` is preferred when present since
  ``*_texts.txt`` there is pre-tokenised) and ``{split}_labels.txt`` (space-separated
  label ids), with optional ``label_ids.txt`` + ``label_texts.txt`` (aligned line by
  line) or ``label_map.tsv``, and optional ``{split}_ids.txt``;
* ``bow`` — the Extreme Classification Repository sparse format: a header line
  ``N D L`` and then ``l1,l2,... f:v f:v ...`` per document (``train.txt``/``test.txt``
  or the dataset's own upstream file names).

A folder ``<data_dir>/<name>/`` is picked up by name for any name; the canonical names
below are also found under their upstream folder names (``data/Wiki-500K`` for
``wiki500k``).  Propensity constants follow the name (:func:`xmc_steps.metrics.propensity_constants`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import StageError


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    upstream: tuple[str, ...]          # upstream folder names (AttentionXML / XMC repository)
    bow_files: tuple[tuple[str, str], ...] = (("train.txt", "test.txt"),)
    description: str = ""


CANONICAL: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec("debtags", ("debtags-bookworm",), description="built-in: Debian package descriptions -> debtags"),
        DatasetSpec("eurlex4k", ("Eurlex-4K", "EUR-Lex", "eurlex"),
                    (("eurlex_train.txt", "eurlex_test.txt"), ("train.txt", "test.txt"))),
        DatasetSpec("wiki10-31k", ("Wiki10-31K", "Wiki10-31k", "wiki10")),
        DatasetSpec("amazoncat13k", ("AmazonCat-13K", "amazonCat"),
                    (("amazonCat_train.txt", "amazonCat_test.txt"), ("train.txt", "test.txt"))),
        DatasetSpec("wiki500k", ("Wiki-500K", "Wiki-500k")),
        DatasetSpec("amazon670k", ("Amazon-670K", "Amazon-670k")),
        DatasetSpec("amazon3m", ("Amazon-3M", "Amazon-3m")),
        DatasetSpec("lf-amazontitles131k", ("LF-AmazonTitles-131K",)),
    ]
}

SPLITS = ("train", "test")


@dataclass
class DatasetFiles:
    """Where a dataset's files are, after layout detection."""

    name: str
    folder: Path
    layout: str                                   # raw | bow
    texts: dict[str, Path] = field(default_factory=dict)
    labels: dict[str, Path] = field(default_factory=dict)
    ids: dict[str, Path] = field(default_factory=dict)
    bow: dict[str, Path] = field(default_factory=dict)
    label_ids: Path | None = None
    label_texts: Path | None = None
    label_map: Path | None = None

    def inputs(self) -> list[Path]:
        """Every input file (for Snakemake's input list)."""
        out = [*self.texts.values(), *self.labels.values(), *self.ids.values(), *self.bow.values()]
        out += [p for p in (self.label_ids, self.label_texts, self.label_map) if p is not None]
        return out


def candidate_folders(name: str, data_dir: str | Path) -> list[Path]:
    data_dir = Path(data_dir)
    out = [data_dir / name]
    spec = CANONICAL.get(name)
    if spec:
        out += [data_dir / u for u in spec.upstream]
    return out


def known_names(data_dir: str | Path) -> list[str]:
    """Canonical names plus every folder under ``data_dir``."""
    names = set(CANONICAL)
    d = Path(data_dir)
    if d.is_dir():
        names |= {p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return sorted(names)


def check_name(name: str, data_dir: str | Path) -> None:
    """Raise a clear error for a dataset that is neither canonical nor present."""
    if name in CANONICAL or any(f.is_dir() for f in candidate_folders(name, data_dir)):
        return
    raise StageError(
        f"unknown dataset '{name}': no folder {Path(data_dir) / name} and not a canonical name. "
        f"Known datasets: {', '.join(known_names(data_dir))}"
    )


def _first(folder: Path, names: list[str]) -> Path | None:
    for n in names:
        if (folder / n).is_file():
            return folder / n
    return None


def locate(name: str, data_dir: str | Path, path: str | None = None, layout: str | None = None) -> DatasetFiles:
    """Find a dataset's files; raise :class:`StageError` saying what is missing."""
    check_name(name, data_dir) if path is None else None
    folders = [Path(path)] if path else candidate_folders(name, data_dir)
    folder = next((f for f in folders if f.is_dir()), None)
    if folder is None:
        raise StageError(
            f"dataset '{name}': none of {', '.join(map(str, folders))} exists"
            + (" (run the `prepare` rule to build it)" if name == "debtags" else
               "; unpack the upstream files there (AttentionXML raw-text or XMC-repository BoW layout)")
        )
    raw = DatasetFiles(name, folder, "raw")
    for split in SPLITS:
        t = _first(folder, [f"{split}_raw_texts.txt", f"{split}_texts.txt"])
        lab = _first(folder, [f"{split}_labels.txt"])
        if t:
            raw.texts[split] = t
        if lab:
            raw.labels[split] = lab
        ids = _first(folder, [f"{split}_ids.txt"])
        if ids:
            raw.ids[split] = ids
    raw.label_ids = _first(folder, ["label_ids.txt"])
    raw.label_texts = _first(folder, ["label_texts.txt"])
    raw.label_map = _first(folder, ["label_map.tsv"])
    raw_ok = all(s in raw.texts and s in raw.labels for s in SPLITS)

    spec = CANONICAL.get(name)
    bow = DatasetFiles(name, folder, "bow")
    for tr, te in (spec.bow_files if spec else (("train.txt", "test.txt"),)):
        if (folder / tr).is_file() and (folder / te).is_file():
            bow.bow = {"train": folder / tr, "test": folder / te}
            break
    bow.label_texts = _first(folder, ["label_texts.txt", "Y.txt"])
    bow_ok = bool(bow.bow)

    if layout == "raw" or (layout is None and raw_ok):
        if not raw_ok:
            missing = [f"{s}_texts.txt" for s in SPLITS if s not in raw.texts] + [f"{s}_labels.txt" for s in SPLITS if s not in raw.labels]
            raise StageError(f"dataset '{name}' in {folder}: raw-text layout is missing {', '.join(missing)}")
        if raw.label_texts and not raw.label_ids:
            raise StageError(f"{raw.label_texts}: label_texts.txt needs label_ids.txt beside it (aligned line by line)")
        return raw
    if layout == "bow" or bow_ok:
        if not bow_ok:
            raise StageError(f"dataset '{name}' in {folder}: BoW layout needs train.txt and test.txt")
        return bow
    raise StageError(
        f"dataset '{name}' in {folder}: neither the raw-text layout (train_texts.txt, train_labels.txt, "
        f"test_texts.txt, test_labels.txt) nor the BoW layout (train.txt, test.txt) was found"
    )
