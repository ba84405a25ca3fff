#!/usr/bin/env bash
# The ELIAS choices that only a label space of 18,056 can settle, on one GPU machine in one call
# (bench/elias-gpu.yaml's aliases; the small label spaces settle nothing: there a batch's shortlists touch
# every row of W_L and stage 1's beam holds every cluster):
#   - the test rows at the defaults (allow_weak: -weak): elias-stage1, elias-stage2, elias-ranker, elias
#     (ELIAS++) on yso-finna-sv-50k and debtags;
#   - stage 2's A: the partition start (the default, chosen on reuters-all5 and on yso's stage-2 start)
#     against Eq. 10's (-eq10), trained;
#   - W_L's decay: touched rows (the default) against every row (-wlall), stage 2;
#   - W_L updated every step (the default) against every 10 steps, the paper's k (-k10);
#   - stage 1's re-fit kept head by head (-perhead: W_C by recall, W_L by P@1) against both heads together,
#     to ELIAS++ (the lever for yso's ELIAS++ targets: its re-fit W_L ranks worse than the trained one);
#   - elias.predict.K: bench/elias_predict_sizes.py on the valid split of each stage-2 model;
#   - ELIAS's own 3-model ensemble on yso (elias-ensemble: seeds 0, 1, 2 of the clustering), issue 33's lever
#     for its R@100 target (about 7 hours of the 2 CPU cores, more than a session keeps its machine).
# The validation numbers are in each stage's guard.json (valid shortlist recall at the guard's width,
# beside stage 1's and the baselines'); the tables go to docs/methods/elias.md.
#
# Prepare here: ../shared/tools/gpu-pack --data debtags,yso-finna-sv-50k
# Then, on the machine (with .gpu carried):
#
#   LIMIT=540 bash bench/gpu_elias_choices.sh
#
# DRY=1 bash bench/gpu_elias_choices.sh prints the plan here (snakemake -n) without the set-up.
# It ends by packing its files into $OUT/gpu.tgz (what finished by then).
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
LIMIT=${LIMIT:-540}
GPU_JOBS=${GPU_JOBS:-6}
CONFIG="--configfile config.yaml bench/elias-gpu.yaml ${EXTRA_CONFIG:-}"
S="python3 -m snakemake --scheduler greedy --keep-going --nolock $CONFIG"
Y=yso-finna-sv-50k
FIRST="results/$Y-perhead/elias.json results/$Y-weak/elias.json results/$Y-eq10/elias-stage2.json"
TARGETS="$FIRST results/$Y-weak/elias-ensemble.json results/debtags-weak/elias.json results/debtags-eq10/elias-stage2.json"
for d in $Y-weak debtags-weak; do
  for m in elias-stage1 elias-stage2 elias-ranker; do TARGETS="$TARGETS results/$d/$m.json"; done
done
TARGETS="$TARGETS results/$Y-wlall/elias-stage2.json results/$Y-k10/elias-stage2.json results/debtags-perhead/elias.json"
[ -n "${ONLY:-}" ] && { TARGETS=$ONLY; FIRST=$ONLY; }

source bench/gpu_dag.sh

SECONDS=0
prepare
start_dag
wait_dag "snakemake.*elias"
# elias.predict.K on validation: every stage-2 model that finished, at K from half the trained one to 4x
for m in results/*/elias/*/*/stage2; do
  [ -f "$m/model.safetensors" ] || continue
  d=${m#results/}; d=${d%%/*}
  K=$(python3 -c "import json; print(json.load(open('$m/elias.json'))['K'])" 2>/dev/null) || continue
  tok=$(dirname "$(ls results/$d/features/tokens/*/tokens_valid.npz | head -1)")
  echo "== $m (trained K $K)" | tee -a "$W/predict_sizes.txt"
  python3 bench/elias_predict_sizes.py --model "$m" --tokens "$tok/tokens_valid.npz" \
    --labels "results/$d/ingest/Y_valid.npz" --K $((K / 2)) "$K" $((K * 2)) $((K * 4)) 2>>"$W/predict_sizes.err" \
    | tee -a "$W/predict_sizes.txt"
done
pack_elias
