"""XR-Linear: a linear model per level of a label tree, beam search to predict.

PECOS XR-Linear / X-Transformer §3.4 with TF-IDF features.  Given a
:class:`~xmc_steps.cluster_tree.ClusterTree` with matrices ``C[0..T-1]`` (``C[t]`` maps the
nodes of level ``t+1`` to their parents at level ``t``; level 0 is the root, level ``T``
the labels), the model holds one ranker matrix ``W[t]`` (``(d+1) x n_{t+1}``, last row the
bias) per level:

* ``W[0]`` scores the coarsest clusters and is trained on all instances;
* ``W[t]`` (t >= 1) scores the children of each level-``t`` node, each node's children
  trained on the instances the negative-sampling mask selects for that node
  (:mod:`xmc_steps.negatives`): TFN = ``Y C_t`` (instances with a positive label under
  the node), MAN = the model's own top-``beam`` beam-search predictions at level ``t``
  on the training data, or both ("tfn+man", the default, as PECOS).

Prediction is beam search: a node's score is its parent's score times
``transform(w . [x; bias])``; ``beam`` nodes per level are kept, and the labels under the
final beam are ranked, ``topk`` per document.  Transforms: ``sigmoid``,
``l2-hinge`` = ``exp(-max(0, 1-z)^2)``, ``l3-hinge`` = ``exp(-max(0, 1-z)^3)``.

The beam search and the masked sparse product are shared with the other methods
(:mod:`xmc_steps.search`).  Prediction reads the rankers through
:class:`~xmc_steps.search.LinearTreeTables` (built on the first call and kept with the model): each
document looks up only its own features under its own beam nodes, with no sparse-matrix product per
call, and gets the bytes :func:`~xmc_steps.search.beam_search` with
:func:`~xmc_steps.search.linear_scorer` gives (the test compares them); rows with a dense block of
features (8 or more stored in half the rows) keep that path, which sums them in another order.

CLI::

    python -m xmc_steps.xr_linear train --features X.npz [--features X2.npz ...] \
        --labels Y.npz [--labels Y2.npz ...] --tree tree.npz --out model_dir --params '{...}'
    python -m xmc_steps.xr_linear predict --model model_dir --features X_test.npz \
        --out predictions.parquet --params '{"beam": 10, "topk": 100}'
    python -m xmc_steps.xr_linear clusters --model model_dir --features X_valid.npz X_test.npz \
        --out clusters_valid.npz clusters_test.npz --params '{"beam": 10}'

``clusters`` writes the top-``beam`` nodes of the finest cluster level (CSR ``N x K``, the
beam's path scores; ``"keep": k`` writes the top-``k`` of the same beam-``beam`` search, whose
first ``beam`` are the same): the linear tree used as a matcher, the baseline and second
candidate source of the X-Transformer matcher (:mod:`xmc_steps.xtransformer`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from . import io, resources
from .cluster_tree import ClusterTree
from .negatives import binarize, check_kind, combine
from .params import Params
from .ranker import SOLVER_MOVED, RankerParams, append_bias, train_rankers
from .search import (PREDICT_BATCH, TRANSFORMS, LinearTreeTables, beam_search, expand_children, linear_scorer,
                     topk_per_row, uses_dense_block)
from .stage import StageError, add_common_args, cli_main, stage_run

FORMAT = "xmc-xr-linear-v1"

# --------------------------------------------------------------------------- model


@dataclass
class XRLinearParams(Params):
    """Training parameters: the negatives (X-Transformer §3.4), the MAN beam, the score transform,
    and the rankers' solver (:class:`RankerParams`, the ``xr_linear.solver`` section)."""

    negatives: str = "tfn+man"  # tfn | man | tfn+man: the instances each cluster's rankers train on
    beam: int = 10  # beam of the model's own predictions used as MAN negatives
    transform: str = "l3-hinge"  # score transform for MAN and the default for prediction
    threads: int = 1  # clusters trained in parallel (the stage's --threads)
    solver: RankerParams = field(default_factory=RankerParams)

    def __post_init__(self) -> None:
        check_kind(self.negatives)
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    _moved = SOLVER_MOVED
    _what = "xr-linear parameter"



