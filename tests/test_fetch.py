"""Fetching a PECOS benchmark (xmc_steps.fetch) from a loopback server: resume after a cut, the
manifest's pins, a refusing server, a tarball without the layout's files."""

import hashlib
import io as _io
import tarfile

import pytest

from conftest import ROOT, xmc_base_tarball
from xmc_steps import datasets, fetch
from xmc_steps.errors import StageError

FILES = datasets.XMC_BASE_FILES


@pytest.fixture
def served(tmp_path, tarball_server, monkeypatch):
    """(server, tarball bytes, manifest path): eurlex-4k's tarball served, an unpinned manifest."""
    data = xmc_base_tarball(tmp_path, "eurlex-4k")
    tarball_server.files["/eurlex-4k.tar.gz"] = data
    monkeypatch.setenv(fetch.BASE_URL_ENV, tarball_server.url)
    manifest = tmp_path / "downloads.tsv"
    manifest.write_text("# test manifest\neurlex-4k\thttps://example.invalid/xmc-base/eurlex-4k.tar.gz\t-\t-\n")
    return tarball_server, data, manifest


def test_a_cut_download_resumes_and_unpacks(tmp_path, served):
    server, data, manifest = served
    folder = tmp_path / "data" / "xmc-base" / "eurlex-4k"
    server.cut_next = True
    with pytest.raises(StageError, match=r"cut at \d+ of \d+ bytes") as e:
        fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
    assert "\n" not in str(e.value)
    part = folder.parent / "eurlex-4k.tar.gz.part"
    assert 0 < part.stat().st_size < len(data)            # kept, under a name that does not look whole
    assert not (folder.parent / "eurlex-4k.tar.gz").exists() and not any((folder / n).exists() for n in FILES)
    got = fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
    assert server.requests[-1][1] == f"bytes={len(data) // 2}-"    # resumed, not restarted
    assert got["sha256"] == hashlib.sha256(data).hexdigest() and got["bytes"] == len(data) and not got["pinned"]
    assert got["pin"] == f"eurlex-4k\thttps://example.invalid/xmc-base/eurlex-4k.tar.gz\t{len(data)}\t{got['sha256']}"
    assert all((folder / n).is_file() for n in FILES)
    assert not part.exists() and not (folder.parent / "eurlex-4k.tar.gz").exists()
    assert [p.name for p in folder.parent.iterdir()] == ["eurlex-4k"]     # no temporary folder left
    files = datasets.locate("eurlex4k", tmp_path / "data")
    assert files.layout == "xmc-base" and files.folder == folder and set(files.features) == {"train", "test"}


def test_the_pinned_values_pass_and_a_wrong_hash_stops_before_unpacking(tmp_path, served):
    server, data, manifest = served
    digest = hashlib.sha256(data).hexdigest()
    folder = tmp_path / "data" / "xmc-base" / "eurlex-4k"
    wrong = "0" * 64
    manifest.write_text(f"# pinned\neurlex-4k\thttps://x.invalid/eurlex-4k.tar.gz\t{len(data)}\t{wrong}\n")
    with pytest.raises(StageError) as e:
        fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
    msg = str(e.value)
    assert "\n" not in msg and digest in msg and wrong in msg and f"{manifest}:2" in msg and "eurlex-4k.tar.gz" in msg
    assert not any((folder / n).exists() for n in FILES)
    assert not (folder.parent / "eurlex-4k.tar.gz.part").exists() and not (folder.parent / "eurlex-4k.tar.gz").exists()
    manifest.write_text(f"eurlex-4k\thttps://x.invalid/eurlex-4k.tar.gz\t{len(data) + 1}\t{digest}\n")
    with pytest.raises(StageError, match=rf"{len(data)} bytes, but .*:1 pins {len(data) + 1}"):
        fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
    manifest.write_text(f"eurlex-4k\thttps://x.invalid/eurlex-4k.tar.gz\t{len(data)}\t{digest}\n")
    assert fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)["pinned"]
    assert all((folder / n).is_file() for n in FILES)


