#!/usr/bin/env bash
# The X-Transformer matcher at K = 8 .. 8192 on one GPU machine, in one call: the valid
# cluster recall@b curves of bench/bench_matcher_scale.py (processes side by side: a
# batch-32 MiniLM leaves most of the GPU idle) and, in the background, the full DAG on
# yso-finna-sv-full.  Prepare here with ../shared/tools/gpu-pack --data debtags,yso-finna-sv-50k,
# `cp ../shared/data/yso-finna-sv-full.tar.xz .gpu/` and (optional, saves the machine's time)
# the linear baselines: `python bench/bench_matcher_scale.py --baselines-only --dataset yso50k
# --leaf-size 100 10 3 --baseline-cache .gpu/baselines/yso50k` (and debtags, leaf 10 100).
# Then, on the machine (with .gpu carried):
#
#   bash bench/gpu_matcher_scale.sh phase1    # prerequisites, curves, yso-sv-full started (setsid)
#   bash bench/gpu_matcher_scale.sh phase2    # waits for yso-sv-full, collects its results
#
# Working files go to bench-out/; each phase ends by packing them into $OUT/<phase>.tgz.
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
S="python3 -m snakemake --scheduler greedy --keep-going --nolock"
LIMIT=${LIMIT:-470}     # seconds for the curves of phase 1
case "${1:-phase1}" in
phase1)
  source .gpu/setup.sh
  mkdir -p data && tar -xJf .gpu/yso-finna-sv-full.tar.xz -C data
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$W/device.txt"
  # the full set, default config (allow_weak: the matcher's guard numbers are reported, not fatal), in its
  # own process session so that it outlives this call
  printf 'datasets:\n  yso-sv-full:\n    xtransformer:\n      matcher: {allow_weak: true}\n' > "$W/full.yaml"
  setsid nohup $S --cores 8 --resources gpu=1 --configfile config.yaml "$W/full.yaml" -- \
     results/yso-sv-full/xtransformer.json results/yso-sv-full/xr-linear.json results/yso-sv-full/parabel.json \
     > "$W/full.log" 2>&1 < /dev/null &
  tok=features/tokens/minilm-64/tokens_test.npz
  $S --cores 16 results/yso-finna-sv-50k/index/pifa-tfidf/label_emb.npz results/yso-finna-sv-50k/$tok \
     results/debtags/index/pifa-tfidf/label_emb.npz results/debtags/$tok > "$W/prep.log" 2>&1 || tail -30 "$W/prep.log"
  B="timeout $LIMIT python3 bench/bench_matcher_scale.py --threads 2 --evals 6"
  Y=".gpu/baselines/yso50k"; D=".gpu/baselines/debtags"
  $B --dataset yso-finna-sv-50k --leaf-size 100 --configs before schedule defaults --set epochs=3 \
     --baseline-cache $Y --out "$W/k256" > "$W/k256.log" 2>&1 & p1=$!
  $B --dataset yso-finna-sv-50k --leaf-size 100 --configs defaults --set epochs=5 --evals 10 \
     --baseline-cache $Y --out "$W/k256-long" > "$W/k256-long.log" 2>&1 & p2=$!
  $B --dataset yso-finna-sv-50k --leaf-size 10 3 --configs before defaults \
     --baseline-cache $Y --out "$W/k2048-8192" > "$W/k2048-8192.log" 2>&1 & p3=$!
  $B --dataset debtags --leaf-size 10 100 --configs before defaults \
     --baseline-cache $D --out "$W/k64" > "$W/k64.log" 2>&1 & p4=$!
  wait $p1 $p2 $p3 $p4
  grep -h -E "^(K=|## K)" "$W"/k*.log
  grep -h -E "Error|Traceback" "$W"/k*.log | head
  grep -E "^\[|Finished|Error|error" "$W/full.log" | tail -4
  tar -czf "$OUT/phase1.tgz" "$W"/*.txt "$W"/*.log "$W"/k*/curves.* 2>/dev/null
  ;;
phase2)
  source .gpu/setup.sh
  LIMIT2=${LIMIT2:-400}; t=0
  while pgrep -f "snakemake.*yso-sv-full" > /dev/null && [ $t -lt $LIMIT2 ]; do sleep 5; t=$((t + 5)); done
  grep -E "rule |Finished|Error|error" "$W/full.log" | tail -30
  for m in xr-linear parabel xtransformer; do
    f=results/yso-sv-full/$m.json
    [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['metrics']; print(sys.argv[2], *(round(m[k],2) for k in ('p_at_1','p_at_3','p_at_5','recall_at_100')), d.get('total_train_time_s'))" "$f" "$m"
  done
  tar -czf "$OUT/phase2.tgz" "$W/full.log" results/yso-sv-full/*.json results/yso-sv-full/*.png \
      results/yso-sv-full/xtransformer/*/*/*/matcher/guard.json results/yso-sv-full/xtransformer/*/*/*/matcher/curve.png \
      logs 2>/dev/null
  ;;
esac
