"""The PECOS benchmarks by name: download a tarball (resumable), verify it, unpack it whole.

``workflow/downloads.tsv`` (the manifest) lists each tarball's URL, size and sha256 where known:
one line per archive, ``archive<TAB>url<TAB>bytes<TAB>sha256``, ``-`` where a value is unknown.
:func:`fetch` then:

1. downloads the URL to ``<folder>.tar.gz.part`` beside the dataset folder, resuming a partial
   file with an HTTP ``Range`` request (``If-Range`` with the first answer's ETag or
   Last-Modified, so a file changed upstream restarts instead of mixing two versions; a server
   that ignores ranges restarts it).  Progress goes to stderr, never stdout;
2. checks the size and the sha256 against the manifest where they are pinned: a mismatch is an
   error naming the file, both values and the manifest line, the download is removed and
   nothing is unpacked.  An unpinned download is accepted; what it got (size, sha256) is logged
   with the manifest line that pins it, and returned for the stage record;
3. renames the part to ``<folder>.tar.gz`` (a verified whole file), unpacks it into a temporary
   folder, checks that every file of the xmc-base layout is there, moves them into the dataset
   folder and removes the tarball.

A URL that cannot be reached is one line naming the URL, the files expected, the folder to put
them in, and ``synth`` (a synthetic set in the same layout).  ``XMC_DATASET_BASE_URL`` replaces
the part of the manifest's URLs before the file name (a mirror; the tests' loopback server), and
``XMC_DATASET_MANIFEST`` names another manifest.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import StageError

BASE_URL_ENV = "XMC_DATASET_BASE_URL"
MANIFEST_ENV = "XMC_DATASET_MANIFEST"
MANIFEST = Path(__file__).resolve().parents[1] / "workflow" / "downloads.tsv"
#: seconds a connection or a read may stall before the download counts as cut
TIMEOUT = 60
CHUNK = 1 << 20


@dataclass(frozen=True)
class ManifestEntry:
    """One line of the manifest: an archive's URL and, where pinned, its size and sha256."""

    archive: str
    url: str
    size: int | None
    sha256: str | None
    path: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def manifest_path() -> Path:
    return Path(os.environ.get(MANIFEST_ENV) or MANIFEST)


def read_manifest(path: Path | None = None) -> dict[str, ManifestEntry]:
    """The manifest's entries by archive name; a malformed line is an error naming it."""
    path = Path(path or manifest_path())
    out: dict[str, ManifestEntry] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 4:
            raise StageError(f"{path}:{i}: expected 4 tab-separated fields (archive, url, bytes, sha256), got {len(parts)}")
        archive, url, size, sha = (p.strip() for p in parts)
        if size != "-" and not (size.isascii() and size.isdigit()):
            raise StageError(f"{path}:{i}: bytes {size!r} is neither a whole number nor '-'")
        if sha != "-" and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
            raise StageError(f"{path}:{i}: sha256 {sha!r} is neither 64 lower-case hex digits nor '-'")
        out[archive] = ManifestEntry(archive, url, None if size == "-" else int(size), None if sha == "-" else sha,
                                     path, i, line)
    return out


def entry(archive: str, manifest: Path | None = None) -> ManifestEntry:
    """The manifest's entry of ``archive``, its URL under ``XMC_DATASET_BASE_URL`` when set."""
    entries = read_manifest(manifest)
    if archive not in entries:
        raise StageError(f"{manifest or manifest_path()}: no line for the archive {archive!r} "
                         f"(listed: {', '.join(sorted(entries))})")
    e = entries[archive]
    base = os.environ.get(BASE_URL_ENV)
    if base:
        e = ManifestEntry(e.archive, f"{base.rstrip('/')}/{e.url.rsplit('/', 1)[-1]}", e.size, e.sha256, e.path, e.line,
                          e.text)
    return e


def archive_url(archive: str) -> str:
    """The URL the fetch rule downloads ``archive`` from (the manifest's, or the base-URL override's)."""
    return entry(archive).url


def pin_line(e: ManifestEntry, size: int, sha256: str) -> str:
    """The manifest line that pins ``e`` to a download of ``size`` bytes with ``sha256``."""
    url = e.text.split("\t")[1].strip()          # the manifest's own URL, not the override's
    return "\t".join([e.archive, url, str(size), sha256])


