#!/usr/bin/env bash
# The headline, `results/wiki500k/elias.json` with the papers' settings (config.paper.yaml: BERT-base at 128
# tokens, C = 4,096, b 20, K 2000, 3 clustering seeds, 15 + 30 epochs), on one GPU machine in one call, on
# synthetic Wiki-500K-shaped data with all 501,070 labels at FRACTION of the documents (xmc_steps.synth);
# then every stage's time, peak memory and peak GPU memory, the test metrics, and the projection of the
# stages' times to the full set (x 1 / FRACTION for the document-bound stages).
#
# Needs the paper's encoder in the Hugging Face cache (`huggingface-cli download bert-base-uncased` where the
# hub is reachable; jobs never download).  ENCODER=minilm runs the packaged MiniLM instead (a lent machine
# without the hub: ../shared/tools/gpu-pack, then `source .gpu/setup.sh` first); EPOCHS="1 1" shortens the
# stages (stage 1, stage 2) and SEEDS=1 trains one clustering seed, for a run that must fit a short lease.
#
#   FRACTION=0.02 LIMIT=3000 bash bench/gpu_headline.sh
#
# It packs its files into $OUT/headline.tgz at the end (what finished by LIMIT seconds).
set -uo pipefail
OUT=${OUT:-bench-out/out}
W=bench-out/headline-gpu
FRACTION=${FRACTION:-0.02}
LIMIT=${LIMIT:-3000}
ENCODER=${ENCODER:-bert_base}
EPOCHS=(${EPOCHS:-15 30})
SEEDS=${SEEDS:-3}
mkdir -p "$OUT" "$W/data"
[ -f .gpu/setup.sh ] && source .gpu/setup.sh
SECONDS=0
[ -f "$W/data/wiki500k/synth.json" ] || python3 -m xmc_steps.stages.synth --shape wiki500k --fraction "$FRACTION" --out "$W/data/wiki500k"
seeds=$(python3 -c "print(list(range($SEEDS)))")
maxlen=128; [ "$ENCODER" = minilm ] && maxlen=64
cat > "$W/overlay.yaml" <<YAML
data_dir: $W/data
results_dir: $W/results
datasets:
  wiki500k:
    tokenize: {encoder: $ENCODER, max_length: $maxlen}
    elias:
      encoder: $ENCODER
      max_length: $maxlen
      seeds: $seeds
      stage1: {train: {epochs: ${EPOCHS[0]}}}
      stage2: {train: {epochs: ${EPOCHS[1]}}}
YAML
T=$W/results/wiki500k/elias.json
setsid nohup python3 -m snakemake --scheduler greedy --nolock --cores all --resources gpu=1 \
  --configfile config.yaml config.paper.yaml "$W/overlay.yaml" -- "$T" > "$W/dag.log" 2>&1 < /dev/null &
while pgrep -f "snakemake.*headline-gpu" > /dev/null && [ $SECONDS -lt $LIMIT ]; do
  sleep 20; [ $((SECONDS % 300)) -lt 20 ] && { echo "t=$SECONDS"; grep -E "Finished jobid|Error in rule" "$W/dag.log" | tail -2; }
done
grep -E "Error|error" "$W/dag.log" | tail -12
python3 - "$W" "$FRACTION" <<'PY'
import glob, json, os, sys
w, f = sys.argv[1], float(sys.argv[2])
rows = []
for rec in sorted(glob.glob(f"{w}/results/wiki500k/**/*record.json", recursive=True)):
    r = json.load(open(rec)); m = r.get("metrics", {})
    rows.append((r.get("rule"), round(r.get("wall_s", 0), 1), round(r.get("peak_rss_mb", 0)),
                 round(m.get("peak_gpu_mem_mb", 0)), rec))
for rule, s, mem, gpu, rec in rows:
    print(f"{rule:28s} {s:9.1f} s  (x{1 / f:.0f}: {s / f / 3600:7.2f} h)  peak {mem} MB  GPU {gpu} MiB  {rec}")
if os.path.exists(f"{w}/results/wiki500k/elias.json"):
    m = json.load(open(f"{w}/results/wiki500k/elias.json"))["metrics"]
    print({k: round(m[k], 2) for k in ("p_at_1", "p_at_3", "p_at_5", "psp_at_5", "recall_at_100")})
PY
tar -czf "$OUT/headline.tgz" "$W/dag.log" "$W/overlay.yaml" logs $(find "$W/results" \( -name "*.json" -o -name "*.png" \) | grep -v checkpoints) 2>/dev/null
ls -la "$OUT"
