"""Tests of the debtags dataset builder (xmc_steps.debtags, run by the stage xmc_steps.stages.prepare_debtags).

Unit tests run on small hand-written Packages / Translation-en / vocabulary texts.
The integration test (marked ``network``) fetches the real bookworm index and
compares the build with the read-only reference copy in ``../shared/data``.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest

from xmc_steps import debtags as pd
from xmc_steps.stages import prepare_debtags as stage
from xmc_steps.errors import StageError

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "debtags-bookworm"
# the index the reference copy was built from (its README): Debian 12.15, InRelease of 2026-07-11
REFERENCE_RELEASE = "12.15"
REFERENCE_DATE = "2026-07-11"
# a later point release changes a few packages; allowed relative drift of the counts
COUNT_TOLERANCE = 0.02

PACKAGES = """\
Package: zeta
Version: 2.0-1
Description: Zeta   editor
Description-md5: 11111111111111111111111111111111
Tag: role::program, use::editing,
 interface::commandline
Section: editors

Package: alpha
Version: 1.0
Description: Alpha tool
 Long text only in Packages,
    indented oddly.
 .
 Second paragraph.
Tag: role::program, suite::TODO

Package: todo-only
Description: Nothing tagged yet
Description-md5: 33333333333333333333333333333333
Tag: role::TODO, use::TODO

Package: untagged
Description: No Tag field at all
Description-md5: 44444444444444444444444444444444

Package: beta
Description: Beta library
Description-md5: 22222222222222222222222222222222
Tag: devel::library, role::devel-lib

Package: beta
Version: 0.9
Description: Beta library (older version)
Description-md5: 22222222222222222222222222222222
Tag: devel::library
"""

TRANSLATIONS = """\
Package: zeta
Description-md5: 11111111111111111111111111111111
Description-en: Zeta editor
 Zeta edits  text.
 .
 It has two   paragraphs.

Package: beta
Description-md5: 22222222222222222222222222222222
Description-en: Beta library
 Routines for beta.

Package: untagged
Description-md5: 44444444444444444444444444444444
Description-en: No Tag field at all
 Never used.
"""

VOCABULARY = """\
Facet: devel
Description: Software Development
 Facet long description.

Tag: devel::library
Description: Libraries
 Long text.
 .
 More.

Facet: role
Status: draft
Description: Role

Tag: role::program
Description: Program

Tag: role::devel-lib
Description: Development Library

Facet: use
Description: Purpose

Tag: use::editing
Description: Editing

Facet: interface
Description: User Interface

