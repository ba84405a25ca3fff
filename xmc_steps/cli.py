"""``xmc``: what a user does outside Snakemake, one command (``pip install .`` installs it).

    xmc predict --model results/debtags/xr-linear --top-k 3 < texts.txt   # ask a trained target
    xmc serve --model results/debtags/xr-linear --port 8080                # keep it warm, answer over HTTP
    xmc fetch --archive eurlex-4k --out data/xmc-base/eurlex-4k            # a PECOS benchmark, verified
    xmc params xr-linear                                                  # every setting, default and doc

``predict`` and ``fetch`` are the stages ``python -m xmc_steps.stages.predict`` and
``python -m xmc_steps.stages.fetch`` (same options, ``xmc predict --help``); ``serve`` is
:mod:`xmc_steps.service` (MLflow's scoring protocol on a model folder, without MLflow: ``mlflow models
serve -m models:/<dataset>-<method>/<version>`` answers the same on the registered model); ``params``
is :mod:`xmc_steps.skeleton` (generated from the parameter classes, as PECOS's
``--generate-params-skeleton``).  Without the package installed: ``python -m xmc_steps.cli ...``.
Each subcommand imports only what it needs, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "build_parser"]

SUBCOMMANDS = {
    "predict": "ask a trained target about new text (one text per line; JSON lines out)",
    "serve": "answer a trained target over HTTP, model loaded once (MLflow's /invocations protocol)",
    "fetch": "download, verify and unpack a PECOS benchmark (eurlex-4k, wiki-500k, ...)",
    "params": "every setting of a method: default, choices, bounds and what it does",
}


#: subcommands that are a stage's CLI, their options its own
PASS_THROUGH = ("predict", "fetch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xmc", description="What a user does outside Snakemake: ask, serve, fetch, "
                                "and list a method's settings.",
                                epilog="xmc <command> --help: the options of one command")
    sub = p.add_subparsers(dest="command", metavar="<command>", required=True)
    for name in PASS_THROUGH:               # their own parsers answer (main dispatches before this one)
        sub.add_parser(name, help=SUBCOMMANDS[name], add_help=False)
    s = sub.add_parser("serve", help=SUBCOMMANDS["serve"], description=SUBCOMMANDS["serve"] + " (xmc_steps.service)")
    s.add_argument("--model", required=True, help="a trained target: results/<dataset>/<method>")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=5000, help="port (default 5000, MLflow's; 0: a free one, printed)")
    s.add_argument("--top-k", type=int, default=10, help="labels per text unless a request sets params.top_k (default 10)")
    s.add_argument("--device", default="auto", help="auto | cpu | cuda[:n] (neural methods)")
    s = sub.add_parser("params", help=SUBCOMMANDS["params"], description=SUBCOMMANDS["params"] + " (xmc_steps.skeleton)")
    s.add_argument("method", help="a method: xr-linear, parabel, xtransformer, elias, lightxml, gudn, dual-encoder")
    s.add_argument("--json", action="store_true", help="a JSON object of the defaults instead of commented YAML")
    return p


def _defaults(tree: dict) -> dict:
    return {k: _defaults(e["section"]) if "section" in e else e["default"] for k, e in tree.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "predict":
        from .stages import predict

        return predict.main(argv[1:])
    if argv and argv[0] == "fetch":
        from .stage import cli_main
        from .stages import fetch

        return cli_main(fetch.main, argv[1:] or ["--help"])
    args = build_parser().parse_args(argv)
    if args.command == "params":
        from . import registry, skeleton

        try:
            sections = skeleton.method_skeleton(args.method)
        except KeyError as e:
            print(f"error: {e.args[0]}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps({k: _defaults(v) for k, v in sections.items()}, indent=2))
        else:
            spec = registry.get(args.method)
            print(f"# {spec.name}: its section of config.yaml (docs/configuration.md), the parameter "
                  f"tree's defaults; its rules pass the section to the stages as --params JSON")
            sys.stdout.write(skeleton.render_yaml(sections))
        return 0
    if args.command == "serve":
        from . import service
        from .serving import PredictError

        try:
            return service.serve(args.model, args.host, args.port, args.top_k, args.device)
        except PredictError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
