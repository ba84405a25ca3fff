"""Build the built-in ``debtags`` dataset from the Debian 12 ("bookworm") package index.

Debian package descriptions labelled with Debtags, in the AttentionXML raw-text
layout (``train_texts.txt``, ``train_labels.txt``, ``test_texts.txt``,
``test_labels.txt``, ``label_ids.txt``, ``label_texts.txt``, ``label_map.tsv``,
``train_ids.txt``, ``test_ids.txt``) plus ``stats.json`` (counts and the md5 of
every file) and ``source.json`` (which index release the files come from).

Recipe (the same as the reference copy's, so that a build from the same index
release is byte-identical to it):

1. :func:`fetch_index` runs ``apt-get update`` with a private sources list, lists
   folder and cache under a work folder (no root-owned apt state is touched) for
   ``deb http://deb.debian.org/debian bookworm main`` (amd64, English
   translations, uncompressed indexes), then ``apt-get download debtags`` and
   ``dpkg-deb -x`` for ``/usr/share/debtags/vocabulary``.
2. For every package paragraph with a ``Tag:`` field: labels are its
   comma-separated tags minus those ending in ``::TODO``; a package left with no
   tag is skipped.  Text is ``"<package> : <short description> . <long
   description>"``, the long description taken from Translation-en by
   ``Description-md5`` (falling back to the package's own ``Description``), its
   continuation lines stripped and joined with spaces, lone ``.`` lines dropped,
   runs of whitespace collapsed to one space.
3. Label name is ``"<facet description>: <tag description>"`` (first lines of
   the vocabulary's ``Description`` fields).
4. Split: the sorted package names are shuffled with ``random.Random(0)``; the
   first 20% (rounded) are the test set.  Each split is written in package-name
   order; labels within a document and the label list are sorted.

The parsing and building functions are pure (text in, text out) and unit-tested
without network; only :func:`fetch_index` needs apt and a mirror.

The packages with no tag at all (about as many as the tagged ones) are what the ``suggestions``
target suggests Debtags for: ``--untagged DIR`` writes their texts (the same recipe) and names
instead of the dataset (:func:`untagged_documents`).

The DAG runs it through the ``prepare_debtags`` stage (:mod:`xmc_steps.stages.prepare_debtags`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from . import io
from .errors import StageError

MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
COMPONENT = "main"
ARCH = "amd64"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"

TEST_FRACTION = 0.2
SEED = 0

#: the data files, in the order they are listed in stats.json's md5 table (sorted)
DATA_FILES = (
    "label_ids.txt",
    "label_map.tsv",
    "label_texts.txt",
    "test_ids.txt",
    "test_labels.txt",
    "test_texts.txt",
    "train_ids.txt",
    "train_labels.txt",
    "train_texts.txt",
)

_WS = re.compile(r"\s+")


# --------------------------------------------------------------------------- parsing


def parse_deb822(text: str) -> list[dict[str, list[str]]]:
    """Split a deb822 control text (Packages, Translation, vocabulary) into paragraphs.

    Each paragraph maps a field name to its value as a list of lines: the text after
    ``Name:`` (stripped) first, then the raw continuation lines (those starting with
    a space or a tab), without their line ends.  Paragraphs are separated by blank
    (empty or whitespace-only) lines; ``#`` comment lines are ignored.
    """
    paras: list[dict[str, list[str]]] = []
    cur: dict[str, list[str]] = {}
    last: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            if cur:
                paras.append(cur)
            cur, last = {}, None
            continue
        if line[0] in " \t":
            if last is None:
                raise ValueError(f"continuation line outside a field: {line[:60]!r}")
            last.append(line)
            continue
        if line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"not a deb822 field line: {line[:60]!r}")
        last = [value.strip()]
        cur[name.strip()] = last
    if cur:
        paras.append(cur)
    return paras


def _first_line(para: dict[str, list[str]], name: str) -> str:
    lines = para.get(name)
    return lines[0].strip() if lines else ""


def long_description(lines: Iterable[str]) -> str:
    """Continuation lines of a Description: stripped, lone '.' lines dropped, joined by spaces."""
    parts = []
    for raw in lines:
        s = raw.strip()
        if not s or s == ".":
            continue
        parts.append(s)
    return " ".join(parts)


@dataclass(frozen=True)
class Package:
    name: str
    tags: tuple[str, ...]  # as listed in the Tag: field (``::TODO`` tags included)
    short: str  # first line of Description
    long: str  # long description from the Packages paragraph ('' if none there)
    md5: str  # Description-md5 ('' if absent)


def parse_packages(text: str) -> list[Package]:
    """The package paragraphs of a ``Packages`` index, in file order (duplicates kept)."""
    out = []
    for para in parse_deb822(text):
        if "Package" not in para:
            continue
        tag_value = " ".join(s.strip() for s in para.get("Tag", []))
        tags = tuple(t.strip() for t in tag_value.split(",") if t.strip())
        desc = para.get("Description", [""])
        out.append(
            Package(
                name=_first_line(para, "Package"),
                tags=tags,
                short=desc[0].strip(),
                long=long_description(desc[1:]),
                md5=_first_line(para, "Description-md5"),
            )
        )
    return out


def parse_translations(text: str) -> dict[str, tuple[str, str]]:
    """``Translation-en``: Description-md5 -> (short description, long description)."""
    out: dict[str, tuple[str, str]] = {}
    for para in parse_deb822(text):
        md5 = _first_line(para, "Description-md5")
        key = next((k for k in para if k.startswith("Description-") and k != "Description-md5"), None)
        if not md5 or key is None:
            continue
        lines = para[key]
        out.setdefault(md5, (lines[0].strip(), long_description(lines[1:])))
    return out


def parse_vocabulary(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """The debtags vocabulary: (facet -> description, tag -> description), first lines."""
    facets: dict[str, str] = {}
    tags: dict[str, str] = {}
    for para in parse_deb822(text):
        desc = _first_line(para, "Description")
        if "Facet" in para:
            facets[_first_line(para, "Facet")] = desc
        elif "Tag" in para:
            tags[_first_line(para, "Tag")] = desc
    return facets, tags


# --------------------------------------------------------------------------- building


def clean_labels(tags: Iterable[str]) -> list[str]:
    """Sorted distinct tags without the ``::TODO`` placeholders."""
    return sorted({t for t in tags if t and not t.endswith("::TODO")})


def document_text(pkg: Package, translations: dict[str, tuple[str, str]]) -> str:
    """``"<package> : <short description> . <long description>"`` on one line."""
    short, long = pkg.short, pkg.long
    if pkg.md5 and pkg.md5 in translations:
        _, long = translations[pkg.md5]
    text = f"{pkg.name} : {short} . {long}"
    return _WS.sub(" ", text).strip()


def label_name(tag: str, facets: dict[str, str], tag_desc: dict[str, str]) -> str:
    """``"<facet description>: <tag description>"``; the raw name for a missing entry."""
    facet = tag.split("::", 1)[0]
    f = facets.get(facet) or facet
    t = tag_desc.get(tag) or tag.split("::", 1)[-1]
    return _WS.sub(" ", f"{f}: {t}").strip()


def split_names(names: Iterable[str], test_fraction: float = TEST_FRACTION, seed: int = SEED) -> tuple[list[str], list[str]]:
    """(train, test) package names: sorted names shuffled with Random(seed), first part test.

    Both lists are returned sorted.
    """
    order = sorted(set(names))
    random.Random(seed).shuffle(order)
    n_test = int(round(test_fraction * len(order)))
    return sorted(order[n_test:]), sorted(order[:n_test])


def _lines(rows: Iterable[str]) -> str:
    return "".join(f"{r}\n" for r in rows)


def build_documents(packages: list[Package], translations: dict[str, tuple[str, str]]) -> dict[str, tuple[str, list[str]]]:
    """package name -> (text, sorted labels), for tagged packages only.

    A package listed more than once (several versions in the index) is taken from its
    first paragraph.
    """
    docs: dict[str, tuple[str, list[str]]] = {}
    for pkg in packages:
        if pkg.name in docs or not pkg.tags:
            continue
        labels = clean_labels(pkg.tags)
        if not labels:
            continue
        docs[pkg.name] = (document_text(pkg, translations), labels)
    return docs


def untagged_documents(packages: list[Package], translations: dict[str, tuple[str, str]],
                       exclude: Iterable[str] = ()) -> dict[str, str]:
    """package name -> text (as :func:`document_text`) of the packages with no Debtags: no ``Tag:``
    field, or only ``::TODO`` tags; a package is taken from its first paragraph, and one tagged in any
    of its paragraphs, or named in ``exclude`` (the dataset's own packages), is left out.  Sorted by name."""
    tagged = {p.name for p in packages if clean_labels(p.tags)} | set(exclude)
    docs: dict[str, str] = {}
    for pkg in packages:
        if pkg.name not in tagged and pkg.name not in docs:
            docs[pkg.name] = document_text(pkg, translations)
    return dict(sorted(docs.items()))


def build_dataset(packages_text: str, translation_text: str, vocabulary_text: str) -> dict[str, str]:
    """Build every data file of the dataset: file name -> content (``stats.json`` included)."""
    packages = parse_packages(packages_text)
    translations = parse_translations(translation_text)
    facets, tag_desc = parse_vocabulary(vocabulary_text)
    docs = build_documents(packages, translations)
    if not docs:
        raise ValueError("no tagged package in the Packages index")
    train, test = split_names(docs)
    label_ids = sorted({lab for _, labs in docs.values() for lab in labs})
    names = [label_name(t, facets, tag_desc) for t in label_ids]

    files: dict[str, str] = {
        "label_ids.txt": _lines(label_ids),
        "label_map.tsv": _lines(f"{i}\t{n}" for i, n in zip(label_ids, names)),
        "label_texts.txt": _lines(names),
    }
    for split, ids in (("train", train), ("test", test)):
        files[f"{split}_ids.txt"] = _lines(ids)
        files[f"{split}_texts.txt"] = _lines(docs[p][0] for p in ids)
        files[f"{split}_labels.txt"] = _lines(" ".join(docs[p][1]) for p in ids)
    files = {k: files[k] for k in DATA_FILES}
    files["stats.json"] = json.dumps(dataset_stats(files), indent=1)
    return files


def _split_stats(texts: list[str], labels: list[list[str]]) -> dict:
    words = [len(t.split()) for t in texts]
    n = len(texts)
    return {
        "docs": n,
        "labels_used": len({lab for labs in labels for lab in labs}),
        "avg_labels_per_doc": round(sum(len(x) for x in labels) / n, 3) if n else 0.0,
        "avg_words": round(sum(words) / n, 1) if n else 0.0,
        "median_words": statistics.median(words) if n else 0,
        "avg_chars": round(sum(len(t) for t in texts) / n, 1) if n else 0.0,
        "docs_without_labels": sum(1 for x in labels if not x),
    }


def dataset_stats(files: dict[str, str]) -> dict:
    """stats.json of a built dataset: per-split counts, label frequencies, sizes, md5s."""

    def rows(name: str) -> list[str]:
        return files[name].splitlines()

    tr_texts, te_texts = rows("train_texts.txt"), rows("test_texts.txt")
    tr_labels = [r.split() for r in rows("train_labels.txt")]
    te_labels = [r.split() for r in rows("test_labels.txt")]
    train = _split_stats(tr_texts, tr_labels)
    test = _split_stats(te_texts, te_labels)
    seen = {lab for labs in tr_labels for lab in labs}
    test["labels_unseen_in_train"] = len({lab for labs in te_labels for lab in labs} - seen)
    test["label_occurrences_unseen_in_train"] = sum(1 for labs in te_labels for lab in labs if lab not in seen)
    freq: dict[str, int] = {}
    for labs in tr_labels + te_labels:
        for lab in labs:
            freq[lab] = freq.get(lab, 0) + 1
    counts = list(freq.values()) or [0]
    return {
        "train": train,
        "test": test,
        "all": {
            "distinct_labels": len(freq),
            "max_label_freq": max(counts),
            "median_label_freq": statistics.median(counts),
            "labels_with_freq_le_5": sum(1 for c in counts if c <= 5),
            "bytes_on_disk": sum(len(files[f].encode("utf-8")) for f in DATA_FILES),
        },
        "md5": {f: hashlib.md5(files[f].encode("utf-8")).hexdigest() for f in DATA_FILES},
    }


def write_dataset(outdir: str | os.PathLike, files: dict[str, str]) -> list[Path]:
    """Write each file atomically (temporary name, then rename) into ``outdir``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        path = outdir / name
        # bytes, not write_text: the files must be byte-identical on every platform
        with io.atomic_path(path) as tmp:
            tmp.write_bytes(content.encode("utf-8"))
        written.append(path)
    return written


# --------------------------------------------------------------------------- fetching


@dataclass
class IndexFiles:
    packages: Path
    translation: Path
    vocabulary: Path
    inrelease: Path | None
    debtags_deb: Path | None = None

    def source_info(self) -> dict:
        info: dict = {
            "mirror": MIRROR,
            "suite": SUITE,
            "component": COMPONENT,
            "architecture": ARCH,
            "packages_file": self.packages.name,
            "translation_file": self.translation.name,
            "packages_sha256": _sha256(self.packages),
            "translation_sha256": _sha256(self.translation),
            "vocabulary_sha256": _sha256(self.vocabulary),
        }
        if self.inrelease is not None and self.inrelease.exists():
            info.update(parse_release(self.inrelease.read_text(encoding="utf-8", errors="replace")))
        if self.debtags_deb is not None:
            info["debtags_deb"] = self.debtags_deb.name
        return info


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_release(text: str) -> dict[str, str]:
    """Origin/Suite/Codename/Version/Date of an (In)Release file (PGP armour skipped)."""
    body = text
    if "-----BEGIN PGP SIGNED MESSAGE-----" in text:
        body = text.split("\n\n", 1)[1] if "\n\n" in text else text
        body = body.split("-----BEGIN PGP SIGNATURE-----", 1)[0]
    paras = parse_deb822(body)
    if not paras:
        return {}
    wanted = {"Origin": "origin", "Suite": "archive_suite", "Codename": "codename", "Version": "release", "Date": "date"}
    return {key: _first_line(paras[0], k) for k, key in wanted.items() if k in paras[0]}


def _apt_options(workdir: Path) -> list[str]:
    return [
        "-o", f"Dir::Etc::SourceList={workdir / 'sources.list'}",
        "-o", "Dir::Etc::SourceParts=/dev/null",
        "-o", f"Dir::State::Lists={workdir / 'lists'}",
        "-o", f"Dir::Cache={workdir / 'cache'}",
        "-o", f"Dir::Cache::archives={workdir / 'cache' / 'archives'}",
        "-o", f"Dir::State::status={workdir / 'status'}",
        "-o", f"Dir::State={workdir / 'state'}",
        "-o", f"APT::Architecture={ARCH}",
        "-o", f"APT::Architectures={ARCH}",
        "-o", "Acquire::Languages=en",
        "-o", "Acquire::GzipIndexes=false",
    ]


def _run(cmd: list[str], log: logging.Logger, cwd: Path | None = None, timeout: float = 900) -> str:
    """Run ``cmd``; return its stderr tail.  StageError naming it and its stderr on failure."""
    log.info("running: %s", " ".join(cmd))
    exe = shutil.which(cmd[0])
    if exe is None:
        raise StageError(f"{cmd[0]} not found: building the debtags dataset needs apt on a Debian system")
    try:
        res = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=timeout,
            env={**os.environ, "LC_ALL": "C"},  # untranslated messages, for the error text
        )
    except subprocess.TimeoutExpired as e:
        raise StageError(f"`{' '.join(cmd)}` timed out after {timeout:.0f} s") from e
    tail = "\n".join((res.stderr or "").strip().splitlines()[-15:])
    if res.returncode != 0:
        raise StageError(f"`{' '.join(cmd)}` failed with exit code {res.returncode}:\n{tail}")
    if tail:
        log.info("%s stderr:\n%s", cmd[0], tail)
    return tail


def find_index_files(index_dir: str | os.PathLike) -> IndexFiles:
    """Locate Packages / Translation-en / InRelease / vocabulary in an index folder.

    ``index_dir`` is a folder written by :func:`fetch_index` (``lists/`` and
    ``debtags/`` below it) or any folder holding the apt list files and a
    ``vocabulary`` file somewhere below it.
    """
    root = Path(index_dir)
    if not root.is_dir():
        raise StageError(f"index folder {root} does not exist")

    def one(pattern: str, what: str, required: bool = True) -> Path | None:
        hits = sorted(p for p in root.rglob(pattern) if p.is_file() and "partial" not in p.parts)
        if not hits:
            if required:
                raise StageError(f"no {what} ({pattern}) under {root}")
            return None
        if len(hits) > 1:
            raise StageError(f"several {what} files under {root}: {', '.join(str(h) for h in hits)}")
        return hits[0]

    pk = one(f"*_dists_{SUITE}_{COMPONENT}_binary-{ARCH}_Packages", "Packages index")
    tr = one(f"*_dists_{SUITE}_{COMPONENT}_i18n_Translation-en", "Translation-en index")
    rel = one(f"*_dists_{SUITE}_InRelease", "InRelease", required=False)
    voc = one("vocabulary", "debtags vocabulary")
    deb = one("debtags_*.deb", "debtags package", required=False)
    assert pk is not None and tr is not None and voc is not None
    return IndexFiles(packages=pk, translation=tr, vocabulary=voc, inrelease=rel, debtags_deb=deb)


def fetch_index(workdir: str | os.PathLike, log: logging.Logger | None = None, mirror: str = MIRROR) -> IndexFiles:
    """Fetch the bookworm main amd64 index and the debtags vocabulary into ``workdir``.

    Everything apt writes stays under ``workdir`` (own sources.list, lists, cache,
    state); nothing of the system's apt state is read or changed except the archive
    keyring.  Raises :class:`StageError` naming the command and its stderr tail when
    apt is missing or a fetch fails.
    """
    log = log or logging.getLogger("xmc.prepare_debtags")
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise StageError(f"{tool} not found: building the debtags dataset needs apt on a Debian system")
    work = Path(workdir).resolve()
    for sub in ("lists/partial", "cache/archives/partial", "state", "debtags"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "status").touch()
    signed = f" signed-by={KEYRING}" if Path(KEYRING).exists() else ""
    (work / "sources.list").write_text(f"deb [arch={ARCH}{signed}] {mirror} {SUITE} {COMPONENT}\n", encoding="utf-8")
    opts = _apt_options(work)

    update = ["apt-get", "update", *opts]
    tail = _run(update, log)
    lists = work / "lists"
    for pattern in (f"*_dists_{SUITE}_{COMPONENT}_binary-{ARCH}_Packages", f"*_dists_{SUITE}_{COMPONENT}_i18n_Translation-en"):
        if not list(lists.glob(pattern)):
            # apt-get update exits 0 when a source fails to download ("W: Failed to fetch")
            raise StageError(
                f"`{' '.join(update)}` did not fetch {pattern} from {mirror} (network or mirror problem?):\n{tail}"
            )

    debdir = work / "debtags"
    for old in debdir.glob("debtags_*.deb"):
        old.unlink()
    _run(["apt-get", "download", *opts, "debtags"], log, cwd=debdir)
    debs = sorted(debdir.glob("debtags_*.deb"))
    if not debs:
        raise StageError("`apt-get download debtags` produced no .deb")
    root = debdir / "root"
    if root.exists():
        shutil.rmtree(root)
    _run(["dpkg-deb", "-x", str(debs[-1]), str(root)], log)
    vocab = root / "usr" / "share" / "debtags" / "vocabulary"
    if not vocab.is_file():
        raise StageError(f"{debs[-1].name} has no /usr/share/debtags/vocabulary")
    files = find_index_files(work)
    log.info("index: %s", json.dumps(files.source_info()))
    return files


# --------------------------------------------------------------------------- CLI


def build_from_index(index: IndexFiles, outdir: str | os.PathLike, log: logging.Logger | None = None) -> dict:
    """Read the index files, build the dataset, write it into ``outdir``; return stats."""
    log = log or logging.getLogger("xmc.prepare_debtags")
    read = lambda p: Path(p).read_text(encoding="utf-8")  # noqa: E731
    files = build_dataset(read(index.packages), read(index.translation), read(index.vocabulary))
    source = index.source_info()
    files["source.json"] = json.dumps(source, indent=1) + "\n"
    write_dataset(outdir, files)
    stats = json.loads(files["stats.json"])
    log.info(
        "debtags %s (%s): %d train / %d test docs, %d labels -> %s",
        source.get("release", "?"), source.get("date", "?"),
        stats["train"]["docs"], stats["test"]["docs"], stats["all"]["distinct_labels"], outdir,
    )
    return stats


def write_untagged(index: IndexFiles, outdir: str | os.PathLike, exclude_files: Iterable[str | os.PathLike] = (),
                   log: logging.Logger | None = None) -> int:
    """``texts.txt`` and ``ids.txt`` (one package per line, aligned) of the packages with no Debtags
    (:func:`untagged_documents`), minus the packages listed in ``exclude_files``; returns their count."""
    log = log or logging.getLogger("xmc.prepare_debtags")
    read = lambda p: Path(p).read_text(encoding="utf-8")  # noqa: E731
    exclude = {line.strip() for f in exclude_files for line in read(f).splitlines() if line.strip()}
    docs = untagged_documents(parse_packages(read(index.packages)), parse_translations(read(index.translation)), exclude)
    write_dataset(outdir, {"ids.txt": _lines(docs), "texts.txt": _lines(docs.values())})
    log.info("%d packages without Debtags (%d of the dataset's packages left out) -> %s", len(docs), len(exclude), outdir)
    return len(docs)