class Progress:
    """A byte counter on stderr (a tqdm bar; Snakemake keeps stdout for itself)."""

    def __init__(self, name: str, total: int | None, initial: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
                        file=sys.stderr, mininterval=2.0, dynamic_ncols=False, ncols=100)

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _meta_path(part: Path) -> Path:
    return part.with_name(part.name + ".json")


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total) of a ``Content-Range: bytes a-b/total`` (or ``bytes */total``) header."""
    if not value or not value.startswith("bytes "):
        return None, None
    span, _, total = value[6:].partition("/")
    first = span.split("-")[0]
    return (int(first) if first.isdigit() else None), (int(total) if total.isdigit() else None)


def download(url: str, part: Path, log=None, progress: bool = True, timeout: float = TIMEOUT) -> int:
    """Download ``url`` into ``part``, resuming what ``part`` already holds; returns its size.

    A cut connection leaves ``part`` as it is (the next call resumes) and raises a
    :class:`StageError` saying how much arrived; so does a server that cannot be reached or
    answers with an error status."""
    meta_path = _meta_path(part)
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    except (ValueError, OSError):        # a note a killed run cut short: start over
        meta = {}
    if meta.get("url") != url:            # a part of another URL (or none): start over
        part.unlink(missing_ok=True)
        meta = {"url": url}
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "xmc-pipeline (python urllib)"}
    if have:
        headers["Range"] = f"bytes={have}-"
        if meta.get("validator"):
            headers["If-Range"] = meta["validator"]
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:       # nothing after the bytes we hold: whole, if the total says so
            _, total = _content_range(e.headers.get("Content-Range"))
            if total == have:
                return have
            part.unlink(missing_ok=True)
            return download(url, part, log, progress, timeout)
        raise StageError(f"{url}: the server answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise StageError(f"{url}: cannot download ({reason})") from None
    with resp:
        first, total = _content_range(resp.headers.get("Content-Range"))
        if resp.status == 206 and first == have:
            mode = "ab"
        else:                             # a full answer (range ignored, or the file changed): restart
            have, mode = 0, "wb"
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        validator = resp.headers.get("ETag") or resp.headers.get("Last-Modified")
        meta.update({"validator": validator, "total": total})
        meta_path.write_text(json.dumps(meta))
        if log:
            log.info("%s: %s from byte %d of %s", url, "resuming" if mode == "ab" else "downloading", have,
                     total if total is not None else "an unknown size")
        bar = Progress(part.name, total, have) if progress else None
        try:
            with open(part, mode) as f:
                while True:
                    try:
                        block = resp.read(CHUNK)
                    except (OSError, http.client.HTTPException):
                        block = b""
                    if not block:
                        break
                    f.write(block)
                    have += len(block)
                    if bar:
                        bar.update(len(block))
        finally:
            if bar:
                bar.close()
    if total is not None and have != total:
        raise StageError(f"{url}: the download was cut at {have} of {total} bytes ({part} kept); "
                         "run again to resume it")
    return have


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, e: ManifestEntry, size: int, sha256: str) -> None:
    """``path`` (``size`` bytes, ``sha256``) matches what the manifest pins; else a one-line error
    naming the file, both values and the manifest line."""
    if e.size is not None and size != e.size:
        raise StageError(f"{path}: {size} bytes, but {e.where} pins {e.size} ({e.text!r}); "
                         "the download was removed, nothing unpacked")
    if e.sha256 is not None and sha256 != e.sha256:
        raise StageError(f"{path}: sha256 {sha256}, but {e.where} pins {e.sha256} ({e.text!r}); "
                         "the download was removed, nothing unpacked")


def _verified(path: Path, e: ManifestEntry) -> tuple[int, str]:
    """(size, sha256) of ``path`` once :func:`verify` passes; a file that fails is removed."""
    size, digest = path.stat().st_size, sha256_of(path)
    try:
        verify(path, e, size, digest)
    except StageError:
        path.unlink(missing_ok=True)
        _meta_path(path).unlink(missing_ok=True)
        raise
    return size, digest


def unpack(tarball: Path, folder: Path, files: tuple[str, ...]) -> None:
    """Unpack ``tarball`` (``xmc-base/<name>/...``, or ``<name>/...``, or the files at its top)
    into ``folder``: through a temporary folder beside it, each file moved into place once all of
    ``files`` are known to be there."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".unpack", dir=folder.parent))
    try:
        try:
            with tarfile.open(tarball, "r:*") as tf:
                tf.extractall(tmp, filter="data")
        except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
            raise StageError(f"{tarball}: not a complete tar archive ({e}); delete it to download it again") from None
        roots = [tmp / "xmc-base" / folder.name, tmp / folder.name, tmp]
        root = next((r for r in roots if (r / files[0]).is_file()), None)
        missing = [n for n in files if root is None or not (root / n).is_file()]
        if missing:
            raise StageError(f"{tarball}: the archive lacks {', '.join(missing)} (expected under xmc-base/{folder.name}/); "
                             "nothing unpacked")
        for child in sorted(root.iterdir()):
            target = folder / child.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            for p in ([child] if child.is_file() else child.rglob("*")):
                os.utime(p)                 # now: newer than anything a previous copy made
            os.replace(child, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch(archive: str, folder: Path, files: tuple[str, ...], log=None, progress: bool = True,
          manifest: Path | None = None) -> dict:
    """Download, verify and unpack ``archive`` into ``folder`` (see the module docstring); returns
    what was fetched (archive, url, bytes, sha256, whether the manifest pinned it)."""
    from .datasets import CANONICAL
    from .synth import SHAPES

    e = entry(archive, manifest)
    shape = next((n for n, spec in CANONICAL.items() if spec.archive == archive and n in SHAPES), "wiki500k")
    folder = Path(folder)
    part = folder.parent / f"{folder.name}.tar.gz.part"
    tarball = folder.parent / f"{folder.name}.tar.gz"
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not tarball.exists():
        try:
            download(e.url, part, log, progress)
        except StageError as err:
            raise StageError(f"{err}; without the network put the files {', '.join(files)} in {folder}/ "
                             f"(the tarball unpacked), or a synthetic set: python -m xmc_steps.stages.synth "
                             f"--shape {shape} --fraction 0.01 --layout xmc-base --out {folder}") from None
        size, digest = _verified(part, e)
        os.replace(part, tarball)
        _meta_path(part).unlink(missing_ok=True)
    else:                                   # a tarball a failed unpack left: checked again (the pins may be new)
        size, digest = _verified(tarball, e)
    pinned = e.sha256 is not None
    if log and not pinned:
        log.warning("%s is not pinned in %s: to pin this download, make line %d read: %s", archive, e.path, e.line,
                    pin_line(e, size, digest).replace("\t", "<TAB>"))
    unpack(tarball, folder, files)
    tarball.unlink()
    return {"archive": archive, "url": e.url, "bytes": size, "sha256": digest, "pinned": pinned,
            "manifest_line": e.where, "pin": pin_line(e, size, digest)}
