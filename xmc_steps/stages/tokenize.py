"""Tokenize stage: documents -> token ids (NPZ) for any Hugging Face tokenizer.

Output per split: ``tokens_{split}.npz`` with ``input_ids`` (int32, N x max_length,
padded with the tokenizer's pad id) and ``lengths`` (int32, tokens before padding, so
the attention mask is ``arange(max_length) < lengths[:, None]``).  Truncation keeps
the first ``max_length`` tokens ([CLS] ... [SEP]; :func:`xmc_steps.encoders.tokenize`).  A ``max_length`` above the
encoder's position limit is an error before anything is tokenized.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .. import encoders, io
from ..encoders import check_max_length, tokenize
from ..stage import add_common_args, cli_main, stage_run

SPLITS = ("train", "valid", "test")
BATCH = 2048   # documents per tokenizer call, read from Parquet batch by batch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.tokenize", description=__doc__.splitlines()[0])
    p.add_argument("--ingest", required=True, help="the ingest stage's output folder")
    p.add_argument("--out", required=True, help="output folder")
    add_common_args(p)
    args = p.parse_args(argv)
    src, out = Path(args.ingest), Path(args.out)
    names = [f"tokens_{s}.npz" for s in SPLITS]
    with stage_run("tokenize", args, outputs=[str(out / n) for n in names]) as st:
        encoder, max_length = st.params["encoder"], int(st.params["max_length"])
        check_max_length(encoder, max_length)
        tok = encoders.load_tokenizer(encoder)
        for s in SPLITS:
            path = src / f"docs_{s}.parquet"
            n, _ = io.column_bytes(path, "text")
            t0 = time.perf_counter()
            ids, lengths = tokenize(io.iter_column(path, "text", BATCH), tok, max_length, n=n,
                                    progress=lambda d, n, s=s: st.log.info("%s: %d/%d documents", s, d, n))
            if s == "test":
                st.online_cost(time.perf_counter() - t0, n)
            io.save_arrays(out / f"tokens_{s}.npz", input_ids=ids, lengths=lengths)
            st.metric(f"truncated_fraction_{s}", float((lengths >= max_length).mean()) if len(lengths) else 0.0)
            st.output(f"tokens_{s}", out / f"tokens_{s}.npz")


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
