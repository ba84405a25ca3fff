#!/usr/bin/env bash
# Issue 52, point 6, on one GPU machine in one call: one neural method's target (LightXML on debtags, the
# default config) trained and predicted twice on the one GPU,
#   1. by today's single-process path (the rules start the stages with the interpreter), then
#   2. by the data-parallel path with one process: XMC_DDP=1 (xmc_steps.distributed.FORCE_ENV) makes the rules
#      start the training and predict stages under `torchrun --nproc-per-node 1 --standalone`, a process group
#      of one over NCCL, DDP, the shards, the label head's row exchange and every collective (snakemake
#      --forcerun lightxml_train: the training and what follows run again on the same inputs),
# then both targets' metrics side by side, their differences, and the lines of the second training's log that
# say it ran under torchrun over NCCL.  On the CPU (gloo) the two paths give the same weights bit for bit
# (tests/test_distributed.py); on a GPU some kernels add in a run-dependent order (atomics in the embedding's
# backward), so the metrics are compared within TOL points (default 0.5) and both are printed.
# The multi-GPU speed-up cannot be measured on a one-GPU machine.
#
# Prepare here: ../shared/tools/gpu-pack           (debtags, the MiniLM weights, the packages)
# Then, on the machine (with .gpu carried):
#
#   bash bench/gpu_ddp.sh          # set-up, the two runs (LIMIT s each at most, default 270), the comparison:
#                                  # $OUT/gpu_ddp.txt, the logs and records in $OUT/gpu_ddp.tgz
#
# DRY=1 bash bench/gpu_ddp.sh prints here both runs' plans and the training/predict commands (snakemake -n -p):
# the second's start under torchrun with one process.
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
LIMIT=${LIMIT:-270}                       # seconds for each of the two runs
TOL=${TOL:-0.5}                           # points of P@k, PSP@5, R@100 within which the two runs agree
TARGET=${TARGET:-results/debtags/lightxml.json}
RULE=${RULE:-lightxml_train}              # the target's neural training rule (run again by the second run)
PY=${PY:-python3}
S="$PY -m snakemake --cores 16 --resources gpu=1 --scheduler greedy --nolock --configfile config.yaml"

if [ "${DRY:-0}" = 1 ]; then
  for mode in single ddp; do
    echo "== $mode"
    if [ $mode = ddp ]; then export XMC_DDP=1; F="--forcerun $RULE"; else F=""; fi
    $S -n -p $F -- $TARGET 2>&1 | grep -E "^rule |xmc_steps\.stages\.lightxml|^[A-Za-z]*(Error|Exception)" \
      | sed -E "s/ --params '[^']*'//; s/^(.{190}).+/\1 .../"
  done
  exit 0
fi

source .gpu/setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$W/device.txt"
export XMC_TRACKING=${XMC_TRACKING:-0}
SECONDS=0
echo "== 1. single process: $TARGET"
timeout "$LIMIT" $S -- "$TARGET" > "$W/single.log" 2>&1 || { echo "single-process run failed or ran out of time"; tail -25 "$W/single.log"; }
cp "$TARGET" "$W/single.json" 2>/dev/null
echo "t=${SECONDS}s"
echo "== 2. XMC_DDP=1: torchrun --nproc-per-node 1 over NCCL: $TARGET"
XMC_DDP=1 timeout "$LIMIT" $S -p --forcerun "$RULE" -- "$TARGET" > "$W/ddp.log" 2>&1 || { echo "DDP run failed or ran out of time"; tail -25 "$W/ddp.log"; }
cp "$TARGET" "$W/ddp.json" 2>/dev/null
echo "t=${SECONDS}s"
grep -h -E "distributed: rank|data parallel: rank" logs/$RULE/*.log logs/lightxml_predict/*.log 2>/dev/null | tail -4
grep -c "torch.distributed.run --nproc-per-node 1" "$W/ddp.log" | sed 's/^/commands started under torchrun: /'
$PY - "$W/single.json" "$W/ddp.json" "$TOL" <<'PYEOF' | tee "$OUT/gpu_ddp.txt"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
tol = float(sys.argv[3])
keys = ["p_at_1", "p_at_3", "p_at_5", "psp_at_5", "recall_at_100"]
print(f"{'metric':<16} {'single process':>15} {'torchrun x1 NCCL':>17} {'difference':>11}")
worst = 0.0
for k in keys:
    x, y = a["metrics"].get(k), b["metrics"].get(k)
    if x is None or y is None:
        continue
    worst = max(worst, abs(x - y))
    print(f"{k:<16} {x:>15.3f} {y:>17.3f} {y - x:>+11.3f}")
for k in ("total_train_time_s", "predict_latency_ms_per_doc", "device"):
    print(f"{k:<16} {a.get(k)!s:>15} {b.get(k)!s:>17}")
print(("SAME" if worst <= tol else "DIFFERENT") + f": largest difference {worst:.3f} points (tolerance {tol})")
PYEOF
tar -czf "$OUT/gpu_ddp.tgz" "$W" logs/$RULE logs/lightxml_predict \
  $(find results/debtags -name "*record.json" -path "*lightxml*" | grep -v checkpoints) 2>/dev/null
ls -la "$OUT"
