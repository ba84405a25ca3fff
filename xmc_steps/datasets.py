"""Dataset registry: canonical names, upstream folder/file names, layout detection.

Three input layouts are understood:

* ``raw`` — the AttentionXML raw-text layout that Eurlex-4K, Wiki10-31K,
  AmazonCat-13K, Wiki-500K and Amazon-670K ship in: ``{split}_texts.txt`` (one document
  per line; AttentionXML's ``{split}_raw_texts.txt`` is preferred when present since
  ``*_texts.txt`` there is pre-tokenised) and ``{split}_labels.txt`` (space-separated
  label ids), with optional ``label_ids.txt`` + ``label_texts.txt`` (aligned line by
  line) or ``label_map.tsv``, and optional ``{split}_ids.txt``;
* ``xmc-base`` — the PECOS project's layout (the tarballs :mod:`xmc_steps.fetch` downloads, the
  folders ELIAS's and XR-Transformer's scripts start from): ``X.{trn,tst}.txt`` (one document per
  line), ``Y.{trn,tst}.npz`` (CSR label matrices, label index = column), optional
  ``output-items.txt`` (label texts, one per column) and ``tfidf-attnxml/X.{trn,tst}.npz`` (the
  dataset's own TF-IDF features, AttentionXML's, which the papers' code uses; ``tfidf.source:
  dataset`` selects them);
* ``bow`` — the Extreme Classification Repository sparse format: a header line
  ``N D L`` and then ``l1,l2,... f:v f:v ...`` per document (``train.txt``/``test.txt``
  or the dataset's own upstream file names).

A folder ``<data_dir>/<name>/`` is picked up by name for any name; the canonical names
below are also found under their upstream folder names (``data/Wiki-500K`` for
``wiki500k``) and, for the six PECOS benchmarks, where their tarball unpacks
(``data/xmc-base/wiki-500k``).  A file that cannot be read (missing, a directory, a broken
link or a link loop) is an error naming the path and the problem.  Propensity constants follow
the name (:func:`xmc_steps.metrics.propensity_constants`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import StageError


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    upstream: tuple[str, ...]          # upstream folder names (AttentionXML / XMC repository)
    bow_files: tuple[tuple[str, str], ...] = (("train.txt", "test.txt"),)
    description: str = ""
    archive: str = ""                  # the PECOS xmc-base tarball's name (xmc_steps.fetch), "" if none


CANONICAL: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec("debtags", ("debtags-bookworm",), description="built-in: Debian package descriptions -> debtags"),
        DatasetSpec("eurlex4k", ("Eurlex-4K", "EUR-Lex", "eurlex"),
                    (("eurlex_train.txt", "eurlex_test.txt"), ("train.txt", "test.txt")),
                    "EU legal documents -> EuroVoc descriptors", "eurlex-4k"),
        DatasetSpec("wiki10-31k", ("Wiki10-31K", "Wiki10-31k", "wiki10"),
                    description="Wikipedia articles -> their Delicious social tags", archive="wiki10-31k"),
        DatasetSpec("amazoncat13k", ("AmazonCat-13K", "amazonCat"),
                    (("amazonCat_train.txt", "amazonCat_test.txt"), ("train.txt", "test.txt")),
                    "Amazon product descriptions -> product categories", "amazoncat-13k"),
        DatasetSpec("wiki500k", ("Wiki-500K", "Wiki-500k"),
                    description="Wikipedia articles -> Wikipedia categories", archive="wiki-500k"),
        DatasetSpec("amazon670k", ("Amazon-670K", "Amazon-670k"),
                    description="Amazon product descriptions -> products bought or viewed together (item-to-item)",
                    archive="amazon-670k"),
        DatasetSpec("amazon3m", ("Amazon-3M", "Amazon-3m"),
                    description="Amazon product descriptions -> products bought or viewed together (item-to-item)",
                    archive="amazon-3m"),
        DatasetSpec("lf-amazontitles131k", ("LF-AmazonTitles-131K",)),
    ]
}

SPLITS = ("train", "test")
LAYOUTS = ("raw", "xmc-base", "bow")
#: the xmc-base layout's file names by split (PECOS: trn, tst)
XMC_BASE_SPLIT = {"train": "trn", "test": "tst"}
#: the xmc-base layout's label texts and its own TF-IDF features' folder
XMC_BASE_LABEL_TEXTS = "output-items.txt"
XMC_BASE_FEATURES = "tfidf-attnxml"
#: every file of an xmc-base folder, as the PECOS tarballs hold them (the fetch rule's outputs)
XMC_BASE_FILES = tuple(
    [f"X.{s}.txt" for s in XMC_BASE_SPLIT.values()] + [f"Y.{s}.npz" for s in XMC_BASE_SPLIT.values()]
    + [XMC_BASE_LABEL_TEXTS] + [f"{XMC_BASE_FEATURES}/X.{s}.npz" for s in XMC_BASE_SPLIT.values()]
)


@dataclass
class DatasetFiles:
    """Where a dataset's files are, after layout detection."""

    name: str
    folder: Path
    layout: str                                   # raw | xmc-base | bow
    texts: dict[str, Path] = field(default_factory=dict)
    labels: dict[str, Path] = field(default_factory=dict)
    ids: dict[str, Path] = field(default_factory=dict)
    bow: dict[str, Path] = field(default_factory=dict)
    label_matrices: dict[str, Path] = field(default_factory=dict)   # xmc-base: Y.{trn,tst}.npz
    features: dict[str, Path] = field(default_factory=dict)         # xmc-base: tfidf-attnxml/X.{trn,tst}.npz
    label_ids: Path | None = None
    label_texts: Path | None = None
    label_map: Path | None = None

    def inputs(self) -> list[Path]:
        """Every input file (for Snakemake's input list)."""
        out = [*self.texts.values(), *self.labels.values(), *self.ids.values(), *self.bow.values(),
               *self.label_matrices.values(), *self.features.values()]
        out += [p for p in (self.label_ids, self.label_texts, self.label_map) if p is not None]
        return out


