"""Synthetic data in the shape of a large benchmark, for scale tests on machines without it.

    python -m xmc_steps.stages.synth --shape wiki500k --fraction 0.02 --out data/wiki500k-f002 [--seed 0]
                                     [--layout raw|xmc-base]

writes the dataset folder (:func:`xmc_steps.synth.write`; the module's docstring says what is kept from
the real set and how the data is made) and prints the counts written.
"""

from __future__ import annotations

import argparse
import json

from .. import synth
from ..stage import cli_main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.synth", description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=sorted(synth.SHAPES))
    p.add_argument("--fraction", type=float, default=0.02, help="share of the real set's documents (labels: all)")
    p.add_argument("--out", required=True, help="dataset folder, e.g. data/wiki500k-f002")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["raw", "xmc-base"], default="raw",
                   help="raw: the AttentionXML files; xmc-base: PECOS's, with its own TF-IDF (tfidf-attnxml/)")
    args = p.parse_args(argv)
    last = {}

    def progress(split, done, n):
        if done == n or done - last.get(split, 0) >= max(1, n // 10):
            last[split] = done
            print(f"{split}: {done}/{n} documents", flush=True)

    info = synth.write(synth.SHAPES[args.shape], args.fraction, args.out, args.seed, progress, args.layout)
    print(json.dumps(info["written"]))


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
