"""Stage: the semantic label index (X-Transformer §3.2), a balanced hierarchical spherical
k-means tree over the label embeddings (:mod:`xmc_steps.cluster_tree`: the algorithm and the
tree layout).

CLI::

    python -m xmc_steps.stages.cluster --label-emb label_emb.npz --out tree.npz \
        --branching 16 --leaf-size 100 [--min-leaves 64] --seed 0 --max-iter 20 [common args, e.g. --threads N]
"""

from __future__ import annotations

import argparse

import scipy.sparse as sp

from .. import io, resources
from ..cluster_tree import hierarchical_kmeans, tree_levels
from ..stage import StageError, add_common_args, cli_main, stage_run

# --------------------------------------------------------------------------- CLI


def cluster_bytes(emb: sp.spmatrix) -> int:
    """Memory :func:`hierarchical_kmeans` adds to the loaded ``L x d`` embedding: at the root split a copy
    of every row and its re-indexed copy (2x the embedding), two dense centroids, and per-label codes
    and orders (about 40 bytes a label)."""
    L, d = emb.shape
    return 2 * resources.csr_bytes(L, emb.nnz) + resources.dense_bytes(2, d) + 40 * L


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m xmc_steps.stages.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--label-emb", required=True, help="label embedding (.npz CSR, L x d)")
    p.add_argument("--out", required=True, help="cluster tree (.npz)")
    p.add_argument("--branching", type=int, default=16, help="branching factor B (power of 2)")
    p.add_argument("--leaf-size", type=int, default=100, help="max labels per leaf cluster")
    p.add_argument("--min-leaves", type=int, default=1, help="at least this many leaf clusters (a floor for small L)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-iter", type=int, default=20, help="2-means iterations per node")
    add_common_args(p)
    args = p.parse_args(argv)
    with stage_run("cluster", args, outputs=[args.out]) as st:
        # --params keys (branching, leaf_size, min_leaves, seed, max_iter, threads) override the flags
        cfg = {"branching": args.branching, "leaf_size": args.leaf_size, "min_leaves": args.min_leaves,
               "seed": args.seed, "max_iter": args.max_iter, "threads": 1}
        unknown = set(st.params) - set(cfg)
        if unknown:
            raise StageError(f"unknown cluster parameter(s): {sorted(unknown)}")
        cfg.update(st.params)
        st.params.update(cfg)
        emb = io.load_csr(args.label_emb)
        st.log.info("clustering %d labels (dim %d, nnz %d): %s", emb.shape[0], emb.shape[1], emb.nnz, cfg)
        try:
            tree_levels(emb.shape[0], int(cfg["branching"]), int(cfg["leaf_size"]), int(cfg["min_leaves"]))
        except ValueError as e:
            raise StageError(str(e)) from e
        resources.check_memory(f"clustering {emb.shape[0]:,} labels", cluster_bytes(emb),
                               "cluster.label_embedding or tfidf.max_features (a smaller L x d embedding)", st.log)
        with st.timed("cluster"):
            tree = hierarchical_kmeans(emb, int(cfg["branching"]), int(cfg["leaf_size"]), int(cfg["seed"]),
                                       int(cfg["max_iter"]), int(cfg["threads"]), progress=st.log.info,
                                       min_leaves=int(cfg["min_leaves"]))
        sizes = tree.cluster_sizes(-1)
        st.log.info("tree levels %s; finest clusters: %d, sizes %d..%d",
                    tree.level_sizes, len(sizes), sizes.min(), sizes.max())
        st.metric("n_clusters", tree.n_clusters)
        st.metric("depth", tree.depth)
        st.metric("max_cluster_size", int(sizes.max()))
        st.extra["level_sizes"] = tree.level_sizes
        tree.save(args.out)
        st.output("tree", args.out)


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