def fetch_folder(name: str, data_dir: str | Path) -> Path | None:
    """Where the fetch rule unpacks a PECOS benchmark (``<data_dir>/xmc-base/<archive>``, the
    tarball's own layout); None for a name without a tarball."""
    spec = CANONICAL.get(name)
    return Path(data_dir) / "xmc-base" / spec.archive if spec and spec.archive else None


def candidate_folders(name: str, data_dir: str | Path) -> list[Path]:
    data_dir = Path(data_dir)
    out = [data_dir / name]
    spec = CANONICAL.get(name)
    if spec:
        out += [data_dir / u for u in spec.upstream]
        if spec.archive:
            out += [fetch_folder(name, data_dir), data_dir / spec.archive]
    return out


def known_names(data_dir: str | Path) -> list[str]:
    """Canonical names plus every folder under ``data_dir``."""
    names = set(CANONICAL)
    d = Path(data_dir)
    if d.is_dir():
        names |= {p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "xmc-base"}
    return sorted(names)


def check_name(name: str, data_dir: str | Path) -> None:
    """Raise a clear error for a dataset that is neither canonical nor present."""
    if name in CANONICAL or any(f.is_dir() for f in candidate_folders(name, data_dir)):
        return
    raise StageError(
        f"unknown dataset '{name}': no folder {Path(data_dir) / name} and not a canonical name. "
        f"Known datasets: {', '.join(known_names(data_dir))}"
    )


