"""How a rule starts a neural training stage: one process, or ``torchrun`` with one process per GPU
(:mod:`xmc_steps.distributed`), on one node or on a SLURM job's nodes.  Light (no torch): Snakemake imports it
when it parses the workflow.

A section's ``gpus`` (processes per node, default 1) and ``nodes`` (default 1) decide:

* ``gpus: 1, nodes: 1``: the interpreter, as before (``python -m xmc_steps.stages.<stage> ...``); torchrun with
  one process when ``XMC_DDP=1`` (:data:`xmc_steps.distributed.FORCE_ENV`: the data-parallel path on one GPU);
* ``gpus: N`` on one node: ``python -m torch.distributed.run --nproc-per-node N --standalone -m xmc_steps.launch
  -- -m ...`` (a free rendezvous port of its own, so several such jobs share a machine; each process runs the
  stage through :func:`run_stage`, so that torchrun parses none of the stage's options), the rule asking for
  ``gpu=N``;
* ``nodes: M``: inside a SLURM job of M nodes, ``srun`` starts one torchrun per node
  (``--ntasks-per-node 1``) that meet at the job's first node (c10d rendezvous, ``--rdzv-id`` the job's id).
  The job's shape (``--nodes``, GPUs per node, no ``srun -n1`` around the command) comes from the SLURM
  profile's resources for the rule (workflow/profiles/slurm/config.yaml).
"""

from __future__ import annotations

import os
import runpy
import shlex
import sys

#: the port the nodes' torchrun processes meet on, at the job's first node
RDZV_PORT = 29500


def command(python: str, gpus: int = 1, nodes: int = 1) -> str:
    """The shell words that start a stage module (``-m xmc_steps.stages.<stage>`` follows them)."""
    gpus, nodes = int(gpus), int(nodes)
    if gpus < 1 or nodes < 1:
        raise ValueError(f"gpus and nodes must be >= 1, got gpus {gpus}, nodes {nodes}")
    py = shlex.quote(python)
    if gpus == 1 and nodes == 1 and os.environ.get("XMC_DDP", "").strip() != "1":
        return py
    # torchrun runs this module, which runs the stage: after "--" torchrun reads none of the stage's options
    # (its own parser would take a stage's --log for an abbreviation of its --log-dir)
    tail = f"-m {__name__} --"
    run = f"{py} -m torch.distributed.run --nproc-per-node {gpus}"
    if nodes == 1:
        return f"{run} --standalone {tail}"
    head = '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    return (f"srun --nodes {nodes} --ntasks-per-node 1 --kill-on-bad-exit=1 {run} --nnodes {nodes} "
            f"--rdzv-backend c10d --rdzv-endpoint {head}:{RDZV_PORT} --rdzv-id \"$SLURM_JOB_ID\" {tail}")


def gpus_of(section: dict) -> int:
    """The GPUs a job of ``section`` holds on one node (Snakemake's ``gpu`` resource)."""
    return int(section.get("gpus", 1) or 1)


def processes(section: dict) -> int:
    """The processes of a job of ``section``: ``gpus x nodes``."""
    return gpus_of(section) * int(section.get("nodes", 1) or 1)


def run_stage(argv: list[str]) -> None:
    """What each torchrun process runs: ``[--] -m <stage module> <stage arguments>``, the stage as
    ``python -m <stage module> <stage arguments>`` would."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit(f"usage: python -m {__name__} [--] -m <stage module> [arguments]")
    sys.argv = [argv[1]] + argv[2:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run_stage(sys.argv[1:])
