# Sourced by the one-call GPU scripts (bench/gpu_elias.sh, bench/gpu_lightxml_gudn.sh): the DAG in its own
# session on the lent machine, a progress line a minute until it ends or LIMIT seconds have passed, then
# its errors, the GPU's state and one line per target (bench/results_table.py).
# Needs: S (the snakemake command), CONFIG, GPU_JOBS, FIRST, TARGETS, W (work folder), OUT, LIMIT, SECONDS counting.

table() { python3 bench/results_table.py "$@"; }   # one line per target

prepare() {     # DRY=1: print the plan (snakemake -n) and exit; else the set-up and the device's name
  if [ "${DRY:-0}" = 1 ]; then
    python3 -m snakemake -n $CONFIG --cores 16 --resources gpu=$GPU_JOBS -- $TARGETS 2>&1 | grep -A40 -E "^Job stats|^[A-Za-z]*(Error|Exception)"
    exit 0
  fi
  source .gpu/setup.sh
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$W/device.txt"
}

pack_elias() {  # every ELIAS stage's guard and curve, the stage records and the logs, into $OUT/gpu.tgz
  tar -czf "$OUT/gpu.tgz" "$W" results/*/*.json logs \
    $(find results -path "*elias*" \( -name "guard.json" -o -name "curve.png" -o -name "*record.json" -o -name "elias.json" \) \
      | grep -v checkpoints) 2>/dev/null
  ls -la "$OUT"
}

start_dag() {   # start the DAG in its own session (it outlives nothing but this call)
  setsid nohup $S --cores 16 --resources gpu=$GPU_JOBS --prioritize $FIRST -- $TARGETS > "$W/dag.log" 2>&1 < /dev/null &
}

wait_dag() {    # $1: the pgrep pattern of the running DAG
  while pgrep -f "$1" > /dev/null && [ $SECONDS -lt $LIMIT ]; do
    sleep 10
    [ $((SECONDS % 60)) -lt 10 ] && { echo "t=$SECONDS"; grep -E "Finished jobid|Error in rule" "$W/dag.log" | tail -2; }
  done
  grep -E "Error|error" "$W/dag.log" | tail -12
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  table $TARGETS | tee "$W/table.txt"
}
