#!/usr/bin/env bash
# ELIAS on one GPU machine in one call, for the validation tables of xmc_steps/elias ("Choosing the
# defaults") and the test rows beside the linear baselines (run on the CPU): on debtags and
# yso-finna-sv-50k, ELIAS++ and its Table 3 build-up rows (elias-stage1, elias-stage2, elias-ranker, elias)
# at the default config and with stage 1's lr_clf at the paper's 1e-2 (bench/elias-gpu.yaml's -lrclf2 aliases), and
# stage 1 from the paper's random start (-random); then the table of test metrics, the training
# sequences/second and peak GPU memory.  Several trainings share the GPU at once.
#
# Prepare here: ../shared/tools/gpu-pack --data debtags,yso-finna-sv-50k
# Then, on the machine (with .gpu carried):
#
#   LIMIT=520 bash bench/gpu_elias.sh       # set-up, the DAG in its own session for LIMIT s, the table
#
# DRY=1 bash bench/gpu_elias.sh prints the plan here (snakemake -n) without the set-up.
# It ends by packing its files into $OUT/gpu.tgz (what finished by then).
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
LIMIT=${LIMIT:-520}     # seconds from the start until what finished is packed
GPU_JOBS=${GPU_JOBS:-6} # trainings sharing the GPU at once
CONFIG="--configfile config.yaml bench/elias-gpu.yaml ${EXTRA_CONFIG:-}"
S="python3 -m snakemake --scheduler greedy --keep-going --nolock $CONFIG"
Y=yso-finna-sv-50k
FIRST="results/$Y/elias.json results/$Y-lrclf2/elias.json results/debtags/elias.json results/debtags-lrclf2/elias.json"
TARGETS="$FIRST"
for d in $Y $Y-lrclf2 debtags debtags-lrclf2; do
  for m in elias-stage1 elias-stage2 elias-ranker; do TARGETS="$TARGETS results/$d/$m.json"; done
done
TARGETS="$TARGETS results/$Y-random/elias-stage1.json results/debtags-random/elias-stage1.json"
# ONLY="<targets>" runs those instead (FIRST: the same), e.g. one dataset's rows within a short lease
[ -n "${ONLY:-}" ] && { TARGETS=$ONLY; FIRST=$ONLY; }

source bench/gpu_dag.sh

SECONDS=0
prepare
start_dag
wait_dag "snakemake.*elias"
pack_elias
