#!/usr/bin/env bash
# LightXML and GUDN, every row of their comparison, on one GPU machine in one call: on debtags the single
# model, lightxml-ensemble, gudn and its two Table 3 ablations, xtransformer and xr-linear, and
# lightxml-static next to lightxml in the clustered mode (bench/clustered.yaml: debtags is flat by
# default, where no negatives are drawn); on yso-finna-sv-50k lightxml, flat (the default) and
# clustered, and gudn clustered and flat with the relative feature guide (the default flat gudn
# collapses there: xmc_steps/gudn); then the training sequences/second and prediction
# milliseconds/document of each, and bench_neural.py's figures on synthetic data.
# Default config (CUDA: bf16 autocast), several trainings at once on the one GPU (a batch-16 MiniLM
# leaves most of it idle), so each stage's seq/s is under the others' load; bench_neural.py runs
# beside the DAG's first (CPU) stages.
#
# Prepare here: ../shared/tools/gpu-pack --data debtags,yso-finna-sv-50k
# Then, on the machine (with .gpu carried):
#
#   LIMIT=520 bash bench/gpu_lightxml_gudn.sh    # set-up, the DAG in its own session for LIMIT s, the table
#
# DRY=1 bash bench/gpu_lightxml_gudn.sh prints the plan here (snakemake -n) without the set-up.
# It ends by packing its files into $OUT/gpu.tgz (what finished by then).
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
LIMIT=${LIMIT:-520}     # seconds from the start until what finished is packed
GPU_JOBS=${GPU_JOBS:-6} # trainings sharing the GPU at once
CONFIG="--configfile config.yaml bench/clustered.yaml"
S="python3 -m snakemake --scheduler greedy --keep-going --nolock $CONFIG"
Y=yso-finna-sv-50k
# the longest first: snakemake starts prioritised jobs (and what they need) before the rest
FIRST="results/$Y-clustered/gudn.json results/$Y-clustered/lightxml.json results/$Y/lightxml.json \
  results/$Y-relative/gudn.json"
TARGETS="$FIRST"
for m in lightxml gudn gudn-no-feature-guide gudn-no-link-guide lightxml-ensemble xtransformer xr-linear; do
  TARGETS="$TARGETS results/debtags/$m.json"
done
for m in lightxml lightxml-static; do TARGETS="$TARGETS results/debtags-clustered/$m.json"; done

source bench/gpu_dag.sh

SECONDS=0
prepare
start_dag
# the throughput of the pieces on synthetic data, beside the DAG's first (CPU) stages
timeout 150 python3 bench/bench_neural.py --mode figures --device cuda --steps 20 --batch-size 16 > "$W/bench_neural.txt" 2>&1
tail -30 "$W/bench_neural.txt"
wait_dag "snakemake.*lightxml"
tar -czf "$OUT/gpu.tgz" "$W" results/*/*.json results/*/*.png logs \
  $(find results -name "*.json" -path "*lightxml*" -o -name "*.json" -path "*gudn*" -o -name "curve*" -o -name "guard.json" \
    | grep -v checkpoints) 2>/dev/null
ls -la "$OUT"
