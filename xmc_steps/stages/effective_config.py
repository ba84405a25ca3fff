"""Effective-config stage: the effective settings of a target (dataset, method) and their hash
(:func:`xmc_steps.config.config_hash`), written as a JSON snapshot for the results."""

from __future__ import annotations

import argparse
import json

from .. import config, io


def main(argv: list[str] | None = None) -> None:
    """``python -m xmc_steps.stages.effective_config --dataset D --method M --settings JSON --out F``:
    write the effective settings of a target and their hash (a snapshot for results)."""
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.effective_config", description=main.__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--method", required=True)
    p.add_argument("--settings", required=True, help="effective settings (JSON)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    settings = json.loads(args.settings)
    io.write_json(args.out, {"dataset": args.dataset, "method": args.method,
                             "config_hash": config.config_hash(settings), "settings": settings})


if __name__ == "__main__":
    main()
