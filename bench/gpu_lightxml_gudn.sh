#!/usr/bin/env bash
# LightXML and GUDN, every row of their comparison, on one GPU machine in two calls: on debtags and
# reuters21578/modapte-all5 the single model, lightxml-ensemble, gudn and its two Table 3 ablations, and
# lightxml-static next to lightxml in the clustered mode (bench/clustered.yaml: both sets are flat by
# default, where no negatives are drawn); on yso-finna-sv-50k lightxml and gudn; xr-linear beside them
# from the same run; then the training sequences/second and prediction milliseconds/document of each.
# Default config (CUDA: bf16 autocast), several trainings at once on the one GPU (a batch-16 MiniLM
# leaves most of it idle).
#
# Prepare here: ../shared/tools/gpu-pack --data debtags,yso-finna-sv-50k,reuters21578/modapte-all5
# Then, on the machine (with .gpu carried):
#
#   bash bench/gpu_lightxml_gudn.sh phase1    # set-up, the DAG started in its own session, LIMIT s of it
#   bash bench/gpu_lightxml_gudn.sh phase2    # waits up to LIMIT2 s more, then the table
#
# DRY=1 bash bench/gpu_lightxml_gudn.sh phase1 prints the plan here (snakemake -n) without the set-up.
# Each phase ends by packing its files into $OUT/<phase>.tgz.
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
LIMIT=${LIMIT:-480}     # seconds phase 1 watches the DAG before it returns
GPU_JOBS=${GPU_JOBS:-4} # trainings sharing the GPU at once
CONFIG="--configfile config.yaml bench/clustered.yaml"
S="python3 -m snakemake --scheduler greedy --keep-going --nolock $CONFIG"
VARIANTS="lightxml lightxml-ensemble gudn gudn-no-feature-guide gudn-no-link-guide xr-linear"
TARGETS=""
for d in debtags reuters-all5; do
  for m in $VARIANTS; do TARGETS="$TARGETS results/$d/$m.json"; done
  for m in lightxml lightxml-static; do TARGETS="$TARGETS results/$d-clustered/$m.json"; done
done
for m in lightxml gudn xr-linear; do TARGETS="$TARGETS results/yso-finna-sv-50k/$m.json"; done

table() {  # one line per target: P@1 P@3 P@5 R@100, train s, training seq/s, predict ms/doc, device
  python3 - "$@" <<'PY'
import glob, json, os, sys
for f in sys.argv[1:]:
    if not os.path.exists(f):
        print(f, "missing"); continue
    d = json.load(open(f)); m = d["metrics"]
    rates = []
    for s in d["stages"]:
        try:
            r = json.load(open(s["record"]))
        except (OSError, ValueError):
            continue
        if "train_seq_per_s" in r.get("metrics", {}):
            rates.append(round(r["metrics"]["train_seq_per_s"], 1))
    print(f, *(round(m[k], 2) for k in ("p_at_1", "p_at_3", "p_at_5", "recall_at_100")),
          "train_s", d.get("total_train_time_s"), "seq/s", rates, "ms/doc", d.get("predict_latency_ms_per_doc"),
          d.get("device"))
PY
}

case "${1:-phase1}" in
phase1)
  if [ "${DRY:-0}" = 1 ]; then
    python3 -m snakemake -n $CONFIG --cores 16 --resources gpu=$GPU_JOBS -- $TARGETS | grep -A40 "^Job stats"
    exit 0
  fi
  source .gpu/setup.sh
  if [ -d data/reuters21578/modapte-all5 ] && [ ! -e data/reuters-all5 ]; then
    mv data/reuters21578/modapte-all5 data/reuters-all5
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$W/device.txt"
  setsid nohup $S --cores 16 --resources gpu=$GPU_JOBS -- $TARGETS > "$W/dag.log" 2>&1 < /dev/null &
  # the throughput of the pieces on synthetic data, while the DAG runs
  timeout 240 python3 bench/bench_neural.py --device cuda --steps 20 > "$W/bench_neural.txt" 2>&1
  t=0
  while pgrep -f "snakemake.*lightxml" > /dev/null && [ $t -lt $LIMIT ]; do sleep 10; t=$((t + 10)); done
  cat "$W/bench_neural.txt" | tail -25
  grep -E "Finished|Error|error" "$W/dag.log" | tail -8
  tar -czf "$OUT/phase1.tgz" "$W" 2>/dev/null
  ;;
phase2)
  source .gpu/setup.sh
  LIMIT2=${LIMIT2:-480}; t=0
  while pgrep -f "snakemake.*lightxml" > /dev/null && [ $t -lt $LIMIT2 ]; do sleep 10; t=$((t + 10)); done
  grep -E "Finished|Error|error" "$W/dag.log" | tail -12
  table $TARGETS | tee "$W/table.txt"
  tar -czf "$OUT/phase2.tgz" "$W" results/*/*.json results/*/*.png logs 2>/dev/null
  ;;
esac