def with_bias(X: sp.spmatrix, bias: float) -> sp.csr_matrix:
    """:func:`~xmc_steps.ranker.append_bias` (the same matrix: float32, sorted indices, the bias
    stored in every row even when 0) built from the arrays, without ``sp.hstack``'s cost per call."""
    X = X if sp.isspmatrix_csr(X) and X.dtype == np.float32 else sp.csr_matrix(X, dtype=np.float32)
    if not X.has_sorted_indices:
        X = X.copy()
        X.sort_indices()
    n, d = X.shape
    lens = np.diff(X.indptr).astype(np.int64)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens + 1, out=indptr[1:])
    last = indptr[1:] - 1                          # each row's bias slot
    indices = np.empty(X.nnz + n, dtype=np.int32)
    data = np.empty(X.nnz + n, dtype=np.float32)
    body = np.ones(X.nnz + n, dtype=bool)
    body[last] = False
    indices[body], data[body] = X.indices, X.data
    indices[last], data[last] = d, np.float32(bias)
    out = sp.csr_matrix((data, indices, indptr), shape=(n, d + 1))
    out.has_sorted_indices = True
    return out


class XRLinearModel:
    """A :class:`ClusterTree` and one ranker matrix per level (``W[t]``: ``(d+1) x n_{t+1}``)."""

    def __init__(self, tree: ClusterTree, W: list[sp.spmatrix], params: XRLinearParams | None = None):
        if len(W) != tree.depth:
            raise ValueError(f"need {tree.depth} weight matrices, got {len(W)}")
        for t, w in enumerate(W):
            if w.shape[1] != tree.level_sizes[t + 1]:
                raise ValueError(f"W[{t}] has {w.shape[1]} columns, level {t + 1} has {tree.level_sizes[t + 1]} nodes")
        self.tree = tree
        # held in the layout the scorer reads (column slices per candidate set), converted once
        # here rather than on every prediction call: at batch size 1 the conversion was most of it
        self.W = [sp.csc_matrix(w, dtype=np.float32) for w in W]
        self.params = params or XRLinearParams()
        self._tables: LinearTreeTables | None = None

    @property
    def tables(self) -> LinearTreeTables:
        """The rankers laid out for beam search (:class:`~xmc_steps.search.LinearTreeTables`), built on
        first use and kept: every later call, one document or many, reads them as they are."""
        if self._tables is None:
            self._tables = LinearTreeTables(self.tree.C, self.W)
        return self._tables

    @property
    def n_features(self) -> int:
        return self.W[0].shape[0] - 1

    @property
    def n_labels(self) -> int:
        return self.tree.n_labels

    # -- training
    @classmethod
    def train(cls, X: sp.spmatrix, Y: sp.spmatrix, tree: ClusterTree,
              params: XRLinearParams | dict | None = None, log=None) -> "XRLinearModel":
        p = params if isinstance(params, XRLinearParams) else XRLinearParams.from_dict(params)
        X = sp.csr_matrix(X, dtype=np.float32)
        Y = binarize(Y)
        N = X.shape[0]
        if Y.shape[0] != N:
            raise ValueError(f"X has {N} rows but Y has {Y.shape[0]}")
        if Y.shape[1] != tree.n_labels:
            raise ValueError(f"Y has {Y.shape[1]} labels but the tree has {tree.n_labels}")
        Xa = append_bias(X, p.solver.bias)
        T = tree.depth
        W: list[sp.csr_matrix] = []
        beam_t = sp.csr_matrix((np.ones(N, np.float32), np.zeros(N, np.int32), np.arange(N + 1)), shape=(N, 1))
        need_man = p.negatives in ("man", "tfn+man")
        for t in range(T):
            t0 = time.perf_counter()
            Y_next = Y if t + 1 == T else binarize(Y @ tree.label_to_cluster(t + 1))
            parent = tree.parents(t + 1)
            if t == 0:
                mask = None
            else:
                if need_man:
                    # the model's own top-b predictions at level t (extend last level's beam)
                    scorer = linear_scorer(Xa, [W[t - 1]], p.transform)
                    cand = expand_children(beam_t, tree.C[t - 1])
                    beam_t = topk_per_row(scorer(0, cand), p.beam)
                mask = combine(p.negatives, Y, tree.label_to_cluster(t), beam_t if need_man else None)
            W.append(train_rankers(X, Y_next, parent, mask, p.solver, threads=p.threads))
            if log:
                avg = mask.sum() / max(N, 1) if mask is not None else 1.0
                log.info("level %d/%d: %d nodes, %.1f clusters/instance in mask, W nnz %d, %.1f s",
                         t + 1, T, Y_next.shape[1], avg, W[-1].nnz, time.perf_counter() - t0)
        return cls(tree, W, p)

    # -- prediction
    def _search(self, X: sp.spmatrix, levels: int, beam: int, keep: int, transform: str | None,
                batch_size: int = PREDICT_BATCH) -> sp.csr_matrix:
        """Beam search down the first ``levels`` levels, ``batch_size`` rows at a time; CSR with
        at most ``keep`` scores per row, sorted indices."""
        kind = transform or self.params.transform
        Xa = with_bias(X, self.params.solver.bias)
        parts = []
        for r0 in range(0, X.shape[0], batch_size):
            Xb = Xa[r0:r0 + batch_size]
            if uses_dense_block(Xb):
                # features stored in most rows are scored in another order there: that path, as it was
                parts.append(beam_search(self.tree.C[:levels], linear_scorer(Xb, self.W, kind), Xb.shape[0], beam, keep))
            else:
                parts.append(self.tables.search(Xb, levels, beam, keep, kind))
        if not parts:
            return sp.csr_matrix((0, self.tree.level_sizes[levels]), dtype=np.float32)
        out = parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")
        out.sort_indices()
        return out

    def predict(self, X: sp.spmatrix, beam: int = 10, topk: int = 100, transform: str | None = None,
                batch_size: int = PREDICT_BATCH) -> sp.csr_matrix:
        """Beam search; CSR ``N x L`` with at most ``topk`` scores per row, ``batch_size`` rows at a time."""
        if X.shape[1] != self.n_features:
            raise ValueError(f"X has {X.shape[1]} features, the model {self.n_features}")
        return self._search(X, self.tree.depth, beam, topk, transform, batch_size)

    def predict_clusters(self, X: sp.spmatrix, level: int = -1, beam: int = 10, transform: str | None = None,
                         keep: int | None = None) -> sp.csr_matrix:
        """Top-``beam`` nodes at cluster ``level`` (default the finest): the matcher output.
        ``keep`` (>= ``beam``) keeps that many of the last level's candidates instead; their
        first ``beam`` are the top-``beam`` (the same search, a longer list)."""
        lev = self.tree.depth + level if level < 0 else level
        return self._search(X, lev, beam, max(beam, keep or beam), transform)

    # -- persistence
    def save(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tree.save(path / "tree.npz")
        for t, w in enumerate(self.W):
            io.save_csr(path / f"W_{t}.npz", w)
        io.write_json(path / "params.json", {
            "format": FORMAT, "depth": self.tree.depth, "n_features": self.n_features,
            "n_labels": self.n_labels, "level_sizes": self.tree.level_sizes,
            # threads change the speed, not the model: left out, so a model is the same file for any
            "params": {k: v for k, v in self.params.to_dict().items() if k != "threads"}})

    @classmethod
    def load(cls, path) -> "XRLinearModel":
        path = Path(path)
        meta = io.read_json(path / "params.json")
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an xr-linear model ({FORMAT})")
        tree = ClusterTree.load(path / "tree.npz")
        W = [io.load_csr(path / f"W_{t}.npz") for t in range(int(meta["depth"]))]
        return cls(tree, W, XRLinearParams.from_dict(XRLinearParams.upgrade(meta["params"])))

    def size_bytes(self) -> int:
        return int(sum(w.data.nbytes + w.indices.nbytes + w.indptr.nbytes for w in self.W))


# --------------------------------------------------------------------------- CLI


def max_children(tree: ClusterTree) -> int:
    """The most children any node of ``tree`` has (a leaf cluster's labels, or B)."""
    return max((int(np.bincount(tree.parents(t)).max()) for t in range(1, tree.depth + 1)), default=1)


def train_bytes(n: int, nnz: int, tree: ClusterTree, p: XRLinearParams) -> int:
    """Memory :meth:`XRLinearModel.train` allocates in proportion to N x (candidates): the features
    with their bias column, and with MAN negatives each level's candidates (the children of the
    top-``beam`` nodes of every document) and their scores."""
    cand = float(n) * p.beam * max_children(tree) if p.negatives in ("man", "tfn+man") else 0.0
    return resources.csr_bytes(n, nnz + n) + 2 * resources.csr_bytes(n, cand)


def predict_bytes(n: int, tree: ClusterTree, beam: int, keep: int, batch_size: int = PREDICT_BATCH,
                  W: list[sp.spmatrix] | None = None) -> int:
    """Memory of :meth:`XRLinearModel._search` over ``n`` documents: the kept ``n x keep`` scores (the
    batches' parts and their stack), one batch's candidates at the widest level (candidates,
    scores and transformed scores) and, given the weights ``W``, the search tables built from them
    (:meth:`~xmc_steps.search.LinearTreeTables.nbytes_for`)."""
    rows = min(n, batch_size)
    tables = LinearTreeTables.nbytes_for(W) if W is not None else 0
    return (2 * resources.csr_bytes(n, float(n) * keep) + 3 * resources.csr_bytes(rows, float(rows) * beam * max_children(tree))
            + tables)


def _stack(paths: list[str]) -> sp.csr_matrix:
    mats = [io.load_csr(p) for p in paths]
    return mats[0] if len(mats) == 1 else sp.vstack(mats, format="csr")


def _train_cli(args) -> None:
    with stage_run("xr_linear_train", args, outputs=[str(args.out)]) as st:
        if len(args.features) != len(args.labels):
            raise StageError("give as many --labels as --features")
        try:
            params = XRLinearParams.from_dict(st.params)
        except (ValueError, TypeError) as e:
            raise StageError(str(e)) from e
        st.params.clear()
        st.params.update(params.to_dict())
        with st.timed("load"):
            X = _stack(args.features)
            Y = _stack(args.labels)
            tree = ClusterTree.load(args.tree)
        if X.shape[0] != Y.shape[0]:
            raise StageError(f"features have {X.shape[0]} rows but labels have {Y.shape[0]}")
        if Y.shape[1] != tree.n_labels:
            raise StageError(f"labels have {Y.shape[1]} columns but the tree has {tree.n_labels} labels")
        st.log.info("training xr-linear: %d instances, %d features, %d labels, tree %s, params %s",
                    X.shape[0], X.shape[1], Y.shape[1], tree.level_sizes, params.to_dict())
        resources.check_memory(f"xr-linear training on {X.shape[0]:,} documents (tree {tree.level_sizes})",
                               train_bytes(X.shape[0], X.nnz, tree, params),
                               "xr_linear.beam or xr_linear.negatives: tfn (the MAN candidates), or cluster.leaf_size "
                               "(labels per leaf)", st.log)
        with st.timed("train"):
            model = XRLinearModel.train(X, Y, tree, params, log=st.log)
        out = Path(args.out)
        st.output("model", str(out))
        st.extra["model_paths"] = [str(out)]
        with io.atomic_dir(out) as tmp:
            model.save(tmp)
        st.metric("model_nnz", sum(w.nnz for w in model.W))
        st.metric("model_bytes", model.size_bytes())


def _predict_cli(args) -> None:
    with stage_run("xr_linear_predict", args, outputs=[args.out]) as st:
        cfg = {"beam": 10, "topk": 100, "transform": None}
        unknown = set(st.params) - set(cfg)
        if unknown:
            raise StageError(f"unknown predict parameter(s): {sorted(unknown)}")
        cfg.update(st.params)
        try:
            model = XRLinearModel.load(args.model)
        except (OSError, ValueError) as e:
            raise StageError(f"cannot load model {args.model}: {e}") from e
        X = _stack(args.features)
        if X.shape[1] != model.n_features:
            raise StageError(f"features have {X.shape[1]} columns, the model expects {model.n_features}")
        cfg["transform"] = cfg["transform"] or model.params.transform
        st.params.update(cfg)
        resources.check_memory(f"xr-linear predictions of {X.shape[0]:,} documents",
                               predict_bytes(X.shape[0], model.tree, int(cfg["beam"]), int(cfg["topk"]), W=model.W),
                               "xr_linear.topk (predictions kept per document) or xr_linear.beam", st.log)
        t0 = time.perf_counter()
        with st.timed("predict"):
            P = model.predict(X, beam=int(cfg["beam"]), topk=int(cfg["topk"]), transform=cfg["transform"])
        dt = time.perf_counter() - t0
        st.log.info("predicted %d documents in %.2f s", X.shape[0], dt)
        st.predictions(args.out, P, int(cfg["topk"]), dt)


def _clusters_cli(args) -> None:
    """The linear tree as a matcher: the top-``beam`` finest clusters of each document."""
    if len(args.features) != len(args.out):
        raise StageError("give as many --out files as --features")
    with stage_run("xr_linear_clusters", args, outputs=list(args.out)) as st:
        # online: the test split's clusters are part of predicting new text (its cost is latency)
        cfg = {"beam": 10, "keep": None, "transform": None, "online": True}
        unknown = set(st.params) - set(cfg) - {"threads"}
        if unknown:
            raise StageError(f"unknown clusters parameter(s): {sorted(unknown)}")
        cfg.update({k: v for k, v in st.params.items() if k in cfg})
        try:
            model = XRLinearModel.load(args.model)
        except (OSError, ValueError) as e:
            raise StageError(f"cannot load model {args.model}: {e}") from e
        cfg["transform"] = cfg["transform"] or model.params.transform
        st.params.update(cfg)
        for f, o in zip(args.features, args.out):
            X = io.load_csr(f)
            if X.shape[1] != model.n_features:
                raise StageError(f"{f}: features have {X.shape[1]} columns, the model expects {model.n_features}")
            keep = max(int(cfg["beam"]), int(cfg["keep"] or cfg["beam"]))
            resources.check_memory(f"{f}: the top-{keep} clusters of {X.shape[0]:,} documents",
                                   predict_bytes(X.shape[0], model.tree, int(cfg["beam"]), keep, W=model.W),
                                   "xtransformer.matcher.topb (clusters kept per document)", st.log)
            t0 = time.perf_counter()
            with st.timed("predict"):
                S = model.predict_clusters(X, beam=int(cfg["beam"]), transform=cfg["transform"],
                                           keep=None if cfg["keep"] is None else int(cfg["keep"]))
            if Path(o).stem.endswith("_test") and cfg["online"]:     # part of predicting new text
                st.online_cost(time.perf_counter() - t0, X.shape[0])
            io.save_csr(o, S)
            st.output(Path(o).stem, o)
            st.log.info("%s: top-%d of %d clusters for %d documents (beam %d)", o, int(cfg["keep"] or cfg["beam"]),
                        S.shape[1], S.shape[0], int(cfg["beam"]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.xr_linear", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train an XR-Linear model")
    t.add_argument("--features", required=True, action="extend", nargs="+", help="features (.npz CSR), rows stacked in order")
    t.add_argument("--labels", required=True, action="extend", nargs="+", help="labels (.npz CSR), aligned with --features")
    t.add_argument("--tree", required=True, help="cluster tree (.npz, xmc_steps.cluster)")
    t.add_argument("--out", required=True, help="model folder")
    add_common_args(t)
    pr = sub.add_parser("predict", help="predict top-k labels")
    pr.add_argument("--model", required=True, help="model folder")
    pr.add_argument("--features", required=True, action="extend", nargs="+", help="features (.npz CSR)")
    pr.add_argument("--out", required=True, help="predictions (.parquet)")
    add_common_args(pr)
    cl = sub.add_parser("clusters", help="the top-beam finest clusters per document (the linear tree as a matcher)")
    cl.add_argument("--model", required=True, help="model folder")
    cl.add_argument("--features", required=True, nargs="+", help="features (.npz CSR), one file per output")
    cl.add_argument("--out", required=True, nargs="+", help="cluster scores (.npz CSR N x K), one per --features")
    add_common_args(cl)
    args = p.parse_args(argv)
    {"train": _train_cli, "predict": _predict_cli, "clusters": _clusters_cli}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
