"""Prediction cost of the pipeline's scoring code on a DAG's trained models, against the same
code at an earlier git revision, in one run (compare the ratios; the machine is shared):

    python bench/bench_predict.py [--dataset yso50k] [--docs 2000] [--baseline REV] [--threads 1] \
        [--pecos ~/pecos-venv/bin/python] [--batch-sizes 1 256] [--docs-batch1 200] \
        [--elias-parts [--elias-K 2000] [--elias-batch 64]]

Times, on the first ``--docs`` test documents: xr-linear's beam search
(``results/<d>/xr-linear/model``) and the X-Transformer rankers' Eq. 2 over the union
candidates (the first ``ranker-*`` model under ``results/<d>/xtransformer/``, with the matcher's
test clusters and embeddings), and with ``--baseline REV`` the same calls with
the package ``xmc_steps`` as it was at ``REV`` (extracted from git and imported under a name
of its own).
Prints one JSON object per (model, code): seconds, ms/document, and whether the predictions
equal the current code's (``identical_to_current``: the same entries and float32 values;
``equal_to_current``: to 1e-5).  ``--batch-sizes`` also times every method called on
batches of that many documents (batch 1: one call per document, on the first
``--docs-batch1`` documents): xr-linear, parabel (``results/<d>/parabel/model``), the
X-Transformer rankers, the matcher's encoder pass over the test tokens (the online half of
X-Transformer), and ELIAS (encoder + index + classifier, ``results/<d>/elias/*/*/stage2``);
each with the batch's ms/document.  ``--pecos PYTHON`` also runs ``bench/pecos_reference.py``
(the reference library's XR-Linear, fit on the same features) with that interpreter and prints
xr-linear's ms/document ratio against it.  ``--elias-parts`` times ELIAS++ (the first
``elias/*/*/stage2`` model, its ``plus/`` ranker and calibration) by parts: the encoder, the index
(Eqs. 1-6), the classifier on the K shortlisted labels and the ELIAS++ ranker on the top 100.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _package_at(rev: str) -> str:
    """Import ``xmc_steps`` as it was at git revision ``rev`` (extracted to a temporary folder) under a
    package name of its own; returns that name."""
    tmp = Path(tempfile.mkdtemp())
    tar = subprocess.run(["git", "archive", "--format=tar", rev, "xmc_steps"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=tar, check=True)
    name = "xmc_steps_at_" + "".join(ch if ch.isalnum() else "_" for ch in rev)
    spec = importlib.util.spec_from_file_location(name, tmp / "xmc_steps" / "__init__.py",
                                                  submodule_search_locations=[str(tmp / "xmc_steps")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg          # its modules (and their dataclasses) look the package up there
    spec.loader.exec_module(pkg)
    return name


def _xt_ranker_of(pkg: str):
    """The X-Transformer rankers' module of package ``pkg``: ``xtransformer.ranker``, or the
    ``xtransformer`` module of a revision from before the ``xtransformer`` package."""
    try:
        return importlib.import_module(f"{pkg}.xtransformer.ranker")
    except ModuleNotFoundError as e:
        if e.name != f"{pkg}.xtransformer.ranker":
            raise
        return importlib.import_module(f"{pkg}.xtransformer")


def _ranker_inputs(root: Path, n: int, xt_ranker):
    """The first X-Transformer ranker of the dataset and what it scores on the first ``n`` test
    documents: (folder, matcher folder, W, C, params, embeddings, matcher clusters, linear clusters)."""
    from xmc_steps import io

    rankers = sorted(root.glob("xtransformer/*/*/*/ranker-*/model"))
    if not rankers:
        return None
    rdir = rankers[0]
    mdir = rdir.parents[1] / "matcher"
    lin_test = next(rdir.parents[2].glob("linear-train+valid/clusters_test.npz"), None)
    W, C, p, _ = xt_ranker.load(rdir)
    emb = io.load_arrays(mdir / "emb_test.npz")["emb"][:n]
    G0 = io.load_csr(mdir / "clusters_test.npz")[:n]
    L0 = io.load_csr(lin_test)[:n] if lin_test is not None and p.candidates != "matcher" else None
    return rdir, mdir, W, C, p, emb, G0, L0


def _batched_jobs(root: Path, n: int, xr_linear, xt_ranker):
    """(name, fn(start, stop)) for each trained model of the dataset: fn predicts rows start:stop."""
    from xmc_steps import io, neural

    X = io.load_csr(root / "features" / "tfidf" / "X_test.npz")[:n] if (root / "features" / "tfidf").is_dir() else None
    if (root / "xr-linear" / "model").is_dir():
        m = xr_linear.XRLinearModel.load(root / "xr-linear" / "model")
        yield "xr-linear", lambda i, j: m.predict(X[i:j], beam=10, topk=100)
    if (root / "parabel" / "model" / "omikuji").exists():
        import omikuji

        from xmc_steps import parabel

        om = omikuji.Model.load(str(root / "parabel" / "model" / "omikuji"))
        L = io.read_table(root / "ingest" / "labels.parquet", ["label_id"]).num_rows
        yield "parabel", lambda i, j: parabel.predict(om, X[i:j], topk=100, beam=10, n_labels=L)
    inputs = _ranker_inputs(root, n, xt_ranker)
    if inputs:
        from xmc_steps import ranker, search
        from xmc_steps.xtransformer import matcher

        rdir, mdir, W, C, p, emb, G0, L0 = inputs
        head = xt_ranker.load_head(mdir / "model.safetensors")

        def rank(i, j):
            cand = xt_ranker.candidate_clusters(G0[i:j], None if L0 is None else L0[i:j], p.candidates, p.topb)
            G = search.matcher_scores(cand, emb[i:j], head)
            return xt_ranker.predict(ranker.ranker_features(X[i:j], emb[i:j], p.ranker_input, p.neural_weight),
                                     W, C, G, p)
        yield f"xtransformer rankers ({rdir.parent.name})", rank
        tok = next(root.glob("features/tokens/*/tokens_test.npz"), None)
        if tok is not None:
            mm = matcher.load_matcher(mdir)
            t = neural.TokenData.load(tok)
            t = neural.TokenData(t.input_ids[:n], t.lengths[:n])

            def encode(i, j, t=t):
                return matcher.predict_clusters(mm, neural.TokenData(t.input_ids[i:j], t.lengths[i:j]), p.topb,
                                                device="cpu", progress=None)
            yield "xtransformer matcher encoder", encode
    stage2 = sorted(root.glob("elias/*/*/stage2/model.safetensors"))
    if stage2:
        from xmc_steps import elias

        folder = stage2[0].parent
        em = elias.load_elias(folder)
        maxlen = folder.parent.name.rsplit("-", 1)[-1]
        t = neural.TokenData.load(next(root.glob(f"features/tokens/*-{maxlen}/tokens_test.npz")))

        def el(i, j, t=t):
            return elias.predict(em, neural.TokenData(t.input_ids[i:j], t.lengths[i:j]), topk=100, device="cpu",
                                 with_emb=False, progress=None)
        yield "elias (encoder + index + classifier)", el


def _elias_parts(root: Path, n: int, K: int | None, batch: int) -> dict | None:
    """ELIAS++ on the first ``n`` test documents in batches of ``batch``, timed by parts: the encoder
    (phi(x)), the index (Eqs. 1-6: cluster scores, beam, paths, top-K), the classifier (``w_l^T phi`` on
    the K shortlisted labels), and the ELIAS++ ranker with its calibration on the top 100."""
    import numpy as np
    import scipy.sparse as sp
    import torch

    from xmc_steps import elias, elias_plus, io, neural
    from xmc_steps.ranker import ranker_features
    from xmc_steps.search import padded_to_csr

    stage2 = sorted(root.glob("elias/*/*/stage2/model.safetensors"))
    if not stage2:
        return None
    folder = stage2[0].parent
    model = elias.load_elias(folder).eval()
    plus = folder.parent / "plus"
    W, meta = elias_plus.load_ranker(plus / "ranker")
    p = elias_plus.EliasPlusParams.from_dict(elias_plus.EliasPlusParams.upgrade(meta["params"]))
    tree = io.load_arrays(plus / "calibration" / "calibration.npz") if (plus / "calibration").is_dir() else None
    freq = elias_plus.label_train_freq(plus / "ranker") if tree is not None else None
    maxlen = folder.parent.name.rsplit("-", 1)[-1]
    t = neural.TokenData.load(next(root.glob(f"features/tokens/*-{maxlen}/tokens_test.npz")))
    X = io.load_csr(root / "features" / "tfidf" / "X_test.npz")[:n]
    K_eff = min(int(K or model.K), model.n_labels)
    secs = dict.fromkeys(("encoder", "index", "classifier", "ranker"), 0.0)
    n = min(n, len(t))
    with torch.no_grad():
        for a in range(0, n, batch):
            b = min(n, a + batch)
            ids, mask = neural.TokenData(t.input_ids[a:b], t.lengths[a:b]).batch(np.arange(b - a))
            t0 = time.perf_counter()
            emb = model.encode(ids, mask).float()
            t1 = time.perf_counter()
            out = model._shortlist(emb, K=K_eff)          # the index and the classifier together
            t2 = time.perf_counter()
            lab0 = out.labels.clamp(min=0)                 # the classifier alone, timed again
            z = torch.bmm(model.wl[lab0], emb.unsqueeze(-1)).squeeze(-1)
            torch.sigmoid(z) * out.yhat
            t3 = time.perf_counter()
            labels = out.labels.numpy()
            pv, pi = torch.topk(out.p.masked_fill(out.labels < 0, -1.0), min(100, K_eff), dim=1)
            P = padded_to_csr(np.take_along_axis(labels, pi.numpy(), 1), pv.numpy(), model.n_labels)
            Xr = ranker_features(X[a:b], emb.numpy(), "tfidf+neural", p.neural_weight)
            elias_plus.plus_scores(Xr, W, elias_plus.candidates(P, p.n_candidates), p, tree, freq)
            t4 = time.perf_counter()
            secs["encoder"] += t1 - t0
            secs["classifier"] += t3 - t2
            secs["index"] += (t2 - t1) - (t3 - t2)
            secs["ranker"] += t4 - t3
    ms = {k: round(1000 * v / n, 3) for k, v in secs.items()}
    return {"dataset": root.name, "model": "elias++ by parts", "docs": n, "batch": batch, "K": K_eff,
            "C": model.n_clusters, "L": model.n_labels, "b": model.b, "kappa": model.kappa,
            "threads": torch.get_num_threads(), "ms_per_doc": ms, "total_ms_per_doc": round(sum(ms.values()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="yso50k")
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--baseline", default=None, help="git revision of the package xmc_steps to compare with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pecos", default=None, help="python of a virtual environment with libpecos==1.2.8")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[], help="also time each method on batches of this size")
    ap.add_argument("--docs-batch1", type=int, default=200, help="documents timed at batch size 1")
    ap.add_argument("--elias-parts", action="store_true",
                    help="also time ELIAS++ by parts (encoder, index, classifier, ranker) on the first --docs documents")
    ap.add_argument("--elias-K", type=int, default=None, help="the shortlist size for --elias-parts (default: as trained)")
    ap.add_argument("--elias-batch", type=int, default=64, help="documents per batch for --elias-parts")
    a = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(v, str(a.threads))
    import numpy as np
    import scipy.sparse as sp

    from xmc_steps import io, ranker, search, xr_linear
    from xmc_steps.xtransformer import ranker as xt_ranker

    codes = {"current": "xmc_steps"}
    if a.baseline:
        codes[a.baseline] = _package_at(a.baseline)
    root = Path(a.results) / a.dataset
    jobs = []
    lin_dir = root / "xr-linear" / "model"
    if lin_dir.is_dir():
        X = io.load_csr(root / "features" / "tfidf" / "X_test.npz")[: a.docs]

        def lin(pkg, X=X):
            model = importlib.import_module(f"{pkg}.xr_linear").XRLinearModel.load(lin_dir)
            return model.predict(X, beam=10, topk=100)
        jobs.append(("xr-linear", X.shape[0], lin))
    inputs = _ranker_inputs(root, a.docs, xt_ranker)
    if inputs:
        rdir, mdir, W, C, p, emb, G0, L0 = inputs
        X = io.load_csr(root / "features" / "tfidf" / "X_test.npz")[: a.docs]
        cand = xt_ranker.candidate_clusters(G0, L0, p.candidates, p.topb)
        G = search.matcher_scores(cand, emb, xt_ranker.load_head(mdir / "model.safetensors"))
        Xr = ranker.ranker_features(X, emb, p.ranker_input, p.neural_weight)

        def rank(pkg):
            return _xt_ranker_of(pkg).predict(Xr, W, C, G, p)
        jobs.append((f"xtransformer {rdir.parent.name}", X.shape[0], rank))
    ours = None
    for name, n, fn in jobs:
        ref = None
        for code, pkg in codes.items():
            t0 = time.perf_counter()
            P = fn(pkg)
            s = time.perf_counter() - t0
            ref = P if ref is None else ref
            ours = 1000 * s / n if (name, code) == ("xr-linear", "current") else ours
            P, R = sp.csr_matrix(P), sp.csr_matrix(ref)
            same = bool(P.shape == R.shape and np.array_equal(P.indptr, R.indptr) and np.array_equal(P.indices, R.indices)
                        and np.array_equal(P.data, R.data))
            d = abs(P - R)
            print(json.dumps({"dataset": a.dataset, "model": name, "code": code, "docs": n, "seconds": round(s, 3),
                              "ms_per_doc": round(1000 * s / n, 3), "identical_to_current": same,
                              "equal_to_current": bool(same or d.nnz == 0 or d.max() <= 1e-5)}), flush=True)
    for b in a.batch_sizes:
        n_docs = min(a.docs, a.docs_batch1) if b == 1 else a.docs
        for name, fn in _batched_jobs(root, n_docs, xr_linear, xt_ranker):
            t0 = time.perf_counter()
            for start in range(0, n_docs, b):
                fn(start, min(n_docs, start + b))
            s = time.perf_counter() - t0
            print(json.dumps({"dataset": a.dataset, "model": name, "batch": b, "docs": n_docs, "seconds": round(s, 3),
                              "ms_per_doc": round(1000 * s / n_docs, 3)}), flush=True)
    if a.elias_parts:
        import torch

        torch.set_num_threads(a.threads)
        parts = _elias_parts(root, a.docs, a.elias_K, a.elias_batch)
        print(json.dumps(parts if parts else {"dataset": a.dataset, "model": "elias++ by parts",
                                              "error": "no trained ELIAS stage 2 under " + str(root)}), flush=True)
    if a.pecos:
        r = subprocess.run([a.pecos, str(ROOT / "bench" / "pecos_reference.py"), "--results", a.results, "--dataset",
                            a.dataset, "--docs", str(a.docs), "--threads", str(a.threads)],
                           check=True, capture_output=True, text=True)
        ref = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(ref), flush=True)
        if ours is not None:
            print(json.dumps({"dataset": a.dataset, "xr_linear_ms_per_doc_ratio_to_pecos": round(ours / ref["ms_per_doc"], 2)}))


if __name__ == "__main__":
    main()
