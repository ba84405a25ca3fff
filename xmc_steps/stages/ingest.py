"""Ingest stage: a dataset folder -> documents and labels as Parquet, label matrices as NPZ.

Finds the dataset (:func:`xmc_steps.datasets.locate`) and runs :func:`xmc_steps.ingest.ingest`, whose
docstring lists the outputs and the rules.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import ingest
from ..datasets import LAYOUTS, locate
from ..layout import DATASET_FEATURES
from ..stage import add_common_args, cli_main, stage_run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.ingest", description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="dataset name")
    p.add_argument("--data-dir", default="data",
                   help="the folder holding the datasets, one subfolder each (default data; config's data_dir)")
    p.add_argument("--path", default=None, help="dataset folder (default: found by name under --data-dir)")
    p.add_argument("--layout", choices=list(LAYOUTS), default=None,
                   help="the dataset's file layout (default: detected from its files; docs/data.md)")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    outputs = [str(out / n) for n in ingest.OUTPUT_NAMES] + [str(out / DATASET_FEATURES.format(split=s)) for s in ("train", "valid", "test")]
    with stage_run("ingest", args, outputs=outputs) as st:
        files = locate(args.name, args.data_dir, args.path, args.layout)
        st.log.info("dataset %s: %s layout in %s", args.name, files.layout, files.folder)
        report = ingest.ingest(files, st.params, out, st.log)
        for s, r in report["splits"].items():
            st.metric(f"{s}_docs", r["docs"])
            st.metric(f"{s}_docs_without_labels", r["docs_without_labels"])
            st.metric(f"{s}_empty_docs", r["empty_docs"])
        st.metric("n_labels", report["n_labels"])
        st.extra["report"] = report
        for n in ingest.OUTPUT_NAMES:
            st.output(n, out / n)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