Tag: interface::commandline
Description: Command Line
"""


# --------------------------------------------------------------------------- parsing


def test_parse_deb822_paragraphs_and_continuations():
    paras = pd.parse_deb822("A: 1\nB: two\n more\n\n\n \nA: 3\n")
    assert paras == [{"A": ["1"], "B": ["two", " more"]}, {"A": ["3"]}]
    with pytest.raises(ValueError):
        pd.parse_deb822(" orphan continuation\n")


def test_parse_packages_fields():
    pkgs = pd.parse_packages(PACKAGES)
    assert [p.name for p in pkgs] == ["zeta", "alpha", "todo-only", "untagged", "beta", "beta"]
    zeta = pkgs[0]
    assert zeta.tags == ("role::program", "use::editing", "interface::commandline")
    assert zeta.md5 == "11111111111111111111111111111111"
    assert zeta.short == "Zeta   editor"
    alpha = pkgs[1]
    assert alpha.md5 == ""
    assert alpha.long == "Long text only in Packages, indented oddly. Second paragraph."
    assert pkgs[3].tags == ()


def test_parse_translations_by_md5():
    tr = pd.parse_translations(TRANSLATIONS)
    assert set(tr) == {"1" * 32, "2" * 32, "4" * 32}
    # continuation lines stripped and joined by spaces, the lone "." line dropped
    assert tr["1" * 32] == ("Zeta editor", "Zeta edits  text. It has two   paragraphs.")


def test_parse_vocabulary_first_lines():
    facets, tags = pd.parse_vocabulary(VOCABULARY)
    assert facets == {"devel": "Software Development", "role": "Role", "use": "Purpose", "interface": "User Interface"}
    assert tags["devel::library"] == "Libraries"
    assert tags["role::devel-lib"] == "Development Library"


def test_parse_release():
    text = (
        "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA512\n\n"
        "Origin: Debian\nLabel: Debian\nSuite: oldstable\nVersion: 12.99\nCodename: bookworm\n"
        "Date: Sat, 01 Jan 2000 00:00:00 UTC\nMD5Sum:\n 0123 12 main/x\n"
        "-----BEGIN PGP SIGNATURE-----\n\nabc\n-----END PGP SIGNATURE-----\n"
    )
    assert pd.parse_release(text) == {
        "origin": "Debian", "archive_suite": "oldstable", "codename": "bookworm",
        "release": "12.99", "date": "Sat, 01 Jan 2000 00:00:00 UTC",
    }


# --------------------------------------------------------------------------- building


def test_labels_and_texts():
    docs = pd.build_documents(pd.parse_packages(PACKAGES), pd.parse_translations(TRANSLATIONS))
    # todo-only (only ::TODO tags) and untagged (no Tag:) are skipped; beta once, first paragraph
    assert sorted(docs) == ["alpha", "beta", "zeta"]
    assert docs["zeta"] == (
        "zeta : Zeta editor . Zeta edits text. It has two paragraphs.",
        ["interface::commandline", "role::program", "use::editing"],
    )
    # no Description-md5: the long description of the Packages paragraph is used
    assert docs["alpha"] == (
        "alpha : Alpha tool . Long text only in Packages, indented oddly. Second paragraph.",
        ["role::program"],
    )
    assert docs["beta"] == ("beta : Beta library . Routines for beta.", ["devel::library", "role::devel-lib"])


def test_md5_missing_from_translations_falls_back_to_description():
    pkgs = pd.parse_packages(
        "Package: gamma\nDescription: Gamma\n Own long text.\nDescription-md5: " + "9" * 32 + "\nTag: role::program\n"
    )
    docs = pd.build_documents(pkgs, pd.parse_translations(TRANSLATIONS))
    assert docs["gamma"][0] == "gamma : Gamma . Own long text."


def test_label_name_fallbacks():
    facets, tags = pd.parse_vocabulary(VOCABULARY)
    assert pd.label_name("devel::library", facets, tags) == "Software Development: Libraries"
    # a tag missing from the vocabulary keeps its raw parts rather than failing
    assert pd.label_name("devel::newthing", facets, tags) == "Software Development: newthing"
    assert pd.label_name("nofacet::x", facets, tags) == "nofacet: x"


def test_split_is_seeded_and_deterministic():
    names = [f"pkg{i:02d}" for i in range(10)]
    train, test = pd.split_names(reversed(names))  # input order does not matter
    # sorted names shuffled with random.Random(0): pkg07, pkg08, ... -> first 2 are test
    assert test == ["pkg07", "pkg08"]
    assert train == sorted(set(names) - {"pkg07", "pkg08"})
    assert pd.split_names(names) == (train, test)
    order = sorted(names)
    random.Random(0).shuffle(order)
    assert test == sorted(order[:2])
    big = [f"p{i}" for i in range(30293)]
    tr, te = pd.split_names(big)
    assert (len(tr), len(te)) == (24234, 6059)
    assert not set(tr) & set(te)


def test_build_dataset_files():
    files = pd.build_dataset(PACKAGES, TRANSLATIONS, VOCABULARY)
    assert set(files) == set(pd.DATA_FILES) | {"stats.json"}
    assert files["label_ids.txt"] == (
        "devel::library\ninterface::commandline\nrole::devel-lib\nrole::program\nuse::editing\n"
    )
    assert files["label_texts.txt"].splitlines() == [
        "Software Development: Libraries", "User Interface: Command Line",
        "Role: Development Library", "Role: Program", "Purpose: Editing",
    ]
    assert files["label_map.tsv"].splitlines()[0] == "devel::library\tSoftware Development: Libraries"
    # 3 docs: round(0.6) = 1 test doc
    train_ids = files["train_ids.txt"].splitlines()
    test_ids = files["test_ids.txt"].splitlines()
    assert len(test_ids) == 1 and len(train_ids) == 2
    assert sorted(train_ids + test_ids) == ["alpha", "beta", "zeta"]
    for split in ("train", "test"):
        ids = files[f"{split}_ids.txt"].splitlines()
        texts = files[f"{split}_texts.txt"].splitlines()
        labels = files[f"{split}_labels.txt"].splitlines()
        assert len(ids) == len(texts) == len(labels)
        assert all(t.startswith(f"{i} : ") for i, t in zip(ids, texts))
        assert all(lab.split() == sorted(lab.split()) for lab in labels)
        assert files[f"{split}_texts.txt"].endswith("\n")
    # same input, same bytes
    assert pd.build_dataset(PACKAGES, TRANSLATIONS, VOCABULARY) == files


def test_stats():
    files = pd.build_dataset(PACKAGES, TRANSLATIONS, VOCABULARY)
    stats = json.loads(files["stats.json"])
    assert set(stats) == {"train", "test", "all", "md5"}
    assert stats["train"]["docs"] + stats["test"]["docs"] == 3
    assert stats["all"]["distinct_labels"] == 5
    assert stats["all"]["max_label_freq"] == 2  # role::program: zeta and alpha
    assert stats["all"]["labels_with_freq_le_5"] == 5
    assert stats["all"]["bytes_on_disk"] == sum(len(files[f].encode()) for f in pd.DATA_FILES)
    assert list(stats["md5"]) == sorted(pd.DATA_FILES)
    for f in pd.DATA_FILES:
        assert stats["md5"][f] == hashlib.md5(files[f].encode()).hexdigest()
    for split in ("train", "test"):
        assert stats[split]["docs_without_labels"] == 0
    assert stats["test"]["labels_unseen_in_train"] <= stats["test"]["labels_used"]
    if REFERENCE.is_dir():  # same keys, same layout as the reference copy's stats.json
        ref = json.loads((REFERENCE / "stats.json").read_text())
        assert {k: list(v) for k, v in stats.items()} == {k: list(v) for k, v in ref.items()}


def test_no_tagged_package_is_an_error():
    with pytest.raises(ValueError):
        pd.build_dataset("Package: a\nDescription: x\n", "", VOCABULARY)


# --------------------------------------------------------------------------- writing, CLI


def test_write_dataset_is_atomic(tmp_path, monkeypatch):
    files = pd.build_dataset(PACKAGES, TRANSLATIONS, VOCABULARY)
    pd.write_dataset(tmp_path, files)
    for name, content in files.items():
        assert (tmp_path / name).read_bytes() == content.encode()

    out = tmp_path / "interrupted"
    real = Path.write_bytes
    calls = {"n": 0}

    def flaky(self, data):
        calls["n"] += 1
        if calls["n"] == 3:
            real(self, data[: len(data) // 2])  # half written, then killed
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", flaky)
    with pytest.raises(KeyboardInterrupt):
        pd.write_dataset(out, files)
    names = list(files)
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(names[:2])  # complete files only: no partial, no temporary
    for name in left:
        assert (out / name).read_bytes() == files[name].encode()


def _fake_index(folder: Path) -> Path:
    lists = folder / "lists"
    lists.mkdir(parents=True)
    (lists / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages").write_text(PACKAGES)
    (lists / "deb.debian.org_debian_dists_bookworm_main_i18n_Translation-en").write_text(TRANSLATIONS)
    (lists / "deb.debian.org_debian_dists_bookworm_InRelease").write_text(
        "Origin: Debian\nSuite: oldstable\nVersion: 12.99\nCodename: bookworm\nDate: Sat, 01 Jan 2000 00:00:00 UTC\n"
    )
    voc = folder / "debtags" / "root" / "usr" / "share" / "debtags"
    voc.mkdir(parents=True)
    (voc / "vocabulary").write_text(VOCABULARY)
    return folder


def test_cli_with_index_dir(tmp_path):
    index = _fake_index(tmp_path / "index")
    out = tmp_path / "out"
    record = tmp_path / "record.json"
    rc = stage.cli_main(stage.main, ["--out", str(out), "--index-dir", str(index), "--record", str(record), "--no-tracking"])
    assert rc == 0
    files = pd.build_dataset(PACKAGES, TRANSLATIONS, VOCABULARY)
    for name, content in files.items():
        assert (out / name).read_text() == content
    source = json.loads((out / "source.json").read_text())
    assert source["release"] == "12.99" and source["codename"] == "bookworm"
    rec = json.loads(record.read_text())
    assert rec["metrics"]["labels"] == 5


def test_untagged_packages_are_the_others(tmp_path):
    """The packages the suggestions target answers for: no tag, or only ::TODO ones; same text recipe."""
    docs = pd.untagged_documents(pd.parse_packages(PACKAGES), pd.parse_translations(TRANSLATIONS))
    assert docs == {"todo-only": "todo-only : Nothing tagged yet .",
                    "untagged": "untagged : No Tag field at all . Never used."}
    assert list(pd.untagged_documents(pd.parse_packages(PACKAGES), {}, exclude={"untagged"})) == ["todo-only"]
    index = _fake_index(tmp_path / "index")
    (tmp_path / "ids.txt").write_text("todo-only\n")
    rc = stage.cli_main(stage.main, ["--untagged", str(tmp_path / "u"), "--index-dir", str(index), "--exclude-ids",
                               str(tmp_path / "ids.txt"), "--no-tracking"])
    assert rc == 0
    assert (tmp_path / "u" / "ids.txt").read_text() == "untagged\n"
    assert (tmp_path / "u" / "texts.txt").read_text() == "untagged : No Tag field at all . Never used.\n"


def test_cli_errors(tmp_path, capsys, monkeypatch):
    rc = stage.cli_main(stage.main, ["--out", str(tmp_path / "o"), "--index-dir", str(tmp_path / "missing"), "--no-tracking"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    rc = stage.cli_main(stage.main, ["--out", str(tmp_path / "o"), "--index-dir", str(tmp_path / "empty"), "--no-tracking"])
    assert rc == 2
    assert "Packages" in capsys.readouterr().err
    assert not (tmp_path / "o" / "train_texts.txt").exists()
    # no apt on this machine: a clear error naming the tool
    monkeypatch.setattr(pd.shutil, "which", lambda name: None)
    with pytest.raises(StageError, match="apt-get not found"):
        pd.fetch_index(tmp_path / "w")


# --------------------------------------------------------------------------- integration

_NETWORK_SIGNS = ("Failed to fetch", "Temporary failure", "Could not resolve", "Could not connect",
                  "did not fetch", "timed out", "Connection", "Unable to connect", "Network is unreachable")


def _release_date(source: dict) -> str:
    try:
        return email.utils.parsedate_to_datetime(source.get("date", "")).date().isoformat()
    except (TypeError, ValueError):
        return ""


@pytest.mark.slow
@pytest.mark.network
def test_real_index_matches_reference(tmp_path):
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("apt-get / dpkg-deb not available")
    if not REFERENCE.is_dir():
        pytest.skip(f"{REFERENCE} is absent (../shared is not beside the checkout)")
    try:
        index = pd.fetch_index(tmp_path / "index")
    except StageError as e:
        if any(s in str(e) for s in _NETWORK_SIGNS):
            pytest.skip(f"cannot reach the Debian mirror: {str(e)[-300:]}")
        raise
    out = tmp_path / "debtags"
    stats = pd.build_from_index(index, out)
    source = json.loads((out / "source.json").read_text())
    ref = json.loads((REFERENCE / "stats.json").read_text())

    same_release = source.get("release") == REFERENCE_RELEASE and _release_date(source) == REFERENCE_DATE
    if same_release:
        for name in pd.DATA_FILES:
            got = hashlib.md5((out / name).read_bytes()).hexdigest()
            assert got == ref["md5"][name], f"{name} differs from the reference"
            assert got == hashlib.md5((REFERENCE / name).read_bytes()).hexdigest()
        assert stats == ref
        assert (out / "stats.json").read_bytes() == (REFERENCE / "stats.json").read_bytes()
        return

    # a later point release: a few packages change; counts must stay close
    pairs = {
        "labels": (stats["all"]["distinct_labels"], ref["all"]["distinct_labels"]),
        "train docs": (stats["train"]["docs"], ref["train"]["docs"]),
        "test docs": (stats["test"]["docs"], ref["test"]["docs"]),
    }
    report = ", ".join(f"{k}: {a} vs {b} ({a - b:+d})" for k, (a, b) in pairs.items())
    changed = [f for f in pd.DATA_FILES if stats["md5"][f] != ref["md5"][f]]
    print(
        f"index release {source.get('release')} of {_release_date(source)} "
        f"(reference {REFERENCE_RELEASE} of {REFERENCE_DATE}): {report}; files differing: {changed}"
    )
    for k, (a, b) in pairs.items():
        assert abs(a - b) <= COUNT_TOLERANCE * b, f"{k} drifted beyond {COUNT_TOLERANCE:.0%}: {report}"