def path_problem(path: Path, want: str = "file") -> str | None:
    """Why ``path`` cannot be read as a ``want`` (``file`` or ``folder``): ``"missing"``, ``"a
    symbolic link loop"``, ``"a broken symbolic link (to ...)"``, ``"a directory where a file
    belongs"``, ...; None when it can."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:                        # Python < 3.13 reports a loop so
            return "a symbolic link loop"
        except OSError as e:
            if e.errno == 40:                       # ELOOP
                return "a symbolic link loop"
            if not os.path.lexists(os.path.realpath(path)):
                return f"a broken symbolic link (to {os.readlink(path)})"
            return f"cannot be read ({e.strerror})"
    if not path.exists():
        return "missing"
    if want == "file" and path.is_dir():
        return "a directory where a file belongs"
    if want == "folder" and not path.is_dir():
        return "a file where a folder belongs"
    if want == "file" and not path.is_file():
        return "not a regular file"
    return None


def _first(folder: Path, names: list[str]) -> Path | None:
    """The first of ``names`` in ``folder`` that exists in any form (a file, or a directory or link
    that :func:`path_problem` then names); None if none does."""
    for n in names:
        p = folder / n
        if p.exists() or p.is_symlink():
            return p
    return None


def missing_folder_message(name: str, folders: list[Path], data_dir: str | Path) -> str:
    """The one-line error for a dataset none of whose folders exists: where its files go, which
    files, where a PECOS benchmark comes from, and how to make a synthetic one."""
    where = ", ".join(map(str, folders))
    if name == "debtags":
        return f"dataset 'debtags': none of {where} exists (run the `prepare` rule to build it)"
    from .synth import SHAPES

    target = fetch_folder(name, data_dir)
    synth = (f"python -m xmc_steps.stages.synth --shape {name if name in SHAPES else 'wiki500k'} --fraction 0.01 "
             "--layout {layout} --out {out}")
    if target is not None:
        from .fetch import archive_url   # light: no network at import

        return (f"dataset '{name}': none of {where} exists; the fetch rule downloads "
                f"{archive_url(CANONICAL[name].archive)} into {target}/ (files {', '.join(XMC_BASE_FILES)}); "
                f"without the network put those files there, or a synthetic set: "
                + synth.format(layout="xmc-base", out=target))
    return (f"dataset '{name}': none of {where} exists; put its files in {folders[0]}/ (raw-text layout: "
            f"train_texts.txt, train_labels.txt, test_texts.txt, test_labels.txt; xmc-base: "
            f"{', '.join(XMC_BASE_FILES[:4])}; BoW: train.txt, test.txt), or a synthetic set: "
            + synth.format(layout="raw", out=folders[0]))


def _raw_files(name: str, folder: Path) -> tuple[DatasetFiles, dict[Path, str]]:
    """The raw-text layout's files in ``folder`` and the required ones that are absent (path ->
    what it is)."""
    raw = DatasetFiles(name, folder, "raw")
    need: dict[Path, str] = {}
    for split in SPLITS:
        t = _first(folder, [f"{split}_raw_texts.txt", f"{split}_texts.txt"])
        lab = _first(folder, [f"{split}_labels.txt"])
        if t:
            raw.texts[split] = t
        else:
            need[folder / f"{split}_texts.txt"] = f"the {split} split's texts"
        if lab:
            raw.labels[split] = lab
        else:
            need[folder / f"{split}_labels.txt"] = f"the {split} split's labels"
        ids = _first(folder, [f"{split}_ids.txt"])
        if ids:
            raw.ids[split] = ids
    raw.label_ids = _first(folder, ["label_ids.txt"])
    raw.label_texts = _first(folder, ["label_texts.txt"])
    raw.label_map = _first(folder, ["label_map.tsv"])
    return raw, need


def _xmc_base_files(name: str, folder: Path) -> tuple[DatasetFiles, dict[Path, str]]:
    """The xmc-base layout's files in ``folder`` and the required ones that are absent."""
    xb = DatasetFiles(name, folder, "xmc-base")
    need: dict[Path, str] = {}
    for split, s in XMC_BASE_SPLIT.items():
        for kind, fname, what in (("texts", f"X.{s}.txt", "texts"), ("label_matrices", f"Y.{s}.npz", "label matrix")):
            p = _first(folder, [fname])
            if p:
                getattr(xb, kind)[split] = p
            else:
                need[folder / fname] = f"the {split} split's {what}"
        f = _first(folder / XMC_BASE_FEATURES, [f"X.{s}.npz"])
        if f:
            xb.features[split] = f
    if len(xb.features) == 1:     # the features are optional, but one split's alone cannot be used
        split = next(s for s in SPLITS if s not in xb.features)
        need[folder / XMC_BASE_FEATURES / f"X.{XMC_BASE_SPLIT[split]}.npz"] = f"the {split} split's features"
    xb.label_texts = _first(folder, [XMC_BASE_LABEL_TEXTS])
    return xb, need


