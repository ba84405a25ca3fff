"""Fetch stage: a PECOS benchmark's tarball -> its xmc-base folder, downloaded, verified, unpacked.

    python -m xmc_steps.stages.fetch --archive wiki-500k --out data/xmc-base/wiki-500k

Runs :func:`xmc_steps.fetch.fetch` (its docstring: resume, verification, the manifest); the
stage record (``--record``) holds what was fetched: URL, bytes, sha256, and the manifest line
that pins it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import fetch
from ..datasets import XMC_BASE_FILES
from ..stage import add_common_args, cli_main, stage_run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.fetch", description=__doc__.splitlines()[0])
    p.add_argument("--archive", required=True, help="the tarball's name in the manifest (wiki-500k, ...)")
    p.add_argument("--out", required=True, help="the dataset folder to fill (data/xmc-base/<archive>)")
    p.add_argument("--manifest", default=None, help=f"the manifest (default ${fetch.MANIFEST_ENV} or {fetch.MANIFEST})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_common_args(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    with stage_run("fetch", args, outputs=[str(out / n) for n in XMC_BASE_FILES]) as st:
        got = fetch.fetch(args.archive, out, XMC_BASE_FILES, st.log, progress=not args.no_progress,
                          manifest=Path(args.manifest) if args.manifest else None)
        st.log.info("%s: %d bytes, sha256 %s, unpacked into %s", got["url"], got["bytes"], got["sha256"], out)
        st.metric("bytes", got["bytes"])
        st.extra["download"] = got
        for n in XMC_BASE_FILES:
            st.output(n, out / n)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