@pytest.mark.parametrize("how", ["refuses", "is not there"])
def test_an_unreachable_server_is_one_line_naming_url_files_folder_and_synth(tmp_path, served, monkeypatch, how):
    server, _, manifest = served
    if how == "refuses":
        server.refuse = 403
    else:
        monkeypatch.setenv(fetch.BASE_URL_ENV, "http://127.0.0.1:9")     # the discard port: nothing listens
    folder = tmp_path / "data" / "xmc-base" / "eurlex-4k"
    with pytest.raises(StageError) as e:
        fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
    msg = str(e.value)
    assert "\n" not in msg and "/eurlex-4k.tar.gz" in msg and str(folder) in msg
    assert all(n in msg for n in FILES) and "xmc_steps.stages.synth" in msg and "--layout xmc-base" in msg
    assert ("HTTP 403" in msg) == (how == "refuses")


def test_a_tarball_without_the_layouts_files_unpacks_nothing(tmp_path, served):
    server, _, manifest = served
    buf = _io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("xmc-base/eurlex-4k/X.trn.txt")
        info.size = 2
        tf.addfile(info, _io.BytesIO(b"a\n"))
    server.files["/eurlex-4k.tar.gz"] = buf.getvalue()
    folder = tmp_path / "data" / "xmc-base" / "eurlex-4k"
    with pytest.raises(StageError, match="the archive lacks X.tst.txt, Y.trn.npz"):
        fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
    assert not (folder / "X.trn.txt").exists()


def test_the_manifest_lists_every_benchmark_and_a_bad_line_is_named(tmp_path):
    entries = fetch.read_manifest(fetch.MANIFEST)
    assert set(entries) == {s.archive for s in datasets.CANONICAL.values() if s.archive}
    for e in entries.values():
        assert e.url == f"https://archive.org/download/pecos-dataset/xmc-base/{e.archive}.tar.gz"
    bad = tmp_path / "m.tsv"
    bad.write_text("# c\neurlex-4k\thttps://x/eurlex-4k.tar.gz\t12\tnot-a-hash\n")
    with pytest.raises(StageError, match=rf"{bad}:2: sha256 'not-a-hash'"):
        fetch.read_manifest(bad)
    bad.write_text("eurlex-4k https://x/eurlex-4k.tar.gz\n")
    with pytest.raises(StageError, match=rf"{bad}:1: expected 4 tab-separated fields"):
        fetch.read_manifest(bad)


def test_the_stage_records_what_it_fetched(tmp_path, served):
    import json

    from xmc_steps.stages import fetch as fetch_stage

    _, data, manifest = served
    folder = tmp_path / "data" / "xmc-base" / "eurlex-4k"
    fetch_stage.main(["--archive", "eurlex-4k", "--out", str(folder), "--manifest", str(manifest), "--no-progress",
                      "--record", str(folder / "download.json"), "--no-tracking"])
    rec = json.loads((folder / "download.json").read_text())
    assert rec["extra"]["download"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert rec["extra"]["download"]["manifest_line"] == f"{manifest}:2"


def test_a_part_of_another_url_or_with_a_cut_note_restarts(tmp_path, served):
    server, data, manifest = served
    folder = tmp_path / "data" / "xmc-base" / "eurlex-4k"
    part = folder.parent / "eurlex-4k.tar.gz.part"
    folder.parent.mkdir(parents=True)
    for note in ('{"url": "http://elsewhere/eurlex-4k.tar.gz", "validator": null}', '{"url": "http://127'):
        part.write_bytes(b"x" * 100)
        part.with_name(part.name + ".json").write_text(note)
        got = fetch.fetch("eurlex-4k", folder, FILES, progress=False, manifest=manifest)
        assert server.requests[-1][1] is None and got["sha256"] == hashlib.sha256(data).hexdigest()
