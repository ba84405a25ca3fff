"""The ``prepare_debtags`` stage: the built-in ``debtags`` dataset, built from the Debian 12 package index
by :mod:`xmc_steps.debtags` (the recipe, the parsers and the split are there).

CLI::

    python -m xmc_steps.stages.prepare_debtags --out data/debtags [--index-dir DIR]
    python -m xmc_steps.stages.prepare_debtags --untagged results/debtags/untagged --exclude-ids data/debtags/*_ids.txt
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from ..debtags import (DATA_FILES, MIRROR, SEED, TEST_FRACTION, build_from_index, fetch_index, find_index_files,
                       write_untagged)
from ..stage import add_common_args, cli_main, stage_run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.prepare_debtags", description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="output folder for the dataset files")
    what.add_argument("--untagged", help="instead: output folder for the packages without Debtags (texts.txt, ids.txt)")
    p.add_argument("--exclude-ids", nargs="*", default=[], help="with --untagged: files of package names to leave out")
    p.add_argument("--index-dir", help="reuse an index already fetched there (skip apt)")
    p.add_argument("--work-dir", help="where to fetch the index (default: a temporary folder, removed after)")
    p.add_argument("--mirror", default=MIRROR, help=f"Debian mirror (default {MIRROR})")
    add_common_args(p)
    args = p.parse_args(argv)
    out = Path(args.out or args.untagged)
    outputs = ([str(out / f) for f in ("texts.txt", "ids.txt")] if args.untagged
               else [str(out / f) for f in (*DATA_FILES, "stats.json", "source.json")])
    with stage_run("prepare_debtags", args, outputs=outputs) as st:
        st.params.update({"index_dir": args.index_dir or "", "mirror": args.mirror, "seed": SEED, "test_fraction": TEST_FRACTION})
        tmp = None if (args.index_dir or args.work_dir) else tempfile.mkdtemp(prefix="debtags-index-")
        try:
            with st.timed("fetch"):
                if args.index_dir:
                    index = find_index_files(args.index_dir)
                else:
                    workdir = args.work_dir or tmp
                    if tmp:
                        os.chmod(tmp, 0o755)  # let apt's unprivileged _apt downloader write there
                    index = fetch_index(workdir, st.log, mirror=args.mirror)
            with st.timed("build"):
                if args.untagged:
                    n_untagged = write_untagged(index, out, args.exclude_ids, st.log)
                else:
                    stats = build_from_index(index, out, st.log)
                st.extra["source"] = index.source_info()
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        for name in outputs:
            st.output(Path(name).name, name)
        if args.untagged:
            st.metric("untagged_packages", n_untagged)
            return
        st.metric("train_docs", stats["train"]["docs"])
        st.metric("test_docs", stats["test"]["docs"])
        st.metric("labels", stats["all"]["distinct_labels"])


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
