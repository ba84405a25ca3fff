"""Ensembles of prediction tables (X-Transformer Table 5 rows 7-9; ELIAS's 3 models).

The stage: the members' prediction tables combined by :func:`xmc_steps.ensemble.combine` (the
``method`` and ``topk`` parameters; the methods are described in :mod:`xmc_steps.ensemble`).

CLI::

    python -m xmc_steps.stages.ensemble --predictions a.parquet b.parquet ... --label-table labels.parquet \\
        --out predictions.parquet --params '{"method": "average", "topk": 100}'
"""

from __future__ import annotations

import argparse

from .. import ensemble, io
from ..stage import StageError, add_common_args, cli_main, stage_run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.stages.ensemble", description=__doc__.splitlines()[0])
    ap.add_argument("--predictions", nargs="+", required=True, help="member prediction tables")
    ap.add_argument("--label-table", required=True, help="the ingest stage's labels.parquet (gives L)")
    ap.add_argument("--out", required=True)
    add_common_args(ap)
    args = ap.parse_args(argv)
    with stage_run("ensemble", args, outputs=[args.out]) as st:
        method = st.params.get("method", "average")
        topk = int(st.params.get("topk", 100))
        L = io.read_table(args.label_table, ["label_id"]).num_rows
        members = [io.read_predictions(p, L) for p in args.predictions]
        try:
            P = ensemble.combine(members, method, topk)
        except ValueError as e:
            raise StageError(str(e)) from e
        io.write_predictions(args.out, P, topk)
        st.metric("n_members", len(members))
        st.output("predictions", args.out)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