def _bow_files(name: str, folder: Path) -> tuple[DatasetFiles, dict[Path, str]]:
    """The BoW layout's files in ``folder`` (the first pair of upstream names with a train file)."""
    spec = CANONICAL.get(name)
    bow = DatasetFiles(name, folder, "bow")
    pairs = spec.bow_files if spec else (("train.txt", "test.txt"),)
    tr, te = next(((a, b) for a, b in pairs if _first(folder, [a])), pairs[-1])
    need: dict[Path, str] = {}
    for split, fname in (("train", tr), ("test", te)):
        if _first(folder, [fname]):
            bow.bow[split] = folder / fname
        else:
            need[folder / fname] = f"the {split} split"
    bow.label_texts = _first(folder, ["label_texts.txt", "Y.txt"])
    return bow, need


_LAYOUT_NAMES = {"raw": "raw-text", "xmc-base": "xmc-base", "bow": "BoW"}


def _problems(files: DatasetFiles, need: dict[Path, str]) -> list[str]:
    """Every reason ``files`` cannot be read: absent required files, then present ones that are no file."""
    layout = _LAYOUT_NAMES[files.layout]
    out = [f"{p}: missing ({what}, {layout} layout)" for p, what in need.items()]
    for p in files.inputs():
        why = path_problem(p)
        if why:
            out.append(f"{p}: {why}")
    return out


def locate(name: str, data_dir: str | Path, path: str | None = None, layout: str | None = None) -> DatasetFiles:
    """Find a dataset's files; raise :class:`StageError` saying what is missing, in one line naming
    the path and the problem."""
    check_name(name, data_dir) if path is None else None
    folders = [Path(path)] if path else candidate_folders(name, data_dir)
    for f in folders:               # a folder that is there but no folder is named, not skipped
        why = path_problem(f, "folder")
        if why and why != "missing":
            raise StageError(f"dataset '{name}': {f}: {why}")
    folder = next((f for f in folders if f.is_dir()), None)
    if folder is None:
        raise StageError(missing_folder_message(name, folders, data_dir))
    found = {"raw": _raw_files(name, folder), "xmc-base": _xmc_base_files(name, folder), "bow": _bow_files(name, folder)}
    if layout is not None:
        files, need = found[layout]
        problems = _problems(files, need)
        if problems:
            raise StageError(f"dataset '{name}' (layout {layout}): {problems[0]}")
        return _checked(files)
    for files, need in found.values():          # a complete layout, raw first
        if not _problems(files, need):
            return _checked(files)
    for files, need in found.values():          # else the first layout with any of its files: what it lacks
        if files.inputs():
            raise StageError(f"dataset '{name}': {_problems(files, need)[0]}")
    raise StageError(
        f"dataset '{name}' in {folder}: no dataset layout found: neither the raw-text layout (train_texts.txt, "
        f"train_labels.txt, test_texts.txt, test_labels.txt) nor xmc-base ({', '.join(XMC_BASE_FILES[:4])}) "
        f"nor the BoW layout (train.txt, test.txt)"
    )


def _checked(files: DatasetFiles) -> DatasetFiles:
    """``files`` after the checks that need more than file names."""
    if files.layout == "raw" and files.label_texts and not files.label_ids:
        raise StageError(f"{files.label_texts}: label_texts.txt needs label_ids.txt beside it (aligned line by line)")
    return files


def dataset_inputs(name: str, data_dir: str | Path, path: str | None = None, layout: str | None = None) -> list[Path]:
    """The files the ingest rule reads: the located dataset's, or, for a PECOS benchmark none of
    whose folders exists, the xmc-base files the fetch rule makes in :func:`fetch_folder`."""
    target = fetch_folder(name, data_dir)
    if target is not None and layout in (None, "xmc-base"):
        absent = (not any(path_problem(f, "folder") != "missing" for f in candidate_folders(name, data_dir))
                  if path is None else Path(path) == target and path_problem(target, "folder") == "missing")
        if absent:
            return [target / n for n in XMC_BASE_FILES]
    return locate(name, data_dir, path, layout).inputs()
