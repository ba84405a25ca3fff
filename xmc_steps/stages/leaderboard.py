"""Leaderboards: every evaluated target of a dataset side by side, next to the papers' figures.

The stage (the tables, figures and seed summaries themselves: :mod:`xmc_steps.leaderboard`).

CLI::

    python -m xmc_steps.stages.leaderboard --results results/debtags/*.json --dataset debtags \\
        --out results/debtags/leaderboard.md [--reported workflow/reported.json]
    python -m xmc_steps.stages.leaderboard --tables results/*/leaderboard.csv --out results/leaderboard.md

With ``--summarise --seeds F ... --out S``: the seed summary of one target's results over its seed
replicas (:func:`xmc_steps.leaderboard.seed_summary`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import io, leaderboard, report_html
from ..stage import StageError, add_common_args, cli_main, stage_run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.leaderboard", description=__doc__.splitlines()[0])
    p.add_argument("--results", nargs="*", default=[], help="results files of one dataset")
    p.add_argument("--tables", nargs="*", default=[], help="leaderboard.csv files: the cross-dataset table")
    p.add_argument("--seeds", nargs="*", default=[],
                   help="with --results: seed summaries (results/<dataset>/seeds/<method>.json) to add; alone with "
                        "--summarise: the results files of one target over seeds, summarised into --out")
    p.add_argument("--summarise", action="store_true", help="write the seed summary of the --seeds results files")
    p.add_argument("--out", required=True, help="leaderboard .md (the .csv and .png beside it)")
    p.add_argument("--reported", help="the papers' figures (workflow/reported.json)")
    p.add_argument("--paper-config", nargs=2, metavar=("CONFIG", "PAPER"),
                   help="config.yaml and config.paper.yaml: mark the rows whose settings are not the paper's")
    add_common_args(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.summarise:
        with stage_run("seed_summary", args, outputs=[str(out)]) as st:
            try:
                summary = leaderboard.seed_summary([io.read_json(f) for f in args.seeds])
            except (OSError, ValueError, KeyError) as e:
                raise StageError(f"seed summary of {' '.join(args.seeds)}: {e}") from e
            io.write_json(out, summary)
            st.output("summary", out)
            st.log.info("%s over %d seeds: P@1 %.2f +- %.2f", summary["method"], summary["n"],
                        summary["mean"]["p_at_1"], summary["std"]["p_at_1"])
        return
    if args.tables:
        with stage_run("leaderboard", args, outputs=[str(out)]) as st:
            io.write_text(out, leaderboard.cross_dataset([Path(t) for t in args.tables]))
            st.output("leaderboard", out)
        return
    stem = out.with_suffix("")
    names = [str(out), str(stem) + ".csv", str(stem) + ".html"] + [str(stem) + s for s in (".png", "_recall.png", "_deciles.png")]
    with stage_run("leaderboard", args, outputs=names) as st:
        results = []
        for f in args.results:
            try:
                results.append(io.read_json(f))
            except (OSError, ValueError) as e:
                raise StageError(f"{f}: {e}") from e
        if not results:
            raise StageError("no results file to rank: evaluate a target first (results/<dataset>/<method>.json)")
        dataset = args.dataset or results[0]["dataset"]
        reported = io.read_json(args.reported) if args.reported else None
        paper_config = None
        if args.paper_config:
            import yaml

            try:
                paper_config = tuple(yaml.safe_load(Path(f).read_text(encoding="utf-8")) or {} for f in args.paper_config)
            except (OSError, yaml.YAMLError) as e:
                raise StageError(f"--paper-config {' '.join(args.paper_config)}: {e}") from e
        rows = leaderboard.add_seed_columns(leaderboard.rows_of(results, reported, paper_config), [io.read_json(f) for f in args.seeds])
        table = leaderboard.markdown(dataset, rows)
        io.write_text(out, table)
        io.write_text(str(stem) + ".html", report_html.markdown_to_html(table, f"{dataset} leaderboard"))  # rendered by snakemake --report
        leaderboard.write_csv(str(stem) + ".csv", rows)
        leaderboard.plots(results, rows, stem, dataset)
        st.metric("targets", len(rows))


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
